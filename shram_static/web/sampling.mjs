// Picking tokens from logits (part of shram.mjs): greedy, or a seeded sample under temperature,
// top-k and top-p as shram_static/sampling.py computes it; generate()'s options checked as
// Python checks its own.

/** mulberry32: a small, fast, seeded 32-bit PRNG; uniform floats in [0, 1). */
export function seededRandom(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Index of the first maximum (torch's and numpy's argmax). */
export function argmax(x) {
  let b = 0;
  for (let i = 1; i < x.length; i++) if (x[i] > x[b]) b = i;
  return b;
}

/**
 * The sampling distribution of `logits` (float64, sums to 1) after transformers' warpers in
 * their order, as `shram_static/sampling.py` computes it: the row's maximum subtracted first (so
 * the top logit is exactly 0 and no temperature > 0 overflows: a tiny temperature leaves the
 * maxima alone), then the temperature, top-k keeping every value tied with the k-th, top-p
 * keeping the smallest set whose probability reaches p (at least one token), softmax.
 */
export function probs(logits, { temperature = 1, topK = 0, topP = 1 } = {}) {
  const V = logits.length;
  let m = -Infinity;
  for (let i = 0; i < V; i++) if (logits[i] > m) m = logits[i];
  const x = new Float64Array(V);
  for (let i = 0; i < V; i++) x[i] = temperature === 1 ? logits[i] - m : (logits[i] - m) / temperature;
  // indices by descending logit (a huge temperature can round distinct values to ties: the
  // logits still order them), when a filter needs them
  let order = null;
  if ((topK > 0 && topK < V) || topP < 1) order = Array.from(x.keys()).sort((a, b) => (logits[b] - logits[a]) || (a - b));
  if (topK > 0 && topK < V) {
    const kth = x[order[topK - 1]];
    for (let i = 0; i < V; i++) if (x[i] < kth) x[i] = -Infinity;
  }
  let z = 0;
  const p = new Float64Array(V);
  for (let i = 0; i < V; i++) { p[i] = Math.exp(x[i]); z += p[i]; }  // max 0: exp(0) = 1, z >= 1
  for (let i = 0; i < V; i++) p[i] /= z;
  if (topP < 1) {
    // transformers: drop the tokens whose ascending cumulative probability is <= 1 - p
    let cum = 0;
    const asc = order.slice().reverse();
    for (let j = 0; j < V - 1; j++) {
      cum += p[asc[j]];
      if (cum <= 1 - topP) p[asc[j]] = 0; else break;
    }
    z = p.reduce((a, b) => a + b, 0);
    for (let i = 0; i < V; i++) p[i] /= z;
  }
  return p;
}

/**
 * One token drawn from `probs(logits, settings)` with `random()` uniform in [0, 1): the first
 * index whose cumulative probability exceeds the draw.
 */
export function sample(logits, settings, random) {
  const p = probs(logits, settings);
  let u = random(), last = 0;
  for (let i = 0; i < p.length; i++) {
    if (p[i] > 0) { last = i; u -= p[i]; if (u < 0) return i; }
  }
  return last;  // rounding left u >= 0: the last token with probability
}


const GENERATE_OPTIONS = ["maxNewTokens", "temperature", "topK", "topP", "seed", "onToken", "signal", "eosTokenId"];

/**
 * `generate`'s options, checked as Python's `HostDecoder.generate` and `Sampler` check theirs:
 * an unknown name, a wrong type or a value out of range throws (TypeError / RangeError) naming it.
 */
export function checkOptions(options, vocabSize) {
  if (options === null || typeof options !== "object") throw new TypeError(`options must be an object, got ${options}`);
  const unknown = Object.keys(options).filter((k) => !GENERATE_OPTIONS.includes(k));
  if (unknown.length) throw new TypeError(`unknown option ${unknown.join(", ")} (known: ${GENERATE_OPTIONS.join(", ")})`);
  const { maxNewTokens = 64, temperature = 0, topK = 0, topP = 1, seed, onToken, signal, eosTokenId } = options;
  const num = (name, v) => {
    if (typeof v !== "number") throw new TypeError(`${name} must be a number, got ${typeof v} ${JSON.stringify(v)}`);
  };
  num("maxNewTokens", maxNewTokens);
  if (!Number.isInteger(maxNewTokens) || maxNewTokens < 1) {
    throw new RangeError(`maxNewTokens must be a positive integer, got ${maxNewTokens}`);
  }
  num("temperature", temperature);
  if (!(temperature >= 0) || !Number.isFinite(temperature)) {
    throw new RangeError(`temperature must be a finite number >= 0, got ${temperature}`);
  }
  num("topK", topK);
  if (!Number.isInteger(topK) || topK < 0) throw new RangeError(`topK must be an integer >= 0, got ${topK}`);
  num("topP", topP);
  if (!(topP > 0 && topP <= 1)) throw new RangeError(`topP must be in (0, 1], got ${topP}`);
  if (seed !== undefined && !Number.isSafeInteger(seed)) throw new TypeError(`seed must be an integer, got ${seed}`);
  if (onToken !== undefined && typeof onToken !== "function") throw new TypeError("onToken must be a function");
  if (signal !== undefined && typeof signal?.aborted !== "boolean") throw new TypeError("signal must be an AbortSignal");
  if (eosTokenId !== undefined && eosTokenId !== null &&
      !(Number.isInteger(eosTokenId) && eosTokenId >= 0 && eosTokenId < vocabSize)) {
    throw new RangeError(`eosTokenId must be null or a token id in [0, ${vocabSize}), got ${eosTokenId}`);
  }
  return options;
}
