// The playground: one image (uploaded, or a registered template), a painted mask, and
// a streamed edit of it through the daemon's own API (docs/api.md). Plain DOM code, no
// build step. A few values are kept on `window` (__lastMask, __previews, __result) so a
// browser test can check what the page sent and showed.
"use strict";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "denoised.token";

// What the edit will use: the uploaded image's base64 bytes, or a template.
const source = { image: null, template: null, width: 64, height: 64 };
window.__previews = [];

// ---- the API, with the bearer token the daemon may want ----

// Fetches `path`, sending the token kept in sessionStorage; on 401 asks for the token
// and tries again, so the page works on daemons with and without one.
async function api(path, opts = {}) {
  for (;;) {
    const headers = { ...(opts.headers || {}) };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = "Bearer " + token;
    const r = await fetch(path, { ...opts, headers });
    if (r.status !== 401) return r;
    sessionStorage.removeItem(TOKEN_KEY);
    await askToken();
  }
}

let tokenWaiters = [];
function askToken() {
  $("auth").hidden = false;
  $("token").focus();
  return new Promise((resolve) => tokenWaiters.push(resolve));
}

$("auth").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("auth").hidden = true;
  const waiters = tokenWaiters;
  tokenWaiters = [];
  waiters.forEach((w) => w());
});

async function json(path, opts) {
  const r = await api(path, opts);
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(errorText(body, r.status));
  return body;
}

function errorText(body, status) {
  const e = body && body.error;
  return e ? `${e.code}: ${e.message}` : `HTTP ${status}`;
}

// ---- the server panel (/readyz is open: no token) ----

async function showServer() {
  try {
    const r = await fetch("/readyz");
    const s = await r.json();
    const groups = Object.entries(s.workers || {})
      .map(([g, w]) => `${g.replace("denoised.", "")} ${w.live}/${w.want}`).join(", ");
    const devices = (s.processes || []).map((p) => `${p.name}: ${p.device}`).join(", ");
    const failed = Object.keys(s.failed || {}).length ? " — failed: " + Object.keys(s.failed).join(", ") : "";
    const q = s.queue ? ` · requests ${s.queue.in_flight}/${s.queue.limit}` : "";
    $("server").textContent = `${s.ready ? "ready" : "not ready"} · workers ${groups} · ${devices}${q}${failed}`;
  } catch (e) {
    $("server").textContent = "server unreachable";
  }
}

// ---- the image: an upload or a template ----

function readDataUrl(blob) {
  return new Promise((resolve, reject) => {
    const fr = new FileReader();
    fr.onload = () => resolve(fr.result);
    fr.onerror = () => reject(fr.error);
    fr.readAsDataURL(blob);
  });
}

function loadImage(url) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error("not an image the browser can read"));
    img.src = url;
  });
}

// The daemon reads PNG and JPEG: those go as they are (their exact pixels); any other
// format the browser reads is re-encoded as PNG.
async function onImageFile(file) {
  const url = await readDataUrl(file);
  const img = await loadImage(url);
  const canvas = sized(img.naturalWidth, img.naturalHeight);
  canvas.getContext("2d").drawImage(img, 0, 0);
  const keep = /^data:image\/(png|jpeg);base64,/.test(url);
  const png = keep ? url : canvas.toDataURL("image/png");
  setSource({ image: png.split(",")[1], template: null, width: img.naturalWidth, height: img.naturalHeight });
  $("image-canvas").getContext("2d").drawImage(img, 0, 0);
  $("before").src = png;
  $("template-select").value = ""; // the upload is the source now, not a template
  $("source-info").textContent = `${file.name}: ${img.naturalWidth}x${img.naturalHeight}`;
}

// A template's image is not retrievable over the API: show its size, blank. Its mask
// is of its image's size (`width` x `height` are the size it is computed at).
function onTemplate(t) {
  const [w, h] = [t.image_width || t.width, t.image_height || t.height];
  setSource({ image: null, template: t.id, width: w, height: h });
  const ctx = $("image-canvas").getContext("2d");
  ctx.fillStyle = "#bbb";
  ctx.fillRect(0, 0, w, h);
  $("before").src = $("image-canvas").toDataURL("image/png");
  $("source-info").textContent = `template ${t.id}: ${w}x${h}, ${t.steps} steps (its image stays on the server)`;
}

function setSource(s) {
  Object.assign(source, s);
  for (const c of [$("image-canvas"), $("mask-canvas")]) {
    c.width = s.width;
    c.height = s.height;
  }
  $("after").removeAttribute("src");
  $("download").hidden = true;
  const template = s.template !== null;
  $("template-note").hidden = !template;
  $("steps").disabled = template;
  $("guidance").disabled = template;
}

function sized(w, h) {
  const c = document.createElement("canvas");
  c.width = w;
  c.height = h;
  return c;
}

