// multistream web client: POST a request, read the SSE reply with fetch + ReadableStream, and
// resume with the last event id (GET /v1/streams/{id}/events) whenever the connection drops.
// DOM updates are batched with requestAnimationFrame so a fast stream does not thrash layout.
// Everything from the server goes into the page as text (textContent), never as HTML; the API key
// lives in sessionStorage (gone with the tab), and resuming or stopping a stream sends the resume
// token its creation returned.
// Text events carry `offset` (where `delta` begins, in code points: Python's len) and `revision`
// (+1 per steer/rewind): the text is text[:offset] + delta, so a rewind replaces the tail.
// "show confidence" asks for logprobs (top 5): each token is coloured by its probability, hovering
// shows its alternatives, and clicking one rewinds the answer to that token with the alternative
// (POST /v1/streams/{id}/rewind {"offset", "token_id"}) while it streams.
// `committed` says how much of it can no longer change: a beam search (num_beams > 1) shows its
// best hypothesis, whose provisional tail after `committed` is drawn faded (span.provisional).
"use strict";

const $ = (id) => document.getElementById(id);
const ui = { go: $("go"), stop: $("stop"), finish: $("finish"), prompt: $("prompt"), amount: $("amount"), key: $("apikey"),
             beams: $("beams"),
             output: $("output"), preview: $("preview"), status: $("status"), confidence: $("confidence") };
ui.key.value = sessionStorage.getItem("multistream.apikey") || "";
ui.key.addEventListener("change", () => sessionStorage.setItem("multistream.apikey", ui.key.value));
try { localStorage.removeItem("multistream.apikey"); } catch (e) { /* older versions kept it there */ }

// Test and debug hook: what the page has seen.
const state = window.__ms = { streamId: null, token: null, lastSeq: -1, text: "", length: 0, committed: 0, revision: 0, frames: 0,
                              finalEvent: null, reconnects: 0, error: null, running: false, seqs: [], kind: null,
                              tokens: [], confidence: false, branches: 0 };
let pending = { text: "", redraw: false, image: null, status: null };
let frameRequested = false;
let controller = null;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (ui.key.value) h["Authorization"] = "Bearer " + ui.key.value;
  if (state.token) h["X-Resume-Token"] = state.token;
  return h;
}

function schedule() {
  if (frameRequested) return;
  frameRequested = true;
  requestAnimationFrame(() => {
    frameRequested = false;
    if (state.confidence && state.tokens.length) { renderTokens(); pending.redraw = false; pending.text = ""; }
    if (pending.redraw) { drawText(); pending.redraw = false; pending.text = ""; }
    if (pending.text) { ui.output.append(document.createTextNode(pending.text)); pending.text = ""; }
    if (pending.image) { ui.preview.src = pending.image; pending.image = null; }
    if (pending.status) { renderStatus(pending.status); pending.status = null; }
  });
}

// The text as committed part (plain) and provisional part (faded), both as text nodes.
function drawText() {
  const chars = Array.from(state.text);
  const cut = Math.min(state.committed, chars.length);
  const provisional = document.createElement("span");
  provisional.className = "provisional";
  provisional.textContent = chars.slice(cut).join("");
  ui.output.replaceChildren(document.createTextNode(chars.slice(0, cut).join("")), provisional);
}

// A status is a list of parts: plain strings, or [text, className, id] for a styled span.
function setStatus(...parts) { pending.status = parts; schedule(); }

function renderStatus(parts) {
  ui.status.replaceChildren(...parts.map((p) => {
    if (typeof p === "string") return document.createTextNode(p);
    const span = document.createElement("span");
    span.textContent = p[0];
    if (p[1]) span.className = p[1];
    if (p[2]) span.id = p[2];
    return span;
  }));
}

// Each token's share of a delta, from its UTF-8 bytes (a token that only starts a character gets
// "", the one that completes it the whole character); the pieces join to the delta.
function splitDelta(delta, entries) {
  const chars = Array.from(delta), pieces = [];
  let bytes = [], done = 0;
  for (const e of entries) {
    bytes = bytes.concat(e.bytes || []);
    const now = Math.min(Array.from(new TextDecoder().decode(new Uint8Array(bytes)).replace(/\uFFFD+$/, "")).length,
                         chars.length);
    pieces.push(chars.slice(done, now).join(""));
    done = Math.max(done, now);
  }
  if (pieces.length && done < chars.length) pieces[pieces.length - 1] += chars.slice(done).join("");
  return pieces;
}

function applyTokens(ev) {
  if (!ev.logprobs && !(typeof ev.offset === "number" && ev.offset < state.length)) return;
  state.tokens = state.tokens.slice(0, ev.index || 0);     // a rewind cuts at its token index
  let at = typeof ev.offset === "number" ? ev.offset : state.length;
  const entries = ev.logprobs || [];
  splitDelta(ev.delta || "", entries).forEach((piece, i) => {
    state.tokens.push({ start: at, text: piece, entry: entries[i] });
    at += Array.from(piece).length;
  });
  pending.redraw = true;
}

