// multistream web client: four modes (text, image, speech, video), each with its own options and output.
// POST a request, read the SSE reply with fetch + ReadableStream, and resume with the last event id
// (GET /v1/streams/{id}/events) whenever the connection drops. DOM updates are batched with
// requestAnimationFrame so a fast stream does not thrash layout.
// Everything from the server goes into the page as text (textContent), never as HTML; the API key
// lives in sessionStorage (gone with the tab), and resuming or stopping a stream sends the resume
// token its creation returned.
// The status line is for people: tokens/s and time to first token (TTFT) for text, the step and
// the time left (the events' eta_s) for images, the audio made and its first-audio time for speech,
// "waiting: N ahead" while the request waits in the server's queue (`event: queued`), and the end
// in words ("done", "cancelled", ...).
// Text events carry `offset` (where `delta` begins, in code points: Python's len) and `revision`
// (+1 per steer/rewind): the text is text[:offset] + delta, so a rewind replaces the tail.
// "show confidence" asks for logprobs (top 5): each token is coloured by its probability, hovering
// shows its alternatives, and clicking one rewinds the answer to that token with the alternative
// (POST /v1/streams/{id}/rewind {"offset", "token_id"}) while it streams.
// `committed` says how much of it can no longer change: a beam search (num_beams > 1) shows its
// best hypothesis, whose provisional tail after `committed` is drawn faded (span.provisional).
// Speech (POST /v1/speech) plays as it arrives: each audio event's 16-bit PCM is scheduled on a
// Web Audio clock right after the previous chunk; "Play again" replays it, "Save WAV" keeps the
// final event's whole utterance.
// Video (POST /v1/video): each preview event carries every frame of the clip's current estimate as
// one animated WebP, shown in an <img> (it plays by itself) and replaced per step; the final event
// is the clip (WebM or MP4), played in a looping <video> from a blob URL, with "Save clip". "Use
// this" ends it now with the current estimate through the full VAE, as for an image.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = { go: $("go"), stop: $("stop"), finish: $("finish"), prompt: $("prompt"), key: $("apikey"),
             maxTokens: $("max-tokens"), beams: $("beams"), confidence: $("confidence"), steps: $("steps"),
             seed: $("seed"), speed: $("speed"), output: $("output"), frame: $("frame"), progress: $("progress"),
             spoken: $("spoken"), replay: $("replay"), save: $("save"), status: $("status"),
             videoSteps: $("video-steps"), videoFrames: $("video-frames"), videoSeed: $("video-seed"),
             videoFrame: $("video-frame"), clip: $("clip"), videoProgress: $("video-progress"),
             saveClip: $("save-clip") };
const MODES = ["text", "image", "speech", "video"];
const PROMPTS = { text: "Write a haiku about rivers", image: "a red circle on a blue background",
                  speech: "Hello there! This is multistream speaking, sentence by sentence.",
                  video: "a red circle moving right on a blue background" };
const EDITABLE = ["image", "video"];     // "Use this" keeps what there is: a picture or a clip
ui.key.value = sessionStorage.getItem("multistream.apikey") || "";
ui.key.addEventListener("change", () => sessionStorage.setItem("multistream.apikey", ui.key.value));
try { localStorage.removeItem("multistream.apikey"); } catch (e) { /* older versions kept it there */ }

// Test and debug hook: what the page has seen.
const state = window.__ms = { mode: "text", streamId: null, token: null, lastSeq: -1, text: "", length: 0, committed: 0,
                              revision: 0, frames: 0, finalEvent: null, reconnects: 0, error: null, running: false,
                              seqs: [], kind: null, tokens: [], confidence: false, branches: 0, queued: null,
                              textTokens: 0, firstTokenT: null, lastT: 0, audioChunks: 0, audioSeconds: 0,
                              firstAudioT: null };
