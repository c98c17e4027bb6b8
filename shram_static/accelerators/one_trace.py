"""`torch.export.export` -> `to_edge_transform_and_lower` with export and decomposition in one
trace per method where the stock stages take four (accelerator `one_trace_lowering`)."""

import dataclasses
import functools
import logging

import torch

from .registry import enabled, patched


def _lighter(ep):
    """`ep` without `from_node` provenance and unused `_assert_tensor_metadata` nodes, in place. WHY: every
    pass deep-copies provenance and re-traces the asserts (one per `.to(dtype)`); neither is the program."""
    target = torch.ops.aten._assert_tensor_metadata.default
    for node in list(ep.graph.nodes):
        node.meta.pop("from_node", None)
        if node.op == "call_function" and node.target is target and not node.users:
            ep.graph.erase_node(node)
    ep.graph_module.recompile()
    return ep


def export_decomposed(mod: torch.nn.Module, args: tuple, decompositions: dict, dynamic_shapes=None):
    """`torch.export.export(mod, args, strict=False).run_decompositions(decompositions)` in one trace.

    WHY: the public flow traces to the training IR, then `run_decompositions` traces the whole graph
    again. This runs what that second trace runs (`_decompose_and_get_gm_with_new_signature_constants`:
    `_export_to_aten_ir` with the non-CIA decompositions, under `_override_composite_implicit_decomp`
    for the CIA ones) through torch.export's non-pre-dispatch path on the module itself, then removes
    the redundant `copy` a buffer mutation leaves. Under no_grad: in-place writes into buffers computed
    from parameters that require grad fail in ExecuTorch's passes.

    Args:
        mod: the module (in eval mode, its inputs static).
        args: example positional inputs.
        decompositions: op -> decomposition, as for `run_decompositions`.
        dynamic_shapes: as for `torch.export.export`.

    Returns:
        The decomposed `ExportedProgram`.
    """
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in (*mod.parameters(), *mod.buffers())):
        # WHY: torch 2.13's non-pre-dispatch export does not unwrap tensor subclasses (torchao's
        # quantized weights): it fails (IndexError in `set_missing_meta_vals`). The training IR
        # unwraps them; its second trace is then the price.
        with torch.no_grad():
            ep = torch.export.export(mod, args, strict=False, dynamic_shapes=dynamic_shapes)
        return _lighter(ep).run_decompositions(decompositions)

    from torch.export import _trace
    from torch.export.exported_program import (_override_composite_implicit_decomp,
                                               _remove_unnecessary_copy_op_pass,
                                               _split_decomp_table_to_cia_and_python_decomp)

    cia, python = _split_decomp_table_to_cia_and_python_decomp(dict(decompositions))
    to_aten = functools.partial(_trace._export_to_aten_ir, decomp_table=python)
    with patched(_trace, _export_to_aten_ir=to_aten), torch.no_grad(), \
            _override_composite_implicit_decomp(cia):
        ep = _trace._export(mod, args, dynamic_shapes=dynamic_shapes, strict=False, pre_dispatch=False)
    _remove_unnecessary_copy_op_pass(ep.graph_module, ep.graph_signature)
    return ep


def export_and_lower(methods: dict, partitioner, constant_methods: dict, compile_config):
    """`torch.export.export` of each method, then `executorch.exir.to_edge_transform_and_lower`, with
    one trace per method (`export_decomposed`) where the stock calls take four; else the stock calls.

    WHY: for a partitioner that checks op support (XNNPACK's), the stock call runs `run_decompositions`
    three times per method, each a full re-trace after export's own. ExecuTorch's public two-step flow
    (`to_edge` with `preserve_ops`, then `to_backend`) decomposes once, here fused with the export's
    trace. It differs only for a kept op the partitioner then rejects (the stock call decomposes it):
    each is checked with the partitioner's support check, any rejection falls back to the stock calls.

    Args:
        methods: name -> (module, example inputs[, dynamic_shapes]); strict=False, no_grad.
        partitioner: one partitioner for every method.
        constant_methods: as for `to_edge_transform_and_lower`.
        compile_config: an `EdgeCompileConfig` (its `preserve_ops` is extended, not replaced).

    Returns:
        The lowered `EdgeProgramManager`.
    """
    from executorch.exir import EdgeProgramManager
    from executorch.exir.program import _program

    if not enabled("one_trace_lowering"):
        return _stock_lower(methods, partitioner, constant_methods, compile_config)
    # The ops the partitioner keeps whole, as the stock call asks for them (a configuration
    # partitioner's list does not depend on the program; its support check, below, does).
    kept = partitioner.ops_to_not_decompose(None)[0]
    table = _program._default_decomposition_table()
    for op in [*compile_config.preserve_ops, *kept]:
        table.pop(op, None)
    programs = {name: export_decomposed(*m[:2], table, *m[2:]) for name, m in methods.items()}
    present = {n.target for ep in programs.values() for n in ep.graph.nodes if n.op == "call_function"}
    keep = [op for op in kept if op in present]
    config = dataclasses.replace(compile_config, preserve_ops=list(compile_config.preserve_ops) + keep)
    # `to_edge` without its `run_decompositions` (done above, with the same table); read when
    # called, as `to_edge` reads it, so the edge-pass accelerators of `lowering()` apply.
    edge = EdgeProgramManager({n: _program._generate_edge_program(config, p, preserve_ops=config.preserve_ops)
                               for n, p in programs.items()}, constant_methods, config)
    for name in programs:
        ep = edge.exported_program(name)
        _, supported = partitioner.ops_to_not_decompose(ep)
        for n in ep.graph.nodes:
            # An edge op wraps its ATen op in `_op`.
            if n.op == "call_function" and getattr(n.target, "_op", n.target) in keep \
                    and not (supported is None or supported(n)):
                return _stock_lower(methods, partitioner, constant_methods, compile_config)
    # The XNNPACK partitioner logs a deprecation notice for to_edge + to_backend, advising the
    # stock call for its support filter; that filter is applied above, so the notice is dropped.
    log = logging.getLogger("executorch.backends.xnnpack.partition.xnnpack_partitioner")
    quiet = lambda record: "DEPRECATION WARNING" not in record.getMessage()  # noqa: E731 (a callable filter)
    log.addFilter(quiet)
    try:
        return edge.to_backend(partitioner)
    finally:
        log.removeFilter(quiet)


def _stock_lower(methods: dict, partitioner, constant_methods: dict, compile_config):
    """The stock calls `export_and_lower` stands for."""
    from executorch.exir import to_edge_transform_and_lower

    with torch.no_grad():
        aten = {name: torch.export.export(*m[:2], strict=False, dynamic_shapes=(m[2:] or (None,))[0])
                for name, m in methods.items()}
    return to_edge_transform_and_lower(aten, partitioner=[partitioner], compile_config=compile_config,
                                       constant_methods=constant_methods)
