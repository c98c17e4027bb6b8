// SHRAM language models in JavaScript: the site written by `shram-static export --format web`
// (its shram.json, model graphs and tokenizer) run by onnxruntime-web in a browser or
// onnxruntime-node under Node. This module owns the prefill graph for the prompt and the decode
// graph after it, the fixed-shape state and stopping; tokenizer.mjs and sampling.mjs beside it
// the tokenizers and the sampler (re-exported here).
//
//   import * as ort from "./ort.wasm.min.mjs";          // or: import * as ort from "onnxruntime-node"
//   import { ShramModel } from "./shram.mjs";
//   const model = await ShramModel.load(ort, "./");     // a URL (browser) or a directory (Node)
//   const { ids, text } = await model.generate("ROMEO:", { maxNewTokens: 64, onToken: (t) => ... });
//
// The graphs are pure functions (input_ids, position_ids, live, past.* -> logits and the rows
// the step wrote, or present.*): the state lives here, updated after each step.

import { argmax, checkOptions, sample, seededRandom } from "./sampling.mjs";
import { Tokenizer } from "./tokenizer.mjs";

export { Tokenizer, checkWellFormed } from "./tokenizer.mjs";
export { argmax, checkOptions, probs, sample, seededRandom } from "./sampling.mjs";
export const MANIFEST = "shram.json";
export const MANIFEST_FORMAT = "shram_static.web/2";

const ARRAYS = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array, bool: Uint8Array, uint8: Uint8Array };

const inNode = typeof process !== "undefined" && !!process.versions?.node;

/**
 * Bytes of `name` under `base`: fetched (a URL) or read from disk (a directory, Node).
 * `onProgress({file, loaded, total})` hears of each chunk as it arrives (total: the
 * Content-Length, else `expected`, else 0 for unknown).
 */
async function readBytes(base, name, onProgress = null, expected = 0) {
  if (inNode && !/^(https?|blob|data):/.test(String(base))) {
    const { readFile } = await import("node:fs/promises");
    const { join } = await import("node:path");
    const { fileURLToPath } = await import("node:url");
    const dir = String(base).startsWith("file:") ? fileURLToPath(base) : String(base);
    let bytes;
    try {
      bytes = new Uint8Array(await readFile(join(dir, name)));
    } catch (e) {
      throw new Error(`cannot read ${join(dir, name)}: ${e.message} (is ${dir} a site written by ` +
        "`shram-static export --format web`?)");
    }
    onProgress?.({ file: name, loaded: bytes.length, total: bytes.length });
    return bytes;
  }
  const url = new URL(name, new URL(String(base), globalThis.location?.href ?? undefined));
  const r = await fetch(url);
  if (!r.ok) throw new Error(`cannot fetch ${url}: HTTP ${r.status} (is the site served as exported?)`);
  const total = Number(r.headers.get("Content-Length")) || expected || 0;
  if (!onProgress || !r.body) return new Uint8Array(await r.arrayBuffer());
  const chunks = [], reader = r.body.getReader();
  let loaded = 0;
  onProgress({ file: name, loaded, total });
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    chunks.push(value);
    loaded += value.length;
    onProgress({ file: name, loaded, total: Math.max(total, loaded) });
  }
  if (chunks.length === 1) return chunks[0];
  const out = new Uint8Array(loaded);
  let at = 0;
  for (const c of chunks) { out.set(c, at); at += c.length; }
  return out;
}

/** Lets the event loop run (a page repaints, a Stop click lands) without setTimeout's 4 ms clamp. */
function macrotask() {
  if (inNode) return new Promise((r) => setImmediate(r));
  return new Promise((r) => {
    const c = new MessageChannel();
    c.port1.onmessage = () => { c.port1.close(); r(); };
    c.port2.postMessage(0);
  });
}

function pathOf(base, name) {
  return String(base).replace(/\/?$/, "/") + name;
}

// -- the model ------------------------------------------------------------------------------

/** A SHRAM model's graphs, state and tokenizer; `generate` runs it. Build with `load`. */
export class ShramModel {
  // each graph: its session and its `writes` (`row_writes_graph`'s layout, applied in #step)
  #decodeGraph;
  #promptGraph;

