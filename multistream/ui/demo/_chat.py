"""The Chat tab: the answer streams token by token; Steer and Regenerate edit it while it streams.

"JSON": with "Answer as JSON" ticked, the answer is generated under the pasted JSON Schema
(``json_schema=``; empty: any JSON object). It streams in as it is written, then is shown formatted.

"Steer" sends the typed text as a new instruction (``stream.steer``); "Regenerate from here"
rewinds the answer to where the selected words begin, or to a character offset (``rewind``, or
``llm.revise`` once the answer ended). "Show confidence" streams with ``top_logprobs=5`` and
shows the answer's tokens coloured by probability; hovering one lists its top alternatives, and
clicking one branches the answer from that token (``rewind(offset, token_id=alt)``, or
``llm.revise(final, offset, token_id=alt)`` once it ended). The coloured tokens are the chat
answer itself (in its bubble), not a copy elsewhere on the page.

Example:
    >>> content_text([{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}])
    'Hello there'
"""

from __future__ import annotations

import asyncio
import html
import json
from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

from ...errors import MultistreamError
from ...events import TextEvent
from ...stream import Stream
from ..view import LiveView, confidence_html, ending_words, markdown_safe_escape, throttled_views
from ._shared import ActiveRuns, ModelSlot, run_key, ui_error

__all__ = ["SELECTION_JS", "ChatTab", "answer_markup", "chat_stats", "clear_chat", "content_text", "formatted_json",
           "json_schema_option"]

_TOP_ALTERNATIVES = 5

# Selecting text in the chat answer fills "Selected in the answer" (Regenerate from here starts
# where it begins); the server finds it in the raw answer, so markdown rendering cannot shift the offset.
SELECTION_JS = """() => {
  document.addEventListener("mouseup", () => {
    const sel = window.getSelection();
    const chat = document.getElementById("ms-chatbot");
    const box = document.querySelector("#ms-chat-selection textarea");
    if (!sel || sel.isCollapsed || !chat || !box || !chat.contains(sel.anchorNode)) return;
    box.value = sel.toString();
    box.dispatchEvent(new Event("input", { bubbles: true }));
  });
  // "Show confidence": clicking an alternative token branches the answer from it.
  document.addEventListener("click", (e) => {
    const alt = e.target.closest && e.target.closest("#ms-chatbot .ms-alt");
    if (!alt) return;
    const box = document.querySelector("#ms-chat-branch textarea");
    const go = document.getElementById("ms-chat-branch-go");
    if (!box || !go) return;
    // The chat's sanitizer drops data attributes: the offset and token id are also classes.
    const cls = (re) => (alt.className.match(re) || [])[1];
    const offset = alt.dataset.offset ?? cls(/(?:^| )ms-o([0-9]+)/), token = alt.dataset.token ?? cls(/(?:^| )ms-t([0-9]+)/);
    if (offset === undefined || token === undefined) return;
    box.value = offset + ":" + token;
    box.dispatchEvent(new Event("input", { bubbles: true }));
    setTimeout(() => go.click(), 50);
  });
}"""


