"""Every argument checked before a model loads, in one place for every command.

Loading a model takes seconds (the embedded text model 5-14 s on a busy machine); a newcomer's
``--temperature -1``, ``--steps 0`` or ``--preview foo`` used to be refused only after it. Now
`multistream.cli.main` calls `check_arguments` right after parsing, before any command runs:

- the generation options (the flags `add_cli_options` made from a family's spec, declared with
  `declare_options`) go through the spec's own check of each option, so the message names the flag,
  then through the family's parse function (the very one the model runs), for the checks that span
  options (``--num-beams 2 --temperature 0.7``, a speech text that is empty or too long);
- each command's own checks (its output paths: `multistream.cli._files`) run next.

A bad value is an `InvalidArgumentError`; `main` prints it on one line and exits with status 2. The
flags that are not options of a spec (``--port``, ``--strip-frames``) check their value in argparse
with `integer` and `number`, and argparse errors are one line too (`OneLineParser`).

Example:
    >>> import argparse
    >>> from multistream.text import TextOptions, parse_text_options
    >>> p = argparse.ArgumentParser()
    >>> _ = declare_options(p, p, TextOptions, lambda args, given: parse_text_options(**given))
    >>> check_arguments(p.parse_args(["--temperature", "-1"]))
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: --temperature: temperature must be a number >= 0 (0 means greedy), got -1.0
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from .._spec import add_cli_options, cli_values, info, option_fields
from ..errors import InvalidArgumentError

__all__ = ["OneLineParser", "check_arguments", "declare_options", "device", "flag_of", "flag_problem", "integer",
           "leave_out", "number", "refuse"]

# torch's device types (c10's DeviceType names), so a --device typo is refused without importing torch.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hip", "meta", "hpu", "mtia", "maia", "xla", "lazy", "ipu", "ve",
                "vulkan", "privateuseone")

#: ``(args, given options) -> anything``: the family's parse function, for the checks that span options.
Finish = Callable[[argparse.Namespace, dict[str, Any]], Any]


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line (the problem, then where the help is), exit
    status 2 as before, instead of a usage block followed by the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def flag_of(name: str) -> str:
    """The flag of option ``name``: ``--max-new-tokens`` for ``max_new_tokens``."""
    return "--" + name.replace("_", "-")


def flag_problem(name: str, exc: Exception) -> InvalidArgumentError:
    """An option's complaint as the command line names it: the flag first, the library's
    ``name=value`` (a Python keyword) as the flag and its value, and its "or None" (a Python
    caller's way to ask for the default) as leaving the flag out.

    Example:
        >>> str(flag_problem("seed", ValueError("seed must be an integer in [0, 2**63) or None, got -1")))
        '--seed: seed must be an integer in [0, 2**63) (or leave --seed out), got -1'
        >>> str(flag_problem("height", ValueError("height=100 is not a multiple of 16; use e.g. height=96")))
        '--height 100 is not a multiple of 16; use e.g. --height 96'
    """
    flag = flag_of(name)
    message, spelled = re.subn(rf"(?<![\w-]){re.escape(name)}=", f"{flag} ", leave_out(str(exc), flag))
    return InvalidArgumentError(message if spelled else f"{flag}: {message}", param=name)


def leave_out(message: str, flag: str) -> str:
    """``message`` with the library's "or None" (a Python caller's way to ask for the default)
    said as leaving ``flag`` out.

    Example:
        >>> leave_out("--video-concurrency must be an integer >= 1 or None, got 0", "--video-concurrency")
        '--video-concurrency must be an integer >= 1 (or leave --video-concurrency out), got 0'
    """
    return re.sub(r" or None(?: \([^)]*\))?", f" (or leave {flag} out)", message)


def declare_options(parser: argparse.ArgumentParser, group: Any, cls: type, finish: Finish, **kwargs: Any) -> list[str]:
    """`add_cli_options` for ``cls`` on ``group`` (a parser or an argument group of ``parser``),
    recorded on ``parser`` so `check_arguments` checks the given values before the command runs;
    ``finish`` is the family's parse function, called with the given options."""
    names = add_cli_options(group, cls, **kwargs)
    parser.set_defaults(option_names=names, option_spec=cls, option_finish=finish)
    return names


def finish_checking_sizes(parse: Callable[..., Any], embedded_sizes: Any) -> Finish:
    """A `declare_options` finish for a diffusion family: ``parse(prompt, **given)``, then, for
    the embedded model (no ``--model``), its sizes (`ImageSizes`), known without loading it, so a
    size it cannot make fails before anything loads."""

    def finish(args: argparse.Namespace, given: dict[str, Any]) -> Any:
        options = parse(args.prompt, **given)
        if args.model is None:
            try:
                embedded_sizes.check(options.height, options.width)
            except InvalidArgumentError as exc:  # named by its flag, as every other option's refusal is
                raise flag_problem(exc.param or "width", exc) from None
        return options

    return finish


