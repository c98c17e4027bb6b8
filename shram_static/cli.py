"""Command line: `shram-static generate|bench|export ...` (also `python -m shram_static`). Progress
goes to stderr, results to stdout; an error a user can fix prints one `error: ...` line, status 2."""

import argparse
import contextlib
import sys
import time

from .backends import BACKENDS, find_backend
from .checkpoint_dir import check_checkpoint_dir
from .console import info, positive_int


def generate(args) -> int:
    """The `generate` subcommand."""
    if args.temperature is not None and not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    where = args.checkpoint if args.checkpoint is not None else "the built-in model"
    info(f"loading {where} ...")  # before the imports: torch and transformers take seconds
    for d in (args.checkpoint, args.draft):
        check_checkpoint_dir(d)
    import torch

    from .decoders import make_decoder
    from .default_model import load_model_and_tokenizer
    from .generation import TextTokenStreamer

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
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="replace")
    streamer = TextTokenStreamer(tok, sys.stdout, eos_token_id=tok.eos_token_id)
    with contextlib.ExitStack() as stack:
        spec = args.speculate or (4 if args.draft is not None else None)
        verify = spec + 1 if spec else None
        load = lambda m: make_decoder(m, args.backend, args.prefill_chunk, stack,  # noqa: E731
                                      tok.eos_token_id, getattr(tok, "bos_token_id", None), verify_len=verify)
        dec, draft = load(model), None
        if args.draft is not None:  # the draft runs on the same backend
            info(f"loading the draft model {args.draft} ...")
            draft = load(load_model_and_tokenizer(args.draft)[0])
        # compiled ahead, so the time below is generation's
        if find_backend(args.backend).runtime == "compiled":
            t0 = time.perf_counter()
            kinds = ("decode", "prefill_last") + (("verify",) if verify else ())
            for d in [dec] if draft is None else [dec, draft]:
                d.warm_up(kinds)
            info(f"compiled in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        dec.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                     do_sample=sample, temperature=args.temperature or 1.0, top_k=args.top_k,
                     top_p=args.top_p, seed=args.seed, eos_token_id=tok.eos_token_id, streamer=streamer,
                     speculate=args.speculate, draft=draft)
        dt = time.perf_counter() - t0
    info(f"{len(streamer.tokens)} new tokens in {dt:.2f} s ({args.backend})")
    return 0


def _add_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="print the continuation of a prompt",
                              description="Prints the continuation of --prompt as it is produced "
                                          "(greedy unless a sampling option is given).")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="checkpoint directory (config.json + model.safetensors [+ tokenizer.json]); "
                        "default: the built-in model")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N")
    p.add_argument("--backend", choices=BACKENDS, default="eager",
                   help="eager or compiled (torch.compile) PyTorch, or an ExecuTorch (pte) / ONNX "
                        "export made into a temporary directory")
    p.add_argument("--prefill-chunk", type=positive_int, default=32, metavar="C",
                   help="tokens per prefill step")
    p.add_argument("--temperature", type=float, metavar="T", help="sample with this temperature")
    p.add_argument("--top-k", type=positive_int, metavar="K", help="sample from the K most likely tokens")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling")
    p.add_argument("--seed", type=int, metavar="S", help="seed of the sampler")
    p.add_argument("--speculate", type=positive_int, metavar="K",
                   help="speculative decoding: up to K guessed tokens per verify step, from prompt "
                        "lookup or --draft (greedy output unchanged)")
    p.add_argument("--draft", metavar="DIR", help="checkpoint of a smaller draft model with the same "
                                                  "tokenizer (implies --speculate 4)")
    p.set_defaults(func=generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shram-static",
                                     description="SHRAM language models from static graphs.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(subparsers)
    from . import evaluate, train
    from .bench import cli as bench_cli
    from .export import cli as export_cli
    for register in (bench_cli.register, bench_cli.register_speculative, export_cli.register, train.register,
                     evaluate.register):
        register(subparsers)
    from .serve import cli as serve_cli  # FastAPI/uvicorn are imported only when serving
    serve_cli.register(subparsers)
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