const audio = window.__msAudio = { ctx: null, buffers: [], sources: [], next: 0, firstStart: null };
const prompts = Object.assign({}, PROMPTS);
let pending = { text: "", redraw: false, image: null, status: null, spoken: null, progress: null, video: null,
                videoProgress: null, clip: null };
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
    if (pending.image) { drawFrame(pending.image); pending.image = null; }
    if (pending.progress !== null) { ui.progress.style.width = pending.progress + "%"; pending.progress = null; }
    if (pending.video) { drawVideoPreview(pending.video); pending.video = null; }
    if (pending.clip) { showClip(pending.clip); pending.clip = null; }
    if (pending.videoProgress !== null) {
      ui.videoProgress.style.width = pending.videoProgress + "%";
      pending.videoProgress = null;
    }
    if (pending.spoken) { drawSpoken(pending.spoken); pending.spoken = null; }
    if (pending.status) { renderStatus(pending.status); pending.status = null; }
  });
}

// -- modes: each has its own prompt, options and output; switching clears the page ------------

function currentMode() { return document.querySelector("input[name=mode]:checked").value; }

function clearOutputs() {
  ui.output.replaceChildren();
  ui.frame.replaceChildren();            // no <img> at all until an image run sends a frame
  ui.progress.style.width = "0";
  ui.videoFrame.replaceChildren();       // likewise no preview <img> until a video run sends one
  ui.videoProgress.style.width = "0";
  if (ui.clip.src) URL.revokeObjectURL(ui.clip.src);
  ui.clip.removeAttribute("src");
  ui.clip.hidden = true;
  if (ui.saveClip.href) URL.revokeObjectURL(ui.saveClip.href);
  ui.saveClip.removeAttribute("href");
  ui.saveClip.hidden = true;
  ui.spoken.replaceChildren();
  ui.replay.disabled = true;
  if (ui.save.href) URL.revokeObjectURL(ui.save.href);
  ui.save.removeAttribute("href");
  ui.save.hidden = true;
  stopAudio();
  audio.buffers = [];
  restNode = null;
  drawnTokens = [];
  pending = { text: "", redraw: false, image: null, status: null, spoken: null, progress: null, video: null,
              videoProgress: null, clip: null };
}

function showMode(mode) {
  prompts[state.mode] = ui.prompt.value;
  state.mode = mode;
  for (const m of MODES) {
    $(m + "-options").hidden = m !== mode;
    $(m + "-out").hidden = m !== mode;
  }
  ui.finish.hidden = !EDITABLE.includes(mode);
  ui.prompt.value = prompts[mode];
  ui.prompt.placeholder = { text: "Ask or write something", image: "Describe a picture",
                            speech: "Text to speak", video: "Describe a clip (a shape, its colour and where it moves)" }[mode];
  clearOutputs();
  renderStatus(["idle"]);
}

for (const input of document.querySelectorAll("input[name=mode]")) {
  input.addEventListener("change", () => showMode(input.value));
}
ui.prompt.value = prompts.text;

// Which families this server serves (/healthz is open): the others' modes are greyed out.
fetch("/healthz").then((r) => r.json()).then((health) => {
  const served = health && health.models ? Object.keys(health.models) : MODES;
  for (const m of MODES) {
    const input = document.querySelector(`input[name=mode][value=${m}]`);
    if (!served.includes(m)) {
      input.disabled = true;
      $("mode-" + m).title = `this server does not serve a ${m} model`;
    }
  }
}).catch(() => { /* an older server: leave every mode on */ });

// -- status line ----------------------------------------------------------------------------------

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

const ENDINGS = { stop: "done", length: "done (reached the token limit)", stop_sequence: "done (stop sequence)",
                  cancelled: "cancelled", finished_early: "stopped early", repetition: "stopped: it was repeating itself",
                  content_filter: "stopped by the content filter" };

function seconds(s) { return s < 10 ? s.toFixed(1) + " s" : Math.round(s) + " s"; }
function ms(x) { return Math.round(x) + " ms"; }

function endingPart(ev) {
  const reason = String(ev.finish_reason || "stop");
  const cls = reason === "cancelled" ? "cancelled" : "final";
  return [ENDINGS[reason] || reason, cls, "final"];
}

