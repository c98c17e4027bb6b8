"""The arguments of `shram-static bench` and `bench-speculative`, parsed without importing torch (so
`--help` and a bad argument answer at once); each command's module is imported when it runs."""

import argparse
import json

from ..backends import BACKENDS, SPEC_BACKENDS
from ..console import positive_int
from .checks import check_bench, check_models
from .speculative import PROMPTS


def _bench(args) -> int:
    check_bench(args)  # before the imports: torch takes seconds
    from .throughput import bench
    return bench(args)


def _bench_speculative(args) -> int:
    check_models([args.model])
    from .speculative import bench_speculative
    return bench_speculative(args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `bench` (also `python -m shram_static.bench`'s)."""
    p.add_argument("--models", nargs="+", default=["builtin", "bench"],
                   help="'builtin', 'bench' (the 12-layer bench config) or checkpoint directories")
    p.add_argument("--backends", nargs="+", default=["eager", "compiled"], choices=BACKENDS)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4])
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--capacity", type=positive_int, metavar="S",
                   help="live tokens per row (the model's inference_sequence_length; default: its own)")
    p.add_argument("--depths", nargs="+", type=positive_int, metavar="D",
                   help="contexts to prefill and decode after (default: 64, a quarter, half and three "
                        "quarters of the capacity, and near it)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per context and round")
    p.add_argument("--rounds", type=int, default=3,
                   help="measurements per backend and context, interleaved across backends")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--plot", metavar="FILE.png", help="plot decode ms/step against context")


def register(subparsers) -> None:
    """Adds the `bench` subcommand to the CLI."""
    p = subparsers.add_parser("bench", help="decode/prefill speed of every backend vs compiled torch and "
                                            "the bandwidth floor")
    add_arguments(p)
    p.set_defaults(func=_bench)


def register_speculative(subparsers) -> None:
    """Adds the `bench-speculative` subcommand to the CLI."""
    p = subparsers.add_parser("bench-speculative", help="speculative (prompt lookup) vs plain greedy decoding, "
                                                        "and a verify step's cost against a decode step's")
    p.add_argument("--model", default="builtin", help="'builtin', 'bench' or a checkpoint directory")
    p.add_argument("--backend", default="compiled", choices=SPEC_BACKENDS)
    p.add_argument("--speculate", type=positive_int, default=4, metavar="K", help="guesses per verify step")
    p.add_argument("--max-new-tokens", type=positive_int, default=400, metavar="N")
    p.add_argument("--prompts", nargs="*", choices=list(PROMPTS), help="default: all (none for the bench model)")
    p.add_argument("--context", type=positive_int, default=256, help="context of the step-cost measurement")
    p.add_argument("--prefill-chunk", type=positive_int, default=32, metavar="C",
                   help="tokens per prefill step (both decoders' prompts; 64 is faster for a long prompt on one row)")
    p.add_argument("--steps", type=positive_int, default=40, help="alternating decode/verify steps timed")
    p.add_argument("--rounds", type=positive_int, default=3, help="plain/speculative runs per prompt, alternating")
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by the process's CPU time instead of wall time (a loaded, shared machine)")
    p.set_defaults(func=_bench_speculative)


def main(argv=None) -> int:
    """`python -m shram_static.bench`: the `bench` command, or one of its worker processes."""
    p = argparse.ArgumentParser(prog="python -m shram_static.bench", description="Throughput of every backend.")
    add_arguments(p)
    p.add_argument("--worker", choices=["export", "serve"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None:
        return _bench(args)
    from . import throughput
    if args.worker == "export":
        print(json.dumps(throughput.export_one(args.model, args.backend, args.batch_size, args.prefill_chunk,
                                               args.out_dir, args.capacity)))
        return 0
    throughput.serve([args.model, args.backend, args.batch_size, args.prefill_chunk, args.steps, args.out_dir,
                      args.capacity, args.depths])  # "serve", the other of argparse's choices
    return 0