def check_options(args: argparse.Namespace) -> None:
    """Each given option through its spec's check, then all of them through the family's parse."""
    cls = getattr(args, "option_spec", None)
    if cls is None:
        return
    given = cli_values(args, args.option_names)
    fields = {f.name: f for f in option_fields(cls)}
    for name, value in given.items():
        check = info(fields[name]).check
        if check is None:
            continue
        try:
            check(value)
        except InvalidArgumentError as exc:
            raise flag_problem(name, exc) from None
    args.option_finish(args, given)


def check_arguments(args: argparse.Namespace) -> None:
    """Every check a command has, before it loads anything: its options, then its own
    ``check_paths(args)`` (set with ``parser.set_defaults``). Raises `InvalidArgumentError`."""
    check_options(args)
    paths = getattr(args, "check_paths", None)
    if paths is not None:
        paths(args)


def check_device_argument(args: argparse.Namespace) -> None:
    """``--device cuda`` where torch has no CUDA, worded for the command line (the loaders' fix names
    ``device='cpu'`` and ``ms.load_text_model``) and said before the model's libraries are imported
    (torch alone: ``multistream video --device cuda`` said it after 5.7 s of diffusers' imports).
    ``speak`` is its loader's to check: its voice may run on onnxruntime's CUDA without torch's."""
    value = getattr(args, "device", None)
    if args.command == "speak" or not isinstance(value, str) or not value.startswith("cuda"):
        return
    import torch

    from .._devices import cuda_problem

    problem = cuda_problem(torch.device(value))
    if problem is not None:
        raise InvalidArgumentError(
            f"--device {value}: {problem}. Fix: leave --device out (auto: CUDA when present, else the CPU) or "
            "pass --device cpu; for CUDA, install a CUDA build of torch on a machine with an NVIDIA GPU")


# The commands whose ``--model`` names a folder, file or hub id, and the model family it loads.
MODEL_COMMANDS = {"text": "text", "image": "image", "video": "video", "speak": "speech"}


def model_problem(value: object, family: str, flag: str = "--model") -> str | None:
    """What is wrong with a model argument that names a folder or hub id (a folder that does not
    exist, a name that is no hub id, a hub id neither cached nor reachable), or None; the
    embedded model's names and ``module:factory`` pass. Torch-free: a fraction of a second. The
    fix names ``flag`` (``--model ./model``), not the Python loader."""
    if not isinstance(value, str) or value.strip().lower() in ("none", "off", "", "default", "auto"):
        return None
    head = value.split(":")[0]
    if ":" in value and not value.startswith(("/", ".", "~")) and "/" not in head:
        return None  # module:factory
    from .._hub import locate
    from ..errors import ModelLoadError

    try:
        locate(value, family=family, pass_as=f"{flag} ./model")
    except ModelLoadError as exc:
        return str(exc)
    return None


def check_model_argument(args: argparse.Namespace) -> None:
    """A command's ``--model``, where it points, before anything heavy is imported
    (`model_problem`): ``multistream text --model ./nope`` took 5 s to say "no such folder", after
    importing torch and transformers; ``multistream serve`` checks its models the same way.
    (``multistream speak --model ./no.onnx`` said "multistream: ... or None for the embedded voice".)"""
    family = MODEL_COMMANDS.get(getattr(args, "command", None) or "")
    if family is None:
        return
    problem = model_problem(getattr(args, "model", None), family)
    if problem is not None:
        raise InvalidArgumentError(f"--model: {problem}")


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=``: an integer in ``[minimum, maximum]``.

    Example:
        >>> integer(1)("3"), integer(0, 65535).__name__
        (3, 'an integer from 0 to 65535')
    """
    want = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give {want}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{value} is out of range; give {want}")
        return value

    parse.__name__ = want  # argparse names the type by it in its own messages
    return parse


def number(minimum: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number ``>= minimum`` (``> minimum`` with ``above``)."""
    want = f"a number {'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {want}") from None
        if value != value or value in (float("inf"), float("-inf")) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"{text} is out of range; give {want}")
        return value

    parse.__name__ = want
    return parse


def device(text: str) -> str:
    """An argparse ``type=`` for ``--device``: ``auto`` or a torch device (``cpu``, ``cuda``,
    ``cuda:1``, ``mps``, ...), checked by its spelling before torch is imported; whether the
    machine has it is the loader's to say.

    Example:
        >>> device("cuda:1")
        'cuda:1'
        >>> device("gpu")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: unknown device 'gpu'; use auto, cpu, cuda or cuda:N (or mps, xpu, ...)
    """
    kind, _, index = text.partition(":")
    if text == "auto" or (kind in DEVICE_TYPES and (not _ or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r}; use auto, cpu, cuda or cuda:N (or mps, xpu, ...)")


device.__name__ = "a device"


def refuse(command: str, exc: Exception) -> int:
    """Print a refused argument on one line and return exit status 2."""
    print(f"multistream {command}: {exc}", file=sys.stderr)
    return 2