  /**
   * Loads a site written by `shram-static export --format web`.
   *
   * @param {object} ort the onnxruntime module: onnxruntime-web (browser, or Node) or onnxruntime-node.
   * @param {string|URL} base the site: a URL (browser) or a directory (Node).
   * @param {object} [options]
   * @param {number} [options.threads] intra-op threads (default: onnxruntime-web uses half the
   *   cores, up to 4, on a cross-origin isolated page and one thread otherwise; onnxruntime-node
   *   its own choice).
   * @param {string[]} [options.executionProviders] onnxruntime-web's providers (default ["wasm"]).
   * @param {function} [options.onProgress] called with {file, loaded, total} as each file arrives.
   * @param {object} [options.sessionOptions] more onnxruntime session options.
   * @returns {Promise<ShramModel>}
   */
  static async load(ort, base, { threads, executionProviders = ["wasm"], onProgress = null, sessionOptions = {} } = {}) {
    if (!ort?.InferenceSession) throw new TypeError("ShramModel.load needs the onnxruntime module as its first argument");
    const manifest = JSON.parse(new TextDecoder().decode(await readBytes(base, MANIFEST)));
    if (manifest.format !== MANIFEST_FORMAT) {
      throw new Error(`${MANIFEST} has format ${JSON.stringify(manifest.format)}; this module reads ${MANIFEST_FORMAT}`);
    }
    const tinfo = manifest.tokenizer;
    const spec = tinfo.type === "tokenizer.json"
      ? JSON.parse(new TextDecoder().decode(await readBytes(base, tinfo.file))) : null;
    const tokenizer = new Tokenizer({ ...tinfo, vocab_size: manifest.vocab_size }, spec);
    const web = !!ort.env?.versions?.web;
    // a quantized site's dq graphs dequantize constant weights (onnx_quantize.dequantized_matmuls):
    // with QDQ fusions off, onnxruntime folds them into float weights once, at load
    const opts = { graphOptimizationLevel: "all", ...sessionOptions,
                   extra: { ...sessionOptions.extra, session: { disable_quant_qdq: "1", ...sessionOptions.extra?.session } } };
    const files = manifest.files, sizes = manifest.bytes ?? {};
    // the graphs that return the rows each step writes (export_web's row_writes_graph):
    // onnxruntime-web copies every output out of its heap, and under Node too the few written
    // rows cost less than binding the whole state in place (docs/web.md); a quantized site's
    // onnxruntime-web graphs have their weights dequantized at load (MatMulNBits is slow in WASM)
    const dq = web && files.decode_rows_dq ? "_dq" : "";
    const roles = { decode: files[`decode_rows${dq}`], prefill: files[`prefill_rows${dq}`] };
    const role = (f) => Object.keys(files).find((k) => files[k] === f);
    let used = threads ?? null, sessions;
    if (web) {
      if (threads) ort.env.wasm.numThreads = threads;
      else if (!globalThis.crossOriginIsolated) ort.env.wasm.numThreads = 1;  // threads need isolation
      // isolated: onnxruntime-web's own default, half the cores (the page's own thread needs one), up to 4
      else ort.env.wasm.numThreads = Math.min(4, Math.ceil((globalThis.navigator?.hardwareConcurrency || 1) / 2));
      used = ort.env.wasm.numThreads;
      // onnxruntime-web reads no file beside the graph by itself: hand it the weights, read once
      // for both graphs; every file downloads at once
      const wanted = [files.data, roles.decode, roles.prefill].filter(Boolean);
      const bytes = await Promise.all(wanted.map((f) => readBytes(base, f, onProgress, sizes[role(f)])));
      const got = Object.fromEntries(wanted.map((f, i) => [f, bytes[i]]));
      sessions = {};
      for (const [r, f] of Object.entries(roles)) {
        if (!f) continue;
        sessions[r] = await ort.InferenceSession.create(got[f], {
          executionProviders, externalData: [{ path: files.data, data: got[files.data] }], ...opts });
      }
    } else {
      // onnxruntime-node finds the weights file beside the graph
      if (threads) opts.intraOpNumThreads = threads;
      sessions = {};
      for (const [r, f] of Object.entries(roles)) {
        if (!f) continue;
        sessions[r] = await ort.InferenceSession.create(pathOf(base, f), opts);
        onProgress?.({ file: f, loaded: sizes[role(f)] ?? 0, total: sizes[role(f)] ?? 0 });
      }
    }
    return new ShramModel({ ort, manifest, tokenizer, sessions, threads: used,
                            executionProvider: web ? executionProviders[0] : "cpu",
                            files: Object.values(roles).filter(Boolean).concat(files.data) });
  }

