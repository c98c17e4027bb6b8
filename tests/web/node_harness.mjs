// Test harness: runs jobs through a site's shram.mjs under Node and prints the results as JSON.
//   node tests/web/node_harness.mjs generate node|web SITE JOBS.json
//     JOBS: [{prompt, options}] -> [{ids, text, stopped} | {error, name}]
//   node tests/web/node_harness.mjs tokenize MODULE TOKENIZER_INFO.json TOKENIZER.json TEXTS.json
//     -> [{ids, text}] (encode with BOS, then decode those ids)
//   node tests/web/node_harness.mjs sample MODULE CASES.json
//     CASES: [{logits, settings, seed, n}] -> [{probs, ids}] (n draws from seededRandom(seed))
import { readFileSync } from "node:fs";
import { resolve } from "node:path";
import { pathToFileURL } from "node:url";

const json = (p) => JSON.parse(readFileSync(p, "utf8"));
const [mode, ...args] = process.argv.slice(2);
const out = [];
if (mode === "generate") {
  const [runtime, site, jobs] = args;
  const ort = runtime === "node" ? await import("onnxruntime-node") : await import("onnxruntime-web");
  const { ShramModel } = await import(pathToFileURL(resolve(site, "shram.mjs")).href);
  const model = await ShramModel.load(ort, resolve(site), { threads: 1 });
  for (const { prompt, options } of json(jobs)) {
    try {
      const streamed = [];
      const r = await model.generate(prompt, { ...options, onToken: ({ text }) => streamed.push(text) });
      out.push({ ids: r.ids, text: r.text, streamed: streamed.join(""), stopped: r.stopped, graphs: model.files });
    } catch (e) {
      out.push({ error: e.message, name: e.name });
    }
  }
} else if (mode === "tokenize") {
  const [module, info, spec, texts] = args;
  const { Tokenizer } = await import(pathToFileURL(resolve(module)).href);
  const tok = new Tokenizer(json(info), json(spec));
  for (const t of json(texts)) {
    const ids = tok.encode(t, true);
    out.push({ ids, text: tok.decode(ids) });
  }
} else if (mode === "sample") {
  const [module, cases] = args;
  const { probs, sample, seededRandom } = await import(pathToFileURL(resolve(module)).href);
  for (const { logits, settings, seed, n } of json(cases)) {
    const x = Float32Array.from(logits), random = seededRandom(seed);
    out.push({ probs: Array.from(probs(x, settings)), ids: Array.from({ length: n }, () => sample(x, settings, random)) });
  }
} else {
  throw new Error(`unknown mode ${mode}`);
}
process.stdout.write(JSON.stringify(out));
