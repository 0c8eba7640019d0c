// graftlm's chat page: plain ES module, no build step. It talks to the server's own API:
// GET /v1/models and /lora-adapters for the picker, POST /v1/chat/completions (SSE) to chat.
// In compare mode one prompt goes to every column at once (the server batches them together).
// History, settings and the API key stay in this browser (localStorage).

const $ = (sel, root = document) => root.querySelector(sel);
const STORE = "graftlm.chat.v1";
const SETTINGS = "graftlm.settings.v1";
const KEY = "graftlm.apikey";

let models = [];    // ids from /v1/models (the base first)
let adapters = [];  // [{id, name, path, scale}] from /lora-adapters
let controller = null;  // the AbortController of the requests in flight

const state = load(STORE, { mode: "chat", columns: [newColumn()] });

function newColumn(from) {
  return { model: from ? from.model : null, scales: from ? { ...from.scales } : {}, messages: [] };
}

function load(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v && typeof v === "object" ? v : fallback;
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function showError(text) {
  const box = $("#error");
  box.textContent = text || "";
  box.hidden = !text;
}

async function errorText(response) {
  try {
    const body = await response.json();
    const msg = (body.error && body.error.message) || JSON.stringify(body);
    return `${response.status}: ${msg}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function api(path) {
  const r = await fetch(path, { headers: headers() });
  if (!r.ok) throw new Error(await errorText(r));
  return r.json();
}

// -- the server's models and adapters ------------------------------------------------------
async function refresh() {
  try {
    const list = await api("/v1/models");
    models = list.data.map((m) => m.id);
    adapters = await api("/lora-adapters");
    $("#status").textContent = `${models[0]}, ${adapters.length} adapter${adapters.length === 1 ? "" : "s"}`;
    showError("");
  } catch (e) {
    $("#status").textContent = "not connected";
    if (String(e.message).startsWith("401")) {
      $("#settings").hidden = false;
      showError(`${e.message} (enter the server's API key in settings)`);
    } else {
      showError(e.message);
    }
  }
  render();
}

function adapterLabel(a) {
  return a.name || String(a.path).split(/[\\/]/).pop();
}

// An adapter's scale in a column: what its slider was set to, else 1 for the adapter the
// picker names (as the server runs `model`), else the server's scale for it.
function scaleOf(col, a) {
  if (a.id in col.scales) return Number(col.scales[a.id]);
  return a.name && a.name === col.model ? 1 : Number(a.scale);
}

// -- rendering ------------------------------------------------------------------------------
function visibleColumns() {
  return state.mode === "compare" ? state.columns : state.columns.slice(0, 1);
}

function render() {
  $("#mode").value = state.mode;
  $("#add-column").hidden = state.mode !== "compare";
  const root = $("#columns");
  root.replaceChildren();
  visibleColumns().forEach((col, index) => root.append(renderColumn(col, index)));
}

function renderColumn(col, index) {
  const node = $("#column-template").content.firstElementChild.cloneNode(true);
  node.dataset.index = String(index);
  const select = $(".model", node);
  for (const id of models) select.append(new Option(id, id));
  if (!col.model || !models.includes(col.model)) col.model = models[0] || null;
  select.value = col.model || "";
  // the picked adapter runs at scale 1 (the server's rule for `model`): its slider shows that
  // until moved, and the column's other sliders keep theirs
  select.addEventListener("change", () => { col.model = select.value; save(); render(); });

  const box = $(".adapters", node);
  for (const a of adapters) {
    const label = document.createElement("label");
    label.className = "adapter";
    const range = document.createElement("input");
    Object.assign(range, { type: "range", min: "0", max: "2", step: "0.05" });
    range.dataset.id = String(a.id);
    range.value = String(scaleOf(col, a));
    const out = document.createElement("output");
    out.textContent = Number(range.value).toFixed(2);
    range.addEventListener("input", () => {
      col.scales[a.id] = Number(range.value);
      out.textContent = Number(range.value).toFixed(2);
      save();
    });
    label.append(adapterLabel(a), range, out);
    box.append(label);
  }
  const remove = $(".remove", node);
  remove.hidden = state.mode !== "compare" || state.columns.length <= 2;
  remove.addEventListener("click", () => { state.columns.splice(index, 1); save(); render(); });

  const list = $(".messages", node);
  for (const m of col.messages) list.append(messageNode(m));
  list.scrollTop = list.scrollHeight;
  return node;
}

function messageNode(m) {
  const div = document.createElement("div");
  div.className = `message ${m.role}${m.stopped ? " stopped" : ""}`;
  div.textContent = m.content;  // text, never HTML
  return div;
}

// -- sending --------------------------------------------------------------------------------
function sampling() {
  const num = (id) => { const v = $(id).value; return v === "" ? undefined : Number(v); };
  return {
    temperature: num("#temperature"),
    top_p: num("#top_p"),
    top_k: num("#top_k"),
    max_tokens: num("#max_tokens"),
    seed: num("#seed"),
  };
}

function requestBody(col) {
  const system = $("#system").value.trim();
  const messages = col.messages
    .filter((m) => !m.pending)
    .map((m) => ({ role: m.role, content: m.content }));
  if (system) messages.unshift({ role: "system", content: system });
  // every slider's scale but the picked adapter's untouched one: a `lora` entry for it would
  // override the picker (the server's rule: the list sets the scales it names)
  const lora = adapters
    .filter((a) => a.id in col.scales || !(a.name && a.name === col.model))
    .map((a) => ({ id: a.id, scale: scaleOf(col, a) }));
  return {
    model: col.model || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    lora,
    ...sampling(),
  };
}

async function stream(col, node, signal) {
  const reply = { role: "assistant", content: "", pending: true };
  col.messages.push(reply);
  const view = messageNode(reply);
  const list = $(".messages", node);
  list.append(view);
  const speed = $(".speed", node);
  speed.textContent = "...";
  let first = 0;
  let pieces = 0;
  let usage = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(col)), signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
          if (chunk.usage) usage = chunk.usage;
          const text = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
          if (text) {
            if (!first) first = performance.now();
            pieces += 1;
            reply.content += text;
            view.textContent = reply.content;
            list.scrollTop = list.scrollHeight;
          }
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stopped = true;
      view.classList.add("stopped");
    } else {
      showError(e.message);
      if (!reply.content) {  // nothing came: the turn did not happen
        col.messages.pop();
        view.remove();
      }
    }
  } finally {
    delete reply.pending;
    const n = usage ? usage.completion_tokens : pieces;
    const seconds = first ? (performance.now() - first) / 1000 : 0;
    speed.textContent = n > 1 && seconds > 0
      ? `${n} tokens, ${((n - 1) / seconds).toFixed(1)} tok/s`
      : `${n} token${n === 1 ? "" : "s"}`;
  }
}

