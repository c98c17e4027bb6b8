"""`export_web`: a static site that runs a SHRAM model in the browser with onnxruntime-web.

The site: `index.html` (the page, and `window.shram.generate` for programs), `shram.mjs` (+
`tokenizer.mjs`, `sampling.mjs`: the ES module, also run under Node), `shram.json` (what the
module needs), `export_onnx`'s batch-1 graphs and their row-writes copies (`row_writes_graph`;
in a quantized site also with dequantized MatMuls), the tokenizer, and onnxruntime-web's runtime
and `coi-serviceworker.min.js` from the npm packages of the project's `package.json`. See
docs/web.md.
"""

import json
import os
import shutil
from pathlib import Path

from ..tokenizer import TOKENIZER_FILE, ByteTokenizer
from .onnx import export_onnx

MANIFEST_FORMAT = "shram_static.web/2"
# onnxruntime-web's WASM-only build (module, loader, SIMD + threads binary) and its WebGPU build
RUNTIME_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm",
                 "ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
PAGE_FILES = ("index.html", "shram.mjs", "tokenizer.mjs", "sampling.mjs")
# coi-serviceworker (npm): makes the page cross-origin isolated on any host, for WASM threads
COI_FILE = "coi-serviceworker.min.js"
WEB_DIR = Path(__file__).resolve().parent.parent / "web"  # the page and module (package data)
_ONNX_TYPES = {1: "float32", 6: "int32", 7: "int64", 9: "bool", 2: "uint8"}


def find_ort_web(where: str | None = None) -> Path:
    """The `dist` folder of the npm package onnxruntime-web.

    Args:
        where: a `node_modules` folder, a folder holding one, or `dist` itself. Default:
            `$SHRAM_ORT_WEB`, else `node_modules` here or above, else in the source checkout.

    Raises:
        FileNotFoundError: the runtime files are not there, with what to run (`npm ci`).
    """
    where = where or os.environ.get("SHRAM_ORT_WEB")
    if where:
        p = Path(where)
        candidates = [p, p / "onnxruntime-web" / "dist", p / "node_modules" / "onnxruntime-web" / "dist"]
    else:
        roots = [Path.cwd(), *Path.cwd().parents, WEB_DIR.parent.parent]
        candidates = [r / "node_modules" / "onnxruntime-web" / "dist" for r in roots]
    for c in candidates:
        if all((c / f).is_file() for f in RUNTIME_FILES) and (c.parent.parent / "coi-serviceworker" / COI_FILE).is_file():
            return c
    looked = ", ".join(str(c) for c in candidates[:4]) + (" ..." if len(candidates) > 4 else "")
    raise FileNotFoundError(
        f"onnxruntime-web's runtime files ({', '.join(RUNTIME_FILES)}) and coi-serviceworker's {COI_FILE} beside "
        f"them were not found (looked in {looked}). "
        f"Run `npm ci` in the shram_static source checkout (its package.json brings onnxruntime-web), "
        f"then export from there, or point SHRAM_ORT_WEB at a node_modules folder that has onnxruntime-web.")


