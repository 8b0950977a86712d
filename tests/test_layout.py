"""The layout holds: module-level imports form no cycle, every import follows an allowed arrow between packages
(docs/architecture.md), and the torch-free modules stay torch-free in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package's sources live in the checkout (setup.py's package_dir).
SOURCES = {"sarathi_lite": ROOT / "sarathi_lite", "sarathi_lite.scheduler": ROOT / "scheduler",
           "sarathi_lite.kernels": ROOT / "kernels"}

# Which package may import which (at module level), by the first two name parts: sarathi_lite.X. The root
# package (sarathi_lite/__init__.py) loads its public names lazily and imports none of them here.
ALLOWED = {
    "scheduler": set(),
    "kernels": set(),
    "metrics": set(),
    "models": {"kernels"},
    "costs": {"scheduler", "metrics", "models"},
    "engine": {"scheduler", "kernels", "models", "metrics", "costs"},
    "bench": {"scheduler", "metrics", "engine"},
    "sim": {"scheduler", "metrics", "models", "engine", "bench", "costs"},
    "server": {"engine"},
    "cli": {"scheduler", "metrics", "engine", "bench", "sim", "costs"},
    "__main__": {"cli"},
}

TORCH_FREE = ("sarathi_lite", "sarathi_lite.scheduler", "sarathi_lite.metrics", "sarathi_lite.engine.config",
              "sarathi_lite.models.config", "sarathi_lite.bench.workload", "sarathi_lite.bench.results",
              "sarathi_lite.bench.capacity", "sarathi_lite.bench.plots", "sarathi_lite.bench.traces",
              "sarathi_lite.costs", "sarathi_lite.costs.base", "sarathi_lite.costs.memory",
              "sarathi_lite.costs.profiled", "sarathi_lite.costs.roofline", "sarathi_lite.costs.spec",
              "sarathi_lite.costs.calibrated", "sarathi_lite.sim.gpu_fit",
              "sarathi_lite.sim.simulator", "sarathi_lite.sim.cost_model", "sarathi_lite.sim.roofline",
              "sarathi_lite.cli")


def _modules() -> dict[str, Path]:
    """Every module of the package by its installed name (``sarathi_lite.scheduler.base``, ...)."""
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports when it is imported: module-level statements only (an import inside
    a function runs later, if ever), ``if TYPE_CHECKING`` blocks excluded."""
    is_package = path.name == "__init__.py"
    base = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:
                    anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                    target = f"{anchor}.{target}" if target else anchor
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in modules:
                        out.add(sub)
                    elif target in modules:
                        out.add(target)

    visit(ast.parse(path.read_text()).body)
    out.discard(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_module_level_imports_have_no_cycle():
    graph = _graph()
    assert len(graph) > 40 and "sarathi_lite.bench.results" in graph and "sarathi_lite.scheduler.base" in graph
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_every_import_follows_an_allowed_arrow():
    bad = sorted(f"{src} -> {dst}" for src, dsts in _graph().items() for dst in dsts
                 if _area(src) != _area(dst) and _area(dst) not in ALLOWED.get(_area(src), set()))
    assert not bad, "\n".join(bad)


def test_the_torch_free_modules_import_without_torch():
    code = ("import importlib, sys\n"
            f"for name in {TORCH_FREE!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert 'torch' not in sys.modules, f'importing {name} imported torch'\n"
            "from sarathi_lite.cli import build_parser\n"
            "build_parser().format_help()\n"
            "assert 'torch' not in sys.modules, 'building the CLI parser imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
