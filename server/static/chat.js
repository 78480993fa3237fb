// SpecSoT-MQ web chat: plain JS over the server's own OpenAI API (streamed chat completions).
// The skeleton streams first, then one live row per point, then the merged answer as Markdown.
// Conversations live in this browser's localStorage; nothing is loaded from anywhere else.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "specsot.chats";
let chats = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = chats.length ? chats[0].id : null;
let editing = null; // index of the user message being edited
let running = null; // AbortController of the answer in progress
let model = null;

function save() { localStorage.setItem(STORE, JSON.stringify(chats)); }
function chat() { return chats.find((c) => c.id === current); }
function settings() {
  return { key: $("api-key").value.trim(), sot: $("sot").value, system: $("system").value.trim(),
           temperature: Number($("temperature").value) || 0, max_tokens: Number($("max-tokens").value) || 256 };
}
for (const id of ["api-key", "sot", "temperature", "max-tokens", "system"]) {
  const el = $(id);
  el.value = localStorage.getItem("specsot." + id) ?? el.value;
  el.addEventListener("change", () => localStorage.setItem("specsot." + id, el.value));
}

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// A small Markdown subset: fenced code, headings, lists, bold, italics, inline code, paragraphs.
function markdown(src) {
  const inline = (t) => escapeHtml(t)
    .replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
  const out = [];
  let list = null, para = [];
  const flush = () => {
    if (para.length) { out.push("<p>" + para.map(inline).join("<br>") + "</p>"); para = []; }
    if (list) { out.push(`</${list}>`); list = null; }
  };
  const lines = src.split("\n");
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    if (line.startsWith("```")) {
      flush();
      const code = [];
      while (++i < lines.length && !lines[i].startsWith("```")) code.push(lines[i]);
      out.push("<pre><code>" + escapeHtml(code.join("\n")) + "</code></pre>");
      continue;
    }
    let m;
    if ((m = line.match(/^(#{1,3})\s+(.*)/))) { flush(); out.push(`<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`); continue; }
    const item = line.match(/^\s*(\d+\.|[-*+])\s+(.*)/);
    if (item) {
      const kind = /\d/.test(item[1]) ? "ol" : "ul";
      if (para.length) flush();
      if (list !== kind) { if (list) out.push(`</${list}>`); out.push(`<${kind}>`); list = kind; }
      out.push("<li>" + inline(item[2]) + "</li>");
      continue;
    }
    if (!line.trim()) { flush(); continue; }
    if (list) { out.push(`</${list}>`); list = null; }
    para.push(line);
  }
  flush();
  return out.join("");
}

function renderSide() {
  const ul = $("conversations");
  ul.innerHTML = "";
  for (const c of chats) {
    const li = document.createElement("li");
    li.className = c.id === current ? "active" : "";
    li.innerHTML = `<span>${escapeHtml(c.title || "New chat")}</span><button title="Delete" type="button">×</button>`;
    li.querySelector("span").onclick = () => { if (!running) { current = c.id; editing = null; render(); } };
    li.querySelector("button").onclick = () => {
      if (running) return;
      chats = chats.filter((x) => x.id !== c.id);
      if (current === c.id) current = chats.length ? chats[0].id : null;
      save(); render();
    };
    ul.appendChild(li);
  }
}

function statsLine(how, leftOut) {
  if (!how) return "";
  const tokens = Object.values(how.phases).reduce((a, p) => a + p.tokens, 0);
  const taus = Object.entries(how.phases).filter(([, p]) => p.tau).map(([n, p]) => `${n} ${p.tau.toFixed(2)}`);
  return `mode ${how.mode} · ${how.points.length} points · ${tokens} tokens · ${how.seconds.toFixed(2)} s` +
    (taus.length ? ` · tau ${taus.join(", ")}` : "") +
    (leftOut ? ` · ${leftOut} earliest turn${leftOut > 1 ? "s" : ""} left out (the conversation outgrew the model's cache)` : "");
}

// The view of one assistant message: skeleton, point rows, answer, stats, error.
function assistantView(msg) {
  const div = document.createElement("div");
  div.className = "msg assistant";
  div.innerHTML = `<div class="skeleton" hidden></div><div class="points"></div><div class="answer"></div>
    <div class="stats dim"></div><div class="error" hidden></div>`;
  const view = {
    div,
    skeleton(text) { const el = div.querySelector(".skeleton"); el.hidden = false; el.textContent += text; },
    plan(points) {
      const box = div.querySelector(".points");
      box.innerHTML = "";
      for (const p of points) {
        if (!p.index) continue;
        const row = document.createElement("div");
        row.className = "point";
        row.dataset.index = p.index;
        row.innerHTML = `<span class="title">${p.index}. ${escapeHtml(p.title)}</span><span class="text"><bdi dir="ltr"></bdi></span>`;
        box.appendChild(row);
      }
    },
    restart(indices) {
      for (const i of indices) {
        const el = div.querySelector(`.point[data-index="${i}"] .text bdi`);
        if (el) el.textContent = "";
        const row = div.querySelector(`.point[data-index="${i}"]`);
        if (row) row.classList.remove("done");
      }
    },
    pointEnd(index) {
      const row = div.querySelector(`.point[data-index="${index}"]`);
      if (row) row.classList.add("done");
    },
    point(index, text) {
      // The row shows the newest text: the line is right-to-left (the ellipsis goes first), the
      // text inside it isolated left-to-right (its punctuation stays at its end).
      const el = div.querySelector(`.point[data-index="${index}"] .text bdi`);
      if (el) el.textContent += text;
    },
    answer(text, final) {
      const el = div.querySelector(".answer");
      if (final) el.innerHTML = markdown(text); else el.textContent = text;
    },
    done(how, leftOut) {
      div.querySelectorAll(".point").forEach((r) => r.classList.add("done"));
      div.querySelector(".stats").textContent = statsLine(how, leftOut);
    },
    error(text) { const el = div.querySelector(".error"); el.hidden = false; el.textContent = text; },
  };
  if (msg) {
    if (msg.how && msg.how.skeleton) view.skeleton(msg.how.skeleton);
    if (msg.how && msg.how.mode === "sot") {
      view.plan(msg.how.points);
      for (const p of msg.how.points) view.point(p.index, p.text);
    }
    view.answer(msg.content || "", true);
    if (msg.how) view.done(msg.how, msg.leftOut);
    if (msg.error) view.error(msg.error);
  }
  return view;
}

function render() {
  renderSide();
  const box = $("messages");
  box.innerHTML = "";
  const c = chat();
  if (!c) return;
  c.messages.forEach((m, i) => {
    if (m.role === "user") {
      const div = document.createElement("div");
      div.className = "msg user";
      div.textContent = m.content;
      const edit = document.createElement("button");
      edit.className = "edit"; edit.type = "button"; edit.textContent = "edit";
      edit.onclick = () => { if (running) return; editing = i; $("input").value = m.content; $("input").focus(); };
      div.appendChild(edit);
      box.appendChild(div);
    } else {
      box.appendChild(assistantView(m).div);
    }
  });
  box.scrollTop = box.scrollHeight;
}

async function fetchModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    model = body.data[0].id;
    $("model").textContent = "model: " + model;
  } catch (e) {
    $("model").textContent = "model list unavailable: " + e.message;
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = settings().key;
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// Server-sent events from a fetch body: yields each `data:` payload.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) yield data;
    }
  }
}