def row_writes_graph(src: str, dst: str) -> list[dict]:
    """Writes a copy of an `export_onnx` graph returning, instead of each `present.<name>`, the
    rows the step wrote, every state's in a few outputs: `write.index` ([n, 1] int64, every
    written row's index) and one `write.rows.<type>.<width>` per kind of row ([m, width]). The
    layout, returned and kept in the copy's `shram_writes` metadata, has per state in state order
    `{"state", "at", "n", "rows", "from"}`: its n indices at `at` of `write.index`, its rows at
    `from` of `rows`.

    WHY: onnxruntime-web copies every output into a new JavaScript array after each run; the
    rows a step writes are a few KB, the whole state megabytes. WHY few outputs: onnxruntime-node
    and -web pay per output and per run, more than a Concat of the rows costs (docs/web.md).

    Args:
        src: the graph (its weights stay in the external data file it names).
        dst: where the copy goes (beside src, so the same data file serves both).

    Returns:
        The layout.

    Raises:
        ValueError: a `present.<name>` output that is not one ScatterND of `past.<name>`, or
            one whose written rows have no static shape.
    """
    import onnx
    from onnx import helper

    from onnxscript.optimizer import remove_unused_nodes

    m = onnx.load(src, load_external_data=False)
    def types(g):
        return {v.name: v for v in [*g.value_info, *g.input, *g.output]}

    written = {n.input[i] for n in m.graph.node if n.op_type == "ScatterND" for i in (1, 2)}
    if not written <= (typed := types(m.graph)).keys():
        m = onnx.shape_inference.infer_shapes(m)
        typed = types(m.graph)
    g = m.graph
    made = {o: n for n in g.node for o in n.output}
    outputs, index, groups, layout = [], [], {}, []
    for o in g.output:
        if not o.name.startswith("present."):
            outputs.append(o)
            continue
        name = o.name.removeprefix("present.")
        n = made.get(o.name)
        if n is None or n.op_type != "ScatterND" or n.input[0] != f"past.{name}":
            raise ValueError(f"{src}: output {o.name} is not a ScatterND of past.{name}; "
                             f"cannot return its written rows")
        t = typed[n.input[2]].type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if not dims or None in dims:
            raise ValueError(f"{src}: the rows written to {o.name} have no static shape ({dims}); "
                             f"cannot lay them out in the row-writes outputs")
        rows = f"write.rows.{_ONNX_TYPES[t.elem_type]}.{'x'.join(map(str, dims[1:]))}"
        group = groups.setdefault(rows, (t.elem_type, dims[1:], []))
        layout.append({"state": name, "at": sum(c for _, c in index), "n": dims[0], "rows": rows,
                       "from": sum(c for _, c in group[2])})
        index.append((n.input[1], dims[0]))
        group[2].append((n.input[2], dims[0]))
    for out, values, et, trail in [("write.index", index, onnx.TensorProto.INT64, [1]),
                                   *((r, v, et, tr) for r, (et, tr, v) in groups.items())]:
        g.node.append(helper.make_node("Concat", [v for v, _ in values], [out], name=f"{out}.concat", axis=0))
        outputs.append(helper.make_tensor_value_info(out, et, [sum(c for _, c in values), *trail]))
    del g.output[:]
    g.output.extend(outputs)
    m.metadata_props.add(key="shram_writes", value=json.dumps(layout))
    # WHY: onnxruntime runs an unread node all the same; a row-writes decode graph reads the
    # caches as passed in (`attention.with_own_rows`), so its whole-cache `ScatterND`s go
    remove_unused_nodes(m)
    onnx.save(m, dst)
    onnx.checker.check_model(dst)  # by path: the weights' data file is found beside it
    return layout


def _tokenizer_entry(tok, out_dir: str) -> dict:
    """Writes the tokenizer's files into the site; returns the manifest's `tokenizer` entry."""
    entry = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "file": TOKENIZER_FILE}
    path = os.path.join(out_dir, TOKENIZER_FILE)
    if isinstance(tok, ByteTokenizer):
        tok.save(out_dir)  # for other tools; the module encodes UTF-8 bytes itself
        return {"type": "bytes", **entry}
    tok.tok.backend_tokenizer.save(path)
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    kind, pre = (spec.get("model") or {}).get("type"), json.dumps(spec.get("pre_tokenizer"))
    if kind != "BPE" or "ByteLevel" not in pre:
        raise ValueError(f"the web module runs byte-level BPE tokenizers only; this tokenizer.json has model "
                         f"{kind!r} and pre_tokenizer {pre[:120]}")
    return {"type": "tokenizer.json", **entry}


