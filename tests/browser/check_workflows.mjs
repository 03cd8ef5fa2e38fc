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
// (Each option also reads $CHECK_WORKFLOWS_MISSING_MODELS=1, $CHECK_WORKFLOWS_TEMPLATE_BROWSER, $CHECK_WORKFLOWS_RUN.)
// --missing-models: also open the frontend's list of missing models (1.49:
//   the error overlay's details; 1.32: the Missing Models dialog) and report it.
// --template-browser MODULE: also open the template browser at this pack's
//   category and report the card titles it shows, in order, and which are cut off.
// --run JSON: queue each workflow once with these widget values set first
//   ({"NodeType": {"widget": value}}, e.g. the tiny model's) and report the
//   node boxes, overlaps and links after the run (live preview, saved video).
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
// How far a reroute's control points reach at most (measured in frontend 1.49: Reroute.controlPoint).
const REROUTE_MAX_OFFSET = Number(process.env.CHECK_WORKFLOWS_REROUTE_OFFSET || 20);

// PrimeVue dialogs/toasts (current frontend) and the legacy ComfyDialog.
const DIALOG_SELECTOR = [
  '.p-dialog',
  '.p-toast-message',
  '.comfy-modal',
  // 1.49's "N errors found" overlay (missing models, node errors).
  '[data-testid="error-overlay"]',
].join(', ');
const RUN_TIMEOUT_MS = 240_000;

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
    missingModels: process.env.CHECK_WORKFLOWS_MISSING_MODELS === '1',
    templateBrowser: process.env.CHECK_WORKFLOWS_TEMPLATE_BROWSER || null,
    run: process.env.CHECK_WORKFLOWS_RUN ? JSON.parse(process.env.CHECK_WORKFLOWS_RUN) : null,
    files: [],
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--url') args.url = argv[++i];
    else if (a === '--out') args.out = argv[++i];
    else if (a === '--screenshots') args.screenshots = argv[++i];
    else if (a === '--thumbnails') args.thumbnails = argv[++i];
    else if (a === '--missing-models') args.missingModels = true;
    else if (a === '--template-browser') args.templateBrowser = argv[++i];
    else if (a === '--run') args.run = JSON.parse(argv[++i]);
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
  // Nodes the frontend draws with a red error outline (missing model, failed validation).
  const redNodes = nodes.filter((n) => n.has_errors).map((n) => `${n.id} ${n.title}`);
  return {
    red_nodes: redNodes,
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

// Runs inside the page: links that run under a node or across a group's title bar. Each link is sampled along
// the curve the frontend draws (an output leaves to the right, an input is entered from the left, control points
// a quarter of the endpoints' distance out; through reroutes, each reroute's tangent bisects its neighbours'
// directions, its control points at most REROUTE_MAX_OFFSET out: scripts/workflow_layout.py), and the samples are
// checked against the paths the frontend really drew (LLink.path / Reroute.path, Path2D), so a frontend that draws
// otherwise makes the check fail instead of passing unseen.
function linkProblems(REROUTE_MAX_OFFSET) {
  const app = window.app;
  const g = app.graph;
  const LG = window.LiteGraph;
  app.canvas.setDirty(true, true);
  app.canvas.draw(true, true);
  const TH = LG.NODE_TITLE_HEIGHT;
  const nodes = (g._nodes || g.nodes || []).map((n) => ({
    id: n.id,
    name: `node ${n.id} ${n.title}`,
    box: [n.pos[0], n.pos[1] - TH, n.size[0], n.size[1] + TH],
  }));
  const titles = (g._groups || g.groups || []).map((gr) => {
    const [x, y, w] = gr._bounding || gr.bounding;
    return { name: `group title ${gr.title}`, box: [x, y, w, gr.titleHeight ?? (gr.font_size || 24) * 1.4] };
  });
  const inside = (p, [x, y, w, h]) => p[0] > x && p[0] < x + w && p[1] > y && p[1] < y + h;
  const bezier = (p0, c0, c1, p1, out) => {
    for (let i = 0; i <= 48; i++) {
      const t = i / 48, u = 1 - t;
      const a = u * u * u, b = 3 * u * u * t, c = 3 * u * t * t, d = t * t * t;
      out.push([a * p0[0] + b * c0[0] + c * c1[0] + d * p1[0], a * p0[1] + b * c0[1] + c * c1[1] + d * p1[1]]);
    }
  };
  const curve = (chain) => {
    const tangents = [];
    for (let i = 1; i < chain.length - 1; i++) {
      const [p, h, f] = [chain[i - 1], chain[i], chain[i + 1]];
      const entering = Math.atan2(h[1] - p[1], h[0] - p[0]);
      const leaving = Math.atan2(f[1] - h[1], f[0] - h[0]);
      let half = (entering - leaving) * 0.5;
      if (Math.abs(half) > Math.PI * 0.5) half += Math.PI;
      const angle = entering - half;
      tangents.push([Math.cos(angle), Math.sin(angle)]);
    }
    const pts = [];
    for (let i = 0; i < chain.length - 1; i++) {
      const [a, b] = [chain[i], chain[i + 1]];
      const span = Math.hypot(b[0] - a[0], b[1] - a[1]);
      const reach = Math.min(REROUTE_MAX_OFFSET, span * 0.25);
      const c0 = i === 0 ? [a[0] + span * 0.25, a[1]] : [a[0] + reach * tangents[i - 1][0], a[1] + reach * tangents[i - 1][1]];
      const c1 = i === chain.length - 2 ? [b[0] - span * 0.25, b[1]] : [b[0] - reach * tangents[i][0], b[1] - reach * tangents[i][1]];
      bezier(a, c0, c1, b, pts);
    }
    return pts;
  };
  const ctx = document.createElement('canvas').getContext('2d');
  ctx.lineWidth = 6;
  const problems = [];
  const unverified = [];
  let checked = 0;
  const linkList = g.links instanceof Map ? [...g.links.values()] : Object.values(g.links || {});
  for (const l of linkList) {
    if (!l) continue;
    const origin = g.getNodeById(l.origin_id);
    const target = g.getNodeById(l.target_id);
    if (!origin || !target) continue;
    const chain = [];
    const reroutes = [];
    for (let id = l.parentId; id != null; ) {
      const r = g.reroutes?.get ? g.reroutes.get(id) : undefined;
      if (!r) break;
      reroutes.unshift(r);
      id = r.parentId;
    }
    const start = origin.getConnectionPos(false, l.origin_slot);
    const end = target.getConnectionPos(true, l.target_slot);
    chain.push([start[0], start[1]], ...reroutes.map((r) => [r.pos[0], r.pos[1]]), [end[0], end[1]]);
    const pts = curve(chain);
    const paths = [...reroutes.map((r) => r.path), l.path].filter(Boolean);
    const what = `link ${l.id} (${origin.id} ${origin.title} -> ${target.id} ${target.title})`;
    if (paths.length !== reroutes.length + 1) {
      unverified.push(`${what}: the frontend kept no drawn path`);
    } else {
      // A stroke's butt ends leave out the points right at a piece's ends: those are not compared.
      const pieceEnds = chain;
      const off = pts.filter(
        (p) =>
          !pieceEnds.some((q) => Math.hypot(p[0] - q[0], p[1] - q[1]) < 4) &&
          !paths.some((path) => ctx.isPointInStroke(path, p[0], p[1])),
      );
      if (off.length > pts.length * 0.02) {
        unverified.push(`${what}: ${off.length} of ${pts.length} samples are off the drawn path, e.g. ${off[0].map(Math.round)}`);
      }
    }
    checked++;
    const ends = nodes.filter((n) => n.id === origin.id || n.id === target.id).map((n) => n.box);
    const near = (p) => Math.hypot(p[0] - start[0], p[1] - start[1]) < 16 || Math.hypot(p[0] - end[0], p[1] - end[1]) < 16;
    const hit = new Set();
    for (const p of pts) {
      if (near(p)) continue;
      for (const n of nodes) if (n.id !== origin.id && n.id !== target.id && inside(p, n.box)) hit.add(n.name);
      for (const t of titles) if (inside(p, t.box)) hit.add(t.name);
      if (ends.some((box) => inside(p, box))) hit.add('its own nodes');
    }
    if (hit.size) problems.push(`${what} crosses ${[...hit].join(', ')}`);
  }
  return { link_problems: problems, link_unverified: unverified, links_checked: checked };
}


// Runs inside the page: set every primitive node (the workflow's width, height and length) to a new value and
// report, from the frontend's own graphToPrompt, which inputs it feeds and whether each now carries that value.
async function sizeFollows() {
  const app = window.app;
  const g = app.graph;
  const newValues = { INT: (v) => (v >= 81 ? v - 32 : v + 16) };
  const primitives = (g._nodes || g.nodes || []).filter((n) => n.type === 'PrimitiveNode');
  const linkOf = (id) => (g.links instanceof Map ? g.links.get(id) : g.links[id]);
  const report = [];
  for (const p of primitives) {
    const widget = p.widgets?.[0];
    if (!widget) {
      report.push({ primitive: p.title, error: 'no widget' });
      continue;
    }
    const value = newValues.INT(widget.value);
    widget.value = value;
    widget.callback?.(value);
    const targets = (p.outputs[0].links || []).map((id) => {
      const l = linkOf(id);
      const t = g.getNodeById(l.target_id);
      return { node: String(t.id), input: t.inputs[l.target_slot].name };
    });
    report.push({ primitive: p.title, value, targets });
  }
  const prompt = (await app.graphToPrompt()).output;
  for (const r of report) {
    r.mismatches = (r.targets || [])
      .filter((t) => prompt[t.node]?.inputs?.[t.input] !== r.value)
      .map((t) => `${t.node}.${t.input}=${prompt[t.node]?.inputs?.[t.input]}`);
  }
  return report;
}

// Runs inside the page: the frontend's list of missing models, as text lines (1.49: the error overlay's "View
// details" panel; 1.32: the Missing Models dialog).
async function missingModelsShown() {
  const button = [...document.querySelectorAll('button')].find((b) => /view details/i.test(b.textContent || ''));
  if (button) {
    button.click();
    await new Promise((r) => setTimeout(r, 1500));
  }
  const visible = (el) => el.getClientRects().length > 0;
  const holders = [...document.querySelectorAll('.comfy-missing-models, .p-dialog, aside, [class*="panel"]')].filter(
    (el) => visible(el) && /missing models/i.test(el.innerText || ''),
  );
  const text = holders.map((el) => el.innerText).join('\n');
  return text.split('\n').map((t) => t.trim()).filter(Boolean);
}

// Runs inside the page: open the template browser at `module`'s category; the card titles in order and the ones
// the card cuts off.
async function templateBrowser({ module, names }) {
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  await window.app.extensionManager.command.execute('Comfy.BrowseTemplates');
  await sleep(2500);
  const item = [...document.querySelectorAll('*')].find(
    (e) => e.children.length === 0 && (e.textContent || '').trim() === module && e.getClientRects().length,
  );
  if (!item) return { error: `no ${module} entry in the template browser` };
  item.click();
  await sleep(2500);
  const wanted = new Set(names);
  const seen = new Set();
  const titles = [];
  const cut = [];
  for (const el of document.querySelectorAll('*')) {
    const text = (el.textContent || '').trim();
    if (el.children.length !== 0 || !wanted.has(text) || seen.has(text) || !el.getClientRects().length) continue;
    seen.add(text);
    titles.push(text);
    if (el.scrollWidth > el.clientWidth + 1 || el.scrollHeight > el.clientHeight + 1) cut.push(text);
  }
  return { titles, cut };
}

// Runs inside the page: queue the loaded workflow with `values` set on the widgets first, and wait for the end.
async function runWorkflow({ values, timeout }) {
  const app = window.app;
  const g = app.graph;
  for (const n of g._nodes || g.nodes || []) {
    const set = values[n.type] || (n.type === 'PrimitiveNode' ? values[`PrimitiveNode:${n.title}`] : null);
    if (!set) continue;
    for (const w of n.widgets || []) {
      if (typeof set === 'object' && w.name in set) {
        w.value = set[w.name];
        w.callback?.(w.value);
      } else if (typeof set !== 'object' && w === n.widgets[0]) {
        w.value = set;
        w.callback?.(w.value);
      }
    }
  }
  const api = window.comfyAPI?.api?.api;
  const ended = new Promise((resolve) => {
    const timer = setTimeout(() => resolve('timeout'), timeout);
    const done = (what) => (event) => {
      clearTimeout(timer);
      resolve(what === 'error' ? `error: ${JSON.stringify(event.detail).slice(0, 500)}` : what);
    };
    api.addEventListener('execution_success', done('success'));
    api.addEventListener('execution_error', done('error'));
  });
  await app.queuePrompt(0, 1);
  const status = await ended;
  // The live preview stays on the sampler and the saved video shows in SaveVideo; let the frontend lay them out.
  await new Promise((r) => setTimeout(r, 2500));
  app.canvas.setDirty(true, true);
  app.canvas.draw(true, true);
  return status;
}

// Runs inside the page at the saved view: which nodes and group titles are off
// the window or under the editor's own panels (tab bar, sidebar, Run bar,
// minimap, zoom controls). Samples points along each title bar and a node's
// bottom edge and asks which element is on top there: it must be the graph
// canvas (or one of the node's own DOM widgets, such as a prompt text box).
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
  // A group's title bar; its empty bottom (room for a node's preview after a run) may lie under the minimap.
  for (const gr of g._groups || g.groups || []) {
    const [x, y, w] = gr._bounding || gr.bounding;
    hidden.push(...check(`group ${gr.title}`, x, y, w, gr.titleHeight ?? (gr.font_size || 24) * 1.4));
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
    link_problems: [],
    link_unverified: [],
    links_checked: 0,
    red_nodes: [],
    size_follows: null,
    missing_models: null,
    run: null,
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
  Object.assign(result, await page.evaluate(linkProblems, REROUTE_MAX_OFFSET));
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
  if (args.missingModels) {
    result.missing_models = await page.evaluate(missingModelsShown);
  }
  if (args.run) {
    await page.evaluate(dismissDialogs, DIALOG_SELECTOR);
    const status = await page.evaluate(runWorkflow, { values: args.run, timeout: RUN_TIMEOUT_MS });
    const after = await page.evaluate(inspectGraph);
    result.run = {
      status,
      node_boxes: after.node_boxes,
      group_boxes: after.group_boxes,
      red_nodes: after.red_nodes,
      ...(await page.evaluate(linkProblems, REROUTE_MAX_OFFSET)),
    };
    if (args.screenshots) {
      result.run.screenshot = join(args.screenshots, imageName(file).replace(/\.png$/, ' (after a run).png'));
      await page.screenshot({ path: result.run.screenshot });
    }
  } else {
    // After the rest: it changes the graph (every primitive gets a new value).
    result.size_follows = await page.evaluate(sizeFollows);
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
  // ComfyUI 0.33 takes a prompt's own live preview method from this setting (0.3.75 only its --preview-method).
  if (args.run) await postSetting(args.url, 'Comfy.Execution.PreviewMethod', 'latent2rgb');

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

    if (args.templateBrowser) {
      const { page } = await openPage();
      const names = args.files.map((f) => basename(f).replace(/\.json$/i, ''));
      report.template_browser = await withTimeout(
        page.evaluate(templateBrowser, { module: args.templateBrowser, names }),
        WORKFLOW_TIMEOUT_MS,
        'template browser',
      );
      if (args.screenshots) {
        report.template_browser.screenshot = join(args.screenshots, 'template browser.png');
        await page.screenshot({ path: report.template_browser.screenshot });
      }
      await page.context().close();
    }
    const results = new Array(args.files.length);
    // Runs one after another: a prompt queued by one page would show in the others' queue panel and slow them.
    const pages = args.run ? 1 : Math.max(1, Math.min(PAGES, args.files.length));
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
              `link_problems=${res.link_problems.length}, link_unverified=${res.link_unverified.length}, ` +
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
