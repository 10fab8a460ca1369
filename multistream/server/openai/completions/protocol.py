"""OpenAI's legacy ``POST /v1/completions`` body (`CompletionRequest`) and its checks (`parse_completion`).

Example:
    >>> from multistream.server import ServerSettings
    >>> parse_completion({"prompt": "Once", "max_tokens": 4}, ServerSettings()).max_tokens
    4
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, Field, create_model

from ....text import TextOptions
from ...bodies import check_prompt_limit
from ...http.bodies import LAX_BODY, validate_body
from ...http.problems import Problem
from ...settings import ServerSettings
from .._choices import MAX_CHOICES
from .._protocol import StreamOptions, given_options, max_tokens, option_fields


class _CompletionBase(BaseModel):
    """``POST /v1/completions`` (OpenAI's legacy completions; see the module docstring)."""

    model_config = LAX_BODY
    model: Optional[str] = Field(default=None, description="the served text model: its name (GET /v1/models), \"default\" or \"text\"; another name is 404 model_not_found")
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(description="a string or a list of strings")
    suffix: Optional[str] = Field(default=None, description="not supported (insertion)")
    max_tokens: Optional[int] = Field(default=16, description="an integer >= 0 (0: only score the prompt, with echo)")
    n: Optional[int] = Field(default=None, description="1..8 completions per prompt")
    best_of: Optional[int] = Field(default=None, description="only equal to n")
    stream: Optional[bool] = Field(default=None, description="true: server-sent chunks")
    stream_options: Optional[StreamOptions] = Field(default=None, description="{'include_usage': true}")
    # OpenAI's own meaning, not `TextOptions.logprobs` (a bool): how many alternatives per token.
    logprobs: Optional[int] = Field(default=None, description="0..20: logprobs of each token and that many "
                                    "alternatives")
    echo: Optional[bool] = Field(default=None, description="true: the prompt (and its logprobs) first")
    user: Optional[str] = Field(default=None, description="accepted and ignored")

    def prompts(self) -> list[str]:
        raw = self.prompt
        if isinstance(raw, str):
            return [raw]
        if raw and all(isinstance(p, str) for p in raw):
            return list(raw)  # type: ignore[arg-type]
        if not raw:
            raise Problem(400, "invalid_argument", "prompt is empty; send a string or a list of strings",
                          param="prompt")
        raise Problem(400, "unsupported", "token-id prompts are not supported; send the prompt as text (a string "
                      "or a list of strings)", param="prompt")

    def to_text_options(self, prompt: str, settings: ServerSettings) -> dict[str, Any]:
        """``TextModel.stream`` keyword arguments for one prompt (a raw completion: ``chat=False``)."""
        check_prompt_limit(prompt, settings)
        kwargs: dict[str, Any] = {"prompt": prompt, "chat": False}
        kwargs["max_new_tokens"] = max_tokens(self.max_tokens, "max_tokens", settings, default=16)
        kwargs.update(given_options(self, tuple(n for n in COMPLETION_OPTION_FIELDS if n != "priority")))
        if self.logprobs is not None:
            kwargs["logprobs"], kwargs["top_logprobs"] = True, self.logprobs
        return kwargs


# The completions fields that have a `TextOptions` namesake (type, default, description from the
# spec; vLLM's extensions marked as such).
COMPLETION_OPTION_FIELDS = ("temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
                            "seed", "top_k", "min_p", "repetition_penalty", "priority", "stop_on_repetition",
                            "speculate", "cache_salt")
_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "priority", "stop_on_repetition", "speculate", "cache_salt")


CompletionRequest = create_model(
    "CompletionRequest", __base__=_CompletionBase, __doc__=_CompletionBase.__doc__,
    **option_fields(TextOptions, COMPLETION_OPTION_FIELDS, _EXTENSIONS))


def parse_completion(body: Any, settings: ServerSettings) -> CompletionRequest:
    req = validate_body(CompletionRequest, body, "POST /v1/completions")
    assert isinstance(req, CompletionRequest)
    if req.suffix:
        raise Problem(400, "unsupported", "suffix (inserting text before a suffix) is not supported; send only a "
                      "prompt", param="suffix")
    n = req.n if req.n is not None else 1
    if not 1 <= n <= MAX_CHOICES:
        raise Problem(400, "invalid_argument", f"n must be from 1 to {MAX_CHOICES}, got {n}", param="n")
    if req.best_of not in (None, n):
        raise Problem(400, "unsupported", f"best_of must equal n ({n}); ranking extra completions is not supported",
                      param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise Problem(400, "invalid_argument", f"logprobs must be an integer from 0 to 20, got {req.logprobs}",
                      param="logprobs")
    if req.max_tokens is not None and req.max_tokens < 0:
        raise Problem(400, "invalid_argument", f"max_tokens must be >= 0, got {req.max_tokens}", param="max_tokens")
    if req.max_tokens == 0 and not req.echo:
        raise Problem(400, "invalid_argument", "max_tokens=0 generates nothing; use it with echo: true to score the "
                      "prompt, or ask for at least 1 token", param="max_tokens")
    req.prompts()
    return req