function textStatus(ev) {
  const parts = [];
  if (ev.is_final && ev.type === "text") {
    const m = ev.metrics || {}, u = ev.usage || {};
    const n = u.completion_tokens != null ? u.completion_tokens : state.textTokens;
    parts.push(endingPart(ev), ` · ${n} tokens`);
    if (m.duration_ms != null) parts.push(` in ${seconds(m.duration_ms / 1000)}`);
    if (m.tokens_per_s != null) parts.push(` · ${m.tokens_per_s.toFixed(1)} tokens/s`);
    const ttft = m.ttft_ms != null ? m.ttft_ms : (state.firstTokenT != null ? state.firstTokenT * 1000 : null);
    if (ttft != null) parts.push(` · TTFT ${ms(ttft)}`);
  } else if (state.firstTokenT == null) {
    parts.push("waiting for the first token…");
  } else {
    // Decode speed after the first token: the prefill is counted in the TTFT.
    const decode = state.lastT - state.firstTokenT;
    const rate = state.textTokens > 1 && decode > 0 ? ((state.textTokens - 1) / decode).toFixed(1) : "–";
    parts.push(`writing · ${state.textTokens} tokens · ${rate} tokens/s · TTFT ${ms(state.firstTokenT * 1000)}`);
  }
  return parts;
}

function imageStatus(ev) {
  if (ev.is_final && ev.type === "image") {
    const m = ev.metrics || {};
    const took = m.duration_ms != null ? m.duration_ms / 1000 : ev.t;
    const at = ev.finish_reason === "stop" ? `${ev.total_steps} steps` : `step ${ev.step}/${ev.total_steps}`;
    return [endingPart(ev), ` · ${at} in ${seconds(took)} · ${ev.width}×${ev.height} ` +
            String(ev.mime || "").split("/").pop().toUpperCase()];
  }
  if (ev.type !== "image") return ["starting…"];
  // The server's estimate (eta_s) when it sends one; else the pace so far.
  let left = typeof ev.eta_s === "number" ? ev.eta_s : null;
  if (left !== null) state.serverEtas += 1;
  if (left === null && ev.step > 0) left = (ev.t / ev.step) * (ev.total_steps - ev.step);
  return [`step ${ev.step}/${ev.total_steps}` + (left !== null ? ` · about ${seconds(Math.max(0, left))} left` : "")];
}

function speechStatus(ev) {
  const first = state.firstAudioT != null ? ` · first audio after ${ms(state.firstAudioT * 1000)}` : "";
  if (ev.is_final && ev.type === "audio") {
    const m = ev.metrics || {};
    const dur = ev.duration_s != null ? ev.duration_s : state.audioSeconds;
    const ttfa = m.ttfa_ms != null ? ` · first audio after ${ms(m.ttfa_ms)}` : first;
    const rtf = m.rtf ? ` · made ${(1 / m.rtf).toFixed(1)}× faster than real time` : "";
    return [endingPart(ev), ` · ${seconds(dur)} of audio${ttfa}${rtf}`];
  }
  if (ev.type !== "audio") return ["starting…"];
  return [`speaking · ${seconds(state.audioSeconds)} of audio${first}`];
}

function videoStatus(ev) {
  if (ev.is_final && ev.type === "video") {
    const m = ev.metrics || {};
    const took = m.duration_ms != null ? m.duration_ms / 1000 : ev.t;
    const at = ev.finish_reason === "stop" ? `${ev.total_steps} steps` : `step ${ev.step}/${ev.total_steps}`;
    const clip = `${ev.num_frames} frames at ${ev.fps} fps (${seconds(ev.num_frames / ev.fps)})`;
    return [endingPart(ev), ` · ${at} in ${seconds(took)} · ${clip} · ${ev.width}×${ev.height} ` +
            String(ev.mime || "").split("/").pop().toUpperCase()];
  }
  if (ev.type !== "video") return ["starting…"];
  let left = typeof ev.eta_s === "number" ? ev.eta_s : null;
  if (left !== null) state.serverEtas += 1;
  if (left === null && ev.step > 0) left = (ev.t / ev.step) * (ev.total_steps - ev.step);
  return [`step ${ev.step}/${ev.total_steps} · ${ev.num_frames} frames` +
          (left !== null ? ` · about ${seconds(Math.max(0, left))} left` : "")];
}

