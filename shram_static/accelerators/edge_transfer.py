"""A lowered edge program (XNNPACK delegates included) to a picklable value and back, so a method
lowered in a forked process (`forked.run_jobs`) joins the program emitted here. ExecuTorch's
serializer (`exir.serde`) carries the graph, delegates' bytes, named data and original modules;
`requires_grad` (the emitter writes it) travels beside it. The emitted program is the one lowering
here gives, but for where memory planning places tensors of equal size (an order hashed by object
identity, not fixed between processes).
"""

import logging

import torch
import torch.utils._pytree as pytree

from .forked import run_jobs


def _grad_flags(ep) -> dict:
    return {n.name: [bool(getattr(v, "requires_grad", False)) for v in pytree.tree_leaves(n.meta.get("val"))]
            for n in ep.graph.nodes}


def _lowered_modules(ep) -> dict:
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    return {n: m for n, m in ep.graph_module.named_children() if isinstance(m, LoweredBackendModule)}


def edge_program_to_value(ep) -> tuple:
    """An edge `ExportedProgram` as a picklable value (`edge_program_from_value` reverses it). The
    delegates' named data and original modules' tensors travel beside the serialized program. WHY: the
    serializer writes them as base64 inside nested JSON, several times their size; it sees them on the
    meta device, and `ep` is restored after."""
    from executorch.exir.serde.serialize import serialize

    lowered, data = _lowered_modules(ep), {}
    try:
        for name, m in lowered.items():
            orig, tensors = m.original_module, {}
            data[name] = (m._named_data_store_output, tensors)  # before any change: `_put_back` undoes
            m._named_data_store_output = None
            for d in (orig.state_dict, orig.constants):
                for k, t in d.items():
                    if isinstance(t, torch.Tensor):
                        tensors[k] = t
                        meta = t.detach().to("meta")
                        is_param = isinstance(t, torch.nn.Parameter)
                        d[k] = torch.nn.Parameter(meta, t.requires_grad) if is_param else meta
        art = serialize(ep)
    finally:
        _put_back(lowered, data)
    return (art.exported_program, art.state_dict, art.constants, art.example_inputs), _grad_flags(ep), data


def _put_back(lowered: dict, data: dict) -> None:
    """Each lowered module's named data and original-module tensors from `data`, in place."""
    for name, (named, tensors) in data.items():
        m = lowered[name]
        m._named_data_store_output = named
        for d in (m.original_module.state_dict, m.original_module.constants):
            for k in d:
                if k in tensors:
                    d[k] = tensors[k]


# `forked.run_jobs` lowers in one process where the accelerator `parallel_lowering` is off.
edge_program_to_value.accelerator = "parallel_lowering"


def lower_in_parallel(jobs: dict, parallel: bool = True) -> dict:
    """`run_jobs` of jobs each returning a lowered edge `ExportedProgram` (sent back from a forked
    process as `edge_program_to_value`; all here where `parallel_lowering` is off)."""
    return run_jobs(jobs, edge_program_to_value, edge_program_from_value, parallel)


def edge_program_from_value(value: tuple):
    """The edge `ExportedProgram` of `edge_program_to_value`."""
    from executorch.exir.serde.export_serialize import SerializedArtifact
    from executorch.exir.serde.serialize import deserialize

    fields, flags, data = value
    # WHY the filter: a method with a dynamic size (a prefix step's slots) logs a warning that
    # changes nothing per symbol of its shape environment that no graph node names
    log = logging.getLogger("executorch.exir.serde.export_serialize")
    quiet = lambda record: "did not appear in the graph" not in record.getMessage()  # noqa: E731
    log.addFilter(quiet)
    try:
        ep = deserialize(SerializedArtifact(*fields))
    finally:
        log.removeFilter(quiet)
    _put_back(_lowered_modules(ep), data)
    for node in ep.graph.nodes:
        for v, grad in zip(pytree.tree_leaves(node.meta.get("val")), flags.get(node.name, ())):
            if grad and isinstance(v, torch.Tensor) and not v.requires_grad:
                v.requires_grad_(True)
    return ep