  /**
   * What `load` made of a site (use `load`).
   *
   * @param {object} parts {ort, manifest, tokenizer, sessions: {decode, prefill?}, threads,
   *   executionProvider, files}: the sessions of the site's row-writes graphs, and the files they read.
   */
  constructor({ ort, manifest, tokenizer, sessions, threads, executionProvider, files }) {
    this.ort = ort;
    this.manifest = manifest;
    this.tokenizer = tokenizer;
    this.threads = threads;
    this.executionProvider = executionProvider;
    this.files = files;
    this.capacity = manifest.capacity;
    this.prefillChunk = sessions.prefill ? manifest.prefill_chunk : 1;
    this.vocabSize = manifest.vocab_size;
    this.quantize = manifest.quantize ?? null;
    this.busy = false;
    // where each graph's outputs hold each state's written rows
    const width = Object.fromEntries(manifest.state.map(({ name, dims }) => [name, dims.slice(1).reduce((a, b) => a * b, 1)]));
    const graph = (sess, role) => ({
      sess, writes: manifest.writes[role].map((w) => ({ ...w, past: `past.${w.state}`, width: width[w.state] })) });
    this.#decodeGraph = graph(sessions.decode, "decode_rows");
    this.#promptGraph = sessions.prefill ? graph(sessions.prefill, "prefill_rows") : this.#decodeGraph;
  }

  /**
   * Generates from a dummy prompt (prefill and decode) in rounds of about a second each until a
   * round runs less than 5% faster than the best before it, or for at most `maxMs`. WHY: V8
   * compiles WebAssembly with its baseline compiler first and optimizes hot functions as they
   * run, so a page's first few hundred tokens run several times slower; a page calls this while
   * it loads, so a user's first generation runs at full speed.
   *
   * @param {object} [opts]
   * @param {number} [opts.maxMs=10000] the most it may take (a round in flight is cut short).
   * @param {function} [opts.onProgress] called with {round, tokens, tokensPerSecond, ms} after each round.
   * @returns {Promise<{rounds: number, tokens: number, ms: number, tokensPerSecond: number}>}
   */
  async warmUp({ maxMs = 10000, onProgress } = {}) {
    const t0 = performance.now(), prompt = new Array(this.prefillChunk + 1).fill(0);
    const most = Math.max(1, this.capacity - prompt.length + 1);
    const stop = new AbortController(), timer = setTimeout(() => stop.abort(), maxMs);
    let best = 0, rounds = 0, tokens = 0, rate = 0, n = Math.min(16, most);
    try {
      while (!stop.signal.aborted) {
        const r = await this.generate(prompt, { maxNewTokens: n, eosTokenId: null, signal: stop.signal });
        rounds++;
        tokens += r.ids.length;
        if (r.stopped === "abort") break;
        rate = r.decodeTokensPerSecond;
        onProgress?.({ round: rounds, tokens, tokensPerSecond: rate, ms: performance.now() - t0 });
        if (rounds >= 3 && rate < best * 1.05) break;  // under 5% faster than the best round
        best = Math.max(best, rate);
        n = Math.max(16, Math.min(128, most, Math.round(rate)));  // about a second at this speed
      }
    } finally {
      clearTimeout(timer);
    }
    return { rounds, tokens, ms: performance.now() - t0, tokensPerSecond: rate };
  }