async function ask(text) {
  if (!current) newChat();
  const c = chat();
  if (editing !== null) { c.messages = c.messages.slice(0, editing); editing = null; }
  // Earlier turns that got a whole answer are the context; failed or stopped ones are left out.
  const history = [];
  for (let i = 0; i + 1 < c.messages.length; i += 2) {
    const [u, a] = [c.messages[i], c.messages[i + 1]];
    if (a && a.content && !a.error) history.push({ role: "user", content: u.content }, { role: "assistant", content: a.content });
  }
  c.messages.push({ role: "user", content: text });
  if (!c.title) c.title = text.slice(0, 60);
  const msg = { role: "assistant", content: "" };
  c.messages.push(msg);
  save(); render();
  const view = assistantView(null);
  const box = $("messages");
  box.lastChild.replaceWith(view.div);
  running = new AbortController();
  $("send").hidden = true; $("stop").hidden = false;
  const s = settings();
  const system = s.system ? [{ role: "system", content: s.system }] : [];  // first, and never left out
  try {
    if (!model) await fetchModel();
    let response;
    for (;;) {  // a conversation longer than the model's cache is asked again without its earliest turn
      response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), signal: running.signal,
        body: JSON.stringify({ model, messages: [...system, ...history, { role: "user", content: text }], stream: true,
                               sot: s.sot, temperature: s.temperature, max_tokens: s.max_tokens }),
      });
      if (response.ok) break;
      const body = await response.json().catch(() => ({}));
      if (body.error && body.error.code === "context_length_exceeded" && history.length) {
        history.splice(0, 2);
        msg.leftOut = (msg.leftOut || 0) + 1;
        continue;
      }
      throw new Error(`${response.status}: ${body.error ? body.error.message : response.statusText}`);
    }
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const ext = chunk.specsot || {};
      const choice = chunk.choices && chunk.choices[0];
      const final = choice && choice.finish_reason;  // its specsot is the whole record, not progress
      if (!final && ext.skeleton) view.skeleton(ext.skeleton);
      if (!final && ext.plan && ext.plan.mode === "sot") view.plan(ext.plan.points);
      if (!final && ext.point) view.point(ext.point.index, ext.point.text);
      if (!final && ext.restart) view.restart(ext.restart.indices);
      if (!final && ext.point_end) view.pointEnd(ext.point_end.index);
      if (choice && choice.delta && choice.delta.content) { msg.content += choice.delta.content; view.answer(msg.content, false); }
      if (final) { msg.how = ext; view.answer(msg.content, true); view.done(ext, msg.leftOut); }
      box.scrollTop = box.scrollHeight;
    }
  } catch (e) {
    msg.error = e.name === "AbortError" ? "stopped" : String(e.message || e);
    view.error(msg.error);
  } finally {
    running = null;
    $("send").hidden = false; $("stop").hidden = true;
    save(); renderSide();
  }
}

function newChat() {
  const c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "", messages: [] };
  chats.unshift(c);
  current = c.id;
  editing = null;
  save(); render();
}

$("new-chat").onclick = () => { if (!running) newChat(); };
$("stop").onclick = () => { if (running) running.abort(); };
$("composer").onsubmit = (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || running) return;
  $("input").value = "";
  ask(text);
};
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
render();
fetchModel();
