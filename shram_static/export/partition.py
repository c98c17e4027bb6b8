"""Which ops of a SHRAM step the XNNPACK delegate takes: XNNPACK's own partitioner configs,
except that a reshape of a tensor made outside the delegate (a weight, a state buffer, a cache
write, a portable gather's output) stays outside it.

WHY: inside an XNNPACK delegate a reshape (`view_copy`) is an operator that copies its input,
and when that input comes from outside (a weight, or the output of a portable gather) the
delegate copies the whole tensor on every call. Outside a delegate ExecuTorch turns the same
`view_copy` into a view that shares its base's memory and costs nothing
(`ReplaceViewCopyWithViewPass`, run by `to_executorch`). On the bench model's decode step the
delegated reshapes copied megabytes per layer per token (the fused expert weights among them),
visible in `perf` as `memmove` on XNNPACK's threads (docs/performance.md, "`.pte`"). XNNPACK's public
partitioner configs: part of the program, not an accelerator.
"""

import torch


def xnnpack_partitioner():
    """An `XnnpackPartitioner` with every one of XNNPACK's default configs, the reshape config
    replaced by one that declines reshapes of tensors made outside the delegate.

    Returns:
        The partitioner for `to_edge_transform_and_lower`.
    """
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.generic_node_configs import ViewCopyConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir.backend.canonical_partitioners.config_partitioner import format_target_name

    delegated = {cfg.target_name for cfg in ALL_PARTITIONER_CONFIGS}

    def made_outside(node) -> bool:
        """The tensor is a graph input (weight, buffer, argument), the output of an op no
        XNNPACK config takes, or a reshape of such a tensor (itself left outside)."""
        if not isinstance(node, torch.fx.Node):
            return False
        if node.op == "placeholder":
            return True
        if node.op != "call_function":
            return False
        name = format_target_name(getattr(node.target, "__name__", ""))
        if name == ViewCopyConfig.target_name:
            return made_outside(node.args[0])
        # A cache write's output counts too: its reshapes are views once
        # `shram_static.export.views` has re-based them on the written buffer.
        return name not in delegated

    class AliasViewConfig(ViewCopyConfig):
        def check_constraints(self, node, ep) -> bool:
            return not made_outside(node.args[0]) and super().check_constraints(node, ep)

    configs = [AliasViewConfig if c is ViewCopyConfig else c for c in ALL_PARTITIONER_CONFIGS]
    return XnnpackPartitioner(configs=configs)
