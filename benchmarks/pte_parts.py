"""What each part of a `.pte` decode step costs: the step exported with one part taken out
(timing only: that program's logits are wrong), timed against the whole step in one process.

While a variant is exported, the name the step calls for its part is patched
(`unittest.mock.patch`); the package is never changed:
- `attention`: `masked_attention` returns its queries, so neither attention runs, nor the
  gathers of the selected expert caches that only the sparse one reads;
- `gathers`: the K selected expert caches are taken as a slice (the first K) instead of an
  `index_select`, a copy on a portable kernel in the runtime;
- `routing`: the block-balanced top-K with its entmax is replaced by the first K experts,
  weighted by a softmax of their logits;
- `entmax`: the router's weights as a softmax of its logits instead of entmax-1.2.

Each variant runs against the whole step as `abba.py` runs two decoders (A, B, B, A, the
direction alternating by round); B/A below 1 is the share of the step the part costs.

    python benchmarks/pte_parts.py [--model bench] [--parts attention gathers routing entmax] [--rounds 12] [--steps 20]
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from unittest import mock

import torch


def _first_k(z, live, start, taken, k, dtype, small=False, pick=None, scores=None):
    """`routing.route` with every token at experts 0..K-1, weighted by a softmax of their logits."""
    B, C, _ = z.shape
    # + 0 * live: a tensor of its own per step, not an expanded constant (an expand_copy kernel)
    idx = torch.arange(k, device=z.device).expand(B, C, k) + 0 * live[..., None].long()  # (B, C, K)
    return idx, torch.softmax(z[..., :k], dim=-1)


def _slice_rows(self, dim, index):
    """`Tensor.index_select` as the first len(index) entries along dim (a slice, not a copy)."""
    return self.narrow(dim, 0, index.numel())


@contextlib.contextmanager
def _patched(targets, new):
    """`mock.patch` of each of `targets` by `new`."""
    with contextlib.ExitStack() as stack:
        for t in targets:
            stack.enter_context(mock.patch(t, new))
        yield


PARTS = {
    "attention": lambda: _patched(("shram_static.layers.masked_attention", "shram_static.attention.masked_attention"),
                                  lambda q, k, v, bias, scale, seen=None, small=False: q * 1.0),
    "gathers": lambda: mock.patch.object(torch.Tensor, "index_select", _slice_rows),
    "routing": lambda: mock.patch("shram_static.layers.route", _first_k),
    "entmax": lambda: mock.patch("shram_static.layers.Router.scores",
                                 staticmethod(lambda z: torch.softmax(z.float(), dim=-1))),
}


def export_without(model, part: str | None, path: str, quantize: str | None = None) -> None:
    """Writes `model`'s decode-only `.pte` with `part` (a key of PARTS, or None) taken out."""
    from shram_static.export import export_pte

    with PARTS[part]() if part else contextlib.nullcontext():
        export_pte(model, path, prefill_chunk=None, quantize=quantize)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bench", help="bench, builtin or a checkpoint directory")
    p.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=list(PARTS))
    p.add_argument("--quantize", choices=["int8", "8da4w"], help="as `shram-static export --quantize`")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    from abba import measure  # this script's folder is on sys.path

    from shram_static.bench import build_model
    from shram_static.export import load_pte

    model = build_model(args.model).eval()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for part in [None, *args.parts]:
            print(f"exporting the decode step{f' without {part}' if part else ''} ...", file=sys.stderr)
            paths[part] = os.path.join(tmp, f"{part or 'whole'}.pte")
            export_without(model, part, paths[part], args.quantize)
        for part in args.parts:
            decoders = [("A1", load_pte(paths[None])), ("B1", load_pte(paths[part])),
                        ("B2", load_pte(paths[part])), ("A2", load_pte(paths[None]))]
            t = measure(decoders, args.rounds, args.steps)
            whole = statistics.median(t["A1"] + t["A2"])
            ratio = statistics.median(t["B/A"])
            print(f"without {part}: B/A {ratio:.3f} ({(1 - ratio) * whole:.2f} ms of a {whole:.2f} ms step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
