"""The command line, as a user runs it: `python -m shram_static` / `shram-static generate`.

Expected continuations are computed independently, by re-running the uncached full forward
(checked against the golden cases in test_model.py) and taking the argmax."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import DATA
from shram_static import ShramForCausalLM
from shram_static.cli import main
from shram_static.default_model import default_model
from shram_static.tokenizer import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = dict(os.environ, PYTHONIOENCODING="utf-8", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(*args, timeout=240):
    return subprocess.run(list(args), capture_output=True, env=_env(), cwd=REPO, timeout=timeout)


def _greedy_text(model, prompt, n):
    """Greedy continuation by re-running the full forward; cut at EOS; decoded."""
    tok = ByteTokenizer()
    ids = tok.encode(prompt)
    new = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            new.append(nxt)
            ids.append(nxt)
    return tok.decode(new)


@pytest.fixture(scope="module")
def builtin_expected():
    return _greedy_text(default_model(), "Hello", 8)


def test_module_generate(builtin_expected):
    r = _run(sys.executable, "-m", "shram_static", "generate", "--prompt", "Hello", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode("utf-8") == builtin_expected + "\n"
    assert b"Traceback" not in r.stderr


def test_installed_entry_point_exits_2_on_error(tmp_path):
    """The `shram-static` console script that `pip install -e .` puts on PATH, on a missing
    checkpoint: exit status 2, the progress line and one `error:` line, no traceback, nothing
    logged by third-party imports. (Its success path is the same `main`: test_module_generate
    runs it through `python -m shram_static`; an interpreter start per test costs seconds.)"""
    exe = shutil.which("shram-static")
    assert exe is not None, "shram-static is not on PATH: the package's console script did not install"
    r = _run(exe, "generate", "--prompt", "Hello", "--checkpoint", str(tmp_path / "missing"))
    assert r.returncode == 2
    err = r.stderr.decode().strip().splitlines()
    assert err[-1].startswith("error: ") and "missing" in err[-1]
    assert b"Traceback" not in r.stderr and r.stdout == b""
    assert err == [f"loading {tmp_path / 'missing'} ...", err[-1]], err


# -- in process (same code path, no interpreter start-up) ------------------------------------
def test_generate_checkpoint(capsys):
    path = os.path.join(DATA, "main_basic")
    expected = _greedy_text(ShramForCausalLM.from_pretrained(path), "The cat", 12)
    assert main(["generate", "--prompt", "The cat", "--checkpoint", path, "--max-new-tokens", "12",
                 "--prefill-chunk", "4"]) == 0
    out = capsys.readouterr()
    assert out.out == expected + "\n"
    assert "loading" in out.err


def test_compiled_generate_compiles_before_its_timing(monkeypatch, capsys):
    """`generate --backend compiled` compiles its steps ahead (`warm_up`: the prompt's and the
    decode step's, with --speculate the verify step's too) and says how long that took; the
    generation's own time excludes it. (An eager decoder stands in, its warm-up a 1 s wait: the
    plumbing is under test; compiled steps: tests/test_compiled_decoder.py.)"""
    import re
    import time

    from shram_static import decoders
    from shram_static.decoder import StaticDecoder

    warmed = []

    class SlowWarmUp(StaticDecoder):
        def warm_up(self, kinds=("decode", "prefill_last")):
            warmed.append(tuple(kinds))
            time.sleep(1.0)
            super().warm_up(kinds)

    monkeypatch.setattr(decoders, "make_decoder", lambda model, backend, chunk, stack, *a, verify_len=None:
                        SlowWarmUp(model, prefill_chunk=chunk, verify_len=verify_len))
    path = os.path.join(DATA, "main_basic")
    for extra, kinds in (([], ("decode", "prefill_last")), (["--speculate", "3"], ("decode", "prefill_last", "verify"))):
        assert main(["generate", "--prompt", "The cat", "--checkpoint", path, "--max-new-tokens", "8",
                     "--backend", "compiled", *extra]) == 0
        err = capsys.readouterr().err
        assert warmed == [kinds], err
        warmed.clear()
        assert float(re.search(r"compiled in ([\d.]+) s", err).group(1)) >= 1.0, err
        assert float(re.search(r"8 new tokens in ([\d.]+) s", err).group(1)) < 1.0, err


def test_checkpoint_tokenizer_json_is_used(tmp_path, capsys):
    """A checkpoint carrying a tokenizer.json goes through it (same ids here: ours)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, "yarn_extended"), dst)
    ByteTokenizer().save(dst)
    expected = _greedy_text(ShramForCausalLM.from_pretrained(dst), "héllo", 10)
    assert main(["generate", "--prompt", "héllo", "--checkpoint", str(dst), "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_sampling_is_seeded(capsys):
    args = ["generate", "--prompt", "Hi", "--max-new-tokens", "12", "--temperature", "1.5",
            "--top-k", "40", "--seed", "7"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert main(args[:-1] + ["8"]) == 0
    assert capsys.readouterr().out != first  # another seed, (almost surely) another sample


@pytest.mark.parametrize("args, words", [
    (["--checkpoint", os.path.join(DATA, "main_basic"), "--max-new-tokens", "100"], ["capacity", "64"]),
    (["--temperature", "0"], ["temperature"]),
    (["--top-p", "1.5"], ["top-p"]),
])
def test_errors_exit_2(capsys, args, words):
    assert main(["generate", "--prompt", "Hello"] + args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ")
    for w in words:
        assert w in err, err


def test_checkpoint_without_tokenizer_and_small_vocab(tmp_path, capsys):
    from helpers import random_model
    random_model(1, vocab_size=100).save_pretrained(tmp_path)
    assert main(["generate", "--prompt", "Hello", "--checkpoint", str(tmp_path)]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


def test_broken_checkpoint_exits_2(tmp_path, capsys):
    shutil.copytree(os.path.join(DATA, "main_basic"), tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").write_bytes(b"garbage")
    assert main(["generate", "--prompt", "Hello", "--checkpoint", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: ") and "model.safetensors" in err


@pytest.mark.parametrize("argv", [
    ["generate"],                                            # --prompt missing
    ["generate", "--prompt", "x", "--max-new-tokens", "0"],
    ["generate", "--prompt", "x", "--backend", "tpu"],
    ["nonsense"],
    [],
])
def test_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "generate" in out and "bench" in out


@pytest.mark.heavy
def test_builtin_model_is_deterministic_and_not_degenerate(capsys):
    """The built-in model is the trained one shipped as package data: identical on every call,
    no global RNG use, and `generate --prompt "ROMEO:"` prints English-looking text."""
    state = torch.random.get_rng_state()
    a, b = default_model(), default_model()
    assert torch.equal(torch.random.get_rng_state(), state), "the global RNG was used"
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    for name, v in a.state_dict().items():
        assert bool((v != 0).any()), name
    logits = a(torch.tensor([ByteTokenizer().encode("Hello, world")])).logits[0]
    assert logits.std(-1).min() > 0.1  # not a flat distribution
    assert len(set(logits.argmax(-1).tolist())) > 1  # not the same token everywhere
    assert main(["generate", "--prompt", "ROMEO:", "--max-new-tokens", "120"]) == 0
    text = capsys.readouterr().out
    assert text == _greedy_text(a, "ROMEO:", 120) + "\n"
    assert text.isascii() and sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.85, text
    common = {"the", "and", "to", "of", "i", "my", "you", "a", "is", "that", "not", "me", "with"}
    assert len(common & set(text.lower().replace(",", " ").replace(".", " ").split())) >= 3, text


@pytest.mark.heavy
def test_export_onnx_command_writes_loadable_artifacts(tmp_path, capsys):
    """`shram-static export --format onnx --decode-only` writes the decode graph, its data and
    tokenizer.json (no prefill graph); the loaded graph generates what StaticDecoder generates.
    On one layer of the test-local tiny model (the shape of the first built-in model): the
    command's plumbing is under test, and each layer lengthens the export (the trained built-in
    model's 4 layers and capacity 1024 take minutes on 2 cores). Both graphs of an ONNX
    export: tests/test_export_onnx.py."""
    from helpers import tiny_model

    from shram_static import StaticDecoder
    from shram_static.export import load_onnx

    out, ckpt = tmp_path / "out", tmp_path / "tiny"
    tiny_model(num_decoder_layers=1).save_pretrained(ckpt)
    records = []  # what reaches torch.onnx's log handler (it does not propagate to torch's or the root)
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("torch.onnx").addHandler(handler)
    try:
        assert main(["export", "--format", "onnx", "--checkpoint", str(ckpt), "--decode-only",
                     "--out", str(out)]) == 0
    finally:
        logging.getLogger("torch.onnx").removeHandler(handler)
    # no notice that torchvision's operators are skipped (a SHRAM step calls none)
    assert not [r for r in records if "torchvision" in r.getMessage()]
    written = capsys.readouterr().out.split()  # every file it wrote, the model's graph first
    assert written[0] == str(out / "model.onnx")
    assert sorted(written) == sorted(str(out / f) for f in os.listdir(out))
    assert [f for f in sorted(os.listdir(out)) if f.startswith("model")] == ["model.onnx", "model.onnx.data"]
    assert (out / "tokenizer.json").is_file()
    ids = torch.tensor([ByteTokenizer().encode("Hi there")])
    want = StaticDecoder(ShramForCausalLM.from_pretrained(ckpt), prefill_chunk=8).generate(ids, max_new_tokens=6)
    assert torch.equal(load_onnx(str(out / "model.onnx")).generate(ids, max_new_tokens=6), want)


def test_export_bad_format_exits_2(tmp_path, capsys):
    assert main(["export", "--format", "tflite", "--out", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_export_quantize_embedding_needs_quantize(tmp_path, capsys):
    """`--quantize-embedding` without `--quantize` is an error before anything is written."""
    assert main(["export", "--format", "pte", "--quantize-embedding", "--out", str(tmp_path / "o")]) == 2
    assert "--quantize-embedding applies with --quantize" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_export_flags_reach_both_exporters(tmp_path, monkeypatch):
    """`--no-parallel` exports in one process (the default is the two-process export);
    `--decode-only` writes no prefill step (`prefill_chunk=None`) in either format; `--full-logits`
    keeps every token's logits in the prefill step of both (default: the last token's)."""
    import shram_static.export as ex

    seen = []

    def fake(fmt):
        def export(model, path, **kw):
            seen.append((fmt, kw["parallel"], kw["prefill_chunk"], kw["full_logits"]))
            return path if fmt == "pte" else {"decode": path}  # what each exporter returns
        return export

    monkeypatch.setattr(ex, "export_pte", fake("pte"))
    monkeypatch.setattr(ex, "export_onnx", fake("onnx"))
    assert main(["export", "--format", "pte,onnx", "--prefill-chunk", "16", "--out", str(tmp_path / "a")]) == 0
    assert main(["export", "--format", "pte,onnx", "--no-parallel", "--decode-only", "--full-logits",
                 "--out", str(tmp_path / "b")]) == 0
    assert seen == [("pte", True, 16, False), ("onnx", True, 16, False), ("pte", False, None, True),
                    ("onnx", False, None, True)]


def _imported_after(code: str) -> set[str]:
    """The top-level and torch/transformers modules a fresh interpreter holds after `code`."""
    probe = ("import sys\n" + code + "\nprint()\nprint(' '.join(sorted(m for m in sys.modules if '.' not in m "
             "or m.startswith(('torch._inductor', 'transformers.modeling_utils', 'executorch.')))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.splitlines()[-1].split())  # the last line: after any help text


def test_the_cli_answers_help_and_bad_arguments_without_torch(tmp_path):
    """`shram-static --help`, a subcommand's `--help`, an argument error and a checkpoint directory
    that is missing or lacks its weights (a benchmark's model too) never import torch: each command
    refuses such a path, and `bench` a round count or depth out of range, with status 2 before the
    seconds of importing torch and transformers."""
    (tmp_path / "text.txt").write_text("some text")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text("{}")
    missing, no_weights = str(tmp_path / "missing"), str(tmp_path / "no_weights")
    bad_paths = [["generate", "--prompt", "x", "--checkpoint", missing],
                 ["generate", "--prompt", "x", "--draft", no_weights],
                 ["export", "--format", "onnx", "--out", str(tmp_path / "out"), "--checkpoint", no_weights],
                 ["eval", "--text", str(tmp_path / "text.txt"), "--checkpoint", missing],
                 ["serve", "--checkpoint", missing],
                 ["bench", "--models", "builtin", no_weights, "--backends", "eager"],
                 ["bench-speculative", "--model", missing],
                 ["bench", "--models", "builtin", "--rounds", "0"],
                 ["bench", "--models", "builtin", "--capacity", "64", "--depths", "60", "--steps", "8"]]
    mods = _imported_after("import contextlib\nfrom shram_static.cli import main\n"
                           "for argv in (['--help'], ['export', '--help'], ['bench', '--help'], ['serve', '--help'],\n"
                           "             ['generate'], ['bench-speculative', '--speculate', '0']):\n"
                           "    with contextlib.suppress(SystemExit):\n"
                           "        main(argv)\n"
                           f"assert [main(argv) for argv in {bad_paths!r}] == [2] * {len(bad_paths)}")
    assert not mods & {"torch", "transformers", "numpy"}, mods


def test_importing_the_package_loads_each_runtime_only_when_used():
    """`import shram_static` imports no torch; the model and the decoder import no exporter,
    runtime or server (ExecuTorch, ONNX, onnxruntime, FastAPI)."""
    assert not _imported_after("import shram_static") & {"torch", "transformers", "numpy"}
    mods = _imported_after("from shram_static import ShramForCausalLM, StaticDecoder")
    assert "torch" in mods and "transformers.modeling_utils" in mods
    assert not mods & {"executorch", "onnx", "onnxscript", "onnxruntime", "fastapi", "uvicorn"}, mods


def test_export_prints_every_file_it_writes_as_the_readme_names_them(tmp_path, monkeypatch, capsys):
    """`export` prints each file it writes (every one exists), with the names the README's
    export examples give: the quantized files carry the mode (`model.int4.onnx`, its data,
    `model.int8.pte`), and the built-in model's tokenizer files. The exporters are stand-ins
    that write the files their real counterparts return (`graph_paths`: the real export of
    test_export_onnx_command_writes_loadable_artifacts); the lowering is tested elsewhere."""
    import shram_static.export as ex
    from shram_static.export.common import graph_paths

    def touch(path):
        open(path, "w").close()
        return path

    def fake_onnx(model, path, prefill_chunk=None, **kw):
        return {role: touch(p) for role, p in graph_paths(path).items() if role != "prefill" or prefill_chunk}

    monkeypatch.setattr(ex, "export_pte", lambda model, path, **kw: touch(path))
    monkeypatch.setattr(ex, "export_onnx", fake_onnx)
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    cases = [("onnx", "int4", ["model.int4.onnx", "model.int4.prefill.onnx", "model.int4.onnx.data"]),
             ("pte", "int8", ["model.int8.pte"]),
             ("pte,onnx", None, ["model.pte", "model.onnx", "model.prefill.onnx", "model.onnx.data"])]
    for fmt, q, names in cases:
        out = tmp_path / (q or "fp32")
        assert main(["export", "--format", fmt, *(["--quantize", q] if q else []), "--out", str(out)]) == 0
        printed = capsys.readouterr().out.split()
        assert printed == [str(out / f) for f in names + ["tokenizer.json", "tokenizer_config.json"]]
        assert all(os.path.isfile(p) for p in printed) and len(printed) == len(os.listdir(out))
        assert all(n in readme for n in names), names