// ---- templates ----

let templates = [];

async function refreshTemplates() {
  try {
    templates = (await json("/v1/templates")).templates || [];
  } catch (e) {
    $("status").textContent = "templates: " + e.message;
    return;
  }
  const sel = $("template-select");
  const keep = sel.value;
  sel.replaceChildren(new Option("(none)", ""));
  for (const t of templates) {
    sel.add(new Option(`${t.id} (${t.image_width || t.width}x${t.image_height || t.height})`, t.id));
  }
  sel.value = templates.some((t) => t.id === keep) ? keep : "";
}

async function registerTemplate() {
  if (!source.image) return say("register: upload an image first");
  const id = $("template-id").value.trim();
  if (!id) return say("register: give the template an id");
  const body = { id, image: source.image, steps: Number($("template-steps").value) };
  const prompt = $("prompt").value;
  if (prompt) body.prompt = prompt;
  say(`registering ${id}…`);
  try {
    await json("/v1/templates", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    say(`registered ${id}`);
    await refreshTemplates();
  } catch (e) {
    say("register: " + e.message);
  }
}

function say(text) {
  $("status").textContent = text;
}

// ---- the mask: painted on a canvas of the image's size ----

const mask = $("mask-canvas");
const mctx = mask.getContext("2d");
let last = null;

// Pointer position in the canvas's own pixels (the canvas is scaled up on screen).
function at(e) {
  const r = mask.getBoundingClientRect();
  return { x: (e.clientX - r.left) * (mask.width / r.width), y: (e.clientY - r.top) * (mask.height / r.height) };
}

function stroke(from, to) {
  const r = mask.getBoundingClientRect();
  mctx.globalCompositeOperation = $("eraser").checked ? "destination-out" : "source-over";
  mctx.strokeStyle = "#f03";
  mctx.lineCap = "round";
  mctx.lineJoin = "round";
  // The slider is in screen pixels, so the brush looks the same on any image size.
  mctx.lineWidth = Number($("brush").value) * (mask.width / r.width);
  mctx.beginPath();
  mctx.moveTo(from.x, from.y);
  mctx.lineTo(to.x + 0.01, to.y); // a zero-length line draws no dot
  mctx.stroke();
}

mask.addEventListener("pointerdown", (e) => {
  mask.setPointerCapture(e.pointerId);
  last = at(e);
  stroke(last, last);
});
mask.addEventListener("pointermove", (e) => {
  if (!last) return;
  const p = at(e);
  stroke(last, p);
  last = p;
});
for (const ev of ["pointerup", "pointercancel"]) mask.addEventListener(ev, () => { last = null; });

// Painted pixels are those with alpha >= 128 (the brush's edge is antialiased).
function forEachPixel(fn) {
  const d = mctx.getImageData(0, 0, mask.width, mask.height);
  for (let i = 0; i < d.data.length; i += 4) fn(d.data, i);
  mctx.putImageData(d, 0, 0);
}

function invertMask() {
  forEachPixel((p, i) => {
    const painted = p[i + 3] >= 128;
    p[i] = 255; p[i + 1] = 0; p[i + 2] = 51; p[i + 3] = painted ? 0 : 255;
  });
}

// An uploaded mask paints where its luma is >= 128, as the daemon reads masks.
async function onMaskFile(file) {
  const img = await loadImage(await readDataUrl(file));
  if (img.naturalWidth !== mask.width || img.naturalHeight !== mask.height) {
    return say(`mask is ${img.naturalWidth}x${img.naturalHeight} but the image is ${mask.width}x${mask.height}`);
  }
  mctx.globalCompositeOperation = "source-over";
  mctx.clearRect(0, 0, mask.width, mask.height);
  mctx.drawImage(img, 0, 0);
  forEachPixel((p, i) => {
    const white = 0.299 * p[i] + 0.587 * p[i + 1] + 0.114 * p[i + 2] >= 128 && p[i + 3] > 0;
    p[i] = 255; p[i + 1] = 0; p[i + 2] = 51; p[i + 3] = white ? 255 : 0;
  });
}

// The mask the daemon gets: a PNG of the image's size, white where painted.
function maskPng() {
  const src = mctx.getImageData(0, 0, mask.width, mask.height).data;
  const out = sized(mask.width, mask.height);
  const octx = out.getContext("2d");
  const d = octx.createImageData(mask.width, mask.height);
  for (let i = 0; i < src.length; i += 4) {
    const v = src[i + 3] >= 128 ? 255 : 0;
    d.data[i] = d.data[i + 1] = d.data[i + 2] = v;
    d.data[i + 3] = 255;
  }
  octx.putImageData(d, 0, 0);
  return out.toDataURL("image/png");
}

// ---- the edit, streamed ----

function editBody() {
  const m = maskPng();
  window.__lastMask = m;
  const body = { mask: m.split(",")[1], prompt: $("prompt").value, seed: Number($("seed").value), stream: true, preview_every: 1 };
  if (source.template !== null) {
    body.template_id = source.template; // steps and guidance are the template's
  } else {
    body.image = source.image;
    body.steps = Number($("steps").value);
    body.guidance = Number($("guidance").value);
  }
  return body;
}

// Server-Sent Events from a POST: EventSource cannot send one, so the body is read
// as it arrives and split into `event:`/`data:` blocks.
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trimStart();
      }
      if (data) await onEvent(name, JSON.parse(data));
    }
  }
}

