// Drives an exported site in headless Chromium (Playwright on the system's browser) and prints
// JSON. Used by the tests and benchmarks/web_speed.py.
//
//   node web/browser.mjs URL JOBS.json [--screenshot PNG] [--ui UI.json] [--webgpu]
//     JOBS: [{prompt, options, url?}] run through window.shram.generate -> results (or {error});
//       a job with a url runs in that page (opened once) instead of URL's
//     UI: {prompt, maxNewTokens, temperature, topK, topP, seed}: typed into the page's form,
//         Generate clicked, the streamed text read back (and shot into PNG)
//   node web/browser.mjs --stdin
//     each stdin line {url, prompt, options} runs in that URL's page (opened once, then kept);
//     each result is one stdout line (benchmarks/web_speed.py interleaves runs this way)
//
// CHROMIUM (default /usr/bin/chromium) names the browser binary.
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { chromium } from "playwright-core";

const { values: o, positionals: [url, jobsPath] } = parseArgs({
  allowPositionals: true,
  options: { screenshot: { type: "string" }, ui: { type: "string" }, stdin: { type: "boolean" },
             webgpu: { type: "boolean" } },
});
const jobs = jobsPath ? JSON.parse(readFileSync(jobsPath, "utf8")) : [];
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  // no sandbox (containers run as root), no GPU (or, with --webgpu, WebGPU on SwiftShader, the
  // CPU's Vulkan), and nothing reaching outside 127.0.0.1
  args: ["--no-sandbox", "--disable-dev-shm-usage", "--disable-background-networking",
    "--disable-component-update", "--disable-default-apps", "--disable-extensions", "--disable-sync",
    "--no-first-run", "--metrics-recording-only", "--disable-breakpad",
    ...(o.webgpu ? ["--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader"] : ["--disable-gpu"])],
});
async function runJob(page, { prompt, options }) {
  return page.evaluate(async ({ prompt, options }) => {
    try {
      let streamed = "";
      const r = await window.shram.generate(prompt, { ...options, onToken: ({ text }) => { streamed += text; } });
      return { ...r, streamed };
    } catch (e) {
      return { error: String(e?.message ?? e) };
    }
  }, { prompt, options });
}

async function openPage(url, logs) {
  const page = await browser.newPage({ viewport: { width: 1000, height: 760 } });
  page.on("console", (m) => logs.push(`${m.type()}: ${m.text()}`));
  page.on("pageerror", (e) => logs.push(`pageerror: ${e.message}`));
  await page.goto(url);
  // a first visit reloads once (coi-serviceworker making the page cross-origin isolated)
  let info;
  for (let tries = 0; ; tries++) {
    try {
      info = await readyInfo(page);
      break;
    } catch (e) {
      if (tries >= 2 || !/context was destroyed|navigat/i.test(String(e?.message))) throw e;
      await page.waitForLoadState("load");
    }
  }
  return { page, info: { ...info, browser: browser.version() } };
}

async function readyInfo(page) {
  await page.waitForFunction(() => window.shram, null, { timeout: 120000 });  // the page's module has run
  return page.evaluate(async () => {
    const m = await window.shram.ready;
    return { crossOriginIsolated: globalThis.crossOriginIsolated, userAgent: navigator.userAgent,
             threads: m.threads, manifest: m.manifest, executionProvider: m.executionProvider, loadMs: m.loadMs,
             warmUp: m.warmUpResult, about: document.getElementById("about").textContent,
             load: document.getElementById("load").innerText };
  });
}

if (o.stdin) {
  const { createInterface } = await import("node:readline");
  const pages = new Map();
  try {
    for await (const line of createInterface({ input: process.stdin })) {
      if (!line.trim()) continue;
      const job = JSON.parse(line);
      const logs = [];
      if (!pages.has(job.url)) pages.set(job.url, await openPage(job.url, logs));
      const { page, info } = pages.get(job.url);
      process.stdout.write(JSON.stringify({ ...(await runJob(page, job)), info, logs }) + "\n");
    }
  } finally {
    await browser.close();
  }
  process.exit(0);
}

const result = { jobs: [], logs: [] };
try {
  const opened = await openPage(url, result.logs);
  const page = opened.page;
  result.info = opened.info;
  const others = new Map();
  for (const job of jobs) {
    if (job.url && !others.has(job.url)) others.set(job.url, await openPage(job.url, result.logs));
    const o = job.url ? others.get(job.url) : opened;
    result.jobs.push({ ...(await runJob(o.page, job)), info: job.url ? o.info : undefined });
  }
  if (o.ui) {
    const ui = JSON.parse(readFileSync(o.ui, "utf8"));
    await page.fill("#prompt", ui.prompt);
    for (const k of ["maxNewTokens", "temperature", "topK", "topP", "seed"]) {
      if (ui[k] !== undefined) await page.fill(`#${k}`, String(ui[k]));
    }
    await page.click("#go");
    await page.waitForSelector("body[data-state=done]", { timeout: 120000 });
    result.ui = { out: await page.textContent("#out"), stats: await page.textContent("#stats"),
                  error: await page.textContent("#error") };
    if (o.screenshot) await page.screenshot({ path: o.screenshot, fullPage: true });
  }
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(result));
