// Property tests of the site's module (shram_static/web/shram.mjs): its sampler and its
// tokenizers, with fast-check (as hypothesis does for the Python side). Run by tests/test_web.py:
//   node --test tests/web/
import assert from "node:assert/strict";
import { test } from "node:test";
import fc from "fast-check";
import { Tokenizer, argmax, checkOptions, probs, sample, seededRandom } from "../../shram_static/web/shram.mjs";

// a fixed seed keeps CI reproducible; FC_SEED=random explores (fast-check prints a failure's seed)
if (process.env.FC_SEED !== "random") fc.configureGlobal({ seed: Number(process.env.FC_SEED ?? 20261206) });
const RUNS = { numRuns: 200 };
const f32 = (o = {}) => fc.float({ noNaN: true, noDefaultInfinity: true, min: -1e4, max: 1e4, ...o });
const logitsArb = fc.array(f32(), { minLength: 1, maxLength: 64 }).map((a) => Float32Array.from(a));
// every positive temperature the sampler may meet, the subnormal ones included
// (temperatures up to 1e3 keep distinct float32 logits distinct after scaling; a larger one
// can round them into ties, which both samplers then treat as ties)
const moderateArb = fc.oneof(
  fc.double({ min: 1e-3, max: 1e3, noNaN: true }),
  fc.double({ min: Number.MIN_VALUE, max: 1e-300, noNaN: true }),
  fc.constantFrom(Number.MIN_VALUE, 1e-308, 1e-45),
);
const temperatureArb = fc.oneof(moderateArb, fc.constantFrom(1e300, Number.MAX_VALUE));
const settingsArb = (t = temperatureArb) => fc.record({
  temperature: t,
  topK: fc.nat({ max: 70 }),
  topP: fc.oneof(fc.constant(1), fc.double({ min: 1e-6, max: 1, noNaN: true })),
});
const uniqueMax = (x) => x.filter((v) => v === Math.max(...x)).length === 1;

test("probs is a distribution at every positive temperature (no NaN, no overflow)", () => {
  fc.assert(fc.property(logitsArb, settingsArb(), (x, s) => {
    const p = probs(x, s);
    assert.equal(p.length, x.length);
    for (const v of p) assert.ok(Number.isFinite(v) && v >= 0, `p holds ${v}`);
    assert.ok(Math.abs(p.reduce((a, b) => a + b, 0) - 1) < 1e-9);
    assert.ok(p[argmax(x)] === Math.max(...p), "a maximum of the logits has the highest probability");
  }), RUNS);
});

test("a sample is a token with probability, kept by top-k", () => {
  fc.assert(fc.property(logitsArb, settingsArb(moderateArb), fc.integer(), (x, s, seed) => {
    const p = probs(x, s), id = sample(x, s, seededRandom(seed));
    assert.ok(Number.isInteger(id) && id >= 0 && id < x.length);
    assert.ok(p[id] > 0, `token ${id} has probability ${p[id]}`);
    if (s.topK > 0 && s.topK < x.length) {
      // compared as scaled (subtracting the max can round logits 1e-31 apart into ties)
      const m = Math.max(...x), scaled = Array.from(x, (v) => (v - m) / s.temperature);
      const kth = scaled.slice().sort((a, b) => b - a)[s.topK - 1];
      assert.ok(scaled[id] >= kth, `token ${id} (${scaled[id]}) is below the ${s.topK}-th value ${kth}`);
    }
  }), RUNS);
});

test("a temperature too small for any other token to keep probability is greedy", () => {
  fc.assert(fc.property(logitsArb.filter(uniqueMax), fc.constantFrom(1e-308, 1e-320, Number.MIN_VALUE), fc.integer(),
    (x, temperature, seed) => {
      // the gap to the runner-up is >= 1 float32 ulp of 1e4, so gap / temperature overflows to -inf
      assert.equal(sample(x, { temperature }, seededRandom(seed)), argmax(x));
    }), RUNS);
});

test("top-k 1 and a tiny top-p keep only the argmax", () => {
  fc.assert(fc.property(logitsArb.filter(uniqueMax), moderateArb, fc.integer(), (x, temperature, seed) => {
    assert.equal(sample(x, { temperature, topK: 1 }, seededRandom(seed)), argmax(x));
    assert.equal(sample(x, { temperature, topP: 1e-12 }, seededRandom(seed)), argmax(x));
  }), RUNS);
});

test("the seeded generator repeats itself and stays in [0, 1)", () => {
  fc.assert(fc.property(fc.integer(), (seed) => {
    const a = seededRandom(seed), b = seededRandom(seed);
    for (let i = 0; i < 20; i++) {
      const u = a();
      assert.equal(u, b());
      assert.ok(u >= 0 && u < 1);
    }
  }), RUNS);
});

