"""The embedded model's tokenizer without importing transformers.

Importing transformers costs about 0.7 s of every start on a 2-core machine (its package set-up,
its hub and version checks), a quarter of the CLI's time to a first token. The embedded model
needs only what a fast tokenizer does: its ``tokenizer.json`` run by the ``tokenizers`` library
(the Rust code transformers' fast tokenizers call) and its chat template rendered by jinja2 as
transformers renders it (a sandbox, ``trim_blocks``, ``lstrip_blocks``, the same ``tojson`` and
``raise_exception``). `EmbeddedTokenizer` is that, and it answers the calls the engine makes
(``__call__``, ``apply_chat_template``, ``decode``, ``backend_tokenizer``, and for logprob tables
``convert_ids_to_tokens`` and ``all_special_ids``) with the ids and text transformers' tokenizer
gives (``tests/text/test_lean_llama.py`` compares them).

The transformers tokenizer is still what users get as ``llm.tokenizer``, built on first use
(`transformers_tokenizer`). Grammars (llguidance reads ``backend_tokenizer``'s JSON) and logprob
tables use this one, so a first ``json_schema=`` or ``logprobs=`` request does not import
transformers.

Example:
    >>> tok = EmbeddedTokenizer.from_folder(folder)                                    # doctest: +SKIP
    >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)  # doctest: +SKIP
    [1, 9690, 198, ...]
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

__all__ = ["EmbeddedTokenizer"]

# The special-token names transformers passes to every chat template.
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class EmbeddedTokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` + ``chat_template.jinja`` of a model folder,
    encoded and rendered without transformers (see the module docstring).

    Example:
        >>> tok = EmbeddedTokenizer.from_folder(folder)                      # doctest: +SKIP
        >>> tok("Hello", add_special_tokens=False)["input_ids"]              # doctest: +SKIP
        [19556]
    """

    def __init__(self, folder: Path, backend: Any, config: dict[str, Any], chat_template: str | None) -> None:
        self.folder = folder
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens = {name: config[name] for name in _SPECIAL_NAMES if isinstance(config.get(name), str)}
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = backend.token_to_id(eos) if eos is not None else None
        # transformers' all_special_ids: the named special tokens' ids (the embedded model's config
        # lists no additional ones; tests/text/test_lean_llama.py compares the two).
        self.all_special_ids = sorted({i for i in map(backend.token_to_id, self.special_tokens.values()) if i is not None})
        self.model_max_length = int(config.get("model_max_length") or 2048)
        self._template: Any = None
        self._transformers: Any = None
        self._lock = threading.Lock()

    @classmethod
    def from_folder(cls, folder: str | Path) -> EmbeddedTokenizer:
        """The tokenizer saved in ``folder`` (what transformers' ``save_pretrained`` wrote)."""
        from tokenizers import Tokenizer

        folder = Path(folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        return cls(folder, Tokenizer.from_file(str(folder / "tokenizer.json")), config, template)

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """``{"input_ids": [...]}``, as transformers' tokenizer returns for one string."""
        return {"input_ids": list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return str(self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        """The vocabulary's piece for one id (e.g. ``"Ġthe"``), as transformers' method gives it."""
        return self.backend_tokenizer.id_to_token(int(token_id))  # type: ignore[no-any-return]

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, **extra: Any) -> Any:
        """The chat rendered by the model's template (and tokenized: the template writes the special
        tokens, so none are added), as transformers' ``apply_chat_template`` does."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = self._compiled().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **self.special_tokens, **extra)
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text

    def _compiled(self) -> Any:
        if self._template is None:
            self._template = _jinja_environment().from_string(self.chat_template)
        return self._template

    def transformers_tokenizer(self) -> Any:
        """transformers' tokenizer of the same folder, built once, at the first call (it imports
        transformers): what ``llm.tokenizer`` is."""
        with self._lock:
            if self._transformers is None:
                self._transformers = _load_transformers_tokenizer(self.folder)
            return self._transformers


def _jinja_environment() -> Any:
    """The environment transformers renders chat templates in (its ``_compile_jinja_template``)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # transformers' filter: Jinja's own escapes HTML characters.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _load_transformers_tokenizer(folder: Path) -> Any:
    """The class ``tokenizer_config.json`` names, which ``AutoTokenizer`` would pick (its module
    costs 0.3 s of imports that this skips)."""
    named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if named == "TokenizersBackend":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