def content_text(content: Any) -> str:
    """A chat message's text, whatever shape Gradio hands it in (str, dict, list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or content.get("content") or "")
    if isinstance(content, (list, tuple)):
        return "".join(content_text(c) for c in content)
    return ""


def _history(history: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": content_text(m.get("content"))} for m in (history or [])]


def chat_stats(view: LiveView) -> str:
    """The line under the chat: live TTFT and speed while it streams, the result once it ended.

    Example:
        >>> chat_stats(LiveView())
        'waiting for the first token… 0.00 s'
    """
    line = _chat_line(view)
    return f"{line} · revision {view.revision}" if view.revision and view.error is None else line


def answer_markup(view: LiveView, confidence: bool = False) -> str:
    """The answer as the chat bubble shows it: settled text as it is, a beam search's provisional
    tail (which may still be replaced) faded; with ``confidence``, its tokens coloured by probability
    (with their alternatives on hover) once they have logprobs.

    Example:
        >>> from multistream.events import TextEvent
        >>> view = LiveView()
        >>> view.apply(TextEvent(stream_id="s", seq=0, t=0.1, delta="The cat", committed=3))
        >>> answer_markup(view)
        'The<span class="ms-provisional" style="opacity:0.45"> cat</span>'
    """
    if not view.texts:
        return ""
    if confidence and view.tokens:
        return confidence_html(view, markdown_safe=True) + _untokened_tail(view)
    settled, provisional = view.settled(0)
    if not provisional:
        return settled
    return f'{settled}<span class="ms-provisional" style="opacity:0.45">{html.escape(provisional)}</span>'


def _untokened_tail(view: LiveView) -> str:
    """Answer text after the last coloured token (held back by the detokenizer), drawn plainly."""
    last = view.tokens[-1]
    rest = view.text(0)[last.start + len(last.text):]
    return f'<span class="ms-conf">{markdown_safe_escape(rest)}</span>' if rest else ""


def _chat_line(view: LiveView) -> str:
    final = view.final
    if isinstance(final, TextEvent) and final.metrics is not None:
        m, u = final.metrics, final.usage or {}
        ttft = m.get("ttft_ms")
        tps = m.get("tokens_per_s")
        return (
            f"**{ending_words(final.finish_reason)}** · TTFT {ttft:.0f} ms · {tps:.1f} tokens/s · "
            f"{u.get('completion_tokens', view.text_tokens)} tokens in {(m.get('duration_ms') or 0) / 1000:.2f} s"
            if ttft is not None and tps is not None
            else f"**{ending_words(final.finish_reason)}** · {u.get('completion_tokens', view.text_tokens)} tokens"
        )
    if view.error is not None:
        return f"**error** · {view.error.get('type')}: {view.error.get('message')}"
    if view.queued is not None:  # on a busy server: where this request stands in its queue
        return view.queue_note()
    if view.first_text_t is None:
        return f"waiting for the first token… {view.t:.2f} s"
    # Decode speed after the first token: the prefill is already counted in the TTFT.
    decode_s = view.t - view.first_text_t
    rate = f"{(view.text_tokens - 1) / decode_s:.1f}" if view.text_tokens > 1 and decode_s > 0 else "–"
    return f"streaming · TTFT {view.first_text_t * 1000:.0f} ms · {rate} tokens/s · {view.text_tokens} tokens"


def json_schema_option(as_json: bool | None, schema_text: str | None) -> dict[str, Any]:
    """The stream option of the JSON box: none, or ``json_schema`` (empty text: any JSON object).

    Example:
        >>> json_schema_option(True, "")
        {'json_schema': {'type': 'object'}}
        >>> json_schema_option(False, "{}")
        {}
    """
    if not as_json:
        return {}
    text = (schema_text or "").strip()
    if not text:
        return {"json_schema": {"type": "object"}}
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise gr.Error(f"the JSON Schema is not JSON: {exc}") from exc
    return {"json_schema": schema}


def formatted_json(text: str) -> str:
    """A finished JSON answer as an indented code block (the text as it is if it does not parse).

    Example:
        >>> print(formatted_json('{"a": 1}'))
        ```json
        {
          "a": 1
        }
        ```
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return "```json\n" + json.dumps(value, indent=2, ensure_ascii=False) + "\n```"


def clear_chat() -> tuple[list[dict[str, Any]], str]:
    """"Clear": an empty chat and no stats line."""
    return [], ""


