// The tokenizers of a site written by `shram-static export --format web` (part of shram.mjs):
// the built-in byte tokenizer and byte-level BPE tokenizer.json, encode refusing what Python
// refuses (text that is not well-formed Unicode), decode streaming.

/** GPT-2's reversible byte -> printable character table (the ByteLevel pre-tokenizer's). */
function bytesToUnicode() {
  const bs = [];
  for (let b = 33; b <= 126; b++) bs.push(b);
  for (let b = 161; b <= 172; b++) bs.push(b);
  for (let b = 174; b <= 255; b++) bs.push(b);
  const cs = bs.slice();
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!bs.includes(b)) { bs.push(b); cs.push(256 + n); n++; }
  }
  const table = new Array(256);
  bs.forEach((b, i) => { table[b] = String.fromCodePoint(cs[i]); });
  return table;
}

// GPT-2's split of text into words before BPE (tokenizers' ByteLevel `use_regex`).
const GPT2_SPLIT = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu;

/**
 * The tokenizers `shram-static export` writes: "bytes" (the built-in byte tokenizer, UTF-8
 * bytes as ids 0-255 and BOS/EOS/PAD after them) and a checkpoint's `tokenizer.json` of
 * byte-level BPE (GPT-2 style: ByteLevel pre-tokenizer and decoder, merges, added tokens).
 * Other tokenizer.json models (WordPiece, Unigram, normalizers other than NFC) raise an error.
 */
export class Tokenizer {
  /**
   * @param {object} info the manifest's `tokenizer` entry: {type, bos_token_id, eos_token_id}.
   * @param {object|null} spec the parsed tokenizer.json (type "tokenizer.json" only).
   */
  constructor(info, spec = null) {
    this.type = info.type;
    this.bosTokenId = info.bos_token_id ?? null;
    this.eosTokenId = info.eos_token_id ?? null;
    this.vocabSize = info.vocab_size;
    if (this.type === "bytes") return;
    if (this.type !== "tokenizer.json") throw new Error(`unknown tokenizer type ${JSON.stringify(this.type)}`);
    const model = spec.model ?? {};
    if (model.type !== "BPE") {
      throw new Error(`tokenizer.json model ${JSON.stringify(model.type)} is not supported (byte-level BPE only)`);
    }
    const norm = spec.normalizer;
    if (norm && norm.type !== "NFC") {
      throw new Error(`tokenizer.json normalizer ${JSON.stringify(norm.type)} is not supported (none or NFC)`);
    }
    this.nfc = !!norm;
    this.split = this.#preTokenizer(spec.pre_tokenizer);
    this.vocab = new Map(Object.entries(model.vocab));
    this.ranks = new Map((model.merges ?? []).map((m, i) => [Array.isArray(m) ? m.join(" ") : m, i]));
    this.idToToken = [];
    for (const [t, i] of this.vocab) this.idToToken[i] = t;
    this.special = new Set();
    this.added = [];
    for (const a of spec.added_tokens ?? []) {
      this.idToToken[a.id] = a.content;
      if (a.special) this.special.add(a.id);
      this.added.push(a);
    }
    const esc = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
    this.addedRe = this.added.length
      ? new RegExp(`(${this.added.map((a) => a.content).sort((a, b) => b.length - a.length).map(esc).join("|")})`)
      : null;
    this.addedIds = new Map(this.added.map((a) => [a.content, a.id]));
    this.byteChar = bytesToUnicode();
    this.charByte = new Map(this.byteChar.map((c, b) => [c, b]));
    this.cache = new Map();
  }