test("generate's options are refused as Python refuses them", () => {
  const bad = [[{ temperature: -1 }, RangeError], [{ temperature: "0.5" }, TypeError], [{ temperature: NaN }, RangeError],
    [{ temperature: Infinity }, RangeError], [{ maxNewTokens: 0 }, RangeError], [{ maxNewTokens: 1.5 }, RangeError],
    [{ maxNewTokens: "8" }, TypeError], [{ topK: -1 }, RangeError], [{ topP: 0 }, RangeError], [{ topP: 1.5 }, RangeError],
    [{ seed: 0.5 }, TypeError], [{ max_new_tokens: 8 }, TypeError], [{ eosTokenId: 300 }, RangeError], [null, TypeError]];
  for (const [o, E] of bad) assert.throws(() => checkOptions(o, 259), E, JSON.stringify(o));
  assert.doesNotThrow(() => checkOptions({ temperature: 1e-308, topK: 0, topP: 1, seed: -3, eosTokenId: null }, 259));
});

// -- tokenizers --------------------------------------------------------------------------------

const bytes = new Tokenizer({ type: "bytes", bos_token_id: 256, eos_token_id: 257, vocab_size: 259 });
const enc = new TextEncoder();
const textArb = fc.string({ unit: "grapheme", maxLength: 40 });  // well-formed: any code point
const loneSurrogateArb = fc.tuple(textArb, fc.integer({ min: 0xd800, max: 0xdfff }), textArb)
  .map(([a, s, b]) => a + String.fromCharCode(s) + b);

test("the byte tokenizer is UTF-8 after BOS and decodes back", () => {
  fc.assert(fc.property(textArb, (s) => {
    const ids = bytes.encode(s);
    assert.deepEqual(ids, [256, ...enc.encode(s)]);
    assert.equal(bytes.decode(ids), s);
  }), RUNS);
});

test("a lone surrogate is refused, as Python's UTF-8 encoder refuses it", () => {
  fc.assert(fc.property(loneSurrogateArb, (s) => {
    assert.throws(() => bytes.encode(s), { name: "RangeError", message: /lone surrogate U\+D[89A-F][0-9A-F]{2} at position \d+/ });
    assert.throws(() => bpe.encode(s), /lone surrogate/);
  }), RUNS);
  assert.throws(() => bytes.encode("ab\ud800"), /lone surrogate U\+D800 at position 2/);
  assert.throws(() => bytes.encode("🙂x\udc00"), /at position 2/);  // code points, as Python counts
});

/** GPT-2's byte -> character table, written out independently of the module's. */
function byteChars() {
  const keep = (b) => (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  let n = 0;
  return Array.from({ length: 256 }, (_, b) => String.fromCodePoint(keep(b) ? b : 256 + n++));
}
const chars = byteChars();
const vocab = Object.fromEntries(chars.map((c, i) => [c, i]));
const merges = [["Ġ", "t"], ["h", "e"], ["Ġt", "he"], ["Ã", "¼"], ["i", "n"], ["in", "g"]];
for (const [a, b] of merges) vocab[a + b] = Object.keys(vocab).length;
const bpe = new Tokenizer({ type: "tokenizer.json", bos_token_id: null, eos_token_id: 262, vocab_size: 263 }, {
  model: { type: "BPE", vocab, merges: merges.map((m) => m.join(" ")) },
  pre_tokenizer: { type: "ByteLevel", add_prefix_space: false, use_regex: true },
  added_tokens: [{ id: 262, content: "<|endoftext|>", special: true }],
});

test("byte-level BPE decodes what it encodes, and streams the same text", () => {
  fc.assert(fc.property(textArb, (s) => {
    const ids = bpe.encode(s);
    assert.equal(bpe.decode(ids), s);
    assert.ok(ids.length <= enc.encode(s).length);
  }), RUNS);
  assert.deepEqual(bpe.encode(" the thing"), [vocab["Ġthe"], vocab["Ġt"], vocab.h, vocab.ing]);
});

test("the streaming decoder gives decode's text for any ids", () => {
  fc.assert(fc.property(fc.array(fc.nat({ max: 258 }), { maxLength: 60 }), (ids) => {
    for (const tok of [bytes, bpe]) {  // 259 tokens and 263
      const d = tok.decoder();
      assert.equal(ids.map((i) => d.push(i)).join("") + d.end(), tok.decode(ids));
    }
  }), RUNS);
});