class ChatTab:
    """The Chat tab's layout and handlers; each browser session has its own run and last answer.

    Example:
        >>> from multistream.testing import ScriptedTextModel
        >>> with gr.Blocks():                                               # doctest: +SKIP
        ...     ChatTab(ModelSlot("text", ScriptedTextModel()), ActiveRuns(), max_fps=15).build()
    """

    def __init__(self, model: ModelSlot, runs: ActiveRuns, max_fps: float, speech: ModelSlot | None = None) -> None:
        self.model = model
        self.runs = runs
        self.max_fps = max_fps
        self.speech = speech  # "Speak the answer" speaks with it
        self.answers: dict[tuple[str, str], TextEvent] = {}  # each session's last finished answer
        self.live_text: dict[tuple[str, str], str] = {}  # each session's answer as it streams (after edits)

    # -- handlers ------------------------------------------------------------------------------

    async def send(self, message: str, history: list[dict[str, Any]], max_tokens: float, temperature: float,
                   top_p: float, seed: float, beams: float = 1, confidence: bool = False,
                   as_json: bool | None = False, schema_text: str | None = "", speak: bool | None = None,
                   request: gr.Request = None) -> AsyncIterator[tuple[Any, ...]]:  # type: ignore[assignment]
        """"Send": stream the answer to ``message`` after the ``history`` shown so far (``beams`` > 1:
        beam search, its settled text plain and the provisional rest faded; as JSON for the pasted
        schema when "Answer as JSON" is ticked)."""
        model = self.model.get()
        message = (message or "").strip()
        if not message:
            raise gr.Error("type a message first")
        turns = [t for t in _history(history) if t["role"] in ("user", "assistant", "system") and t["content"]]
        prompt = [*turns, {"role": "user", "content": message}]
        structured = json_schema_option(as_json, schema_text)
        k = int(beams or 1)
        # Beam search is greedy: the sampling sliders do not apply to it.
        sampling: dict[str, Any] = {"num_beams": k, "temperature": 0.0} if k > 1 else {
            "temperature": float(temperature), "top_p": float(top_p),
            "seed": None if seed is None or int(seed) < 0 else int(seed)}
        try:
            stream = model.stream(
                prompt,
                max_new_tokens=int(max_tokens),
                **sampling,
                **({"logprobs": True, "top_logprobs": _TOP_ALTERNATIVES} if confidence else {}),
                **structured,
            )
        except MultistreamError as exc:
            raise ui_error(exc) from exc
        shown: list[dict[str, Any]] = [*prompt, {"role": "assistant", "content": ""}]
        key = run_key(request, "chat")
        answer = self._stream_answer(key, stream, shown, None, "waiting for the first token…", bool(confidence),
                                     as_json=bool(structured))
        if speak is None:  # no speech model: the three outputs
            async for out in answer:
                yield out
        elif not speak:
            # The player is hidden and left alone: any value sent to a streaming gr.Audio puts it in
            # a playing state whose hls.js polls an empty playlist (hundreds of console errors).
            async for out in answer:
                yield (*out, gr.skip())
        else:
            async for out in self._spoken(key, answer):
                yield out

    async def _stream_answer(self, key: tuple[str, str], stream: Stream, shown: list[dict[str, Any]],
                             view: LiveView | None, first_note: str,
                             confidence: bool = False, as_json: bool = False) -> AsyncIterator[tuple[Any, ...]]:
        """(chat, input box, stats) updates while ``stream`` writes the last message of ``shown``
        (with ``confidence``, its tokens coloured in the bubble)."""
        self.runs.start(key, stream)
        self.answers.pop(key, None)
        self.live_text.pop(key, None)  # "Speak the answer" must not read the previous answer
        try:
            if view is not None:
                shown[-1] = {"role": "assistant", "content": answer_markup(view, confidence)}
            yield shown, "", first_note
            # `start` is the view to continue (a revision keeps the text before its offset).
            start = view
            async for view in throttled_views(stream, self.max_fps, start):
                shown[-1] = {"role": "assistant", "content": answer_markup(view, confidence)}
                self.live_text[key] = view.text(0) if view.texts else ""
                if view.error is not None:
                    shown[-1]["content"] += f"\n\n⚠️ {view.error.get('message')}"
                elif isinstance(view.final, TextEvent):
                    self.answers[key] = view.final  # "Regenerate from here" revises it once it ended
                    if as_json:  # streamed raw as it was written; shown formatted once complete
                        shown[-1]["content"] = formatted_json(view.final.text or "")
                # The box was cleared once above; now it is left alone, so the user can type an
                # instruction for "Steer" while the answer streams.
                yield shown, gr.skip(), chat_stats(view)
        finally:
            self.runs.end(key, stream)
            self.live_text.pop(key, None)

    def stop(self, request: gr.Request) -> None:
        """"Stop": cancel this session's answer (the model stops within one token)."""
        self.runs.cancel(run_key(request, "chat"))

    def steer(self, instruction: str, request: gr.Request) -> str:
        """"Steer": the typed text becomes a new instruction for the answer being written."""
        instruction = (instruction or "").strip()
        if not instruction:
            raise gr.Error("type how the answer should change (e.g. 'make it shorter'), then press Steer")
        stream = self.runs.get(run_key(request, "chat"))
        if stream is None:
            raise gr.Error("no answer is being written; Steer changes an answer while it streams (use Send)")
        try:
            stream.steer(instruction)
        except MultistreamError as exc:
            raise ui_error(exc) from exc
        return ""

    async def regenerate(self, offset: float | None, selection: str, instruction: str,
                         history: list[dict[str, Any]], request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        """"Regenerate from here": rewind the streaming answer to where the selected text begins
        (or to ``offset`` characters when nothing is selected), or revise the finished answer from
        there (``llm.revise``), optionally under the typed instruction."""
        key = run_key(request, "chat")
        stream = self.runs.get(key)
        final = self.answers.get(key)
        at = self._rewind_point(key, offset, selection, running=stream is not None)
        note = (instruction or "").strip() or None
        if stream is not None:
            try:
                stream.rewind(at, instruction=note)
            except MultistreamError as exc:
                raise ui_error(exc) from exc
            yield gr.skip(), "", gr.skip(), ""  # the running send handler shows the new text
            return
        if final is None or not history:
            raise gr.Error("no answer to regenerate yet; Send a message first")
        async for out in self._revise_finished(key, final, history, at, f"regenerating from character {at}…",
                                               instruction=note):
            yield (*out, "")

    async def branch(self, spec: str, history: list[dict[str, Any]],
                     request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        """A click on an alternative of a coloured token in the answer (``spec`` is ``"offset:token_id"``):
        the answer is regenerated from that token's place, starting with the alternative."""
        try:
            offset_text, token_text = (spec or "").split(":")
            offset, token_id = int(offset_text), int(token_text)
        except ValueError:
            raise gr.Error("click one of the alternatives shown when hovering a token") from None
        key = run_key(request, "chat")
        stream = self.runs.get(key)
        if stream is not None:
            try:
                stream.rewind(offset, token_id=token_id)
            except MultistreamError as exc:
                raise ui_error(exc) from exc
            yield gr.skip(), gr.skip(), gr.skip()  # the running send handler shows the new text
            return
        final = self.answers.get(key)
        if final is None or not history:
            raise gr.Error("no answer to branch yet; Send a message with Show confidence first")
        async for out in self._revise_finished(key, final, history, offset, f"branching at character {offset}…",
                                               confidence=True, token_id=token_id):
            yield out

    async def _revise_finished(self, key: tuple[str, str], final: Any, history: list[dict[str, Any]], at: int,
                               note: str, confidence: bool = False, **edit: Any) -> AsyncIterator[tuple[Any, ...]]:
        """Stream ``llm.revise(final, at, **edit)`` into the last answer, its first ``at``
        characters kept (Regenerate from here, or a click on an alternative)."""
        model = self.model.get()
        revise = getattr(model, "revise", None)
        if revise is None:
            raise gr.Error(f"{type(model).__name__} cannot revise a finished answer")
        try:
            stream = revise(final, at, **edit)
        except MultistreamError as exc:
            raise ui_error(exc) from exc
        shown: list[dict[str, Any]] = list(_history(history))
        kept = (final.text or "")[:at]
        shown[-1] = {"role": "assistant", "content": kept}
        async for out in self._stream_answer(key, stream, shown, LiveView.starting_with(kept), note, confidence):
            yield out

    def _rewind_point(self, key: tuple[str, str], offset: float | None, selection: str, running: bool) -> int:
        """Where "Regenerate from here" starts: the selection's place in the answer, else ``offset``."""
        if selection and selection.strip():
            final = self.answers.get(key)
            text = self.live_text.get(key, "") if running else (final.text or "" if final is not None else "")
            at = text.find(selection)
            if at < 0:
                at = text.find(selection.strip())
            if at < 0:
                raise gr.Error("the selected text is not in the answer (any more); select it again, "
                               "or clear the selection and set 'From character'")
            return at
        if offset is None or int(offset) < 0:
            raise gr.Error("select text in the answer, or set 'From character' (0 = the start)")
        return int(offset)

    async def _spoken(self, key: tuple[str, str], answer: AsyncIterator[tuple[Any, ...]]) -> AsyncIterator[tuple[Any, ...]]:
        """``answer``'s updates with a fourth output, the audio of the answer spoken while it streams
        ("Speak the answer"): each update carries the audio made since the previous one; after
        the text has ended, the rest of the speech follows."""
        from ._speech import speak_while_written

        tts = self.speech.get()  # type: ignore[union-attr]
        writing = [True]
        pending: list[bytes] = []
        rate = [0]
        done = asyncio.Event()

        async def listen() -> None:
            try:
                async for ev in speak_while_written(tts, lambda: self.live_text.get(key), lambda: writing[0]):
                    if not ev.is_final and ev.num_samples:
                        rate[0] = ev.sample_rate
                        pending.append(ev.data)
            finally:
                done.set()

        def take() -> Any:
            if not pending:
                return None
            data = b"".join(pending)
            pending.clear()
            return rate[0], np_samples(data)

        task = asyncio.ensure_future(listen())
        try:
            async for out in answer:
                yield (*out, take())
            writing[0] = False
            while not done.is_set() or pending:
                chunk = take()
                if chunk is not None:
                    yield (*(gr.skip() for _ in range(3)), chunk)
                else:
                    await asyncio.sleep(0.05)
        finally:
            writing[0] = False
            if not done.is_set():
                task.cancel()

    # -- layout --------------------------------------------------------------------------------

    def build(self) -> None:
        """Lay the tab out and wire its events (inside a ``gr.Blocks`` context)."""
        with gr.Tab("Chat", id="chat"):
            if self.model.missing:
                gr.Markdown(f"⚠️ No text model: {self.model.why}")
            chatbot = gr.Chatbot(label="Chat", height=380, elem_id="ms-chatbot")
            with gr.Row():
                msg = gr.Textbox(placeholder="Ask something…", show_label=False, scale=5, elem_id="ms-chat-input")
                send = gr.Button("Send", variant="primary", scale=1, elem_id="ms-chat-send")
                stop = gr.Button("Stop", variant="stop", scale=1, elem_id="ms-chat-stop")
                steer = gr.Button("Steer", scale=1, elem_id="ms-chat-steer")
            with gr.Row():
                selection = gr.Textbox(label="Selected in the answer (select text above)", scale=3, max_lines=2,
                                       elem_id="ms-chat-selection")
                rewind_at = gr.Number(value=0, precision=0, minimum=0, label="or from character", scale=1,
                                      elem_id="ms-chat-offset")
                regenerate = gr.Button("Regenerate from here", scale=2, elem_id="ms-chat-rewind")
            stats = gr.Markdown("", elem_id="ms-chat-stats")
            with gr.Accordion("Sampling", open=False):
                with gr.Row():
                    max_tokens = gr.Slider(1, 512, value=128, step=1, label="Max new tokens", elem_id="ms-chat-max-tokens")
                    temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature (0 = greedy)",
                                            elem_id="ms-chat-temperature")
                    top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="Top-p")
                    seed = gr.Number(value=-1, precision=0, label="Seed (-1 = random)")
                    beams = gr.Slider(1, 8, value=1, step=1, label="Beams (1 = off; >1: greedy beam search)",
                                      elem_id="ms-chat-beams")
            with gr.Accordion("JSON", open=False, elem_id="ms-chat-json-box"):
                as_json = gr.Checkbox(value=False, label="Answer as JSON (constrained to the schema)",
                                      elem_id="ms-chat-json")
                schema_text = gr.Code(value="", language="json", lines=6, interactive=True,
                                      label="JSON Schema (empty: any JSON object)", elem_id="ms-chat-schema")
            with gr.Row():
                confidence = gr.Checkbox(value=False, label="Show confidence (colour tokens by probability; hover "
                                         "for alternatives, click one to branch from it)", elem_id="ms-chat-confidence-on")
                clear = gr.Button("Clear", size="sm")
            if self.speech is not None:
                with gr.Row():
                    speak_on = gr.Checkbox(value=False, label="Speak the answer (audio plays while the text streams)",
                                           elem_id="ms-chat-speak")
                    # Shown only while "Speak the answer" is on: no audio element (and no playlist
                    # polling) on a page that does not speak.
                    spoken = gr.Audio(label="Spoken answer", streaming=True, autoplay=True, interactive=False,
                                      elem_id="ms-chat-audio", visible=False)
                speak_on.change(_player_visibility, speak_on, spoken, api_name=False, queue=False,
                                show_progress="hidden")
            branch_spec = gr.Textbox(elem_id="ms-chat-branch", elem_classes=["ms-hidden"], show_label=False)
            branch_go = gr.Button("branch", elem_id="ms-chat-branch-go", elem_classes=["ms-hidden"])
            inputs = [msg, chatbot, max_tokens, temperature, top_p, seed, beams, confidence, as_json, schema_text]
            outputs = [chatbot, msg, stats]
            # With a speech model, Send also takes "Speak the answer" and streams the spoken answer.
            send_inputs = inputs + [speak_on] if self.speech is not None else inputs
            send_outputs = outputs + [spoken] if self.speech is not None else outputs
            send.click(self.send, send_inputs, send_outputs, api_name="chat", show_progress="hidden")
            msg.submit(self.send, send_inputs, send_outputs, api_name=False, show_progress="hidden")
            stop.click(self.stop, None, None, api_name="stop_chat", queue=False)
            # Typing while the answer streams, then Steer: a new instruction from the next token on.
            steer.click(self.steer, [msg], [msg], api_name="steer_chat", queue=False)
            regenerate.click(self.regenerate, [rewind_at, selection, msg, chatbot],
                             [chatbot, msg, stats, selection], api_name="regenerate_chat", show_progress="hidden")
            branch_go.click(self.branch, [branch_spec, chatbot], outputs, api_name="branch_chat",
                            show_progress="hidden")
            clear.click(clear_chat, None, [chatbot, stats], api_name=False, queue=False)


def _player_visibility(speak: bool) -> Any:
    """The spoken answer's player is on the page only while "Speak the answer" is ticked."""
    return gr.update(visible=bool(speak))


def np_samples(data: bytes) -> Any:
    """16-bit PCM bytes as the numpy array Gradio's audio takes."""
    import numpy as np

    return np.frombuffer(data, dtype="<i2")