async function send(text) {
  showError("");
  const cols = visibleColumns();
  const nodes = [...$("#columns").children];
  for (const [i, col] of cols.entries()) {
    const m = { role: "user", content: text };
    col.messages.push(m);
    $(".messages", nodes[i]).append(messageNode(m));
  }
  controller = new AbortController();
  busy(true);
  try {
    await Promise.all(cols.map((col, i) => stream(col, nodes[i], controller.signal)));
  } finally {
    controller = null;
    busy(false);
    save();
  }
}

function busy(on) {
  $("#send").disabled = on;
  $("#stop").disabled = !on;
  document.body.dataset.busy = on ? "1" : "0";
}

// -- wiring ---------------------------------------------------------------------------------
function setUp() {
  const settings = load(SETTINGS, {});
  for (const id of ["temperature", "top_p", "top_k", "max_tokens", "seed", "system"]) {
    const input = $(`#${id}`);
    if (settings[id] !== undefined) input.value = settings[id];
    input.addEventListener("change", () => {
      settings[id] = input.value;
      localStorage.setItem(SETTINGS, JSON.stringify(settings));
    });
  }
  const key = $("#api-key");
  key.value = localStorage.getItem(KEY) || "";
  key.addEventListener("change", () => {
    if (key.value) localStorage.setItem(KEY, key.value);
    else localStorage.removeItem(KEY);
    refresh();
  });
  $("#toggle-settings").addEventListener("click", () => { $("#settings").hidden = !$("#settings").hidden; });
  $("#mode").addEventListener("change", () => {
    state.mode = $("#mode").value;
    while (state.mode === "compare" && state.columns.length < 2) {
      state.columns.push(newColumn(state.columns[0]));
    }
    save();
    render();
  });
  $("#add-column").addEventListener("click", () => {
    state.columns.push(newColumn(state.columns[0]));
    save();
    render();
  });
  $("#new-chat").addEventListener("click", () => {
    for (const col of state.columns) col.messages = [];
    showError("");
    save();
    render();
  });
  $("#stop").addEventListener("click", () => { if (controller) controller.abort(); });
  const input = $("#input");
  $("#composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = input.value.trim();
    if (!text || controller) return;
    input.value = "";
    send(text);
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("#composer").requestSubmit();
    }
  });
  busy(false);
  refresh();
}

setUp();
