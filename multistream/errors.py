"""The exception hierarchy: one root, `MultistreamError`, and a subclass per kind of misuse.

Each subclass also derives from the matching built-in (`ValueError`, `RuntimeError`, ...) so code
that already catches those keeps working.

Example:
    >>> import multistream as ms
    >>> try:
    ...     raise ms.InvalidArgumentError("max_new_tokens must be >= 1, got 0")
    ... except ms.MultistreamError as err:
    ...     print(err)
    max_new_tokens must be >= 1, got 0
"""

from __future__ import annotations

__all__ = [
    "EngineClosedError",
    "EventFormatError",
    "InvalidArgumentError",
    "ModelLoadError",
    "MultistreamError",
    "PromptTooLongError",
    "StreamConsumedError",
    "StreamFinishedError",
]


class MultistreamError(Exception):
    """Root of every error multistream raises on purpose."""


class InvalidArgumentError(MultistreamError, ValueError):
    """A call got an argument it cannot use; the message names it and says what would work.

    ``param`` is the argument's name where one argument is at fault (set where the error is
    raised: an option's own check gets it from its declaration), so a server's 400 names the
    parameter without reading the message; None when the fault spans several.

    Example:
        >>> InvalidArgumentError("top_p must be in (0, 1]", param="top_p").param
        'top_p'
    """

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class PromptTooLongError(InvalidArgumentError):
    """The prompt does not fit in the model's context window."""


class StreamConsumedError(MultistreamError, RuntimeError):
    """A stream was iterated again after it ended, was closed, or is being iterated elsewhere."""


class EventFormatError(MultistreamError, ValueError):
    """A wire-form event (a dict from JSON) does not follow the protocol."""


class ModelLoadError(MultistreamError, OSError):
    """A model could not be loaded (missing files, no network for a hub id, bad format)."""


class EngineClosedError(MultistreamError, RuntimeError):
    """A stream was started on a model whose engine was closed (``model.close()``)."""


class StreamFinishedError(InvalidArgumentError):
    """An edit (steer, rewind) was asked of a stream that has already ended or was cancelled."""