def export_web(model, tokenizer, out_dir, prefill_chunk: int | None = 32, *, parallel: bool = True,
               full_logits: bool = False, ort_web: str | None = None, quantize: str | None = None) -> dict[str, str]:
    """Writes the static site (module docstring) into `out_dir`.

    Args:
        model: a `ShramForCausalLM` (not modified).
        tokenizer: its tokenizer (`ByteTokenizer`, or an `HFTokenizer` of byte-level BPE).
        out_dir: the site's folder (created).
        prefill_chunk: tokens per prefill call; None: no prefill graph (prompts token by token).
        parallel, full_logits: as `export_onnx`.
        ort_web: where onnxruntime-web is (`find_ort_web`); default: found from here.
        quantize: None (fp32), "int8" or "int4" (MatMulNBits weights, and with int4 the token
            embedding as int4 rows).

    Returns:
        {"index": index.html, "manifest": shram.json, **export_onnx's paths}.

    Raises:
        FileNotFoundError: onnxruntime-web's files are missing (checked before exporting).
        ValueError: a tokenizer the module cannot run, or a bad `quantize`.
    """
    import onnx

    from .onnx_quantize import check_onnx_quantize, dequantized_matmuls

    check_onnx_quantize(quantize)
    dist = find_ort_web(ort_web)  # before the export's minutes, not after
    os.makedirs(out_dir, exist_ok=True)
    tok_entry = _tokenizer_entry(tokenizer, out_dir)
    # whole-cache graphs (prefix_lengths=()): the module feeds no `slots` input
    paths = export_onnx(model, os.path.join(out_dir, "model.onnx"), batch_size=1, prefill_chunk=prefill_chunk,
                        eos_token_id=tokenizer.eos_token_id, parallel=parallel, full_logits=full_logits,
                        quantize=quantize, quantize_embedding=quantize == "int4", prefix_lengths=(),
                        row_writes=True)
    writes = {}  # where each state's written rows lie in a row-writes graph's outputs (its dq copy's alike)
    for role in ("decode", "prefill"):
        if role in paths:  # model.rows.onnx (traced for it) in place; model.prefill.onnx -> model.rows.prefill.onnx
            rows = os.path.join(out_dir, "model.rows" + os.path.basename(paths[role]).removeprefix("model"))
            writes[f"{role}_rows"] = row_writes_graph(paths.get(f"{role}_rows", paths[role]), rows)
            paths[f"{role}_rows"] = rows
            if quantize is not None:  # what onnxruntime-web runs: float MatMuls of weights dequantized at load
                dq = rows.replace("model.rows", "model.rows.dq")
                onnx.save(dequantized_matmuls(onnx.load(rows, load_external_data=False))[0], dq)
                onnx.checker.check_model(dq)
                paths[f"{role}_rows_dq"] = dq
    # Each graph without its nodes' metadata_props (stack traces, build paths) and intermediate
    # shapes (onnxruntime infers them); after the row-writes graphs, which are made with the shapes.
    for role, p in paths.items():
        if role != "data":
            m = onnx.load(p, load_external_data=False)
            for n in m.graph.node:
                del n.metadata_props[:]
            del m.graph.value_info[:]
            onnx.save(m, p)
    graph = onnx.load(paths["decode"], load_external_data=False).graph
    state = [{"name": i.name.removeprefix("past."), "type": _ONNX_TYPES[i.type.tensor_type.elem_type],
              "dims": [d.dim_value for d in i.type.tensor_type.shape.dim]}
             for i in graph.input if i.name.startswith("past.")]
    cfg = model.config
    with open(dist.parent / "package.json", encoding="utf-8") as f:
        ort_version = json.load(f)["version"]
    manifest = {
        "format": MANIFEST_FORMAT, "files": {role: os.path.basename(p) for role, p in paths.items()},
        "prefill_chunk": prefill_chunk or 1, "capacity": cfg.inference_sequence_length,
        "vocab_size": cfg.vocab_size, "eos_token_id": tokenizer.eos_token_id, "tokenizer": tok_entry,
        "state": state, "writes": writes, "quantize": quantize, "quantized_embedding": quantize == "int4",
        "bytes": {role: os.path.getsize(p) for role, p in paths.items()},
        "onnxruntime_web": ort_version,
        "model": {"layers": cfg.num_decoder_layers, "width": cfg.embedding_width,
                  "parameters": sum(p.numel() for p in model.parameters())},
    }
    with open(os.path.join(out_dir, "shram.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    coi = dist.parent.parent / "coi-serviceworker" / COI_FILE
    for src in [*(WEB_DIR / n for n in PAGE_FILES), *(dist / n for n in RUNTIME_FILES), coi]:
        shutil.copyfile(src, os.path.join(out_dir, src.name))
    return {"index": os.path.join(out_dir, "index.html"), "manifest": os.path.join(out_dir, "shram.json"), **paths}
