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

    WHY: onnxscript's `SlicesSplit` (two Slices of one tensor's halves -> one Split) is a
    two-output pattern whose matcher is slower than the other rules together on a SHRAM step,
    which holds hundreds of Slices and never matches it. `optimize_ir` reads the rule tuple
    when it runs, so it is swapped for the block only.
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


onnx_export = without_onnx_rewrite_rules  # the seam's name (`accelerators.onnx_export()`)
