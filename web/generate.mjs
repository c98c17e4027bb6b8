// Runs a site written by `shram-static export --format web` under Node with onnxruntime-node:
// the page's own module (site/shram.mjs), no browser.
//
//   node web/generate.mjs site/ "ROMEO:" [--max-new-tokens 64] [--temperature 0.8 --top-k 40 --top-p 0.95 --seed 0]
//
// Prints the prompt and its continuation as it is generated, then the speed on stderr. Every
// argument and the site's files are checked before anything loads: a bad one is one line on
// stderr and exit status 2; a failure while generating is one line and status 1.
import { existsSync, readFileSync, statSync } from "node:fs";
import { join, resolve } from "node:path";
import { pathToFileURL } from "node:url";
import { parseArgs } from "node:util";

const USAGE = 'usage: node web/generate.mjs SITE_DIR "prompt" [--max-new-tokens N] [--temperature T] ' +
  "[--top-k K] [--top-p P] [--seed S] [--threads N]";

function fail(message, status = 2) {
  process.stderr.write(`generate.mjs: ${message}\n`);
  process.exit(status);
}

/** `text` as a number that `ok` accepts, else exit 2 naming the option. */
function number(name, text, ok, want) {
  const v = /^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i.test(String(text).trim()) ? Number(text) : NaN;
  if (!ok(v)) fail(`--${name} must be ${want}, got ${JSON.stringify(text)}`);
  return v;
}

/** The site's manifest, after checking that every file the module reads is there. */
function checkSite(dir) {
  if (!existsSync(dir) || !statSync(dir).isDirectory()) fail(`the site ${dir} is not a directory`);
  const manifestPath = join(dir, "shram.json");
  if (!existsSync(manifestPath)) {
    fail(`the site ${dir} has no shram.json (write one with \`shram-static export --format web --out ${dir}\`)`);
  }
  let manifest;
  try {
    manifest = JSON.parse(readFileSync(manifestPath, "utf8"));
  } catch (e) {
    fail(`${manifestPath} is not valid JSON: ${e.message}`);
  }
  const files = ["shram.mjs", "tokenizer.mjs", "sampling.mjs", ...Object.values(manifest.files ?? {}), manifest.tokenizer?.file].filter(Boolean);
  for (const f of files) if (!existsSync(join(dir, f))) fail(`the site ${dir} is missing ${f} (named by shram.json)`);
  return manifest;
}

const VALUED = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--threads"];
// `--temperature -1` as `--temperature=-1`: parseArgs would take -1 for an option of its own,
// and the value is then checked (and refused) by name below
const argv = process.argv.slice(2).flatMap((a, i, all) =>
  (VALUED.includes(all[i - 1]) && !all[i - 1].includes("=") && a.startsWith("-") ? [] :
    VALUED.includes(a) && all[i + 1]?.startsWith("-") ? [`${a}=${all[i + 1]}`] : [a]));
let parsed;
try {
  parsed = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      "max-new-tokens": { type: "string", default: "64" }, temperature: { type: "string", default: "0" },
      "top-k": { type: "string", default: "0" }, "top-p": { type: "string", default: "1" },
      seed: { type: "string" }, threads: { type: "string" }, help: { type: "boolean", short: "h" },
    },
  });
} catch (e) {
  fail(`${e.message.split("\n")[0].replace(/\. To specify .*/, "")} (${USAGE})`);
}
const { values: o, positionals } = parsed;
if (o.help) {
  process.stdout.write(USAGE + "\n");
  process.exit(0);
}
if (positionals.length !== 2) fail(`expected SITE_DIR and a prompt, got ${positionals.length} argument(s) (${USAGE})`);
const [site, prompt] = positionals;
const options = {
  maxNewTokens: number("max-new-tokens", o["max-new-tokens"], (v) => Number.isInteger(v) && v >= 1, "a positive integer"),
  temperature: number("temperature", o.temperature, (v) => Number.isFinite(v) && v >= 0, "a finite number >= 0"),
  topK: number("top-k", o["top-k"], (v) => Number.isInteger(v) && v >= 0, "an integer >= 0"),
  topP: number("top-p", o["top-p"], (v) => v > 0 && v <= 1, "a number in (0, 1]"),
};
if (o.seed !== undefined) options.seed = number("seed", o.seed, Number.isSafeInteger, "an integer");
const threads = o.threads === undefined ? undefined
  : number("threads", o.threads, (v) => Number.isInteger(v) && v >= 1, "a positive integer");
if (prompt.length === 0) fail("the prompt is empty: give some text to continue");
const dir = resolve(site);
const manifest = checkSite(dir);

let model, ort;
try {
  ort = await import("onnxruntime-node");
  const { ShramModel } = await import(pathToFileURL(join(dir, "shram.mjs")).href);
  model = await ShramModel.load(ort, dir, { threads });
  const n = model.tokenizer.encode(prompt).length;  // a prompt the tokenizer refuses fails before it is echoed
  if (n + options.maxNewTokens - 1 > model.capacity) {
    fail(`the prompt (${n} tokens with BOS) plus --max-new-tokens ${options.maxNewTokens} - 1 exceeds the model's ` +
      `capacity of ${model.capacity} tokens`);
  }
} catch (e) {
  fail(`cannot load ${dir} (${manifest.model?.layers ?? "?"} layers): ${e.message}`, 1);
}
let r;
try {
  process.stdout.write(prompt);
  r = await model.generate(prompt, { ...options, onToken: ({ text }) => process.stdout.write(text) });
} catch (e) {
  process.stdout.write("\n");
  fail(e.message, 1);
}
process.stdout.write("\n");
console.error(`${r.ids.length} tokens, time to first token ${r.ttftMs.toFixed(0)} ms, ` +
  `${r.decodeTokensPerSecond.toFixed(1)} tokens/s (onnxruntime-node ${ort.env.versions.node})`);
