"""Fewer, larger nodes in the exported ONNX graphs: a step's RMSNorms, RoPE rotations and max
trees rewritten into `RMSNormalization`, `RotaryEmbedding` and `ReduceMax` (opset 23).

WHY: onnxruntime spends microseconds on each of thousands of small nodes, and the step is
written for XNNPACK (`shram_static.reductions`), whose forms are 9 nodes per RMSNorm, 7 per
RoPE and 3 per max-tree level in ONNX. onnxscript's own fusions match transformers' Llama forms,
not these; the rules use its pattern rewriter. A form a rule does not match keeps its plain
nodes, which compute the same values.
"""

import onnx_ir as ir
from onnxscript.rewriter import RewritePass, pattern

OPSET = 23  # RMSNormalization and RotaryEmbedding are ONNX ops from opset 23


def _shape(v) -> list[int] | None:
    """The static shape of an ir.Value, or None."""
    if v is None or v.shape is None or not all(isinstance(d, int) for d in v.shape):
        return None
    return list(v.shape)


def _ints(v) -> list[int] | None:
    """The integer constant an ir.Value holds, flattened, or None."""
    c = v.const_value if v is not None else None
    return None if c is None else [int(a) for a in c.numpy().reshape(-1)]


def _float(v) -> float | None:
    """The float a one-element constant ir.Value holds, or None."""
    c = v.const_value if v is not None else None
    if c is None or c.numpy().size != 1 or c.numpy().dtype.kind != "f":
        return None
    return float(c.numpy().reshape(-1)[0])


def _last_axis(axes, rank: int) -> bool:
    a = _ints(axes)
    return a is not None and len(a) == 1 and a[0] % rank == rank - 1


def _half_slice(x, start, end, axes, steps, lo: int, hi: int) -> bool:
    """Whether Slice(x, start, end, axes, steps) takes [lo, hi) of x's last axis."""
    shp = _shape(x)
    if shp is None or not _last_axis(axes, len(shp)) or _ints(steps) not in ([1], None):
        return False
    s, e = _ints(start), _ints(end)
    return s == [lo] and e is not None and len(e) == 1 and min(e[0], shp[-1]) == hi


class RMSNormFusion(pattern.RewriteRuleClassBase):
    """`layers.RMSNorm` in fp32: scale * (x * 1/sqrt(mean_last(x*x) + eps)) -> RMSNormalization."""

    def pattern(self, op, x, s1, axes, s2, eps, scale):
        m = op.ReduceMean(op.Reshape(op.Mul(x, x), s1, _allow_other_attributes=True), axes,
                          _allow_other_attributes=True, _outputs=["m"])
        ms = op.Reshape(m, s2, _allow_other_attributes=True, _outputs=["ms"])
        inv = op.Reciprocal(op.Sqrt(op.Add(ms, eps)))
        return op.Mul(scale, op.Mul(x, inv))

    def check(self, op, x, axes, eps, scale, m, ms, **_):
        r = pattern.MatchResult()
        xs, ss, src = _shape(x), _shape(scale), _shape(m.producer().inputs[0])
        if xs is None or ss is None or src is None or _ints(axes) is None:
            return r.fail("shapes or axes not static")
        # A row-major reshape whose last axis is x's last axis, averaged over that axis and
        # size-1 axes only, then reshaped to x's rows: each mean is over one row of x.
        d, rank = xs[-1], len(src)
        axs = {a % rank for a in _ints(axes)}
        if (src[-1] != d or rank - 1 not in axs or any(src[a] != 1 for a in axs - {rank - 1})
                or _shape(ms) != xs[:-1] + [1] or ss != [d]
                or m.producer().attributes.get_int("keepdims", 1) != 1):
            return r.fail("not a mean over x's last axis with a per-channel scale")
        if x.dtype != ir.DataType.FLOAT or scale.dtype != ir.DataType.FLOAT:
            return r.fail("not fp32")
        if _float(eps) is None:
            return r.fail("epsilon is not a float constant")
        return r

    def rewrite(self, op, x, eps, scale, **_):
        return op.RMSNormalization(x, scale, axis=-1, epsilon=_float(eps), stash_type=int(ir.DataType.FLOAT))