function statusFor(ev) {
  const parts = state.kind === "image" ? imageStatus(ev) : state.kind === "speech" ? speechStatus(ev)
    : state.kind === "video" ? videoStatus(ev) : textStatus(ev);
  if (state.revision) parts.push(` · revision ${state.revision}`);
  if (state.reconnects) parts.push(` · reconnected ${state.reconnects}×`);
  if (ev.type === "error") {
    state.error = ev.error;
    return [["error: " + String(ev.error && ev.error.message), "err", "final"]];
  }
  return parts;
}

// `event: queued` {"position": N, "queued": M}: position 1 is next.
function queuedStatus(q) {
  state.queued = q;
  const ahead = Math.max(0, (q.position || 1) - 1);
  setStatus([ahead ? `waiting: ${ahead} ahead` : "waiting: next in line", "queued"],
            ` · ${q.queued} waiting in all`);
}

// -- text ------------------------------------------------------------------------------------------

// The text as committed part (plain) and provisional part (faded), both as text nodes.
function drawText() {
  const chars = Array.from(state.text);
  const cut = Math.min(state.committed, chars.length);
  const provisional = document.createElement("span");
  provisional.className = "provisional";
  provisional.textContent = chars.slice(cut).join("");
  ui.output.replaceChildren(document.createTextNode(chars.slice(0, cut).join("")), provisional);
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
  const n = (ev.token_ids || []).length;
  if (n && state.firstTokenT === null) state.firstTokenT = ev.t;
  state.textTokens += n;
  state.lastT = ev.t;
}

// -- image -----------------------------------------------------------------------------------------

function drawFrame(src) {
  let img = $("preview");
  if (!img) {
    img = document.createElement("img");
    img.id = "preview";
    img.alt = "the picture being made";
    ui.frame.append(img);
  }
  img.src = src;
}

// -- video -----------------------------------------------------------------------------------------

// Every frame of the current estimate, as one animated WebP: an <img> plays it by itself.
function drawVideoPreview(src) {
  let img = $("video-preview");
  if (!img) {
    img = document.createElement("img");
    img.id = "video-preview";
    img.alt = "every frame of the clip being made";
    ui.videoFrame.append(img);
  }
  img.hidden = false;
  img.src = src;
}

// The finished clip in a looping <video>; the preview makes way for it.
function showClip(ev) {
  const blob = new Blob([b64bytes(ev.data)], { type: ev.mime });
  const url = URL.createObjectURL(blob);
  ui.clip.src = url;
  ui.clip.hidden = false;
  const img = $("video-preview");
  if (img) img.hidden = true;
  ui.saveClip.href = URL.createObjectURL(blob);
  ui.saveClip.download = "clip." + (ev.mime.split("/").pop() || "webm");
  ui.saveClip.hidden = false;
  ui.clip.play().catch(() => { /* autoplay refused: the controls are there */ });
}

function applyVideo(ev) {
  if (ev.is_final && String(ev.mime).startsWith("video/")) {
    pending.clip = ev;
    pending.video = null;
  } else {
    // A preview, or a final the server cut short (its newest preview, still a picture).
    state.frames += 1;
    pending.video = "data:" + ev.mime + ";base64," + ev.data;
  }
  pending.videoProgress = ev.is_final ? 100 : (ev.total_steps ? Math.round(100 * ev.step / ev.total_steps) : 0);
}

// -- speech ----------------------------------------------------------------------------------------

function b64bytes(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

function pcmBuffer(bytes, rate) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const n = Math.floor(bytes.byteLength / 2);
  const buffer = audio.ctx.createBuffer(1, Math.max(1, n), rate);
  const ch = buffer.getChannelData(0);
  for (let i = 0; i < n; i++) ch[i] = view.getInt16(2 * i, true) / 32768;
  return buffer;
}