function color(p) { return `hsla(${Math.round(120 * Math.max(0, Math.min(1, p)))}, 75%, 62%, 0.45)`; }

// The answer as one span per token (textContent only), with its alternatives in a hover box.
// Spans already on screen are kept: only new tokens are appended and a rewind removes the cut
// ones, so the alternatives box under the mouse stays put (and clickable) while the answer streams.
let drawnTokens = [];   // [{ token, span }] in ui.output, in order
let restNode = null;    // text after the last token (held back at the end), shown plainly

function tokenSpan(t) {
  const span = document.createElement("span");
  const p = Math.exp(t.entry.logprob);
  span.className = "ms-tok";
  span.style.background = color(p);
  span.dataset.offset = t.start;
  span.dataset.p = p.toFixed(4);
  span.append(document.createTextNode(t.text));
  const tip = document.createElement("span");
  tip.className = "ms-tip";
  tip.append(document.createTextNode(`${JSON.stringify(t.entry.token)} ${(100 * p).toFixed(1)}%`));
  for (const alt of t.entry.top_logprobs || []) {
    const b = document.createElement("button");
    b.className = "ms-alt" + (alt.token_id === t.entry.token_id ? " ms-chosen" : "");
    b.dataset.offset = t.start;
    b.dataset.token = alt.token_id;
    b.textContent = `${JSON.stringify(alt.token)} ${(100 * Math.exp(alt.logprob)).toFixed(1)}%`;
    tip.append(b);
  }
  span.append(tip);
  return span;
}

function renderTokens() {
  if (!restNode || restNode.parentNode !== ui.output) {   // a new run (or plain text drawn before): start over
    drawnTokens = [];
    restNode = document.createTextNode("");
    ui.output.replaceChildren(restNode);
  }
  let keep = 0;
  while (keep < drawnTokens.length && keep < state.tokens.length && drawnTokens[keep].token === state.tokens[keep]) keep++;
  for (const gone of drawnTokens.splice(keep)) gone.span.remove();
  for (const t of state.tokens.slice(keep)) {
    const span = tokenSpan(t);
    ui.output.insertBefore(span, restNode);
    drawnTokens.push({ token: t, span });
  }
  const last = state.tokens[state.tokens.length - 1];
  const covered = last ? last.start + Array.from(last.text).length : 0;
  restNode.textContent = Array.from(state.text).slice(covered).join("");
}

// Clicking an alternative: regenerate from that token's place, starting with the alternative.
ui.output.addEventListener("click", async (e) => {
  const alt = e.target.closest && e.target.closest(".ms-alt");
  if (!alt || !state.streamId) return;
  if (!state.running) { setStatus(["the answer has ended; branch while it streams (or generate again)", "err"]); return; }
  const response = await fetch(`/v1/streams/${encodeURIComponent(state.streamId)}/rewind`, {
    method: "POST", headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({ offset: parseInt(alt.dataset.offset, 10), token_id: parseInt(alt.dataset.token, 10) }) })
    .catch(() => null);
  if (response && !response.ok) setStatus([await errorText(response), "err"]);
  else state.branches += 1;
});

// text = text[:offset] + delta, with offsets in code points (Array.from splits surrogate pairs
// correctly; String.prototype.slice would count UTF-16 units and cut an emoji in half).
function applyText(ev) {
  const delta = ev.delta || "";
  const offset = typeof ev.offset === "number" ? ev.offset : state.length;
  state.revision = ev.revision || 0;
  if (offset === state.length) {          // the common case: append
    state.text += delta;
    pending.text += delta;
  } else {                                // a rewind: replace from offset on and redraw
    state.text = Array.from(state.text).slice(0, offset).join("") + delta;
    pending.redraw = true;
  }
  state.length = offset + Array.from(delta).length;
  const committed = typeof ev.committed === "number" ? ev.committed : state.length;
  // Anything provisional (now or before) is drawn in two parts; plain streams keep appending.
  if (committed < state.length || state.committed < state.prevLength) pending.redraw = true;
  state.committed = committed;
  state.prevLength = state.length;
}

