// Load UI-format workflow files into a running ComfyUI frontend (headless
// Chromium) and report what the real frontend makes of them.
//
//   node check_workflows.mjs --url http://127.0.0.1:PORT --out result.json
//        [--screenshots DIR] [--thumbnails DIR] wf1.json ...
//
// Findings (missing node types, broken links, combo values the server does not
// offer, nodes hidden under the editor's own panels at the saved view, dialogs,
// console errors) go into the report; the exit code is non-zero only when the
// check itself could not run.
//
// --screenshots DIR (or $CHECK_WORKFLOWS_SCREENSHOTS): DIR/<workflow>.png, the
//   window as the workflow opens (its saved view).
// --thumbnails DIR (or $CHECK_WORKFLOWS_THUMBNAILS): DIR/<workflow>.png, the
//   whole graph fitted to the window with the editor's panels hidden.

import { mkdir, readFile, writeFile } from 'node:fs/promises';
import { basename, join } from 'node:path';
import { chromium } from 'playwright-core';

const CHROMIUM = process.env.CHROMIUM_PATH || '/usr/bin/chromium';
const PAGE_LOAD_TIMEOUT_MS = 60_000;
const APP_READY_TIMEOUT_MS = 120_000;
const WORKFLOW_TIMEOUT_MS = 60_000;
// Dialogs and toasts appear asynchronously after loadGraphData resolves.
const SETTLE_MS = 1_500;
const OVERALL_TIMEOUT_MS = Number(process.env.CHECK_WORKFLOWS_TIMEOUT_MS || 540_000);
// The workflows are shared out over this many pages, each opening them one after another, so their settle
// waits overlap (most of a workflow's check is SETTLE_MS of waiting); each extra page costs one app start.
const PAGES = Number(process.env.CHECK_WORKFLOWS_PAGES || 3);

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
  const args = {
    url: null,
    out: null,
    screenshots: process.env.CHECK_WORKFLOWS_SCREENSHOTS || null,
    thumbnails: process.env.CHECK_WORKFLOWS_THUMBNAILS || null,
    files: [],
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--url') args.url = argv[++i];
    else if (a === '--out') args.out = argv[++i];
    else if (a === '--screenshots') args.screenshots = argv[++i];
    else if (a === '--thumbnails') args.thumbnails = argv[++i];
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
  // Combo widgets whose value is not among the options the server offers
  // (LoadImage / LoadVideo list ComfyUI's input folder, the model loader its
  // models folder): the prompt would be refused with "Invalid image file" etc.
  const invalidCombos = [];
  const combosChecked = [];
  for (const n of nodes) {
    for (const w of n.widgets || []) {
      if (w.type !== 'combo') continue;
      let values = w.options && w.options.values;
      if (typeof values === 'function') {
        try { values = values(w, n); } catch { values = null; }
      }
      if (!Array.isArray(values)) continue;
      combosChecked.push([n.type, w.name]);
      if (!values.includes(w.value)) {
        invalidCombos.push({ node: n.id, type: n.type, widget: w.name, value: w.value, options: values.slice(0, 20) });
      }
    }
  }
  // Notes whose text does not fit their box (the reader would have to scroll).
  const clippedNotes = [];
  for (const n of nodes) {
    if (!/Note$/.test(n.type)) continue;
    for (const w of n.widgets || []) {
      const el = w.element;
      if (!el) continue;
      const inner = el.querySelector('.ProseMirror, textarea') || el;
      if (inner.scrollHeight > inner.clientHeight + 2) {
        clippedNotes.push({ node: n.id, scrollHeight: inner.scrollHeight, clientHeight: inner.clientHeight });
      }
    }
  }
  return {
    node_count: nodes.length,
    node_types: nodes.map((n) => n.type),
    clipped_notes: clippedNotes,
    missing_types: missing,
    broken_links: broken,
    invalid_combos: invalidCombos,
    combos_checked: combosChecked,
    groups: (g._groups || g.groups || []).map((gr) => gr.title),
    // As the frontend sized them (it grows nodes to fit their widgets), title bars included.
    node_boxes: nodes.map((n) => ({
      id: n.id,
      type: n.type,
      box: [n.pos[0], n.pos[1] - LG.NODE_TITLE_HEIGHT, n.size[0], n.size[1] + LG.NODE_TITLE_HEIGHT],
    })),
    group_boxes: (g._groups || g.groups || []).map((gr) => ({ title: gr.title, box: [...(gr._bounding || gr.bounding)] })),
  };
}

