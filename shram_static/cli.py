"""Command line: `shram-static generate|bench|export ...` (also `python -m shram_static`).

`generate` prints the continuation of a prompt, from the built-in model or a checkpoint
directory, on any backend. Progress messages go to stderr, the text alone to stdout. Errors
a user can fix (a bad checkpoint, a prompt too long for the capacity, ...) print one
`error: ...` line to stderr and exit with status 2.
"""

import argparse
import contextlib
import sys
import tempfile
import time

BACKENDS = ("eager", "compiled", "pte", "onnx")


def _info(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _make_decoder(model, tok, backend: str, prefill_chunk: int, stack: contextlib.ExitStack):
    if backend in ("eager", "compiled"):
        from .decoder import StaticDecoder
        return StaticDecoder(model, batch_size=1, prefill_chunk=prefill_chunk,
                             compile=backend == "compiled", eos_token_id=tok.eos_token_id)
    try:
        from .export import export_onnx, export_pte, load_onnx, load_pte
    except ImportError as e:
        raise ValueError(f"backend {backend!r} needs shram_static.export, which failed to import: {e}") from e
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="shram_static_"))
    t0 = time.perf_counter()
    if backend == "pte":
        path = f"{tmp}/model.pte"
        _info(f"exporting to ExecuTorch ({path}) ...")
        export_pte(model, path, batch_size=1, prefill_chunk=prefill_chunk, eos_token_id=tok.eos_token_id)
        dec = load_pte(path)
    else:
        path = f"{tmp}/model.onnx"
        _info(f"exporting to ONNX ({path}) ...")
        export_onnx(model, path, batch_size=1, prefill_chunk=prefill_chunk, eos_token_id=tok.eos_token_id)
        dec = load_onnx(path)
    _info(f"exported and loaded in {time.perf_counter() - t0:.1f} s")
    return dec


def generate(args) -> int:
    """The `generate` subcommand."""
    import torch

    from .default_model import load_model_and_tokenizer

    if args.temperature is not None and not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    where = args.checkpoint if args.checkpoint is not None else "the built-in model"
    _info(f"loading {where} ...")
    model, tok = load_model_and_tokenizer(args.checkpoint)
    ids = tok.encode(args.prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens: give a non-empty --prompt")
    capacity = model.config.inference_sequence_length
    if len(ids) + args.max_new_tokens - 1 > capacity:
        raise ValueError(f"the prompt ({len(ids)} tokens) plus --max-new-tokens {args.max_new_tokens} "
                         f"exceeds the model's context capacity of {capacity} tokens "
                         f"(inference_sequence_length); shorten the prompt or lower --max-new-tokens")
    sample = args.temperature is not None or args.top_k is not None or args.top_p is not None
    with contextlib.ExitStack() as stack:
        dec = _make_decoder(model, tok, args.backend, args.prefill_chunk, stack)
        if args.backend == "compiled":
            _info("compiling the prefill and decode steps (first call)...")
        t0 = time.perf_counter()
        out = dec.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                           do_sample=sample, temperature=args.temperature or 1.0, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, eos_token_id=tok.eos_token_id)
        dt = time.perf_counter() - t0
    new = out[0].tolist()
    if tok.eos_token_id is not None and tok.eos_token_id in new:
        new = new[:new.index(tok.eos_token_id)]
    text = tok.decode(new)
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="replace")
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    _info(f"{len(new)} new tokens in {dt:.2f} s ({args.backend})")
    return 0


def _add_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="print the continuation of a prompt",
                              description="Prints the continuation of --prompt (greedy unless a "
                                          "sampling option is given).")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="checkpoint directory (config.json + model.safetensors [+ tokenizer.json]); "
                        "default: the built-in model")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32, metavar="N")
    p.add_argument("--backend", choices=BACKENDS, default="eager",
                   help="eager or compiled (torch.compile) PyTorch, or an ExecuTorch (pte) / ONNX "
                        "export made into a temporary directory")
    p.add_argument("--prefill-chunk", type=_positive_int, default=32, metavar="C",
                   help="tokens per prefill step")
    p.add_argument("--temperature", type=float, metavar="T", help="sample with this temperature")
    p.add_argument("--top-k", type=_positive_int, metavar="K", help="sample from the K most likely tokens")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling")
    p.add_argument("--seed", type=int, metavar="S", help="seed of the sampler")
    p.set_defaults(func=generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shram-static",
                                     description="SHRAM language models from static graphs.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_generate(subparsers)
    from . import bench
    from .export import cli as export_cli
    bench.register(subparsers)
    export_cli.register(subparsers)
    return parser


def main(argv=None) -> int:
    """Runs the CLI; returns the exit status (0 ok, 2 usage or input error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (OSError, ValueError, TypeError, ImportError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
