// Load UI-format workflow files into a running ComfyUI frontend (headless
// Chromium) and report what the real frontend makes of them.
//
//   node check_workflows.mjs --url http://127.0.0.1:PORT --out result.json wf1.json ...
//
// Findings (missing node types, broken links, dialogs, console errors) go into
// the report; the exit code is non-zero only when the check itself could not run.

import { readFile, writeFile } from 'node:fs/promises';
import { basename } from 'node:path';
import { chromium } from 'playwright-core';

const CHROMIUM = process.env.CHROMIUM_PATH || '/usr/bin/chromium';
const PAGE_LOAD_TIMEOUT_MS = 60_000;
const APP_READY_TIMEOUT_MS = 120_000;
const WORKFLOW_TIMEOUT_MS = 60_000;
// Dialogs and toasts appear asynchronously after loadGraphData resolves.
const SETTLE_MS = 1_500;
const OVERALL_TIMEOUT_MS = Number(process.env.CHECK_WORKFLOWS_TIMEOUT_MS || 540_000);

// PrimeVue dialogs/toasts (current frontend) and the legacy ComfyDialog.
const DIALOG_SELECTOR = [
  '.p-dialog',
  '.p-toast-message',
  '.comfy-modal',
].join(', ');

// With --disable-api-nodes the server's CSP blocks the frontend's calls to
// api.comfy.org; those errors are the intended behaviour, not findings.
const NOISE_PATTERNS = [/violates the following Content Security Policy directive/];

function isNoise(text) {
  return NOISE_PATTERNS.some((re) => re.test(text));
}

function parseArgs(argv) {
  const args = { url: null, out: null, files: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--url') args.url = argv[++i];
    else if (a === '--out') args.out = argv[++i];
    else if (a.startsWith('--')) throw new Error(`unknown option ${a}`);
    else args.files.push(a);
  }
  if (!args.url || !args.out || args.files.length === 0) {
    throw new Error('usage: check_workflows.mjs --url URL --out OUT.json WORKFLOW.json...');
  }
  args.url = args.url.replace(/\/+$/, '');
  return args;
}

async function postSetting(baseUrl, id, value) {
  const res = await fetch(`${baseUrl}/api/settings/${encodeURIComponent(id)}`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify(value),
    signal: AbortSignal.timeout(15_000),
  });
  if (!res.ok) throw new Error(`POST settings ${id} -> HTTP ${res.status}`);
}

// Link checks on the file as written, before the frontend has a chance to
// repair anything (Comfy.Validation.Workflows silently fixes some links).
function rawBrokenLinks(wf) {
  const problems = [];
  const nodes = new Map((wf.nodes || []).map((n) => [n.id, n]));
  for (const link of wf.links || []) {
    const [id, originId, originSlot, targetId, targetSlot] = Array.isArray(link)
      ? link
      : [link.id, link.origin_id, link.origin_slot, link.target_id, link.target_slot];
    const origin = nodes.get(originId);
    const target = nodes.get(targetId);
    const report = (reason) => problems.push({ link_id: id, reason });
    if (!origin) { report(`origin node ${originId} missing`); continue; }
    if (!target) { report(`target node ${targetId} missing`); continue; }
    const out = (origin.outputs || [])[originSlot];
    const inp = (target.inputs || [])[targetSlot];
    if (!out) report(`origin ${originId} has no output slot ${originSlot}`);
    else if (!(out.links || []).includes(id)) report(`origin ${originId} output ${originSlot} does not list link`);
    if (!inp) report(`target ${targetId} has no input slot ${targetSlot}`);
    else if (inp.link !== id) report(`target ${targetId} input ${targetSlot} points at link ${inp.link}`);
  }
  return problems;
}

// Runs inside the page after loadGraphData.
function inspectGraph() {
  const app = window.app;
  const LG = window.LiteGraph;
  const g = app.graph;
  const registered = LG.registered_node_types || {};
  const nodes = g._nodes || g.nodes || [];
  const missing = [...new Set(nodes.map((n) => n.type).filter((t) => !(t in registered)))];
  const linkList = g.links instanceof Map ? [...g.links.values()] : Object.values(g.links || {});
  const broken = [];
  for (const l of linkList) {
    if (!l) continue;
    const origin = g.getNodeById(l.origin_id);
    const target = g.getNodeById(l.target_id);
    const report = (reason) => broken.push({ link_id: l.id, reason });
    if (!origin) { report(`origin node ${l.origin_id} missing`); continue; }
    if (!target) { report(`target node ${l.target_id} missing`); continue; }
    if (!origin.outputs || l.origin_slot < 0 || l.origin_slot >= origin.outputs.length) {
      report(`origin ${l.origin_id} has no output slot ${l.origin_slot}`);
    }
    if (!target.inputs || l.target_slot < 0 || l.target_slot >= target.inputs.length) {
      report(`target ${l.target_id} has no input slot ${l.target_slot}`);
    } else if (target.inputs[l.target_slot].link !== l.id) {
      report(`target ${l.target_id} input ${l.target_slot} points at link ${target.inputs[l.target_slot].link}`);
    }
  }
  return {
    node_count: nodes.length,
    node_types: nodes.map((n) => n.type),
    missing_types: missing,
    broken_links: broken,
  };
}

