"""The accelerators' registry (shram_static/accelerators/registry.py): each runs only where verified and
can be switched off; with every one off, a golden model lowers to the same `.pte` bytes and the
same tokens; importing with an unsupported torch says which versions are supported."""

import importlib
import logging
import subprocess
import sys
import unittest.mock

import pytest
import torch

from helpers import LOWERING_ACCELERATORS, lowering_work, random_ids, run_oracle, tiny_model
from shram_static.accelerators import check_versions, enabled, registry, set_stock, stock
from shram_static.accelerators.registry import REGISTRY, STOCK_ENV, UnsupportedVersionError


@pytest.fixture
def fresh(monkeypatch):
    """No switch set, no environment override, and the one-line logs not yet written."""
    monkeypatch.delenv(STOCK_ENV, raising=False)
    monkeypatch.setattr(registry, "_stock", None)
    registry._log_once.cache_clear()
    registry.decide.cache_clear()  # decisions made with another installed_version
    yield monkeypatch
    registry._log_once.cache_clear()
    registry.decide.cache_clear()


def test_every_accelerator_records_where_and_what_it_was_verified_on():
    assert len(REGISTRY) >= 10
    for a in REGISTRY.values():
        # every one that touches a package records the releases it was verified on
        assert (a.verified or a.internals.startswith("no private internal")) and all(a.verified.values()), a.name
        assert set(a.verified) <= {"torch", "executorch", "onnxscript"}, a.name
        assert a.where and a.internals, a.name


