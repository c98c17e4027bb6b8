"""The compiled StaticDecoder's own fast paths and host checks, against plain math: `RowLinear`
and `RowExperts` (values, repacking after a weight changed, the caches' prefixes), the top-k as ranks, a compiled
decoder following weight changes and never altering the caller's model, and its weights checked
once per kind of step inside `generate` (`steady`)."""

import pytest
import torch

from helpers import compiled_test_model, random_config, randomize_
from shram_static import ShramForCausalLM, StaticDecoder
from shram_static.decoder import FEW_ROWS, RowExperts, RowLinear
from shram_static.entmax import entmax12_unrolled
from shram_static.layers import BEA, Router
from shram_static.fast_layers import FusedRouter
from shram_static.routing import top_k, top_k_ranks

TOL = 1e-3


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_row_linear_equals_linear(dtype, tol):
    """The compiled decode's projection, eager and compiled, against a float64 product: one,
    four and FEW_ROWS rows over its packed weight (300 outputs: the last block padded), also
    from a column-major weight; more rows take F.linear on the weight itself."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 96, generator=gen).to(dtype)
    lin, lin_cm = RowLinear(w), RowLinear(w.t().contiguous().t())  # the second column-major
    assert lin.packed.shape == (19, 96, 16) and torch.equal(lin.packed, lin_cm.packed)
    compiled = torch.compile(lin, fullgraph=True, dynamic=False)
    for rows in (1, 4, FEW_ROWS):
        x = torch.randn(rows, 1, 96, generator=gen).to(dtype)
        want = (x.double() @ w.double().t()).float()
        for f in (lin, lin_cm, compiled):
            got = f(x)
            assert got.dtype == dtype and got.shape == (rows, 1, 300)
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    many = torch.randn(FEW_ROWS + 1, 96, generator=gen).to(dtype)
    torch.testing.assert_close(lin(many), torch.nn.functional.linear(many, w), atol=0, rtol=0)


def test_row_linear_repack():
    """`repack` follows a weight written in place (same buffer, which a compiled step keeps
    reading) or replaced by another dtype (a new buffer); until then the packed copy is the
    weight as it was packed."""
    gen = torch.Generator().manual_seed(6)
    w = torch.nn.Parameter(torch.randn(40, 24, generator=gen), requires_grad=False)
    lin = RowLinear(w)
    buf, x = lin.packed, torch.randn(2, 24, generator=gen)
    old = x @ w.t()
    with torch.no_grad():
        w.mul_(-2)
    torch.testing.assert_close(lin(x), old, atol=1e-5, rtol=1e-5)  # not followed yet
    lin.repack()
    assert lin.packed is buf
    torch.testing.assert_close(lin(x), x @ w.t(), atol=1e-5, rtol=1e-5)
    w.data = w.data.double()
    lin.repack()
    assert lin.packed.dtype == torch.float64 and lin.packed is not buf
    torch.testing.assert_close(lin(x.double()), x.double() @ w.t(), atol=1e-5, rtol=1e-5)  # fp32 sums


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_row_experts_project_equals_experts(dtype, tol):
    """The compiled steps' expert projections, eager and compiled, against a float64 product of
    each token's selected experts' own weights: 1 and FEW_ROWS / 2 tokens per row (each token's
    blocks) and more than FEW_ROWS (every expert, then each token's picked), repeated and
    distinct experts; `repack`
    follows a weight written in place, on both paths."""
    gen = torch.Generator().manual_seed(9)
    cfg = random_config(9)
    L, d, u, K = cfg.num_mosrah_heads, cfg.embedding_width, cfg.head_dim, cfg.num_selected_heads
    bea = BEA(cfg).requires_grad_(False)
    for w in (bea.q_proj, bea.k_proj, bea.v_proj, bea.o_proj):
        w.copy_(torch.randn(w.shape, generator=gen))
    bea = bea.to(dtype)
    row = RowExperts(bea)
    compiled = torch.compile(row.project, fullgraph=True, dynamic=False)

    def want(h, idx):
        return [torch.einsum("bcd,bckdu->bcku", h.double(), w.double()[idx]).float()
                for w in (bea.q_proj, bea.k_proj, bea.v_proj)]

    for C in (1, FEW_ROWS // 2, 16):
        h = torch.randn(2, C, d, generator=gen).to(dtype)
        idx = torch.randint(0, L, (2, C, K), generator=gen)
        idx[0, 0] = idx[0, 0, 0]  # one token with one expert K times
        for f in (row.project, compiled):
            got = f(h, idx)
            for g, w in zip(got, want(h, idx)):
                assert g.dtype == dtype and g.shape == (2, C, K, u)
                torch.testing.assert_close(g.float(), w, atol=tol * d ** 0.5, rtol=tol)
    buf = row.qkv
    with torch.no_grad():
        bea.v_proj.mul_(-2)
    row.repack()
    assert row.qkv is buf
    for h, idx in ((h, idx), (h[:, :2], idx[:, :2])):
        for g, w in zip(row.project(h, idx), want(h, idx)):
            torch.testing.assert_close(g.float(), w, atol=tol * d ** 0.5, rtol=tol)


def test_cache_prefixes_by_row_and_by_block_are_each_querys_first_slots():
    """Both gathers of the per-token attention (`BEA.prefix` by row index for the exports,
    `RowExperts.prefix` by whole cache for the compiled steps, whose golden tests run it
    compiled), against slicing each query's own cache in a Python loop; repeated caches and P
    from one slot to all of them."""
    from shram_static.attention import prefix_blocks, prefix_rows

    gen = torch.Generator().manual_seed(4)
    B, L, S, u, C, K = 2, 4, 9, 8, 3, 2
    k, v = torch.randn(2, B * L, S, u, generator=gen)
    head = torch.randint(0, B * L, (B, C, K), generator=gen)
    head[0, 0] = head[0, 0, 0]  # one query's K caches the same one
    assert RowExperts.prefix is prefix_blocks and BEA.prefix is prefix_rows
    for f in (prefix_rows, prefix_blocks):
        for P in (1, 4, S):
            want = [torch.stack([c[h, :P] for h in head.reshape(-1).tolist()]).view(B, C, K, P, u) for c in (k, v)]
            got = f(k, v, head, P)
            assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want)), (f.__name__, P)


def test_a_pure_decode_step_puts_its_rows_into_the_caches_it_read():
    """`with_own_rows` (the ONNX graphs' decode step: the caches read as passed in, the token's
    K rows put in) against writing the rows into copies of the caches and slicing each query's
    first P slots in a Python loop. A live token's slots lie below P; a dead one writes to the
    sink, slot S - 1: with P = S (the web site's whole caches) both rows equal the loop's, with
    P < S the live row does (the dead token's own copies are not read)."""
    from shram_static.attention import prefix_rows, with_own_rows

    gen = torch.Generator().manual_seed(5)
    B, L, S, u, K = 2, 4, 9, 8, 2
    k, v = torch.randn(2, B * L, S, u, generator=gen)
    ks, vs = torch.randn(2, B, 1, K, u, generator=gen)
    head = torch.tensor([[[1, 3]], [[6, 4]]])  # (B, 1, K): each row's own experts
    for P in (S, 5):
        wslot = torch.tensor([[[2, 4]], [[S - 1, S - 1]]])  # row 1 dead: the sink
        kw, vw = k.clone(), v.clone()
        for b in range(B):
            for j in range(K):
                kw[head[b, 0, j], wslot[b, 0, j]] = ks[b, 0, j]
                vw[head[b, 0, j], wslot[b, 0, j]] = vs[b, 0, j]
        want = [torch.stack([c[h, :P] for h in head.reshape(-1).tolist()]).view(B, 1, K, P, u) for c in (kw, vw)]
        got = with_own_rows(*prefix_rows(k, v, head, P), ks, vs, wslot)
        rows = B if P == S else 1
        assert all(torch.equal(a[:rows], b[:rows]) for a, b in zip(got, want)), P
        assert not torch.equal(prefix_rows(k, v, head, P)[0][:1], want[0][:1])  # the rows are new ones


def test_compiled_decoder_follows_weight_changes():
    """Weights changed after a compiled decoder was built, in place (as `load_state_dict`
    writes them) or replaced by new tensors (`.data`), are what its next prefill, decode and
    verify steps read (its RowLinears and RowExperts pack them again): the logits equal the uncached
    forward's of the changed model. A stale packed copy would give the old model's; the
    experts' weights are changed on their own once, so a stale expert copy shows alone. (Only
    the decode step compiles; prefill and verify run eager on the same packed modules, whose
    copies `_follow_weights` keeps for every kind: two cold compiles fewer.)"""
    model = compiled_test_model(7)
    dec = StaticDecoder(model, compile=("decode",))
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(7))

    def run():
        dec.reset()
        out = [dec.prefill(ids[:, :5])[:, -1]]
        out += [dec.decode(ids[:, t]) for t in range(5, 7)]
        out += list(dec.verify(ids[:, 7:12]).unbind(1))  # logits after tokens 7..11
        return torch.stack(out, 1)  # (1, 8, V): after tokens 4..11

    def want():
        with torch.no_grad():
            return model(ids).logits[:, 4:]

    torch.testing.assert_close(run(), want(), atol=TOL, rtol=0)
    before = run()
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        model.load_state_dict({k: v * (1 + 0.5 * torch.rand(v.shape, generator=gen))
                               for k, v in model.state_dict().items() if k.endswith("proj.weight")}, strict=False)
    changed = run()
    assert (changed - before).abs().max() > 100 * TOL  # the change shows in the logits
    torch.testing.assert_close(changed, want(), atol=TOL, rtol=0)
    for lin in (m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        lin.weight.data = -lin.weight.data  # a new tensor each
    torch.testing.assert_close(run(), want(), atol=TOL, rtol=0)
    experts = [m for m in model.modules() if isinstance(m, BEA)]
    before = run()
    with torch.no_grad():
        for bea in experts:  # in place, one projection each way
            bea.k_proj.mul_(1 + 0.5 * torch.rand(bea.k_proj.shape, generator=gen))
    changed = run()
    assert (changed - before).abs().max() > 100 * TOL
    torch.testing.assert_close(changed, want(), atol=TOL, rtol=0)
    for bea in experts:  # replaced
        bea.v_proj.data = -bea.v_proj.data
    torch.testing.assert_close(run(), want(), atol=TOL, rtol=0)


def test_a_weight_in_another_layout_compiles_the_steps_again():
    """The compiled steps skip Dynamo's guards on the decoder's own modules (`owned_guards`):
    a weight they read directly replaced by the same values in another layout (the router's,
    transposed in memory; a norm's, misaligned) makes the decoder compile its steps again, and
    the logits stay the uncached forward's. Read in the old layout, they would not be."""
    model = compiled_test_model(9)
    dec = StaticDecoder(model, compile=("decode",))
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(9))

    def run():
        dec.reset()
        dec.prefill(ids[:, :5])
        return torch.stack([dec.decode(ids[:, t]) for t in range(5, 8)], 1)  # after tokens 5..7

    def want():
        with torch.no_grad():
            return model(ids).logits[:, 5:]

    torch.testing.assert_close(run(), want(), atol=TOL, rtol=0)
    counters = torch._dynamo.utils.counters["stats"]
    graphs = counters["unique_graphs"]
    layer = model.model.layers[0]
    w = layer.attention.sparse_attention.router.routing_weight
    w.data = w.data.t().contiguous().t()  # (L, d) values, column-major
    n = layer.attn_norm.weight
    n.data = torch.cat([n.data.new_zeros(1), n.data])[1:]  # 4 bytes past an aligned start
    torch.testing.assert_close(run(), want(), atol=TOL, rtol=0)
    assert counters["unique_graphs"] == graphs + 1


@pytest.mark.parametrize("L, k", [(4, 2), (16, 4), (8, 1), (6, 6)])
def test_top_k_as_ranks_is_top_k(L, k):
    """The compiled decode step's top-k (ranks, fused by Inductor) against a sort: largest
    first, taken (-inf) experts last, a tie to the lower index; eager and compiled."""
    gen = torch.Generator().manual_seed(L * 10 + k)
    z = torch.randn(5, 3, L, generator=gen)
    z[0, :, :L // 2] = float("-inf")  # half the experts taken
    z[1, 0] = 0.5  # all tied
    z[2, 1, 1:3] = z[2, 1, 0]  # a tie at the top
    want = torch.tensor([[sorted(range(L), key=lambda i: (-z[b, c, i].item(), i))[:k] for c in range(3)]
                         for b in range(5)])
    for f in (top_k_ranks, torch.compile(top_k_ranks, fullgraph=True, dynamic=False)):
        got = f(z, k)
        assert got.dtype == torch.long and torch.equal(got, want)
    torch.testing.assert_close(top_k(z[3:], k), want[3:], atol=0, rtol=0)  # untied rows: = topk


@pytest.mark.parametrize("tied", [False, True])
def test_decoders_never_alter_the_model(tied):
    """Building decoders (eager, compiled batch 1 and 2 with their RowLinear swap)
    leaves the caller's module tree, weights, layouts and mode as they were; the decoders
    hold the same weight tensors (no copy; a RowLinear's packed layout is its own), an eager
    decoder's steps the unswapped layers; two decoders on one model both stay correct."""
    model = randomize_(ShramForCausalLM(random_config(4, tie_word_embeddings=tied)), 4)
    model.train()
    before = {k: (v.clone(), v.stride(), v.data_ptr()) for k, v in model.state_dict().items()}
    types = [type(m) for m in model.modules()]
    decs = [StaticDecoder(model, batch_size=1), StaticDecoder(model, batch_size=1, compile=True),
            StaticDecoder(model, batch_size=2, compile=True)]
    assert [type(m) for m in model.modules()] == types and model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k][0]) and (v.stride(), v.data_ptr()) == before[k][1:], k
    ptrs = {p.data_ptr() for p in model.parameters()}
    for dec in decs[1:]:
        swapped = [m for m in dec.module.model.modules() if isinstance(m, RowLinear)]
        assert len(swapped) == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) + tied
        assert all(m.weight.data_ptr() in ptrs for m in swapped), "a decoder copied a weight"
        experts = [m for m in dec.module.model.modules() if isinstance(m, RowExperts)]
        assert len(experts) == model.config.num_decoder_layers
        assert all(w.data_ptr() in ptrs for m in experts for w in (*m.sources, m.o_proj))
        routers = [m for m in dec.module.model.modules() if isinstance(m, Router)]
        assert len(routers) == model.config.num_decoder_layers and all(type(r) is FusedRouter for r in routers)
        assert all(r.scores is entmax12_unrolled and r.pick is top_k_ranks for r in routers)  # the fused forms
        assert all(r.routing_weight.data_ptr() in ptrs for r in routers)
    eager = decs[0].module.model.modules()
    assert not any(isinstance(m, (RowLinear, RowExperts, FusedRouter)) for m in eager)
    assert not any(isinstance(m, FusedRouter) for m in model.modules())
    # two eager decoders on one model, interleaved, each equal to the uncached forward
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    want = model(ids).logits
    a, b = StaticDecoder(model, batch_size=1, prefill_chunk=4), StaticDecoder(model, batch_size=1, prefill_chunk=3)
    la, lb = a.prefill(ids[:, :5]), b.prefill(ids[:, :5])
    la = torch.cat([la, a.prefill(ids[:, 5:])], 1)
    lb = torch.cat([lb, b.prefill(ids[:, 5:])], 1)
    torch.testing.assert_close(la, want, atol=TOL, rtol=0)
    torch.testing.assert_close(lb, want, atol=TOL, rtol=0)


