"""`shram-static eval`: bits per byte and perplexity of a model on a text, on any backend.

The text's UTF-8 bytes are streamed through a static decoder in windows of `window` bytes
(default: the capacity, `inference_sequence_length`). Each window starts afresh: `reset()`,
then one `prefill` of BOS followed by the window's bytes but its last, and every next-byte
prediction is scored (BOS predicts the window's first byte, and so on), so each window scores
exactly its `window` bytes with 0 .. window-1 bytes of context. This is how `shram-static
train` validates (at its training length), and how a user checks an export or an int8 artifact.
"""

import contextlib
import json
import math
import os
import sys
import time

from .backends import BACKENDS
from .checkpoint_dir import check_checkpoint_dir
from .decoders import make_decoder
from .console import info, positive_int


def read_text_bytes(path, max_bytes: int | None = None) -> bytes:
    """The UTF-8 bytes of a text file (the first `max_bytes`, the whole file checked), checked
    before any model work: FileNotFoundError / IsADirectoryError, or ValueError when empty or
    not UTF-8."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"--text {path!r} is a directory; give a UTF-8 text file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--text {path!r} does not exist")
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise ValueError(f"--text {path!r} is empty: there is nothing to score")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path!r} is not UTF-8 text: byte {e.start} (0x{data[e.start]:02x}) "
                         f"cannot be decoded ({e.reason})") from None
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    return data if max_bytes is None else data[:max_bytes]


def score_bytes(decoder, data: bytes, window: int | None = None, progress: bool = True) -> dict:
    """Mean next-byte negative log-likelihood of `data` under a byte-tokenized decoder.

    Args:
        decoder: a batch-1 `HostDecoder` (StaticDecoder, or a loaded .pte / .onnx).
        data: the bytes to score (non-empty).
        window: bytes per window, 1..capacity (default the capacity); see the module docstring.
        progress: show a tqdm bar on stderr.

    Returns:
        dict with bytes, windows, window, nll (nats per byte), bits_per_byte, perplexity.
    """
    import torch
    from tqdm import tqdm

    from .tokenizer import ByteTokenizer

    if decoder.batch_size != 1:
        raise ValueError(f"score_bytes needs a batch-1 decoder, got batch_size {decoder.batch_size}")
    if not data:
        raise ValueError("there are no bytes to score")
    S = decoder.capacity
    window = S if window is None else window
    if not 1 <= window <= S:
        raise ValueError(f"window must be in [1, {S}] (the decoder's capacity), got {window}")
    bos = ByteTokenizer().bos_token_id
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    total = 0.0
    with tqdm(total=len(data), unit="B", unit_scale=True, disable=not progress, file=sys.stderr,
              desc="eval", dynamic_ncols=True) as bar:
        for i in range(0, len(data), window):
            y = buf[i:i + window]  # (w,) targets
            x = torch.cat([torch.tensor([bos]), y[:-1]])[None]  # (1, w) BOS + all but the last
            decoder.reset()
            logits = decoder.prefill(x)[0].double()  # (w, V)
            total += float(-logits.log_softmax(-1).gather(-1, y[:, None]).sum())
            bar.update(len(y))
            bar.set_postfix(bpb=f"{total / min(i + window, len(data)) / math.log(2):.4f}", refresh=False)
    nll = total / len(data)
    return {"bytes": len(data), "windows": len(range(0, len(data), window)), "window": window, "nll": nll,
            "bits_per_byte": nll / math.log(2), "perplexity": math.exp(nll)}


def evaluate(text, checkpoint=None, backend: str = "eager", max_bytes: int | None = None,
             window: int | None = None, prefill_chunk: int = 32, progress: bool = True) -> dict:
    """Bits per byte and perplexity of a checkpoint (default the built-in model) on a text file.

    Args:
        text: path of a UTF-8 text file.
        checkpoint: checkpoint directory (byte tokenizer only), or None for the built-in model.
        backend: one of `BACKENDS` (export backends build into a temporary directory).
        max_bytes: score only the first N bytes.
        window: bytes per window (default the capacity).
        prefill_chunk: tokens per prefill step of the decoder.
        progress: progress bar and messages on stderr.

    Returns:
        `score_bytes`' dict plus backend, checkpoint, text and seconds.

    Raises:
        FileNotFoundError, ValueError (incl. CheckpointError): bad text, checkpoint or option.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    data = read_text_bytes(text, max_bytes)
    check_checkpoint_dir(checkpoint)  # before the seconds of importing torch
    from .default_model import load_model_and_tokenizer
    from .tokenizer import ByteTokenizer

    model, tok = load_model_and_tokenizer(checkpoint)
    if not isinstance(tok, ByteTokenizer):
        raise ValueError(f"checkpoint {checkpoint!r} has its own tokenizer.json; eval scores bytes "
                         f"and needs a byte-tokenized model (no tokenizer.json)")
    S = model.config.inference_sequence_length
    if window is not None and not 1 <= window <= S:
        raise ValueError(f"--window must be in [1, {S}] (the model's inference_sequence_length), got {window}")
    with contextlib.ExitStack() as stack:
        dec = make_decoder(model, backend, prefill_chunk, stack, tok.eos_token_id, getattr(tok, "bos_token_id", None),
                           full_logits=True)  # every byte is scored
        t0 = time.perf_counter()
        r = score_bytes(dec, data, window, progress)
        r["seconds"] = time.perf_counter() - t0
    r.update(backend=backend, checkpoint=checkpoint, text=os.fspath(text))
    return r


def run(args) -> int:
    """The `eval` subcommand."""
    where = args.checkpoint if args.checkpoint is not None else "the built-in model"
    info(f"evaluating {where} on {args.text} ({args.backend}) ...")
    r = evaluate(args.text, args.checkpoint, args.backend, args.max_bytes, args.window,
                 args.prefill_chunk, progress=not args.quiet)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print(f"{r['bits_per_byte']:.4f} bits/byte  perplexity {r['perplexity']:.4f}  "
              f"({r['nll']:.4f} nats/byte over {r['bytes']} bytes, {r['windows']} windows of "
              f"{r['window']}, {args.backend}, {r['seconds']:.1f} s)")
    return 0


def register(subparsers) -> None:
    """Adds the `eval` subcommand to the CLI."""
    p = subparsers.add_parser("eval", help="bits per byte and perplexity of a model on a text file",
                              description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file to score")
    p.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory; default: the built-in model")
    p.add_argument("--backend", choices=BACKENDS, default="eager",
                   help="eager or compiled PyTorch, or an ExecuTorch (pte, pte-int8) / ONNX export "
                        "built into a temporary directory")
    p.add_argument("--max-bytes", type=positive_int, metavar="N", help="score only the first N bytes")
    p.add_argument("--window", type=positive_int, metavar="N",
                   help="bytes per window (default: the model's capacity, inference_sequence_length)")
    p.add_argument("--prefill-chunk", type=positive_int, default=32, metavar="C", help="tokens per prefill step")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