  /** The state before any token: zeros (finite; stale slots are masked by position). */
  #zeroState() {
    const st = {};
    for (const { name, dims, type } of this.manifest.state) {
      const A = ARRAYS[type];
      if (!A) throw new Error(`state ${name} has type ${type}, which this module cannot hold`);
      st[`past.${name}`] = new this.ort.Tensor(type, new A(dims.reduce((a, b) => a * b, 1)), dims);
    }
    return st;
  }

  /** One step: tokens (one chunk) at `pos`, padded with dead tokens; returns last logits. */
  async #step({ sess, writes }, chunk, tokens, pos, state) {
    const ids = new BigInt64Array(chunk), live = new Uint8Array(chunk);
    tokens.forEach((t, i) => { ids[i] = BigInt(t); live[i] = 1; });
    const T = this.ort.Tensor;
    const feeds = {
      input_ids: new T("int64", ids, [1, chunk]), position_ids: new T("int64", BigInt64Array.of(BigInt(pos)), [1]),
      live: new T("bool", live, [1, chunk]), ...state,
    };
    // onnxruntime-web copies every input into its WASM heap and every output out of it (and
    // onnxruntime-node allocates every output anew): the graph returns only the rows it wrote,
    // applied here to the state this module holds (in write order: the last write to a row
    // wins, as in the graph)
    const out = await sess.run(feeds);
    const index = out["write.index"].data;
    for (const { past, at, n, rows, from, width: w } of writes) {
      const src = out[rows].data, dst = state[past].data;
      for (let i = 0; i < n; i++) dst.set(src.subarray((from + i) * w, (from + i + 1) * w), Number(index[at + i]) * w);
    }
    const lg = out.logits.data;  // [1, 1 or chunk, V]: the last live token's row
    const row = lg.length === this.vocabSize ? 0 : tokens.length - 1;
    return lg.subarray(row * this.vocabSize, (row + 1) * this.vocabSize);
  }

  /**
   * Generates a continuation of `prompt` (BOS added): prefill in chunks, then one decode step
   * per new token, greedy or sampled, until `maxNewTokens` or the end-of-sequence token.
   *
   * @param {string|number[]} prompt text, or token ids (used as given).
   * @param {object} [opts]
   * @param {number} [opts.maxNewTokens=64] tokens to produce at most.
   * @param {number} [opts.temperature=0] 0: greedy (argmax); > 0: sample at this temperature.
   * @param {number} [opts.topK=0] keep the k most likely tokens (0: all). Sampling only.
   * @param {number} [opts.topP=1] keep the most likely tokens up to probability p (1: all).
   * @param {number} [opts.seed] seeds the sampler (the same seed, the same tokens); default random.
   * @param {function} [opts.onToken] called with {id, text, index} as each token is produced
   *   (`text`: what the token completes; a multi-byte character arrives with its last byte).
   * @param {AbortSignal} [opts.signal] stops generating when aborted (the tokens so far are returned).
   * @param {number|null} [opts.eosTokenId] the token that ends generation (default: the
   *   tokenizer's end-of-sequence token; null: none, always `maxNewTokens` tokens).
   * @returns {Promise<{ids: number[], text: string, promptTokens: number, ttftMs: number,
   *   decodeTokensPerSecond: number, stopped: string}>} `stopped`: "eos", "length" or "abort".
   */
  async generate(prompt, options = {}) {
    const { maxNewTokens = 64, temperature = 0, topK = 0, topP = 1, seed, onToken, signal,
            eosTokenId = this.manifest.eos_token_id } = checkOptions(options, this.vocabSize);
    const t0 = performance.now();
    const ids = this.#promptIds(prompt);
    // the last new token is returned, not fed back: prompt + maxNewTokens - 1 tokens are held
    if (ids.length + maxNewTokens - 1 > this.capacity) {
      throw new RangeError(`the prompt (${ids.length} tokens with BOS) plus maxNewTokens (${maxNewTokens}) - 1 ` +
        `exceeds the model's capacity of ${this.capacity} tokens: shorten the prompt or lower maxNewTokens`);
    }
    if (this.busy) throw new Error("this model is already generating: await the running generate() first");
    this.busy = true;
    try {
      const greedy = temperature === 0;
      const random = seededRandom(seed ?? Math.floor(Math.random() * 2 ** 32));
      const pick = (lg) => (greedy ? argmax(lg) : sample(lg, { temperature, topK, topP }, random));
      const state = this.#zeroState();
      const C = this.prefillChunk;
      let logits = null;
      for (let i = 0; i < ids.length; i += C) {
        logits = await this.#step(this.#promptGraph, C, ids.slice(i, i + C), i, state);
      }
      const out = [], dec = this.tokenizer.decoder(), eos = eosTokenId;
      let text = "", ttft = 0, tDecode = 0, stopped = "length", yielded = performance.now();
      for (let t = 0; t < maxNewTokens; t++) {
        const id = pick(logits);
        out.push(id);
        const piece = dec.push(id);
        text += piece;
        if (t === 0) { ttft = performance.now() - t0; tDecode = performance.now(); }
        onToken?.({ id, text: piece, index: t });
        if (id === eos) { stopped = "eos"; break; }
        if (signal?.aborted) { stopped = "abort"; break; }
        if (t + 1 === maxNewTokens) break;
        // a step's promise resolves as a microtask: a page would show nothing until the end
        if (performance.now() - yielded > 40) { await macrotask(); yielded = performance.now(); }
        logits = await this.#step(this.#decodeGraph, 1, [id], ids.length + t, state);
      }
      const rest = dec.end();
      if (rest) { text += rest; onToken?.({ id: null, text: rest, index: out.length }); }
      const steps = out.length - 1;
      return { ids: out, text, promptTokens: ids.length, ttftMs: ttft, stopped,
               decodeTokensPerSecond: steps > 0 ? steps / ((performance.now() - tDecode) / 1000) : 0 };
    } finally {
      this.busy = false;
    }
  }

  #promptIds(prompt) {
    if (Array.isArray(prompt)) {
      if (prompt.length === 0) throw new RangeError("the prompt is empty: give at least one token");
      for (const i of prompt) {
        if (!Number.isInteger(i) || i < 0 || i >= this.vocabSize) {
          throw new RangeError(`prompt token ${i} is outside the vocabulary [0, ${this.vocabSize})`);
        }
      }
      return prompt.slice();
    }
    if (typeof prompt !== "string") throw new TypeError(`the prompt must be a string or token ids, got ${typeof prompt}`);
    if (prompt.length === 0) throw new RangeError("the prompt is empty: type some text to continue");
    return this.tokenizer.encode(prompt, true);
  }
}