def test_two_compiled_decoders_interleaved_run_their_own_graphs():
    """Two compiled decoders of different configs in one process (their steps share code
    objects, so Dynamo caches an entry per decoder), called in turn: each step runs its own
    decoder's compiled graph, with that model's logits."""
    # the first: the config (and decode graph) of the tests above
    models = [compiled_test_model(14), randomize_(ShramForCausalLM(random_config(15, num_decoder_layers=1)), 15).eval()]
    assert models[0].config.to_dict() != models[1].config.to_dict()
    decs = [StaticDecoder(m, compile=True) for m in models]
    ids = [torch.randint(0, m.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3)) for m in models]
    with torch.no_grad():
        want = [m(i).logits for m, i in zip(models, ids)]
    for t in range(9):  # decode steps only: one compile per decoder
        for d, i, w in zip(decs, ids, want):
            torch.testing.assert_close(d.decode(i[:, t]), w[:, t], atol=TOL, rtol=0)


def test_a_later_decoder_of_other_sizes_compiles_them_as_constants(monkeypatch):
    """A compiled decoder built after one of another batch size and config compiles its own
    sizes as constants: its decode graph, like the first's, has at most one symbolic size (the
    slots' length P, where `accelerators.dynamic_length` is on), not Dynamo's automatic dynamic
    shapes for what differs from the earlier decoder (which, on torch 2.15, its nested layer
    region cannot trace)."""
    compile_, symbols = torch.compile, []

    def capture(gm, inputs):
        symbols.append(sum(isinstance(x, torch.SymInt) for x in inputs))
        return gm.forward
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend=capture, fullgraph=True))
    models = [compiled_test_model(14), randomize_(ShramForCausalLM(random_config(15, num_decoder_layers=1)), 15).eval()]
    with torch.no_grad():
        for B, m in zip((1, 2), models):
            StaticDecoder(m, batch_size=B, compile=["decode"]).decode(torch.zeros(B, dtype=torch.long))
    assert len(symbols) == 2 and symbols[1] == symbols[0] <= 1, symbols


