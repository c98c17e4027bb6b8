"""`shram-static export`: write `.pte` and/or `.onnx` artifacts plus `tokenizer.json`, and print
the path of every file written, one per line (each format's main file first, the tokenizer's
files last)."""

import argparse
import os
import shutil
import time

from ..backends import quantize_modes
from ..checkpoint_dir import check_checkpoint_dir
from ..console import info

FORMATS = ("pte", "onnx", "web")
QUANTIZE = {"pte": quantize_modes("pte"), "onnx": quantize_modes("onnx"), "web": quantize_modes("onnx")}


def export_main(args) -> int:
    """Exports the model of `--checkpoint` (built-in model when absent) into `--out`."""
    check_checkpoint_dir(args.checkpoint)  # before the imports (torch takes seconds)
    from .web import COI_FILE, PAGE_FILES, RUNTIME_FILES, export_web, find_ort_web

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"--format takes a comma-separated subset of {FORMATS}, got {args.format!r}")
    if args.quantize_embedding and not args.quantize:
        raise ValueError("--quantize-embedding applies with --quantize (int8 or 8da4w)")
    if "web" in formats:
        if args.batch_size != 1:
            raise ValueError("--format web runs one prompt at a time: leave --batch-size at 1")
        find_ort_web()  # a missing runtime says so now, not after minutes of export
        if "onnx" in formats and args.quantize not in QUANTIZE["onnx"]:
            formats.remove("onnx")  # the site holds the same fp32 model.onnx: written once
    if args.quantize and not any(args.quantize in QUANTIZE[f] for f in formats):
        raise ValueError(f"--quantize {args.quantize} applies to none of {formats} "
                         f"(pte takes {', '.join(QUANTIZE['pte'])}; onnx and web take {', '.join(QUANTIZE['onnx'])})")
    info(f"loading {args.checkpoint or 'the built-in model'} ...")  # before the imports: torch takes seconds
    from ..default_model import load_model_and_tokenizer
    from . import export_onnx, export_pte

    model, tok = load_model_and_tokenizer(args.checkpoint)
    os.makedirs(args.out, exist_ok=True)
    # The stock ExecuTorch runner reads a tokenizer.json: ship the checkpoint's own, else ours.
    src = os.path.join(args.checkpoint, "tokenizer.json") if args.checkpoint else None
    if src and os.path.isfile(src):
        shutil.copy(src, os.path.join(args.out, "tokenizer.json"))
        tok_files = ["tokenizer.json"]
    else:
        tok.save(args.out)  # tokenizer.json, and a tokenizer_config.json naming its special tokens
        tok_files = [f for f in ("tokenizer.json", "tokenizer_config.json")
                     if os.path.isfile(os.path.join(args.out, f))]
    written = []
    eos = tok.eos_token_id
    stem = os.path.join(args.out, "model")
    for fmt in formats:
        t = time.perf_counter()
        quantize = args.quantize if args.quantize in QUANTIZE[fmt] else None
        if args.quantize and quantize is None:
            takers = " and ".join(f for f in FORMATS if args.quantize in QUANTIZE[f])
            info(f"note: --quantize {args.quantize} applies to {takers} only; the .{fmt} stays fp32")
        chunk = ("decode only" if args.decode_only else f"prefill chunk {args.prefill_chunk}, "
                 f"{'every' if args.full_logits else 'the last'} token's logits")
        info(f"exporting {fmt} (batch {args.batch_size}, {chunk}{', ' + quantize if quantize else ''}); "
             f"lowering can take minutes ...")
        suffix = f".{quantize}" if quantize else ""
        kw = dict(prefill_chunk=None if args.decode_only else args.prefill_chunk, parallel=args.parallel,
                  full_logits=args.full_logits, quantize=quantize)
        if fmt == "web":
            site = (os.path.join(args.out, f) for f in (*PAGE_FILES, *RUNTIME_FILES, COI_FILE))
            files = [*export_web(model, tok, args.out, **kw).values(), *site]
        elif fmt == "pte":
            files = [export_pte(model, f"{stem}{suffix}.pte", batch_size=args.batch_size, eos_token_id=eos,
                                bos_token_id=tok.bos_token_id, quantize_embedding=args.quantize_embedding,
                                prefix_decode=args.prefix_decode, **kw)]
        else:  # the decode graph first
            paths = export_onnx(model, f"{stem}{suffix}.onnx", batch_size=args.batch_size, eos_token_id=eos,
                                **kw)
            files = list(paths.values())
        info(f"wrote {files[0]}{f' (+ {len(files) - 1} more files)' if len(files) > 1 else ''} in "
             f"{time.perf_counter() - t:.0f} s")
        for path in files:
            if path not in written:  # web and onnx share the fp32 model.onnx
                written.append(path)
                print(path, flush=True)
    for f in tok_files:
        print(os.path.join(args.out, f))
    return 0


def register(subparsers) -> None:
    """Adds the `export` subcommand to the CLI."""
    p = subparsers.add_parser("export", help="write ExecuTorch (.pte) and/or ONNX artifacts")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the built-in model)")
    p.add_argument("--format", default="pte,onnx", help="comma-separated: pte, onnx, web (default pte,onnx); web: a static site "
                        "that runs the model in the browser (onnxruntime-web; needs `npm ci`)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--decode-only", action="store_true",
                   help="write no prefill step (.pte method, .onnx graph): prompts run token by token "
                        "through the decode step, as ExecuTorch's stock runner does; half the export work")
    p.add_argument("--full-logits", action="store_true",
                   help="the prefill step returns every token's logits (for scoring text), not only each "
                        "row's last token's (all generation reads; the lm_head then runs on one token per row)")
    p.add_argument("--quantize", choices=sorted({m for modes in QUANTIZE.values() for m in modes}), default=None,
                   help="int8: int8 weights (.pte: per channel, int8 activations; .onnx: weight-only, "
                        "blocks of 32); 8da4w (.pte): int4 weights in groups of 32, int8 activations; "
                        "int4 (.onnx, web): weight-only int4 in blocks of 32 (web: the token embedding too)")
    p.add_argument("--quantize-embedding", action="store_true",
                   help="with --quantize, store the embedding as int8 rows too: a quarter of its bytes, "
                        "same speed, more logit drift")
    p.add_argument("--prefix-decode", action="store_true",
                   help="pte at batch 1: also write a decode method over the live prefix of the sparse caches "
                        "(what the Python runner then uses; stock runners keep the whole-cache `forward`): "
                        "cheaper decode at a large capacity, one more method to lower")
    p.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="export the decode and prefill steps in two processes at once (Linux, 2+ CPUs; "
                        "default): ~1.3x faster, up to twice the peak memory")
    p.set_defaults(func=export_main)
