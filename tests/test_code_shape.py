"""The shape rules of the codebase, checked on its syntax tree (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shoestring"
MAX_FUNCTION_LINES = 60


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))]


def test_no_function_is_longer_than_60_lines() -> None:
    long = [
        f"{p.relative_to(SRC)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for p, tree in _trees()
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n.end_lineno or n.lineno) - n.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def _package(path: Path) -> str:
    """``train`` for src/shoestring/train/x.py; the module name for a top-level module."""
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_no_module_imports_another_packages_private_names() -> None:
    reach_ins = [
        f"{p.relative_to(SRC)}:{n.lineno} imports {n.module}.{a.name}"
        for p, tree in _trees()
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("shoestring.")
        for a in n.names
        if a.name.startswith("_") and n.module.split(".")[1] != _package(p)
    ]
    assert reach_ins == []
