"""ExecuTorch's partitioning of a graph into delegates, in time linear in the partition count
(`faster_partitioning`, accelerator `linear_partitioning`): the same partitions, the same graph."""

import contextlib

import torch

from .registry import enabled, patched


def _can_merge_partitions(self, p1, p2, partitions_by_id) -> bool:
    """`GroupBasedPartitioner._can_merge_partitions` of executorch 1.4-1.5, same answer: two partitions
    merge unless a node outside both, fed by one, feeds one back (a cycle), checked on the dependency
    sets, then on the live graph. WHY: the stock method scans each external user's downstream set in
    a Python generator; `isdisjoint` asks the same in C over the smaller set."""
    from torch.fx.passes.utils.fuser_utils import validate_partition

    combined = set(partitions_by_id[p1].nodes) | set(partitions_by_id[p2].nodes)
    for node in combined:
        for user in node.users:
            if user not in combined and not self.dependency_viewer.downstreams_of(user).isdisjoint(combined):
                return False
    return validate_partition(list(combined))


def _legalize_order(gm) -> list:
    """The node order `torch.fx.passes.tools_common.legalize_graph` (torch 2.13-2.15) gives
    `gm`: Kahn's algorithm over a deque, runtime-assertion and scalar ops first."""
    import collections
    import operator

    prioritized = {operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv,
                   operator.mod, operator.le, operator.lt, operator.ge, operator.gt, operator.eq,
                   operator.ne, torch.ops.aten.sym_constrain_range.default,
                   torch.ops.aten.sym_constrain_range_for_size.default, torch.ops.aten._assert_async.msg,
                   torch.ops.aten.scalar_tensor.default, torch.ops.aten._assert_scalar.default}
    nodes = list(gm.graph.nodes)
    indeg = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in node.users:
            indeg[user] += 1
    queue = collections.deque(n for n in nodes if indeg[n] == 0)
    order = []
    while queue:
        cur = queue.popleft()
        order.append(cur)
        for user in cur.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                if user.op == "call_function" and user.target in prioritized:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    if len(order) < len(nodes):
        raise RuntimeError(f"Input graph has cycles, unable to add {[n for n in indeg if indeg[n] != 0]}")
    return order


@contextlib.contextmanager
def faster_partitioning():
    """Within the block, ExecuTorch's partitioning of a graph into delegates gives the same partitions
    and graph in time linear, not quadratic, in the partition count.

    WHY: most of `to_backend` outside XNNPACK's preprocessing was two quadratic steps. (1)
    `GroupBasedPartitioner` tries to merge every pair of partitions (`_can_merge_partitions`). (2)
    after cutting out each delegate, `legalize_graph` copies every node into a new graph and
    regenerates its code: the same order is applied in place, the code regenerated once at the end
    (nothing runs the module in between)."""
    if not enabled("linear_partitioning"):  # off: the stock path
        yield
        return
    from executorch.exir import lowered_backend_module as lbm
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner

    touched = {}

    def legalize_in_place(gm):
        cursor = gm.graph._root
        for node in _legalize_order(gm):
            if cursor._next is not node:
                cursor.append(node)
            cursor = node
        touched[id(gm)] = gm
        return gm

    try:
        with patched(GroupBasedPartitioner, _can_merge_partitions=_can_merge_partitions), \
                patched(lbm, legalize_graph=legalize_in_place):
            yield
    finally:
        for gm in touched.values():
            gm.recompile()