def test_unverified_release_runs_the_stock_path_with_one_debug_line(fresh, caplog):
    real = registry.installed_version
    fresh.setattr(registry, "installed_version", lambda d: "2.99.0" if d == "torch" else real(d))
    caplog.set_level(logging.DEBUG, logger="shram_static.accelerators.registry")
    assert not enabled("batched_kernel_builds") and not enabled("batched_kernel_builds")
    assert enabled("needed_xnnpack_passes") == (real("executorch") in registry.EXECUTORCH)  # no torch in it
    lines = [r for r in caplog.records if "batched_kernel_builds" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG
    assert "torch 2.99.0" in lines[0].getMessage() and "stock path" in lines[0].getMessage()


def test_environment_and_python_switches_turn_them_off(fresh):
    names = list(REGISTRY)
    on = {n for n in names if enabled(n)}  # as verified here
    fresh.setenv(STOCK_ENV, "1")
    assert not any(enabled(n) for n in names)
    fresh.setenv(STOCK_ENV, f"{names[0]}, {names[1]}")  # the named ones only
    assert {n for n in names if enabled(n)} == on - set(names[:2])
    fresh.setenv(STOCK_ENV, "0")
    assert {n for n in names if enabled(n)} == on
    with stock():
        assert not any(enabled(n) for n in names)
    assert {n for n in names if enabled(n)} == on
    set_stock(True)
    fresh.setenv(STOCK_ENV, "0")
    assert not any(enabled(n) for n in names)
    set_stock(False)  # the Python switch wins over the environment
    fresh.setenv(STOCK_ENV, "1")
    assert {n for n in names if enabled(n)} == on
    set_stock(None)
    with pytest.raises(TypeError):
        set_stock("yes")
    with pytest.raises(KeyError, match="registered"):
        enabled("no_such_accelerator")


def test_supported_versions_are_checked():
    assert check_versions({"torch": "2.13.0+cpu", "executorch": "1.4.1"}) == []
    assert check_versions({"torch": "2.14.1+cu130", "executorch": "1.5.1"}) == []
    assert check_versions({"torch": "2.14.1", "executorch": None}) == []  # ExecuTorch optional here
    assert check_versions({"torch": "2.15.0", "executorch": "1.5.1"}) == []
    newer = check_versions({"torch": "2.16.0", "executorch": "1.5.1"})
    assert len(newer) == 1 and "torch 2.16.0" in newer[0] and "torch 2.13-2.15" in newer[0]
    for versions in ({"torch": "2.12.1", "executorch": "1.4.1"}, {"torch": "2.13.0", "executorch": "1.3.0"},
                     {"torch": None}):
        with pytest.raises(UnsupportedVersionError, match=r"torch 2\.13-2\.15, executorch 1\.4-1\.5"):
            check_versions(versions)


def test_stock_patches_nothing():
    """With every accelerator off, the seam's compile hook and stage blocks replace nothing."""
    from executorch.backends.xnnpack import _passes
    from executorch.exir import lowered_backend_module as lbm
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner
    from executorch.exir.program import _program
    from onnxscript import rewriter
    from torch._dynamo.callback import callback_handler
    from torch._inductor import cpu_vec_isa
    from torch._inductor.async_compile import AsyncCompile

    from shram_static import accelerators

    def watched():
        return (list(callback_handler.start_callbacks), AsyncCompile.cpp_pybinding, cpu_vec_isa.valid_vec_isa_list,
                _program._generate_edge_program, _program._get_aten_to_edge_passes, _program.edge_to_executorch_passes,
                _passes.XNNPACKPassManager.__init__, GroupBasedPartitioner._can_merge_partitions, lbm.legalize_graph,
                torch.fx.GraphModule.recompile, rewriter._DEFAULT_REWRITE_RULES)
    before = watched()
    with stock():
        accelerators.prepare_compile("cpu")
        with accelerators.lowering(), accelerators.onnx_export():
            assert watched() == before
    assert watched() == before


@pytest.mark.heavy
def test_importing_with_an_old_torch_names_the_supported_versions():
    code = ("import importlib.metadata as m\n"
            "real = m.version\n"
            "m.version = lambda d: '2.11.0' if d == 'torch' else real(d)\n"
            "import shram_static\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("shram_static.accelerators.registry.UnsupportedVersionError")
    assert "torch 2.11.0 is installed" in last and "torch 2.13-2.15" in last


@pytest.mark.heavy
def test_stock_lowering_writes_the_same_program_and_logits(tmp_path, caplog):
    """A random one-layer model's decode-only `.pte`, lowered with every accelerator this stack
    verifies and with none (`stock()`): the same bytes (debug handles aside: the one-trace export
    has no training IR to number them from; they are ETDump metadata, not the program), and the
    stock program's logits are the float64 oracle's. The accelerated lowering does less work for
    it: one trace for export and decomposition (stock: four), one trace for the per-op edge
    conversions (stock: four passes) and views to copies in place (stock: a re-trace). XNNPACK's
    notice against the two-step flow (whose support filter the fast path applies itself) is not
    shown. (The golden cases' accelerated programs: tests/test_export_pte.py.)"""
    from executorch.exir.program import _program

    from shram_static.export import load_pte
    from shram_static.accelerators.edge_passes import _PER_OP_EDGE_PASSES
    from shram_static.export.pte import lower_program
    from shram_static.step import StepModule

    if not all(enabled(n) for n in LOWERING_ACCELERATORS):
        pytest.skip("a lowering accelerator is off here: nothing to compare with the stock lowering")
    model, B = tiny_model(seed=5, num_decoder_layers=1, training_sequence_length=64), 2
    handles = importlib.import_module("executorch.exir.passes.debug_handle_generator_pass")
    ours_module = lambda mod: isinstance(getattr(mod, "step", None), StepModule)
    ours_program = lambda ep: any("local_k" in b for b in ep.graph_signature.buffers)
    generate = _program._generate_edge_program
    with unittest.mock.patch.object(handles, "get_greatest_ancestor_node_identifier",
                                    lambda node: f"{node.name}.{id(node.graph)}"):
        caplog.set_level("WARNING")
        with lowering_work(ours_module, ours_program) as fast_work:
            fast = lower_program(model, batch_size=B, prefill_chunk=None, parallel=False).buffer
        assert not [r for r in caplog.records if "DEPRECATION WARNING" in r.getMessage()]
        with stock(), lowering_work(ours_module, ours_program) as stock_work:
            slow = lower_program(model, batch_size=B, prefill_chunk=None, parallel=False).buffer
    assert _program._generate_edge_program is generate  # the accelerators restored what they patch
    assert fast == slow
    assert (len(stock_work["traces"]), len(fast_work["traces"])) == (4, 1)
    sp, fp = stock_work["passes"], fast_work["passes"]
    assert [sp.count(p) for p in _PER_OP_EDGE_PASSES] == [1] * len(_PER_OP_EDGE_PASSES)
    assert [fp.count(p) for p in _PER_OP_EDGE_PASSES] == [0] * len(_PER_OP_EDGE_PASSES)
    assert fp.count("FusedEdgeConversionPass") == 1
    assert (sp.count("ReplaceViewOpsWithViewCopyOpsPass"), fp.count("ViewOpsToCopiesInPlace"),
            fp.count("ReplaceViewOpsWithViewCopyOpsPass")) == (1, 1, 0)
    path = tmp_path / "stock.pte"
    path.write_bytes(slow)
    dec = load_pte(str(path))
    assert dec.batch_size == B and dec.prefill_chunk == 1 and dec.meta["decode_method"] == "decode"
    ids = random_ids(model.config, B, 12, seed=6)
    got = torch.stack([dec.decode(ids[:, t]) for t in range(ids.shape[1])], dim=1)
    want = run_oracle(model, ids)[0]
    assert (got.double() - want).abs().max().item() <= 1e-3