function collectDialogs(selector) {
  const visible = (el) => {
    const s = window.getComputedStyle(el);
    return s.display !== 'none' && s.visibility !== 'hidden' && el.getClientRects().length > 0;
  };
  return [...document.querySelectorAll(selector)]
    .filter(visible)
    .map((el) => el.innerText.trim().replace(/\s+\n/g, '\n'))
    .filter((t) => t.length > 0);
}

function dismissDialogs(selector) {
  // Removing the nodes is more reliable than clicking each variant's close
  // button; the frontend recreates dialogs on demand.
  for (const el of document.querySelectorAll(selector)) {
    const mask = el.closest('.p-dialog-mask');
    (mask || el).remove();
  }
}

async function checkWorkflow(page, file, consoleSink) {
  const text = await readFile(file, 'utf8');
  const wf = JSON.parse(text);
  const result = {
    file,
    name: basename(file),
    missing_types: [],
    broken_links: [],
    raw_broken_links: rawBrokenLinks(wf),
    dialogs: [],
    load_error: null,
    console_errors: [],
    api_prompt: null,
  };
  await page.evaluate(dismissDialogs, DIALOG_SELECTOR);
  consoleSink.length = 0;
  try {
    await page.evaluate(
      async ({ wf, name }) => {
        // clean=true replaces the current graph instead of opening a new tab state.
        await window.app.loadGraphData(wf, true, true, name);
      },
      { wf, name: basename(file) },
    );
  } catch (err) {
    result.load_error = String(err && err.message ? err.message : err);
  }
  await page.waitForTimeout(SETTLE_MS);
  const info = await page.evaluate(inspectGraph);
  Object.assign(result, info);
  result.dialogs = await page.evaluate(collectDialogs, DIALOG_SELECTOR);
  try {
    result.api_prompt = await page.evaluate(async () => {
      const p = await window.app.graphToPrompt();
      // Round-trip drops functions/undefined the same way the frontend's POST does.
      return JSON.parse(JSON.stringify(p.output));
    });
  } catch (err) {
    result.api_prompt = null;
    result.load_error = result.load_error || `graphToPrompt: ${err && err.message ? err.message : err}`;
  }
  result.console_errors = consoleSink.filter((t) => !isNoise(t));
  result.console_noise = consoleSink.filter(isNoise);
  return result;
}

function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} timed out after ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  // A fresh user would get the template browser instead of an empty canvas.
  await postSetting(args.url, 'Comfy.TutorialCompleted', true);

  const browser = await chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    args: [
      '--headless',
      '--no-sandbox',
      '--disable-gpu',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-quic',
      '--no-first-run',
      '--disable-sync',
    ],
  });
  const report = { url: args.url, startup_console_errors: [], startup_dialogs: [], results: [] };
  try {
    const context = await browser.newContext({ viewport: { width: 1600, height: 1000 } });
    // The page may only talk to the local server; anything else is blocked so
    // a stray CDN or telemetry request cannot hang or leak.
    const origin = new URL(args.url).origin;
    await context.route('**/*', (route) => {
      const u = route.request().url();
      if (u.startsWith(origin) || u.startsWith('data:') || u.startsWith('blob:')) return route.continue();
      return route.abort();
    });
    const page = await context.newPage();
    const consoleSink = [];
    page.on('console', (msg) => {
      if (msg.type() !== 'error') return;
      let text = msg.text();
      // "Failed to load resource" does not name the resource; the location does.
      const where = msg.location() && msg.location().url;
      if (where && !text.includes(where)) text = `${text} [${where}]`;
      consoleSink.push(text);
    });
    page.on('pageerror', (err) => consoleSink.push(`pageerror: ${err.message}`));

    await page.goto(args.url, { waitUntil: 'domcontentloaded', timeout: PAGE_LOAD_TIMEOUT_MS });
    await page.waitForFunction(
      () => window.app && window.app.graph && window.LiteGraph && window.app.canvas,
      null,
      { timeout: APP_READY_TIMEOUT_MS, polling: 250 },
    );
    await page.waitForTimeout(SETTLE_MS);
    report.startup_console_errors = consoleSink.filter((t) => !isNoise(t));
    report.startup_dialogs = await page.evaluate(collectDialogs, DIALOG_SELECTOR);

    for (const file of args.files) {
      const res = await withTimeout(checkWorkflow(page, file, consoleSink), WORKFLOW_TIMEOUT_MS, file);
      report.results.push(res);
      console.log(
        `${res.name}: ${res.node_count} nodes, missing=${res.missing_types.length}, ` +
          `broken=${res.broken_links.length}, dialogs=${res.dialogs.length}, ` +
          `console_errors=${res.console_errors.length}`,
      );
    }
  } finally {
    await browser.close();
  }
  await writeFile(args.out, JSON.stringify(report, null, 2));
}

const watchdog = setTimeout(() => {
  console.error(`check_workflows: overall timeout ${OVERALL_TIMEOUT_MS} ms`);
  process.exit(3);
}, OVERALL_TIMEOUT_MS);
watchdog.unref();

main().then(
  () => process.exit(0),
  (err) => {
    console.error(err && err.stack ? err.stack : String(err));
    process.exit(2);
  },
);
