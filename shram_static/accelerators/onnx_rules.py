"""The ONNX exporter's optimizer without the rewrite rules that never match a SHRAM step
(`without_onnx_rewrite_rules`, accelerator `skip_onnx_slices_split`)."""

import contextlib

from .registry import enabled


# onnxscript rewrite rules the ONNX export leaves out (see `without_onnx_rewrite_rules`).
SKIPPED_ONNX_RULES = ("SlicesSplit",)


@contextlib.contextmanager
def without_onnx_rewrite_rules(names=SKIPPED_ONNX_RULES):
    """Within the block, the ONNX exporter's optimizer (`torch.onnx.export(optimize=True)`,
    i.e. `onnxscript.optimizer.optimize_ir`) applies its default rewrite rules except `names`.

    WHY: onnxscript's `SlicesSplit` (two Slices of one tensor's last-axis halves -> one Split)
    is a two-output pattern, and its matcher is far slower than the other 45 rules together on
    a SHRAM step, which holds hundreds of Slices (cache views, RoPE halves) and never matches
    it: most of an optimizer round on the bench model's decode graph, and the optimizer is most
    of an `.onnx` export (docs/performance.md, "Accelerators"). The optimized
    graphs are otherwise what the exporter makes (tests/test_onnx_lowering.py compares the op
    histograms with and without). `optimize_ir` reads the rule tuple when it runs, so it is
    swapped for the block only;
    runs only on the releases it was verified on (registry.py).
    """
    if not enabled("skip_onnx_slices_split"):  # off: the stock path
        yield
        return
    from onnxscript import rewriter

    rules = rewriter._DEFAULT_REWRITE_RULES
    keep = tuple(r for r in rules if getattr(r, "name", None) not in names)
    rewriter._DEFAULT_REWRITE_RULES = keep
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules
