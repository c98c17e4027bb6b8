"""`shram-static serve` and `bench-serve`. SIGINT / SIGTERM drain the server and exit with status 0
(a second SIGINT at once); an engine that failed exits with status 1, so a supervisor restarts it."""

import os
import signal
import sys

from ..backends import BACKENDS, find_backend
from ..checkpoint_dir import check_checkpoint_dir
from ..console import positive_int
from .limits import MAX_BODY_BYTES, MAX_STOP, MAX_STOP_CHARS


def serve(args) -> int:
    """The `serve` subcommand."""
    from ..console import info
    from .server import import_server, make_server

    import_server()  # a missing extra is named before the app's imports fail on it
    info(f"loading {args.checkpoint or 'the built-in model'} ({args.backend}) ...")  # torch takes seconds
    check_checkpoint_dir(args.checkpoint)
    from .app import create_app
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        info(f"listening on {args.host}: reachable from other machines"
             + ("" if args.api_key else " (no --api-key set)"))
    app = create_app(checkpoint=args.checkpoint, backend=args.backend, batch_size=args.batch_size,
                     prefill_chunk=args.prefill_chunk, max_queue=args.max_queue, api_key=args.api_key,
                     model_name=args.model_name, max_body_bytes=args.max_body_bytes, max_stop=args.max_stop,
                     max_stop_chars=args.max_stop_chars, token_ids_only=args.token_ids_only)
    info(f"serving {app.state.model_name} ({args.backend}, {args.batch_size} rows) on "
         f"http://{args.host}:{args.port}/v1; GET /health is 503 until the model is loaded"
         + (" and compiled" if find_backend(args.backend).runtime == "compiled" else ""))
    server = make_server(app, args.host, args.port, args.shutdown_timeout, args.log_level)
    # WHY: after a clean shutdown uvicorn raises the signal again under the previous handler;
    # SIGTERM's default would exit with status 143, which a supervisor reads as a crash.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run()
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    if server.failed:
        print(f"error: the server stopped: {server.failed}", file=sys.stderr)
        return 1
    return 0


class _Terminated(Exception):
    """SIGTERM, raised again by uvicorn after its clean shutdown."""


def _terminated(signum, frame):
    raise _Terminated


def _nonneg_float(text: str) -> float:
    import argparse
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


def add_model_args(p) -> None:
    """Options shared by `serve` and `bench-serve`: the model and how it is served."""
    p.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory; default: the built-in model")
    p.add_argument("--backend", choices=BACKENDS, default="compiled",
                   help="eager or compiled PyTorch, or an ExecuTorch / ONNX export made at start-up")
    p.add_argument("--batch-size", type=positive_int, default=4, metavar="B",
                   help="requests decoded at once, one per row of the static state (default 4)")
    p.add_argument("--prefill-chunk", type=positive_int, default=16, metavar="C",
                   help="prompt tokens per prefill-shape step (default 16); while other rows decode, "
                        "a prompt shorter than 4 chunks joins one token per decode step instead, so "
                        "running streams never wait for a prefill step")
    p.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                   help="requests that may wait while every row is busy (B + N at once are taken); beyond, "
                        "429 with Retry-After (default 64)")


def register(subparsers) -> None:
    """Adds `serve` and `bench-serve` to the CLI."""
    from .bench import bench_serve

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)",
                              description="Serves the model over an OpenAI-compatible API "
                                          "(/v1/completions, /v1/chat/completions, /v1/models, "
                                          "/health, /metrics). B requests decode at once; more "
                                          "wait in a FIFO queue.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SHRAM_STATIC_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SHRAM_STATIC_API_KEY)")
    p.add_argument("--model-name", metavar="NAME", help="model id clients send (default: the checkpoint "
                                                        "directory's name or shram-static-builtin)")
    p.add_argument("--shutdown-timeout", type=_nonneg_float, default=10.0, metavar="S",
                   help="on SIGINT/SIGTERM, let running requests finish for S seconds (default 10)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--max-body-bytes", type=positive_int, default=MAX_BODY_BYTES, metavar="N",
                   help=f"largest request body; a larger one gets 413 (default {MAX_BODY_BYTES}: 1 MiB)")
    p.add_argument("--max-stop", type=positive_int, default=MAX_STOP, metavar="N",
                   help=f"most stop strings per request (default {MAX_STOP}, as OpenAI)")
    p.add_argument("--max-stop-chars", type=positive_int, default=MAX_STOP_CHARS, metavar="N",
                   help=f"longest stop string, in characters (default {MAX_STOP_CHARS})")
    p.add_argument("--token-ids-only", action="store_true",
                   help="serve without a tokenizer (a checkpoint without its tokenizer.json): prompts "
                        "are token ids, choices carry token_ids, text prompts get 400")
    p.set_defaults(func=serve)

    b = subparsers.add_parser("bench-serve", help="serving benchmark: concurrent streaming clients",
                              description="Starts the server on 127.0.0.1, sends N concurrent streaming "
                                          "requests, then the same requests one at a time; reports "
                                          "aggregate tokens/s, time to first token, inter-token latency "
                                          "and busy-row occupancy.")
    add_model_args(b)
    b.add_argument("--model", default="bench", help="'bench' (the benchmark config, seeded weights), "
                                                    "'builtin', or use --checkpoint (default bench)")
    b.add_argument("--clients", type=positive_int, default=16, metavar="N")
    b.add_argument("--prompt-tokens", default="8-40", metavar="LO-HI", help="prompt lengths (uniform)")
    b.add_argument("--output-tokens", default="64-128", metavar="LO-HI", help="output lengths (uniform)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    b.set_defaults(func=bench_serve)