// Runs inside the page at the saved view: which nodes and groups are off the
// window or under the editor's own panels (tab bar, sidebar, Run bar, minimap,
// zoom controls). Samples points along each title bar and the bottom edge and
// asks which element is on top there: it must be the graph canvas (or one of
// the node's own DOM widgets, such as a prompt text box).
function hiddenAtSavedView() {
  const app = window.app;
  const canvasEl = app.canvas.canvas;
  const rect = canvasEl.getBoundingClientRect();
  const { scale, offset } = app.canvas.ds;
  const titleHeight = window.LiteGraph.NODE_TITLE_HEIGHT;
  const toScreen = (x, y) => [rect.left + (x + offset[0]) * scale, rect.top + (y + offset[1]) * scale];
  const isOwnWidget = (el) => !!el.closest('.dom-widget, [class*="dom-widget"], .comfy-multiline-input, textarea, video, img');
  const describe = (el) => {
    if (!el) return 'off the window';
    const cls = typeof el.className === 'string' ? el.className : '';
    return `${el.tagName.toLowerCase()}${el.id ? '#' + el.id : ''}${cls ? '.' + cls.trim().split(/\s+/).slice(0, 3).join('.') : ''}`;
  };
  const check = (what, x, y, w, h) => {
    const problems = [];
    const ys = [y + Math.min(12, h / 2), y + h - 4];
    for (const py of ys) {
      for (const fx of [0.02, 0.5, 0.98]) {
        const [sx, sy] = toScreen(x + w * fx, py);
        const el = document.elementFromPoint(sx, sy);
        if (el === canvasEl || (el && isOwnWidget(el))) continue;
        problems.push(`${what} at (${Math.round(sx)}, ${Math.round(sy)}): ${describe(el)}`);
      }
    }
    return problems;
  };
  const hidden = [];
  const g = app.graph;
  for (const n of g._nodes || g.nodes || []) {
    hidden.push(...check(`node ${n.id} ${n.title}`, n.pos[0], n.pos[1] - titleHeight, n.size[0], n.size[1] + titleHeight));
  }
  for (const gr of g._groups || g.groups || []) {
    const [x, y, w, h] = gr._bounding || gr.bounding;
    hidden.push(...check(`group ${gr.title}`, x, y, w, h));
  }
  return { hidden, view: { scale, offset: [offset[0], offset[1]] }, window: [window.innerWidth, window.innerHeight] };
}

// Thumbnail view: only the graph canvas and the nodes' own DOM widgets (prompt
// text boxes, note text, video previews) stay visible; the whole graph is
// fitted to the window.
const THUMBNAIL_CSS = `
  body * { visibility: hidden !important; }
  canvas#graph-canvas, .dom-widget, .dom-widget * { visibility: visible !important; }
`;

function fitGraph(margin) {
  const app = window.app;
  const g = app.graph;
  const titleHeight = window.LiteGraph.NODE_TITLE_HEIGHT;
  let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
  const add = (x, y, w, h) => { x0 = Math.min(x0, x); y0 = Math.min(y0, y); x1 = Math.max(x1, x + w); y1 = Math.max(y1, y + h); };
  for (const n of g._nodes || g.nodes || []) add(n.pos[0], n.pos[1] - titleHeight, n.size[0], n.size[1] + titleHeight);
  for (const gr of g._groups || g.groups || []) add(...(gr._bounding || gr.bounding));
  const rect = app.canvas.canvas.getBoundingClientRect();
  const scale = Math.min((rect.width - 2 * margin) / (x1 - x0), (rect.height - 2 * margin) / (y1 - y0));
  app.canvas.ds.scale = scale;
  app.canvas.ds.offset[0] = (rect.width - (x1 - x0) * scale) / 2 / scale - x0;
  app.canvas.ds.offset[1] = (rect.height - (y1 - y0) * scale) / 2 / scale - y0;
  app.canvas.show_info = false;
  app.canvas.setDirty(true, true);
  return scale;
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

function imageName(file) {
  return basename(file).replace(/\.json$/i, '') + '.png';
}

async function checkWorkflow(page, file, consoleSink, args) {
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
    invalid_combos: [],
    combos_checked: [],
    clipped_notes: [],
    hidden: [],
    view: null,
    screenshot: null,
    thumbnail: null,
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
  Object.assign(result, await page.evaluate(hiddenAtSavedView));
  if (args.screenshots) {
    result.screenshot = join(args.screenshots, imageName(file));
    await page.screenshot({ path: result.screenshot });
  }
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
  if (args.thumbnails) {
    const style = await page.addStyleTag({ content: THUMBNAIL_CSS });
    await page.evaluate(fitGraph, 16);
    await page.waitForTimeout(SETTLE_MS);
    result.thumbnail = join(args.thumbnails, imageName(file));
    await page.screenshot({ path: result.thumbnail });
    await style.evaluate((el) => el.remove());
    await page.evaluate(() => { window.app.canvas.show_info = true; });
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
  for (const dir of [args.screenshots, args.thumbnails]) {
    if (dir) await mkdir(dir, { recursive: true });
  }
  const report = { url: args.url, startup_console_errors: [], startup_dialogs: [], results: [] };
  try {
    // Each page in its own context: no storage shared, so no page restores another's workflow.
    const openPage = async () => {
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
      report.startup_console_errors.push(...consoleSink.filter((t) => !isNoise(t)));
      report.startup_dialogs.push(...(await page.evaluate(collectDialogs, DIALOG_SELECTOR)));
      return { page, consoleSink };
    };

    const results = new Array(args.files.length);
    const pages = Math.max(1, Math.min(PAGES, args.files.length));
    await Promise.all(
      Array.from({ length: pages }, async (_, first) => {
        const { page, consoleSink } = await openPage();
        for (let i = first; i < args.files.length; i += pages) {
          const file = args.files[i];
          const res = await withTimeout(checkWorkflow(page, file, consoleSink, args), WORKFLOW_TIMEOUT_MS, file);
          results[i] = res;
          console.log(
            `${res.name}: ${res.node_count} nodes, missing=${res.missing_types.length}, ` +
              `broken=${res.broken_links.length}, invalid_combos=${res.invalid_combos.length}, ` +
              `hidden=${res.hidden.length}, dialogs=${res.dialogs.length}, ` +
              `console_errors=${res.console_errors.length}`,
          );
        }
      }),
    );
    report.results = results;
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
