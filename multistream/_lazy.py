"""Names a package loads only when first used, so importing it stays light (no torch, diffusers or
gradio until a model or the demo is asked for). One home for the module ``__getattr__`` that the
package faces (`multistream`, `multistream.text`, `multistream.image`, `multistream.ui.demo`) share.

Example:
    >>> getattr_ = lazy_attributes("json", {"dumps": "json"}, {})
    >>> getattr_("dumps")([1])
    '[1]'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, table: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``table[name]`` (relative to ``package``) on first use of
    ``name`` and keeps the value in ``namespace`` (the module's globals), so later uses cost nothing."""

    def __getattr__(name: str) -> Any:
        module_name = table.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name, package), name)
        namespace[name] = value
        return value

    return __getattr__