  #preTokenizer(p) {
    if (!p) throw new Error("tokenizer.json has no pre_tokenizer: only byte-level BPE is supported");
    const steps = p.type === "Sequence" ? p.pretokenizers : [p];
    const fns = [];
    let byteLevel = false;
    for (const s of steps) {
      if (s.type === "ByteLevel") {
        byteLevel = true;
        const prefix = !!s.add_prefix_space, re = s.use_regex !== false;
        fns.push((pieces) => pieces.flatMap((w) => {
          const x = prefix && !w.startsWith(" ") ? " " + w : w;  // each piece, as tokenizers does
          return re ? (x.match(GPT2_SPLIT) ?? []) : [x];
        }));
      } else if (s.type === "Split" && s.pattern?.Regex && s.behavior === "Isolated" && !s.invert) {
        const re = new RegExp(s.pattern.Regex, "gu");
        fns.push((pieces) => pieces.flatMap((w) => isolate(w, re)));
      } else {
        throw new Error(`tokenizer.json pre_tokenizer ${JSON.stringify(s.type)} is not supported ` +
          "(ByteLevel, Split by regex with behavior Isolated)");
      }
    }
    if (!byteLevel) throw new Error("tokenizer.json has no ByteLevel pre_tokenizer: only byte-level BPE is supported");
    return (text) => fns.reduce((pieces, f) => f(pieces), [text]);
  }

  /** Token ids of `text`, after BOS when `addBos` and the tokenizer has one. */
  encode(text, addBos = true) {
    if (typeof text !== "string") throw new TypeError(`text must be a string, got ${typeof text}`);
    checkWellFormed(text);
    const ids = addBos && this.bosTokenId !== null ? [this.bosTokenId] : [];
    if (this.type === "bytes") {
      for (const b of new TextEncoder().encode(text)) ids.push(b);
      return ids;
    }
    const parts = this.addedRe ? text.split(this.addedRe) : [text];
    parts.forEach((part, i) => {
      if (i % 2 === 1) { ids.push(this.addedIds.get(part)); return; }
      if (!part) return;
      for (const word of this.split(this.nfc ? part.normalize("NFC") : part)) {
        for (const tok of this.#bpe(word)) {
          const id = this.vocab.get(tok);
          if (id === undefined) throw new Error(`token ${JSON.stringify(tok)} is not in the vocabulary`);
          ids.push(id);
        }
      }
    });
    return ids;
  }

  #bpe(word) {
    const hit = this.cache.get(word);
    if (hit) return hit;
    let parts = Array.from(new TextEncoder().encode(word), (b) => this.byteChar[b]);
    while (parts.length > 1) {
      let best = -1, rank = Infinity;
      for (let i = 0; i < parts.length - 1; i++) {
        const r = this.ranks.get(parts[i] + " " + parts[i + 1]);
        if (r !== undefined && r < rank) { rank = r; best = i; }
      }
      if (best < 0) break;
      const a = parts[best], b = parts[best + 1], merged = [];
      for (let i = 0; i < parts.length; i++) {  // merge every occurrence of the best pair
        if (i < parts.length - 1 && parts[i] === a && parts[i + 1] === b) { merged.push(a + b); i++; }
        else merged.push(parts[i]);
      }
      parts = merged;
    }
    if (this.cache.size < 10000) this.cache.set(word, parts);
    return parts;
  }

  /** Bytes (ByteLevel) or text (added tokens) of one id; special tokens give nothing. */
  #bytesOf(id) {
    if (!Number.isInteger(id) || id < 0 || id >= this.vocabSize) {
      throw new RangeError(`token id ${id} is outside the vocabulary [0, ${this.vocabSize})`);
    }
    if (this.type === "bytes") return id < 256 ? Uint8Array.of(id) : new Uint8Array(0);
    if (this.special.has(id)) return new Uint8Array(0);
    const tok = this.idToToken[id];
    if (tok === undefined) return new Uint8Array(0);
    if (this.addedIds.has(tok)) return new TextEncoder().encode(tok);
    return Uint8Array.from(Array.from(tok), (c) => this.charByte.get(c) ?? 0);
  }

  /** Text of `ids`: special tokens skipped, invalid UTF-8 as U+FFFD. */
  decode(ids) {
    const s = this.decoder();
    return ids.map((i) => s.push(i)).join("") + s.end();
  }

  /** A streaming decoder: `push(id)` returns the text completed so far, `end()` the rest. */
  decoder() {
    const td = new TextDecoder("utf-8");
    return {
      push: (id) => td.decode(this.#bytesOf(id), { stream: true }),
      end: () => td.decode(),
    };
  }
}

// a high surrogate not followed by a low one, or a low one not after a high one
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/**
 * Throws unless `text` is well-formed Unicode: a lone surrogate (which JSON and JavaScript
 * strings can hold) has no UTF-8 bytes, so Python refuses it, and TextEncoder would silently
 * turn it into U+FFFD.
 */
export function checkWellFormed(text) {
  const m = LONE_SURROGATE.exec(text);
  if (!m) return;
  const at = Array.from(text.slice(0, m.index)).length;  // in code points, as Python counts
  const hex = m[0].charCodeAt(0).toString(16).toUpperCase();
  throw new RangeError(`the text is not valid Unicode: it holds a lone surrogate U+${hex} at position ${at} ` +
    "(surrogates not allowed; UTF-8 cannot encode it)");
}

/** `text` split by `re` (global) with each match kept as a piece of its own. */
function isolate(text, re) {
  const out = [];
  let at = 0;
  for (const m of text.matchAll(re)) {
    if (m.index > at) out.push(text.slice(at, m.index));
    if (m[0]) out.push(m[0]);
    at = m.index + m[0].length;
  }
  if (at < text.length) out.push(text.slice(at));
  return out;
}
