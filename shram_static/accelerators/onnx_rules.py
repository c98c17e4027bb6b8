"""The ONNX exporter's optimizer without the rewrite rules that never match a SHRAM step
(`without_onnx_rewrite_rules`, accelerator `skip_onnx_slices_split`)."""

import contextlib

from .registry import enabled, patched


SKIPPED_ONNX_RULES = ("SlicesSplit",)


@contextlib.contextmanager
def without_onnx_rewrite_rules(names=SKIPPED_ONNX_RULES):
    """Within the block, the ONNX exporter's optimizer (`onnxscript.optimizer.optimize_ir`) applies its
    default rewrite rules except `names`.

    WHY: `SlicesSplit` (two Slices of one tensor's halves -> one Split) is a two-output pattern whose
    matcher is slower than the other rules together on a SHRAM step, which holds hundreds of Slices
    and never matches it. `optimize_ir` reads the rule tuple when it runs: swapped for the block only.
    """
    if not enabled("skip_onnx_slices_split"):  # off: the stock path
        yield
        return
    from onnxscript import rewriter

    keep = tuple(r for r in rewriter._DEFAULT_REWRITE_RULES if getattr(r, "name", None) not in names)
    with patched(rewriter, _DEFAULT_REWRITE_RULES=keep):
        yield


onnx_export = without_onnx_rewrite_rules  # the seam's name (`accelerators.onnx_export()`)
