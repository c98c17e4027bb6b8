"""Reshapes of the state buffers as free views in the `.pte`, written caches included.

The partitioner leaves reshapes of state buffers and cache writes outside the delegates
(`partition.py`), where `to_executorch` makes them views. Two ExecuTorch (1.4-1.5) behaviours
need mending for that: a view of a cache write is based on a spec that is never the buffer's
(`written_cache_views_pass`), and a view of an initialised state buffer stores its starting
bytes again (`state_view_planning`). Both are public hooks: part of the program, not accelerators.
"""

import torch


def written_cache_views_pass(gm: torch.fx.GraphModule):
    """Re-bases every reshape of a cache's last write onto the buffer the write updates.

    For `ExecutorchBackendConfig(passes=...)`, after `run_reinplace_pass`. WHY: the view pass
    builds a view's spec on its base's before memory planning aliases an `index_put_` onto its
    input, so the view read other memory; the write returns its buffer, and graph order still
    runs every reader after the write.

    Args:
        gm: an edge graph module after `run_reinplace_pass`.

    Returns:
        `PassResult(gm, modified)`.
    """
    from torch.fx.passes.infra.pass_base import PassResult

    def in_place(n) -> bool:
        schema = getattr(n.target, "_schema", None)
        return n.op == "call_function" and schema is not None and schema.is_mutable

    modified = False
    for n in gm.graph.nodes:
        if n.op != "call_function" or "view_copy" not in str(n.target) or not n.args:
            continue
        base = n.args[0]
        if not (isinstance(base, torch.fx.Node) and in_place(base) and "index_put_" in str(base.target)):
            continue
        # Only the buffer's last write: a view of an earlier one would see the later write's data.
        if any(in_place(u) and u.args and u.args[0] is base for u in base.users):
            continue
        root = base
        while isinstance(root, torch.fx.Node) and in_place(root):  # the buffer under a chain of writes
            root = root.args[0]
        n.args = (root, *n.args[1:])
        modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def state_view_planning():
    """The `MemoryPlanningPass` for `ExecutorchBackendConfig`: one shared copy of each state
    buffer across methods, views of state buffers planned as plain tensors in place."""
    from executorch.exir import memory
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.tensor import TensorSpec

    class StateViewPlanning(MemoryPlanningPass):
        """`MemoryPlanningPass(share_mutable_buffers=True)` planning every view of a state buffer
        as a plain tensor at the buffer's place (else the emitter stores its bytes per view)."""

        def __init__(self):
            super().__init__(share_mutable_buffers=True)
            self._planned: list[tuple[torch.fx.GraphModule, set]] = []

        def run(self, graph_module, graph_signature=None):
            res = super().run(graph_module, graph_signature)
            buffers = set(graph_signature.inputs_to_buffers) if graph_signature is not None else set()
            self._planned.append((graph_module, buffers))
            return res

        def run_multimethod(self):
            super().run_multimethod()  # places the shared state buffers
            for gm, buffers in self._planned:
                for n in gm.graph.nodes:
                    if n.op != "call_function" or n.target is not memory.view:
                        continue
                    root = n.args[0]
                    while isinstance(root, torch.fx.Node) and root.target is memory.view:
                        root = root.args[0]
                    if not (isinstance(root, torch.fx.Node) and root.op == "placeholder" and root.target in buffers):
                        continue
                    old = n.meta["spec"]
                    plain = TensorSpec.from_tensor(n.meta["val"])
                    plain.mem_id, plain.mem_obj_id, plain.mem_offset = old.mem_id, old.mem_obj_id, old.mem_offset
                    plain.lifetime = list(old.lifetime)
                    n.meta["spec"] = plain

    return StateViewPlanning()
