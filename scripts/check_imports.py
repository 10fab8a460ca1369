"""Report (and fail on) what breaks the package's layering: import cycles between its modules and
private names imported from another module. Also counts the modules directly under ``multistream/``.

Every import counts, at module level, inside a function or under ``if TYPE_CHECKING:`` (an
annotations-only import never runs, but a cycle through one still ties two modules together: a
module's types belong below it, e.g. `image/_job.py`). A private name is one that starts with ``_`` (not a dunder);
importing a private *module* (``from .text._model import TextModel``) is how a family's public face
reads its own parts and is fine.

Usage: ``python scripts/check_imports.py [PACKAGE_DIR]`` (default: this checkout's ``multistream``);
exit status 1 when there is a cycle or a private import. The layer contracts themselves are
import-linter's (``lint-imports``, configured in pyproject.toml).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def all_imports(tree: ast.AST) -> list[ast.ImportFrom | ast.Import]:
    """Every import statement of a module, wherever it stands (function bodies, TYPE_CHECKING blocks)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def main(root: Path) -> int:
    modules: dict[str, tuple[Path, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        name, is_package = module_name(path, root)
        modules[name] = (path, is_package)
    top = root.name
    graph: dict[str, set[str]] = {name: set() for name in modules}
    private: list[str] = []
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rsplit(".", 1)[0]
        for node in all_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        graph[name].add(alias.name)
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == top or target.startswith(top + ".")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:  # `from . import module`
                    graph[name].add(sub)
                    continue
                if target in modules:
                    graph[name].add(target)
                if alias.name.startswith("_") and not alias.name.startswith("__") and target != name:
                    private.append(f"{path.relative_to(root.parent)}:{node.lineno}: {alias.name} from {target}")
    # a package's __init__ importing its own submodules is not a cycle with them
    cycles = _cycles(graph)
    direct = sorted(p.name for p in root.iterdir() if (p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists()))
    print(f"modules and packages directly under {top}/: {len(direct)} ({', '.join(direct)})")
    print(f"import cycles: {len(cycles)}")
    for cycle in cycles:
        print("  " + " -> ".join(cycle + [cycle[0]]))
    print(f"private names imported from another module: {len(private)}")
    for line in private:
        print("  " + line)
    return 1 if cycles or private else 0


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle's members."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            # a package and its own submodules (its face re-exporting them) are one unit
            outside = [m for m in component if not any(m != p and m.startswith(p + ".") for p in component)]
            if len(component) > 1 and len(outside) != 1:
                found.append(sorted(component))
            elif len(component) > 1 and not all(m.startswith(outside[0]) for m in component):
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[1] / "multistream"
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else default))