function setProgress(step, steps) {
  // Attributes (not only properties), so observers of the DOM see each change.
  $("progress").setAttribute("max", String(steps));
  $("progress").setAttribute("value", String(step));
}

async function onEvent(name, data) {
  if (name === "status") {
    // While it waits, `ahead` is its place in the queue.
    const ahead = data.ahead ? ` (${data.ahead} ahead in the queue)` : "";
    say(data.status + "…" + ahead);
  }
  else if (name === "step") {
    setProgress(data.step, data.steps);
    say(`denoising: step ${data.step}/${data.steps} (${data.elapsed_s.toFixed(1)} s)`);
  } else if (name === "preview") {
    const src = `data:image/${data.format};base64,${data.image}`;
    window.__previews.push(src);
    $("after").src = src;
  } else if (name === "done") await showResult(data);
  else if (name === "error") throw new Error(errorText(data, "stream"));
}

// The result is fetched as the daemon's binary reply (`Accept: image/*` on its job):
// the image's own bytes, shown and downloaded as they are, whatever its size.
async function showResult(r) {
  const res = await api(`/v1/jobs/${r.id}`, { headers: { Accept: "image/*" } });
  if (!res.ok) throw new Error(errorText(await res.json().catch(() => ({})), res.status));
  const blob = await res.blob();
  const url = URL.createObjectURL(blob);
  // For a browser test: the bytes as a data URL, and what is shown.
  window.__result = await new Promise((resolve) => {
    const fr = new FileReader();
    fr.onload = () => resolve(fr.result);
    fr.readAsDataURL(blob);
  });
  window.__shown = url;
  $("after").src = url;
  $("download").href = url;
  $("download").download = `edit.${{ "image/jpeg": "jpg", "image/webp": "webp" }[blob.type] || "png"}`;
  $("download").hidden = false;
  const max = Number($("progress").getAttribute("max"));
  setProgress(max, max);
  const computed = r.computed_width && (r.computed_width !== r.width || r.computed_height !== r.height)
    ? ` (computed at ${r.computed_width}x${r.computed_height})` : "";
  say(`done: ${r.width}x${r.height}${computed} in ${r.timings ? r.timings.total_s.toFixed(2) + " s" : "?"}`);
}

async function submitEdit(e) {
  e.preventDefault();
  if (!source.image && source.template === null) return say("upload an image or pick a template first");
  $("submit").disabled = true;
  window.__previews = [];
  window.__result = null;
  window.__state = "running";
  setProgress(0, 1);
  say("sending…");
  try {
    const r = await api("/v1/edits", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(editBody()) });
    if (!r.ok) throw new Error(errorText(await r.json().catch(() => ({})), r.status));
    await readEvents(r, onEvent);
    window.__state = window.__result ? "done" : "error";
    if (!window.__result) say("the stream ended without a result");
  } catch (err) {
    window.__state = "error";
    say("error: " + err.message);
  } finally {
    $("submit").disabled = false;
  }
}

// ---- before/after ----

function showCompare() {
  // The after image covers the before image from the slider's position rightwards.
  $("after").style.clipPath = `inset(0 0 0 ${$("compare-slider").value}%)`;
}

// ---- wiring ----

$("image-file").addEventListener("change", (e) => {
  const f = e.target.files[0];
  if (f) onImageFile(f).catch((err) => say("image: " + err.message));
});
$("mask-file").addEventListener("change", (e) => {
  const f = e.target.files[0];
  if (f) onMaskFile(f).catch((err) => say("mask: " + err.message));
});
$("template-select").addEventListener("change", (e) => {
  const t = templates.find((t) => t.id === e.target.value);
  if (t) onTemplate(t);
});
$("template-refresh").addEventListener("click", refreshTemplates);
$("template-register").addEventListener("click", registerTemplate);
$("clear").addEventListener("click", () => mctx.clearRect(0, 0, mask.width, mask.height));
$("invert").addEventListener("click", invertMask);
$("edit").addEventListener("submit", submitEdit);
$("compare-slider").addEventListener("input", showCompare);

showCompare();
showServer();
setInterval(showServer, 5000);
refreshTemplates();
window.__ready = true;
