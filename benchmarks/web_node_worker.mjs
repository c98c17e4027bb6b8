// benchmarks/web_speed.py's Node side: a site's shram.mjs on onnxruntime-web (WASM) or
// onnxruntime-node, one thread; each stdin line {prompt, options} -> one stdout line of
// generate()'s result.
//   node benchmarks/web_node_worker.mjs web|node SITE
import { createInterface } from "node:readline";
import { resolve } from "node:path";
import { pathToFileURL } from "node:url";

const [runtime, site] = process.argv.slice(2);
const ort = runtime === "node" ? await import("onnxruntime-node") : await import("onnxruntime-web");
const { ShramModel } = await import(pathToFileURL(resolve(site, "shram.mjs")).href);
const model = await ShramModel.load(ort, resolve(site), { threads: 1 });
for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue;
  const { prompt, options } = JSON.parse(line);
  try {
    process.stdout.write(JSON.stringify(await model.generate(prompt, options)) + "\n");
  } catch (e) {
    process.stdout.write(JSON.stringify({ error: e.message }) + "\n");
  }
}