function handle(ev) {
  if (ev.seq <= state.lastSeq) return;          // a replayed event we already have
  state.lastSeq = ev.seq;
  state.streamId = ev.stream_id;
  state.seqs.push(ev.seq);
  if (ev.type === "text") {
    if (state.confidence) applyTokens(ev);
    applyText(ev);
  } else if (ev.type === "image") {
    state.frames += 1;
    pending.image = "data:" + ev.mime + ";base64," + ev.data;
  }
  let line = `stream ${String(ev.stream_id).slice(0, 8)} · seq ${ev.seq}`;
  if (ev.type === "image") line += ` · step ${ev.step}/${ev.total_steps}`;
  if (state.revision) line += ` · revision ${state.revision}`;
  if (state.reconnects) line += ` · reconnects ${state.reconnects}`;
  const parts = [line];
  if (ev.type === "error") {
    state.error = ev.error;
    parts.push(" · ", ["error: " + String(ev.error && ev.error.message), "err"]);
  }
  if (ev.is_final) {
    state.finalEvent = ev;
    parts.push(" · ", ["is_final ✓ " + String(ev.finish_reason || ev.type), "final", "final"]);
  }
  setStatus(...parts);
}

// Read an SSE body incrementally; returns when the body ends (cleanly or not).
async function readSSE(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) handle(JSON.parse(data.join("\n")));
      if (state.finalEvent) { reader.cancel().catch(() => {}); return; }
    }
  }
}

async function errorText(response) {
  try { const body = await response.json(); return body.error ? body.error.message : JSON.stringify(body); }
  catch (e) { return response.status + " " + response.statusText; }
}

async function run(kind, body) {
  Object.assign(state, { streamId: null, token: null, lastSeq: -1, text: "", length: 0, committed: 0, prevLength: 0,
                         revision: 0, frames: 0,
                         finalEvent: null, reconnects: 0, error: null, running: true, seqs: [], kind,
                         tokens: [], confidence: kind === "text" && !!body.logprobs, branches: 0 });
  pending.text = ""; pending.redraw = false;
  if (kind === "text") ui.output.textContent = "";   // an image run keeps the last text on screen
  ui.go.disabled = true; ui.stop.disabled = false; ui.finish.disabled = kind !== "image";
  setStatus("starting…");
  controller = new AbortController();
  let attempt = 0;
  try {
    let response = await fetch("/v1/" + kind, { method: "POST", body: JSON.stringify(body), signal: controller.signal,
                                                headers: headers({ "Content-Type": "application/json" }) });
    if (!response.ok) { setStatus([await errorText(response), "err"]); return; }
    state.streamId = response.headers.get("X-Stream-Id");
    state.token = response.headers.get("X-Resume-Token");
    for (;;) {
      try { await readSSE(response); } catch (e) { if (controller.signal.aborted) return; }
      if (state.finalEvent || controller.signal.aborted) return;
      // The connection dropped before the final event: resume after the last event we have.
      attempt += 1;
      if (attempt > 8) { setStatus(["connection lost; gave up after 8 tries", "err"]); return; }
      state.reconnects += 1;
      setStatus(`connection lost; resuming after seq ${state.lastSeq} (try ${attempt})…`);
      await new Promise((r) => setTimeout(r, Math.min(250 * 2 ** (attempt - 1), 4000)));
      try {
        response = await fetch(`/v1/streams/${encodeURIComponent(state.streamId)}/events`, { signal: controller.signal,
                                 headers: headers({ "Last-Event-ID": String(state.lastSeq) }) });
      } catch (e) { if (controller.signal.aborted) return; continue; }
      if (response.status === 204) return;                   // nothing left: it had ended
      if (!response.ok) { setStatus([await errorText(response), "err"]); return; }
      attempt = 0;
    }
  } finally {
    state.running = false;
    ui.go.disabled = false; ui.stop.disabled = true; ui.finish.disabled = true;
  }
}

ui.go.addEventListener("click", () => {
  const kind = document.querySelector("input[name=kind]:checked").value;
  const amount = parseInt(ui.amount.value, 10) || undefined;
  const beams = parseInt(ui.beams.value, 10) || 1;
  const body = kind === "text" ? Object.assign({ prompt: ui.prompt.value, max_new_tokens: amount },
                                               beams > 1 ? { num_beams: beams } : {})
                               : { prompt: ui.prompt.value, steps: amount };
  if (kind === "text" && ui.confidence.checked) Object.assign(body, { logprobs: true, top_logprobs: 5 });
  run(kind, body);
});

ui.stop.addEventListener("click", async () => {
  if (state.streamId) {
    // Ask the server to cancel: the stream then ends with finish_reason "cancelled".
    await fetch(`/v1/streams/${encodeURIComponent(state.streamId)}`, { method: "DELETE", headers: headers() })
      .catch(() => {});
  }
});

// "Use this": stop the image now and keep it (the final is the current estimate, full quality).
ui.finish.addEventListener("click", async () => {
  if (!state.streamId) return;
  const response = await fetch(`/v1/streams/${encodeURIComponent(state.streamId)}/finish`, { method: "POST",
                                                                                          headers: headers() })
    .catch(() => null);
  if (response && !response.ok) setStatus([await errorText(response), "err"]);
});