class RoPEFusion(pattern.RewriteRuleClassBase):
    """`rope.apply_rope` in fp32: x*cos + cat(-x2, x1)*sin -> RotaryEmbedding (non-interleaved).

    Matches x (B, H, S, u) with rows (B, 1, S, u) (local path) and x (B, S, K, u) with rows
    (B, S, 1, u) (selected experts; RotaryEmbedding's 3-D form (B, S, K*u), num_heads=K).
    """

    def pattern(self, op, x, cos, sin, s1, e1, a1, t1, s2, e2, a2, t2):
        rot = op.Concat(op.Neg(op.Slice(x, s1, e1, a1, t1)), op.Slice(x, s2, e2, a2, t2), axis=-1)
        return op.Add(op.Mul(x, cos), op.Mul(rot, sin))

    def check(self, op, x, cos, sin, s1, e1, a1, t1, s2, e2, a2, t2, **_):
        r = pattern.MatchResult()
        xs, cs = _shape(x), _shape(cos)
        if xs is None or cs is None or len(xs) != 4 or _shape(sin) != cs or xs[-1] % 2:
            return r.fail("shapes")
        u = xs[-1]
        if not (_half_slice(x, s1, e1, a1, t1, u // 2, u) and _half_slice(x, s2, e2, a2, t2, 0, u // 2)):
            return r.fail("not a rotation of halves")
        if any(v.dtype != ir.DataType.FLOAT for v in (x, cos, sin)):
            return r.fail("not fp32")
        B, A, S, _ = xs
        return r if cs in ([B, 1, S, u], [B, A, 1, u]) else r.fail(f"cos/sin rows {cs} do not match x {xs}")

    def rewrite(self, op, x, cos, sin, **_):
        B, A, S, u = x.shape
        per_head = list(cos.shape) == [B, 1, S, u]  # (B, H, S, u) layout
        n = S if per_head else A

        def half(t):  # (.., u) duplicated halves -> (B, n, u/2), the op's cache rows
            t = op.Slice(t, op.Constant(value_ints=[0]), op.Constant(value_ints=[u // 2]),
                         op.Constant(value_ints=[-1]))
            return op.Reshape(t, op.Constant(value_ints=[B, n, u // 2]))

        if per_head:
            return op.RotaryEmbedding(x, half(cos), half(sin))
        y = op.RotaryEmbedding(op.Reshape(x, op.Constant(value_ints=[B, A, S * u])),
                               half(cos), half(sin), num_heads=S)
        return op.Reshape(y, op.Constant(value_ints=[B, A, S, u]))


class MaxHalvesFusion(pattern.RewriteRuleClassBase):
    """The last level of `reductions.max_last`'s tree, Max(y[..., :1], y[..., 1:2]) -> ReduceMax(y)."""

    def pattern(self, op, y, s1, e1, a1, t1, s2, e2, a2, t2):
        return op.Max(op.Slice(y, s1, e1, a1, t1), op.Slice(y, s2, e2, a2, t2))

    def check(self, op, y, s1, e1, a1, t1, s2, e2, a2, t2, **_):
        r = pattern.MatchResult()
        ys = _shape(y)
        if ys is None or ys[-1] != 2 or not (_half_slice(y, s1, e1, a1, t1, 0, 1)
                                             and _half_slice(y, s2, e2, a2, t2, 1, 2)):
            return r.fail("not the halves of a width-2 tensor")
        return r

    def rewrite(self, op, y, **_):
        return op.ReduceMax(y, op.Constant(value_ints=[-1]), keepdims=1)


class MaxTreeFusion(MaxHalvesFusion):
    """ReduceMax(Max(y[..., :h], y[..., h:2h])) -> ReduceMax(y): one level of `max_last`'s tree."""

    def pattern(self, op, y, s1, e1, a1, t1, s2, e2, a2, t2, axes):
        m = op.Max(op.Slice(y, s1, e1, a1, t1), op.Slice(y, s2, e2, a2, t2))
        return op.ReduceMax(m, axes, _allow_other_attributes=True, _outputs=["out"])

    def check(self, op, y, s1, e1, a1, t1, s2, e2, a2, t2, axes, out, **_):
        r = pattern.MatchResult()
        ys = _shape(y)
        if ys is None or ys[-1] % 2 or not _last_axis(axes, len(ys)):
            return r.fail("shapes or axes")
        if out.producer().attributes.get_int("keepdims", 1) != 1:
            return r.fail("keepdims")
        h = ys[-1] // 2
        if not (_half_slice(y, s1, e1, a1, t1, 0, h) and _half_slice(y, s2, e2, a2, t2, h, 2 * h)):
            return r.fail("not the halves of y")
        return r


RULES = (RMSNormFusion.rule(), RoPEFusion.rule(), MaxHalvesFusion.rule(), MaxTreeFusion.rule())


def fuse_onnx_ops(model: ir.Model, max_rounds: int = 16) -> dict[str, int]:
    """Applies the rules to an opset-23 `ir.Model` in place until none matches (a round per max
    tree level), then merges duplicate nodes (RoPE's cos/sin rows) and drops unused ones.

    Args:
        model: the exporter's model (`ONNXProgram.model`), default-domain opset 23.
        max_rounds: bound on the rounds (a max tree over 2**n needs n + 1).

    Returns:
        How many nodes of each fused op type the graph holds afterwards.
    """
    from onnx_ir.passes.common import CommonSubexpressionEliminationPass, RemoveUnusedNodesPass

    if model.opset_imports.get("") != OPSET:
        raise ValueError(f"fuse_onnx_ops needs an opset-{OPSET} model, got opset "
                         f"{model.opset_imports.get('')}")
    rewrite = RewritePass(RULES)
    for _ in range(max_rounds):
        if not rewrite(model).modified:
            break
    CommonSubexpressionEliminationPass()(model)
    RemoveUnusedNodesPass()(model)
    return {op: sum(n.op_type == op and n.domain == "" for n in model.graph)
            for op in ("RMSNormalization", "RotaryEmbedding", "ReduceMax")}
