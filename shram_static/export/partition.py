"""Which ops of a SHRAM step the XNNPACK delegate takes: XNNPACK's own partitioner configs,
except that a reshape of a tensor made outside the delegate (a weight, a state buffer, a cache
write, a portable gather's output) stays outside it.

WHY: inside a delegate a reshape copies its whole input on every call; outside, `to_executorch`
makes it a free view (docs/performance.md, "`.pte`"). Public configs: part of the program.
"""

import torch


def xnnpack_partitioner():
    """An `XnnpackPartitioner` with XNNPACK's default configs, the reshape config declining
    reshapes of tensors made outside the delegate.

    Returns:
        The partitioner for `to_edge_transform_and_lower`.
    """
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.generic_node_configs import ViewCopyConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir.backend.canonical_partitioners.config_partitioner import format_target_name

    delegated = {cfg.target_name for cfg in ALL_PARTITIONER_CONFIGS}

    def made_outside(node) -> bool:
        """A graph input, the output of an op no XNNPACK config takes, or a reshape of either."""
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
