"""Export and decomposition in one trace: what `torch.export.export(...).run_decompositions(...)`
gives, for the ExecuTorch lowering (`lowering.export_and_lower`), without tracing the graph
twice.
"""

import functools

import torch


def drop_provenance(ep) -> None:
    """Deletes the `from_node` provenance of every node of an exported program, in place.

    WHY: torch.fx records, on every node a pass creates, a deep copy of the whole provenance
    chain of the node it came from, so each of lowering's hundreds of passes copies chains that
    grow with every pass (`copy.deepcopy` under `fx.traceback.NodeSource` was a large share of
    a profiled lowering). Provenance is debugging metadata; the program does not change.
    """
    for node in ep.graph.nodes:
        node.meta.pop("from_node", None)


def drop_metadata_asserts(ep) -> None:
    """Erases torch.export's `_assert_tensor_metadata` nodes (no users), in place.

    WHY: strict export emits one per `.to(dtype)`/`.float()` (56 of the 818 nodes of the tiny
    model's decode graph, most of them same-dtype no-ops), and ExecuTorch removes them only
    after decomposing the graph three times; every pass until then re-traces them.
    """
    target = torch.ops.aten._assert_tensor_metadata.default
    for node in list(ep.graph.nodes):
        if node.op == "call_function" and node.target is target and not node.users:
            ep.graph.erase_node(node)
    ep.graph_module.recompile()


def export_decomposed(mod: torch.nn.Module, args: tuple, decompositions: dict):
    """`torch.export.export(mod, args, strict=False).run_decompositions(decompositions)` in one
    trace: the module traced straight to functional ATen with `decompositions` applied.

    WHY: the public flow traces the module to the training IR, then `run_decompositions`
    traces that whole graph again (about half of a method's time before its conversion to
    edge). This is what that second trace runs (torch 2.13's
    `_decompose_and_get_gm_with_new_signature_constants`: `_export_to_aten_ir` with the
    non-CIA decompositions, under `_override_composite_implicit_decomp` for the CIA ones), run
    by torch.export's own non-pre-dispatch path (`_export(pre_dispatch=False)`, what
    `torch.export.export` ran before the training IR) on the module itself, followed by the
    same removal of the redundant `copy` that a buffer mutation leaves at the output. Part of
    the accelerator `one_trace_lowering` (shram_static/accelerators.py: `export_and_lower` calls it
    only where that is on); tests/test_lowering.py checks the lowered bytes against ExecuTorch's
    stock call. A module holding tensor subclasses (torchao's quantized weights) takes the
    public flow's two traces.

    Traced under no_grad: in-place writes into buffers computed from parameters that require
    grad fail in ExecuTorch's passes.

    Args:
        mod: the module (in eval mode, its inputs static).
        args: example positional inputs.
        decompositions: op -> decomposition, as for `run_decompositions`.

    Returns:
        The decomposed `ExportedProgram`.
    """
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in (*mod.parameters(), *mod.buffers())):
        # WHY: torch 2.13's non-pre-dispatch export does not unwrap tensor subclasses (torchao's
        # quantized weights): it fails (IndexError in `set_missing_meta_vals`). The training IR
        # unwraps them; its second trace is then the price.
        with torch.no_grad():
            ep = torch.export.export(mod, args, strict=False)
        drop_provenance(ep)
        drop_metadata_asserts(ep)
        return ep.run_decompositions(decompositions)

    from torch.export import _trace
    from torch.export.exported_program import (_override_composite_implicit_decomp,
                                               _remove_unnecessary_copy_op_pass,
                                               _split_decomp_table_to_cia_and_python_decomp)

    cia, python = _split_decomp_table_to_cia_and_python_decomp(dict(decompositions))
    to_aten = _trace._export_to_aten_ir
    _trace._export_to_aten_ir = functools.partial(to_aten, decomp_table=python)
    try:
        with torch.no_grad(), _override_composite_implicit_decomp(cia):
            ep = _trace._export(mod, args, strict=False, pre_dispatch=False)
    finally:
        _trace._export_to_aten_ir = to_aten
    _remove_unnecessary_copy_op_pass(ep.graph_module, ep.graph_signature)
    return ep
