"""The built-in request traces (package data): ``conversation`` and ``arxiv``. See README.md beside this file."""

from __future__ import annotations

import os
from pathlib import Path

TRACES_ENV = "SARATHI_LITE_TRACES"
BUILTIN_TRACES = ("conversation", "arxiv")
_HERE = Path(__file__).resolve().parent


def trace_path(name_or_path: str | Path) -> Path:
    """The CSV of a built-in trace name (``"conversation"``, ``"arxiv"``), or ``name_or_path`` itself as a path.

    A folder named by ``$SARATHI_LITE_TRACES`` holding ``<name>.csv`` takes precedence over the shipped copy.
    Raises ``ValueError`` for a name that is neither built in nor an existing file.
    """
    text = str(name_or_path)
    if text in BUILTIN_TRACES:
        override = os.environ.get(TRACES_ENV)
        if override and (Path(override) / f"{text}.csv").is_file():
            return Path(override) / f"{text}.csv"
        return _HERE / f"{text}.csv"
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"trace {text!r} is neither a built-in trace ({', '.join(BUILTIN_TRACES)}) nor a file")
    return path


def trace_label(name_or_path: str | Path) -> str:
    """How a trace is recorded in results: its built-in name, else the file's name (never a machine's path)."""
    text = str(name_or_path)
    return text if text in BUILTIN_TRACES else Path(text).name