def test_cpp_wrapper_option_unrolls_the_layers():
    """Inductor's C++ wrapper cannot compile the nested layer region (invoke_subgraph) on this
    torch: a decoder given `cpp_wrapper` in its options traces every layer inline, one without it
    calls the nested region per layer; with it, its steps' small buffers go on the stack."""
    from helpers import tiny_model

    model = tiny_model()  # two layers (Dynamo inlines a region called once)

    def subgraph_calls(options) -> int:
        graphs = []

        def capture(gm, _inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        step = StaticDecoder(model, prefill_chunk=4, options=options).module
        with torch.no_grad():
            torch.compile(step, backend=capture, fullgraph=True)(
                torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                torch.ones(1, 1, dtype=torch.bool))
        return sum("invoke_subgraph" in str(n.target) for g in graphs for n in g.graph.nodes)

    assert subgraph_calls(None) == model.config.num_decoder_layers
    assert subgraph_calls({"cpp_wrapper": True}) == 0
    assert subgraph_calls({"cpp_wrapper": False}) == model.config.num_decoder_layers
    torch._dynamo.reset()
    # under the C++ wrapper every kind of step keeps its small buffers on the stack, unless asked not to
    stack = "aot_inductor.allow_stack_allocation"
    for options, want in (({"cpp_wrapper": True}, True), ({"cpp_wrapper": True, stack: False}, False), ({}, None)):
        kinds = StaticDecoder(model, compile=True, options=options)._options.values()
        assert [o.get(stack) for o in kinds] == [want] * len(kinds)


def test_warm_up_says_a_cpp_wrapper_compile_takes_minutes(monkeypatch, capsys):
    """`warm_up` names the C++ wrapper's first compile (minutes) on each kind of step compiled
    under it, and not on those compiled by default or run eagerly."""
    from helpers import tiny_model

    model = tiny_model()
    for options, compile, want in (({"cpp_wrapper": True}, True, True), ({}, True, False),
                                   ({"cpp_wrapper": True}, {"decode"}, None)):
        dec = StaticDecoder(model, compile=compile, options=options)
        monkeypatch.setattr(dec, "_run", lambda *a, **k: None)  # the messages, not the compile
        dec.warm_up(("decode", "prefill_last"))
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warming up")]
        said = ["C++ wrapper: minutes the first time" in line for line in lines]
        assert len(lines) == 2 and said == ([want, want] if want is not None else [True, False]), lines


def test_cpp_wrapper_from_the_environment(monkeypatch):
    """SHRAM_STATIC_CPP_WRAPPER=1 gives compiled decoders (every command's) the C++ wrapper unless
    their options say otherwise, eager ones nothing; a bad value is refused by name."""
    from helpers import tiny_model
    from shram_static.decoder import CPP_WRAPPER_ENV

    model = tiny_model()
    monkeypatch.setenv(CPP_WRAPPER_ENV, "1")
    assert not StaticDecoder(model, compile=True).module.nested
    assert StaticDecoder(model, compile=True, options={"cpp_wrapper": False}).module.nested
    assert all(not o.get("cpp_wrapper") for o in StaticDecoder(model)._options.values())
    monkeypatch.setenv(CPP_WRAPPER_ENV, "0")
    assert StaticDecoder(model, compile=True).module.nested
    monkeypatch.setenv(CPP_WRAPPER_ENV, "yes please")
    with pytest.raises(ValueError, match=CPP_WRAPPER_ENV):
        StaticDecoder(model, compile=True)


class _ChangesAWeight:
    """A streamer that negates a weight in place when the n-th token column arrives (the prompt
    is put first): the caller's code between two steps of `generate`."""

    def __init__(self, weight: torch.Tensor, n: int):
        self.weight, self.n, self.puts = weight, n, 0

    def put(self, value):
        self.puts += 1
        if self.puts == self.n + 1:
            with torch.no_grad():
                self.weight.neg_()

    def end(self):
        pass


@pytest.mark.parametrize("speculate", [None, 3])
def test_generate_checks_each_step_once_unless_a_streamer_runs_between_steps(monkeypatch, speculate):
    """Without a streamer nothing but `generate` runs between its steps, so a compiled decoder
    checks its weights (`decoder._stamps`) once per kind of step and call (`StaticDecoder.steady`).
    With a streamer every step is checked: a weight the streamer changes in place mid-generation
    is what the next step reads (the tokens equal an eager decoder's under the same streamer,
    and differ from the unchanged model's). Only the decode step compiles: the prompt's and the
    verify steps run eager on the same packed modules and are checked the same way, per kind."""
    from shram_static import decoder as D

    model = compiled_test_model(21)  # the graphs of the tests above
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(21))
    ids = torch.cat([ids, ids], 1)  # a prompt that repeats: prompt lookup has guesses
    w = model.model.layers[-1].mlp.down_proj.weight  # a RowLinear's source in the compiled copy
    kept = w.detach().clone()
    comp = StaticDecoder(model, compile=("decode",))
    eager = StaticDecoder(model)
    calls = []
    stamps = D._stamps
    monkeypatch.setattr(D, "_stamps", lambda w: calls.append(1) or stamps(w))
    plain = comp.generate(ids, max_new_tokens=16, speculate=speculate)
    calls.clear()
    assert torch.equal(comp.generate(ids, max_new_tokens=16, speculate=speculate), plain)
    kinds = 2 if speculate is None else 3  # the prompt's chunks, decode (and verify) steps
    assert len(calls) == kinds
    got = comp.generate(ids, max_new_tokens=16, speculate=speculate, streamer=_ChangesAWeight(w, 6))
    assert len(calls) > kinds + 8  # every step checked
    with torch.no_grad():
        w.copy_(kept)
    want = eager.generate(ids, max_new_tokens=16, speculate=speculate, streamer=_ChangesAWeight(w, 6))
    with torch.no_grad():
        w.copy_(kept)
    assert torch.equal(got, want) and not torch.equal(got, plain)
    assert torch.equal(got[:, :6], plain[:, :6])
