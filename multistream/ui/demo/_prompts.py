"""How the demo asks the LLM for an image prompt (Prompt-to-picture) or a video prompt (the Video
tab's "Write and film"). Needs no gradio (the notebook uses it).

Example:
    >>> prompt_messages("the sun at night", "free")[-1]
    {'role': 'user', 'content': 'the sun at night'}
"""

from __future__ import annotations

__all__ = ["DEFAULT_IDEA", "DEFAULT_VIDEO_IDEA", "prompt_messages", "shapes_prompt_pattern", "shapes_video_pattern",
           "video_prompt_messages"]

#: The Prompt-to-picture tab's first idea. The embedded models get it right end to end: SmolLM2
#: writes "a red circle on a blue background" and the shapes model draws exactly that (checked by
#: tests/ui/test_demo.py on the real models). "the sun over the sea", the old default, came out as "a
#: blue circle on a red background": the 135M model keeps colours an idea names, not ones it implies.
DEFAULT_IDEA = "a red ball in the blue sea"

_SHAPES_SYSTEM = (
    "You turn an idea into a picture description for a tiny image model. It can only draw ONE shape "
    "on a plain background. Shapes: circle, square, triangle, star. Colors: red, green, blue, yellow, "
    "orange, purple, white, black. Reply with one line only, exactly in the form: "
    "a <color> <shape> on a <color> background"
)
_SHAPES_FEW_SHOT = (
    ("the sun at night", "a yellow circle on a black background"),
    ("a pine tree in the snow", "a green triangle on a white background"),
    ("a starfish in the sea", "an orange star on a blue background"),
    ("a plum on the grass", "a purple circle on a green background"),
    ("a box of tomatoes", "a red square on a yellow background"),
)
#: The Video tab's first idea for the LLM to turn into a clip prompt.
DEFAULT_VIDEO_IDEA = "a red ball rolling to the right across the blue sea"

_VIDEO_SHAPES_SYSTEM = (
    "You turn an idea into a description of a short clip for a tiny video model. It can only film ONE shape "
    "moving in a straight line on a plain background. Shapes: circle, square, triangle, star. Colors: red, "
    "green, blue, yellow, orange, purple, white, black. Motions: moving left, moving right, moving up, moving "
    "down. Reply with one line only, exactly in the form: a <color> <shape> moving <direction> on a <color> "
    "background"
)
_VIDEO_SHAPES_FEW_SHOT = (
    ("the sun setting at night", "a yellow circle moving down on a black background"),
    ("a green kite rising into the white sky", "a green triangle moving up on a white background"),
    ("a starfish drifting left in the sea", "an orange star moving left on a blue background"),
    ("a purple box sliding right over the grass", "a purple square moving right on a green background"),
)
_VIDEO_FREE_SYSTEM = (
    "You write short, vivid prompts for a text-to-video model: what is seen and how it moves. Reply with one "
    "line of at most 25 words, no quotes."
)
_FREE_SYSTEM = (
    "You write short, vivid prompts for a text-to-image model. Reply with one line of at most 20 words, "
    "no quotes."
)


def shapes_prompt_pattern() -> str:
    """The embedded image model's whole vocabulary as a regular expression, for ``allowed=``.

    The LLM's decoding is held to it, so what the LLM writes is exactly what gets drawn.

    Example:
        >>> import re
        >>> bool(re.fullmatch(shapes_prompt_pattern(), "a small yellow circle on a blue background"))
        True
    """
    from ..._shapes import COLORS, SHAPES, SIZES

    colors, shapes, sizes = "|".join(COLORS), "|".join(SHAPES), "|".join(SIZES)
    return rf"an? (({sizes}) )?({colors}) ({shapes}) on an? ({colors}) background"


def prompt_messages(idea: str, style: str) -> list[dict[str, str]]:
    """The chat messages that ask the LLM to turn ``idea`` into an image prompt.

    ``style`` is ``"shapes"`` (a few-shot prompt in the embedded image model's vocabulary; pair it
    with ``allowed=shapes_prompt_pattern()``) or ``"free"`` (one vivid line for any model).

    Example:
        >>> msgs = prompt_messages("a fire truck", "shapes")
        >>> msgs[0]["role"], msgs[-1]["content"], len(msgs)
        ('system', 'a fire truck', 12)
    """
    if style == "free":
        return [{"role": "system", "content": _FREE_SYSTEM}, {"role": "user", "content": idea}]
    messages = [{"role": "system", "content": _SHAPES_SYSTEM}]
    for user, assistant in _SHAPES_FEW_SHOT:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": idea})
    return messages


def shapes_video_pattern() -> str:
    """The embedded video model's whole vocabulary (a shape, its colour, its motion, the
    background) as a regular expression, for ``allowed=``: what the LLM writes is what gets filmed.

    Example:
        >>> import re
        >>> bool(re.fullmatch(shapes_video_pattern(), "a red circle moving right on a blue background"))
        True
    """
    from ..._shapes import COLORS, MOTIONS, SHAPES, SIZES

    colors, shapes, sizes = "|".join(COLORS), "|".join(SHAPES), "|".join(SIZES)
    motions = "|".join(MOTIONS)
    return rf"an? (({sizes}) )?({colors}) ({shapes}) ({motions}) on an? ({colors}) background"


def video_prompt_messages(idea: str, style: str) -> list[dict[str, str]]:
    """The chat messages that ask the LLM to turn ``idea`` into a video prompt.

    ``style`` is ``"shapes"`` (few-shot, in the embedded video model's vocabulary; pair it with
    ``allowed=shapes_video_pattern()``) or ``"free"`` (one vivid line for any video model).

    Example:
        >>> msgs = video_prompt_messages("a falling leaf", "shapes")
        >>> msgs[0]["role"], msgs[-1]["content"], len(msgs)
        ('system', 'a falling leaf', 10)
    """
    if style == "free":
        return [{"role": "system", "content": _VIDEO_FREE_SYSTEM}, {"role": "user", "content": idea}]
    messages = [{"role": "system", "content": _VIDEO_SHAPES_SYSTEM}]
    for user, assistant in _VIDEO_SHAPES_FEW_SHOT:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": idea})
    return messages
