"""List the functions over 60 lines and the classes over 300 lines (the developers' guide's limits) in the given
folders or files (default: sarathi_lite/engine and sarathi_lite/sim). A function's or class's length counts its
lines from the ``def``/``class`` line (decorators included) to its last line. Exit status 1 when any is found.

    python3 scripts/long_code.py [PATH ...]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FUNCTION = 60
MAX_CLASS = 300
DEFAULT = ("sarathi_lite/engine", "sarathi_lite/sim")


def too_long(path: Path) -> list[str]:
    """``path:line kind name lines`` for each function or class of ``path`` over its limit, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = node.end_lineno - first + 1
            is_class = isinstance(node, ast.ClassDef)
            if lines > (MAX_CLASS if is_class else MAX_FUNCTION):
                found.append(f"{path}:{node.lineno} {'class' if is_class else 'def'} {node.name} {lines} lines")
    return found


def main(argv: list[str]) -> int:
    paths = []
    for name in argv or DEFAULT:
        p = Path(name)
        paths += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    found = [line for path in paths for line in too_long(path)]
    print("\n".join(found) if found else f"none over {MAX_FUNCTION} (functions) / {MAX_CLASS} (classes) lines")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