// Each chunk starts where the previous one ends (or now, if playback has caught up).
function play(buffer) {
  const src = audio.ctx.createBufferSource();
  src.buffer = buffer;
  src.connect(audio.ctx.destination);
  const at = Math.max(audio.next, audio.ctx.currentTime + 0.05);
  src.start(at);
  if (audio.firstStart === null) audio.firstStart = at;
  audio.next = at + buffer.duration;
  audio.sources.push(src);
}

function stopAudio() {
  for (const src of audio.sources || []) { try { src.stop(); } catch (e) { /* not started */ } }
  audio.sources = [];
  audio.next = 0;
  audio.firstStart = null;
}

function applyAudio(ev) {
  if (!ev.is_final && ev.data && ev.num_samples) {
    const buffer = pcmBuffer(b64bytes(ev.data), ev.sample_rate);
    audio.buffers.push(buffer);
    if (!state.stopRequested) play(buffer);   // after Stop, chunks still on the way stay silent
    state.audioChunks += 1;
    state.audioSeconds += ev.num_samples / ev.sample_rate;
    if (state.firstAudioT === null) state.firstAudioT = ev.t;
    if (Array.isArray(ev.text_span)) { state.spokenTo = Math.max(state.spokenTo || 0, ev.text_span[1]); }
    pending.spoken = true;
  }
  if (ev.is_final && ev.audio) {
    const blob = new Blob([b64bytes(ev.audio)], { type: "audio/wav" });
    ui.save.href = URL.createObjectURL(blob);
    ui.save.hidden = false;
  }
}

// The text with the part made into audio so far highlighted.
function drawSpoken() {
  const chars = Array.from(state.spokenText || "");
  const mark = document.createElement("mark");
  mark.textContent = chars.slice(0, state.spokenTo || 0).join("");
  ui.spoken.replaceChildren(mark, document.createTextNode(chars.slice(state.spokenTo || 0).join("")));
}

ui.replay.addEventListener("click", () => {
  if (!audio.ctx || !audio.buffers.length) return;
  stopAudio();
  for (const b of audio.buffers) play(b);
});

// -- the stream ------------------------------------------------------------------------------------

function handle(ev) {
  if (ev.seq <= state.lastSeq) return;          // a replayed event we already have
  state.lastSeq = ev.seq;
  state.streamId = ev.stream_id;
  state.seqs.push(ev.seq);
  state.queued = null;
  if (ev.type === "text") {
    if (state.confidence) applyTokens(ev);
    applyText(ev);
  } else if (ev.type === "image") {
    state.frames += 1;
    pending.image = "data:" + ev.mime + ";base64," + ev.data;
    pending.progress = ev.total_steps ? Math.round(100 * ev.step / ev.total_steps) : 100;
  } else if (ev.type === "audio") {
    applyAudio(ev);
  } else if (ev.type === "video") {
    applyVideo(ev);
  }
  if (ev.is_final) state.finalEvent = ev;
  setStatus(...statusFor(ev));
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
      const lines = block.split("\n");
      const name = (lines.find((l) => l.startsWith("event:")) || "").slice(6).trim();
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (!data.length) continue;
      const value = JSON.parse(data.join("\n"));
      if (name === "queued") queuedStatus(value);    // not a protocol event: no seq, never replayed
      else handle(value);
      if (state.finalEvent) { reader.cancel().catch(() => {}); return; }
    }
  }
}

async function errorText(response) {
  try { const body = await response.json(); return body.error ? body.error.message : JSON.stringify(body); }
  catch (e) { return response.status + " " + response.statusText; }
}

function setRunning(running) {
  state.running = running;
  ui.go.disabled = running;
  ui.stop.disabled = !running;
  ui.finish.disabled = !running || !EDITABLE.includes(state.kind);
  // One run at a time, in the mode it started in.
  for (const input of document.querySelectorAll("input[name=mode]")) {
    if (running) { input.dataset.wasDisabled = input.disabled ? "1" : ""; input.disabled = true; }
    else { input.disabled = input.dataset.wasDisabled === "1"; }
  }
}

