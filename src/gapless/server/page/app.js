// The page at /: a chat with the served model, and the server's step summaries, live.
// Plain browser JavaScript, no build step; every call goes to the server that served it.
"use strict";

const $ = (id) => document.getElementById(id);
const ID_CHARS = 8; // the live view shows a request by the start of its id

let apiKey = sessionStorage.getItem("gapless-api-key") || "";
let model = null;

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (apiKey) h.Authorization = "Bearer " + apiKey;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch {
    return response.statusText;
  }
}

// Reads a Server-Sent Events body, calling onEvent(type, data, comments) per event. fetch,
// not EventSource: EventSource cannot send the Authorization header.
async function readSSE(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let type = "message";
      const data = [];
      const comments = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) comments.push(line.slice(1).trim());
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        else if (line.startsWith("event:")) type = line.slice(6).trim();
      }
      onEvent(type, data.join("\n"), comments);
    }
  }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers(false) });
    if (!r.ok) throw new Error(`${r.status}: ${await errorText(r)}`);
    model = (await r.json()).data[0].id;
    $("model").textContent = model;
  } catch (e) {
    $("model").textContent = `(${e.message})`;
  }
}

// -- the chat ---------------------------------------------------------------------------------

const history = []; // {role, content}: the conversation, kept in this page only
let chatAbort = null;
const myIds = new Set(); // id starts of this page's requests, marked in the live view

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  box.append(body, meta);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return { box, body, meta };
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function numberField(id, integer) {
  const value = integer ? parseInt($(id).value, 10) : parseFloat($(id).value);
  return Number.isFinite(value) ? value : undefined;
}

async function sendChat(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.box.classList.add("streaming");
  chatAbort = new AbortController();
  setBusy(true);
  const body = {
    messages: history,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    max_tokens: numberField("max_tokens", true),
  };
  if (model) body.model = model;
  let content = "";
  let tokens = 0;
  let finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(true),
      body: JSON.stringify(body),
      signal: chatAbort.signal,
    });
    if (!r.ok) throw new Error(`${r.status}: ${await errorText(r)}`);
    await readSSE(r, (type, data, comments) => {
      for (const c of comments) {
        if (c.startsWith("prefill_progress ")) {
          const p = JSON.parse(c.slice("prefill_progress ".length));
          reply.meta.textContent = `prefill ${p.processed}/${p.total}`;
        }
      }
      if (!data || data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.id) {
        const id = chunk.id.replace(/^chatcmpl-/, "").slice(0, ID_CHARS);
        reply.box.dataset.id = id;
        myIds.add(id);
      }
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        // One chunk per token, after the one that opens the message with its role.
        if (choice.finish_reason) finish = choice.finish_reason;
        else if (!delta.role) tokens += 1;
        if (delta.content) content += delta.content;
      }
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      reply.body.textContent = content;
      reply.meta.textContent = `${tokens} tokens`;
      reply.box.dataset.tokens = String(tokens);
      $("messages").scrollTop = $("messages").scrollHeight;
    });
  } catch (e) {
    finish = e.name === "AbortError" ? "stopped" : `error: ${e.message}`;
  } finally {
    reply.box.classList.remove("streaming");
    reply.meta.textContent = `${tokens} tokens` + (finish ? `, ${finish}` : "");
    if (content) history.push({ role: "assistant", content });
    else if (finish && finish.startsWith("error")) history.pop(); // let the user retry
    chatAbort = null;
    setBusy(false);
  }
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chatAbort) return;
  $("prompt").value = "";
  sendChat(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("chat-form").requestSubmit();
  }
});
// Aborting the fetch closes the connection; the server cancels the request at its next step.
$("stop").addEventListener("click", () => chatAbort && chatAbort.abort());
$("clear").addEventListener("click", () => {
  if (chatAbort) chatAbort.abort();
  history.length = 0;
  $("messages").replaceChildren();
});

// -- the live view ----------------------------------------------------------------------------

let liveAbort = null;
let wakeLive = () => {};

function pause(ms) {
  // Resolves after ms (never, for null), or at once when the key changes.
  return new Promise((resolve) => {
    const timer = ms === null ? null : setTimeout(resolve, ms);
    wakeLive = () => {
      clearTimeout(timer);
      resolve();
    };
  });
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function seconds(s) {
  return s === null || s === undefined ? "–" : `${s.toFixed(s < 10 ? 2 : 1)} s`;
}

function render(s) {
  $("steps-per-s").textContent = String(s.steps_per_s);
  const last = s.last_step;
  $("last-step").textContent =
    `${last.decode_tokens} decode + ${last.prefill_tokens} prefill tokens, ${last.ms} ms`;
  $("kv").textContent = `${s.kv_blocks.used} / ${s.kv_blocks.total} in use`;
  $("kv-bar").max = s.kv_blocks.total;
  $("kv-bar").value = s.kv_blocks.used;
  $("counts").textContent = `${s.running} running, ${s.waiting} waiting`;
  const rows = s.requests.map((q) => {
    const tr = document.createElement("tr");
    Object.assign(tr.dataset, {
      id: q.id,
      state: q.state,
      prompt: q.prompt_tokens,
      computed: q.computed,
      reloaded: q.reloaded,
      generated: q.generated,
    });
    if (myIds.has(q.id)) tr.className = "mine";
    const progress = document.createElement("progress");
    progress.max = q.prompt_tokens;
    progress.value = q.computed;
    const label = document.createElement("span");
    // Tokens reloaded from the disk tier count as computed; the label says how many.
    const reloaded = q.reloaded ? ` (${q.reloaded} from disk)` : "";
    label.textContent = ` ${q.computed}/${q.prompt_tokens}${reloaded}`;
    const prefill = cell("", "prefill");
    prefill.append(progress, label);
    tr.append(
      cell(q.index ? `${q.id} #${q.index}` : q.id, "id"),
      cell(q.state, `state ${q.state}`),
      cell(q.class, "class"),
      cell(q.tenant ?? "", "tenant"),
      prefill,
      cell(String(q.generated), "generated"),
      cell(seconds(q.age_s)),
      cell(seconds(q.ttft_s)),
    );
    return tr;
  });
  $("requests").tBodies[0].replaceChildren(...rows);
}

function setLiveState(text) {
  $("live-state").textContent = text;
}

async function watchLive() {
  for (;;) {
    liveAbort = new AbortController();
    let wait = 2000;
    try {
      const r = await fetch("/v1/live", { headers: headers(false), signal: liveAbort.signal });
      if (r.status === 401) {
        setLiveState("needs the API key");
        wait = null; // until a key is given
      } else if (!r.ok) {
        setLiveState(`unavailable (${r.status}: ${await errorText(r)}); retrying`);
      } else {
        setLiveState("live");
        let reason = "closed";
        await readSSE(r, (type, data) => {
          if (type === "end") reason = JSON.parse(data).reason;
          else if (data) render(JSON.parse(data));
        });
        setLiveState(`stream ended (${reason}); reconnecting`);
      }
    } catch (e) {
      if (e.name === "AbortError") wait = 0; // the key changed: reconnect now
      else setLiveState(`disconnected (${e.message}); retrying`);
    }
    await pause(wait);
  }
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  apiKey = $("key").value.trim();
  if (apiKey) sessionStorage.setItem("gapless-api-key", apiKey);
  else sessionStorage.removeItem("gapless-api-key");
  if (liveAbort) liveAbort.abort();
  wakeLive();
  loadModel();
});

$("key").value = apiKey;
loadModel();
watchLive();
