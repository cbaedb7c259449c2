"""``shoestring.infer`` has no import cycle, counting imports inside functions too, and the
codecs stay a leaf (the KV cache and the weight compressor both build on them)."""

from __future__ import annotations

import ast
from pathlib import Path

import shoestring.infer

PACKAGE = "shoestring.infer"
ROOT = Path(shoestring.infer.__file__).parent


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Sibling modules ``path`` imports anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
            out.add(node.module.split(".")[2])  # type: ignore[union-attr]
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith(PACKAGE + ".")}
    return out


def _graph() -> dict[str, set[str]]:
    modules = {p.stem for p in ROOT.glob("*.py")}
    return {m: _imports(ROOT / f"{m}.py", modules) for m in modules}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_no_import_cycle_inside_infer() -> None:
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check works


def test_codecs_import_nothing_from_infer() -> None:
    graph = _graph()
    assert graph["codecs"] == set()
    assert "codecs" in graph["kvcache"] and "codecs" in graph["quant"]