async function run(kind, path, body) {
  clearOutputs();
  Object.assign(state, { streamId: null, token: null, lastSeq: -1, text: "", length: 0, committed: 0, prevLength: 0,
                         revision: 0, frames: 0, finalEvent: null, reconnects: 0, error: null, seqs: [], kind,
                         tokens: [], confidence: kind === "text" && !!body.logprobs, branches: 0, queued: null,
                         textTokens: 0, firstTokenT: null, lastT: 0, audioChunks: 0, audioSeconds: 0,
                         firstAudioT: null, spokenText: kind === "speech" ? body.text : "", spokenTo: 0,
                         stopRequested: false, serverEtas: 0 });
  if (kind === "speech") { pending.spoken = true; schedule(); }
  setRunning(true);
  setStatus("starting…");
  controller = new AbortController();
  let attempt = 0;
  try {
    let response = await fetch(path, { method: "POST", body: JSON.stringify(body), signal: controller.signal,
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
      setStatus(`connection lost; resuming (try ${attempt})…`);
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
    setRunning(false);
    ui.replay.disabled = !audio.buffers.length;
  }
}

function positiveInt(input, name) {
  const value = Number(input.value);
  if (!Number.isInteger(value) || value < 1) throw new Error(`${name} must be a whole number of at least 1`);
  return value;
}

ui.go.addEventListener("click", () => {
  const kind = currentMode();
  const prompt = ui.prompt.value;
  let path, body;
  try {
    if (kind === "text") {
      path = "/v1/text";
      body = { prompt, max_new_tokens: positiveInt(ui.maxTokens, "max new tokens") };
      const beams = parseInt(ui.beams.value, 10) || 1;
      if (beams > 1) body.num_beams = beams;
      if (ui.confidence.checked) Object.assign(body, { logprobs: true, top_logprobs: 5 });
    } else if (kind === "image") {
      path = "/v1/image";
      body = { prompt, steps: positiveInt(ui.steps, "steps") };
      if (ui.seed.value !== "") body.seed = parseInt(ui.seed.value, 10);
    } else if (kind === "video") {
      path = "/v1/video";
      // Animated WebP previews (every frame, per step) in the model's default preview mode ("tiny":
      // a decoder fitted to its VAE, shipped with the embedded model). The final is the clip (WebM).
      body = { prompt, steps: positiveInt(ui.videoSteps, "steps"), preview_format: "webp" };
      if (ui.videoFrames.value !== "") body.num_frames = positiveInt(ui.videoFrames, "frames");
      if (ui.videoSeed.value !== "") body.seed = parseInt(ui.videoSeed.value, 10);
    } else {
      path = "/v1/speech";
      body = { text: prompt, speed: Number(ui.speed.value) || 1 };
      // The audio clock starts inside the click (browsers let a page play sound after a gesture).
      audio.ctx = audio.ctx || new AudioContext();
      audio.ctx.resume().catch(() => {});
    }
  } catch (e) { setStatus([e.message, "err"]); return; }
  run(kind, path, body);
});

ui.stop.addEventListener("click", async () => {
  state.stopRequested = true;
  if (state.kind === "speech") stopAudio();
  if (state.streamId) {
    // Ask the server to cancel: the stream then ends with finish_reason "cancelled".
    await fetch(`/v1/streams/${encodeURIComponent(state.streamId)}`, { method: "DELETE", headers: headers() })
      .catch(() => {});
  }
});

// "Use this": stop the image or clip now and keep it (the final is the current estimate, full quality).
ui.finish.addEventListener("click", async () => {
  if (!state.streamId) return;
  const response = await fetch(`/v1/streams/${encodeURIComponent(state.streamId)}/finish`, { method: "POST",
                                                                                          headers: headers() })
    .catch(() => null);
  if (response && !response.ok) setStatus([await errorText(response), "err"]);
});
