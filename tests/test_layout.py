"""The layout holds: module-level imports form no cycle, every import follows an allowed arrow between packages
(docs/architecture.md), every import inside a function is on a short list of deliberate ones, and the torch-free
modules stay torch-free in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package's sources live in the checkout (setup.py's package_dir).
SOURCES = {"sarathi_lite": ROOT / "sarathi_lite", "sarathi_lite.scheduler": ROOT / "scheduler" / "src",
           "sarathi_lite.kernels": ROOT / "kernels" / "src"}

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
    "integrations": {"scheduler", "costs"},
    "cli": {"scheduler", "metrics", "engine", "bench", "sim", "server", "costs"},
    "__main__": {"cli"},
}

# The imports inside functions the layout allows, each with its reason: (importing module or package, imported
# modules or packages, why). An import inside a function that no entry covers fails the test below; so does an
# entry that no import uses any more.
FUNCTION_IMPORTS = (
    ("sarathi_lite.cli", ("sarathi_lite.engine", "sarathi_lite.bench.replay", "sarathi_lite.bench.http_client",
                          "sarathi_lite.server", "sarathi_lite.sim.profiler", "torch", "uvicorn"),
     "CLI commands that run a model or serve load it when they run: building the parser stays torch-free"),
    ("sarathi_lite", ("tqdm", "pandas", "matplotlib", "httpx", "ray"),
     "optional dependencies, loaded where they are used (progress bars, to_pandas, plots, the HTTP client, Ray "
     "sweeps)"),
    ("sarathi_lite.kernels._flashinfer", ("flashinfer",), "optional: FlashInfer loads only where it is usable"),
    ("sarathi_lite.engine.llm_engine", ("transformers",),
     "the tokenizer: transformers loads only for a checkpoint that ships one"),
    ("sarathi_lite.models.builtin", ("torch", "safetensors", "transformers"),
     "the built-in model's one-time GGUF conversion: resolving a model name stays torch-free"),
    ("sarathi_lite.server", ("sarathi_lite.server.app", "uvicorn", "h11"),
     "the server package's limits and flags import without FastAPI; the app and uvicorn's protocol load on use"),
)

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


def _resolve(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The modules an import statement in module ``name`` names: package modules as deep as they exist (``from
    sarathi_lite.bench import replay`` -> ``sarathi_lite.bench.replay``), others as written."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    target = node.module or ""
    if node.level:
        base = name if is_package else name.rpartition(".")[0]
        anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
        target = f"{anchor}.{target}" if target else anchor
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]


def function_imports(name: str, source: str, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """``(function, imported module)`` for every import statement inside a function or method of the module
    ``name`` (whose text is ``source``), at any depth."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name], in_function or not isinstance(child, ast.ClassDef))
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                is_package = name in modules and modules[name].name == "__init__.py"
                found.extend((".".join(scope), m) for m in _resolve(name, is_package, child, modules))
            else:
                visit(child, scope, in_function)

    visit(ast.parse(source), [], False)
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def unlisted_function_imports(name: str, source: str, modules: dict[str, Path],
                              allowed: tuple = FUNCTION_IMPORTS) -> list[str]:
    """The imports inside functions of module ``name`` that no entry of ``allowed`` covers, as text."""
    return [f"{name}: {function} imports {imported}" for function, imported in function_imports(name, source, modules)
            if not any(_under(name, src) and any(_under(imported, dst) for dst in dsts) for src, dsts, _ in allowed)]


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports when it is imported: module-level statements only (an import inside
    a function runs later, if ever), ``if TYPE_CHECKING`` blocks excluded."""
    is_package = path.name == "__init__.py"
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
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update(m for m in _resolve(name, is_package, node, modules) if m in modules)

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


def test_every_function_level_import_is_on_the_list_with_its_reason():
    modules = _modules()
    bad = [line for name, path in sorted(modules.items())
           for line in unlisted_function_imports(name, path.read_text(), modules)]
    assert not bad, "import inside a function, not in FUNCTION_IMPORTS:\n" + "\n".join(bad)
    used = {(src, dst) for name, path in modules.items() for _, imported in function_imports(name, path.read_text(),
                                                                                            modules)
            for src, dsts, _ in FUNCTION_IMPORTS if _under(name, src) for dst in dsts if _under(imported, dst)}
    stale = [(src, dst) for src, dsts, _ in FUNCTION_IMPORTS for dst in dsts if (src, dst) not in used]
    assert not stale, f"FUNCTION_IMPORTS entries no import uses (delete them): {stale}"
    assert all(reason for _, _, reason in FUNCTION_IMPORTS)


def test_a_function_level_import_outside_the_list_fails():
    modules = {**_modules(), "sarathi_lite.engine.fake": ROOT / "fake.py", "sarathi_lite.cli.fake": ROOT / "fake.py"}
    source = ("import os\n"
              "from sarathi_lite.scheduler import Request\n\n"
              "def cost():\n"
              "    from ..sim import simulator\n"
              "    return simulator\n\n"
              "class Engine:\n"
              "    import json\n\n"
              "    def step(self):\n"
              "        def inner():\n"
              "            import sarathi_lite.bench.replay\n"
              "        if True:\n"
              "            from transformers import AutoTokenizer\n")
    assert unlisted_function_imports("sarathi_lite.engine.fake", source, modules) == [
        "sarathi_lite.engine.fake: cost imports sarathi_lite.sim.simulator",
        "sarathi_lite.engine.fake: Engine.step.inner imports sarathi_lite.bench.replay",
        "sarathi_lite.engine.fake: Engine.step imports transformers",
    ]  # module- and class-level imports are the arrows test's, not this one's
    # a CLI command may load the engine and torch when it runs; nothing else
    assert unlisted_function_imports("sarathi_lite.cli.fake", "def cmd():\n    from sarathi_lite.engine.llm import "
                                     "LLM\n    import torch\n", modules) == []
    assert unlisted_function_imports("sarathi_lite.cli.fake", "def cmd():\n    import numpy\n", modules) == [
        "sarathi_lite.cli.fake: cmd imports numpy"]
    only_engine = (("sarathi_lite.engine", ("sarathi_lite.sim",), "a reason"),)
    assert unlisted_function_imports("sarathi_lite.engine.fake", "def f():\n    from ..sim import simulator\n",
                                     modules, only_engine) == []


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
