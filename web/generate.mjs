// Runs a site written by `shram-static export --format web` under Node with onnxruntime-node:
// the page's own module (site/shram.mjs), no browser.
//
//   node web/generate.mjs site/ "ROMEO:" [--max-new-tokens 64] [--temperature 0.8 --top-k 40 --top-p 0.95 --seed 0]
//
// Prints the prompt and its continuation as it is generated, then the speed on stderr.
import { resolve } from "node:path";
import { pathToFileURL } from "node:url";
import { parseArgs } from "node:util";
import * as ort from "onnxruntime-node";

const { values: o, positionals: [site, prompt] } = parseArgs({
  allowPositionals: true,
  options: {
    "max-new-tokens": { type: "string", default: "64" }, temperature: { type: "string", default: "0" },
    "top-k": { type: "string", default: "0" }, "top-p": { type: "string", default: "1" },
    seed: { type: "string" }, threads: { type: "string" },
  },
});
if (!site || prompt === undefined) {
  console.error('usage: node web/generate.mjs SITE_DIR "prompt" [--max-new-tokens N] [--temperature T] ' +
    "[--top-k K] [--top-p P] [--seed S] [--threads N]");
  process.exit(2);
}
const dir = resolve(site);
const { ShramModel } = await import(pathToFileURL(resolve(dir, "shram.mjs")).href);
const model = await ShramModel.load(ort, dir, { threads: o.threads ? Number(o.threads) : undefined });
process.stdout.write(prompt);
const r = await model.generate(prompt, {
  maxNewTokens: Number(o["max-new-tokens"]), temperature: Number(o.temperature), topK: Number(o["top-k"]),
  topP: Number(o["top-p"]), seed: o.seed === undefined ? undefined : Number(o.seed),
  onToken: ({ text }) => process.stdout.write(text),
});
process.stdout.write("\n");
console.error(`${r.ids.length} tokens, time to first token ${r.ttftMs.toFixed(0)} ms, ` +
  `${r.decodeTokensPerSecond.toFixed(1)} tokens/s (onnxruntime-node ${ort.env.versions.node})`);
