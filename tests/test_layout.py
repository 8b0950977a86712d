"""The layout holds: module-level imports form no cycle, every import follows an allowed arrow between packages
and docs/design/architecture.md's import table names exactly the arrows there are, every import inside a function
is on a short list of deliberate ones, no module uses another's private names, and the torch-free modules stay
torch-free in a fresh interpreter. The
documentation's layout holds too: README.md stays short, every page under docs/ is reachable by links from it and
every local link resolves, no raw result (JSON) lies under docs/, and every JSON under benchmarks/results/ says
which command, commit and machine made it, with no path of the machine it was made on."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package's sources live in the checkout (setup.py's package_dir).
SOURCES = {"sarathi_lite": ROOT / "sarathi_lite", "sarathi_lite.scheduler": ROOT / "scheduler" / "src",
           "sarathi_lite.kernels": ROOT / "kernels" / "src"}

# Which package may import which (at module level), by the first two name parts: sarathi_lite.X. The root
# package (sarathi_lite/__init__.py) loads its public names lazily and imports none of them here. The table in
# docs/design/architecture.md names the arrows in use (test_the_architecture_import_table_is_the_real_one).
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
    "plan": {"scheduler", "metrics", "bench", "costs", "engine", "sim"},
    "integrations": {"scheduler", "costs", "metrics", "bench", "sim"},
    "cli": {"scheduler", "metrics", "engine", "bench", "sim", "server", "costs", "plan"},
    "__main__": {"cli"},
}

# The imports inside functions the layout allows, each with its reason: (importing module or package, imported
# modules or packages, why). An import inside a function that no entry covers fails the test below; so does an
# entry that no import uses any more.
FUNCTION_IMPORTS = (
    ("sarathi_lite.cli", ("sarathi_lite.engine", "sarathi_lite.bench.replay", "sarathi_lite.bench.http_client",
                          "sarathi_lite.server", "sarathi_lite.sim.profiler", "sarathi_lite.integrations.vllm.simclock",
                          "torch", "uvicorn"),
     "CLI commands that run a model, serve or run vLLM's scheduler load it when they run: building the parser stays "
     "torch- and vLLM-free"),
    ("sarathi_lite.integrations.vllm", ("vllm", "sarathi_lite.integrations.vllm.scheduler",
                                        "sarathi_lite.integrations.vllm.harness"),
     "vLLM's release is checked before any module that needs a supported release is imported, so the plugin's "
     "entry point and its refusal load under every release"),
    ("sarathi_lite", ("tqdm", "pandas", "matplotlib", "httpx", "ray"),
     "optional dependencies, loaded where they are used (progress bars, to_pandas, plots, the HTTP client, Ray "
     "sweeps)"),
    ("sarathi_lite.kernels._flashinfer", ("flashinfer",), "optional: FlashInfer loads only where it is usable"),
    ("sarathi_lite.engine.llm_engine", ("transformers",),
     "the tokenizer: transformers loads only for a checkpoint that ships one"),
    ("sarathi_lite.models.builtin", ("torch", "safetensors", "transformers"),
     "the built-in model's one-time GGUF conversion: resolving a model name stays torch-free"),
    ("sarathi_lite.plan.real", ("sarathi_lite.engine.instances", "sarathi_lite.bench.replay"),
     "the planner's real runs load the engine (torch) only when asked for: planning stays torch-free"),
    ("sarathi_lite.server", ("sarathi_lite.server.app", "uvicorn", "h11"),
     "the server package's limits and flags import without FastAPI; the app and uvicorn's protocol load on use"),
)

TORCH_FREE = ("sarathi_lite", "sarathi_lite.scheduler", "sarathi_lite.metrics", "sarathi_lite.engine.config",
              "sarathi_lite.models.config", "sarathi_lite.bench.workload", "sarathi_lite.bench.results",
              "sarathi_lite.bench.capacity", "sarathi_lite.bench.plots", "sarathi_lite.bench.traces",
              "sarathi_lite.costs", "sarathi_lite.costs.base", "sarathi_lite.costs.memory",
              "sarathi_lite.costs.profiled", "sarathi_lite.costs.roofline", "sarathi_lite.costs.spec",
              "sarathi_lite.costs.calibrated", "sarathi_lite.costs.pipeline", "sarathi_lite.sim.gpu_fit",
              "sarathi_lite.sim.simulator", "sarathi_lite.sim.cost_model",
              "sarathi_lite.cli", "sarathi_lite.plan", "sarathi_lite.plan.real")


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
    target = _from_target(name, is_package, node)
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]


def _from_target(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` statement in module ``name`` imports from, absolute."""
    target = node.module or ""
    if node.level:
        base = name if is_package else name.rpartition(".")[0]
        anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
        target = f"{anchor}.{target}" if target else anchor
    return target


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


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _reaches_in(name: str, module: str) -> bool:
    """Whether module ``name`` may use ``module`` (a dotted name of ours): yes unless a part of it is private
    (``_flashinfer``), which only modules inside the package holding that part may use."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if _private(part) and not _under(name, ".".join(parts[:i])):
            return False
    return True


def private_imports(name: str, source: str, modules: dict[str, Path]) -> list[str]:
    """Where module ``name`` (whose text is ``source``) reaches a private name of another of our modules, at any
    depth: ``from m import _x``, ``import m._x`` or ``m._x`` on a module it imported, where ``_x`` is a function,
    class or constant of ``m``, or a private module of a package ``name`` is not inside."""
    is_package = name in modules and modules[name].name == "__init__.py"
    ours = tuple(SOURCES)
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> our module it is bound to

    def check(module: str, where: int) -> None:
        if module in modules or any(m.startswith(module + ".") for m in modules):  # a module or a package
            if not _reaches_in(name, module):
                found.append(f"{name}:{where} imports the private module {module}")
        elif module.startswith(ours) and _private(module.rpartition(".")[2]):
            found.append(f"{name}:{where} imports {module}")

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                check(a.name, node.lineno)
                bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(name, is_package, node)
            if not target.startswith(ours):
                continue
            check(target, node.lineno)
            for a in node.names:
                check(f"{target}.{a.name}", node.lineno)
                if f"{target}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{target}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                dotted = ".".join([bound[value.id], *reversed(chain)])
                if dotted.rpartition(".")[0] in modules or dotted in modules:
                    check(dotted, node.lineno)
    return found


def test_no_module_imports_a_private_name_of_another():
    modules = _modules()
    bad = [line for name, path in sorted(modules.items()) for line in private_imports(name, path.read_text(), modules)]
    assert not bad, "private names used across modules (make them public or move the code):\n" + "\n".join(bad)


def test_the_private_import_check_finds_every_form():
    modules = _modules()
    source = ("from sarathi_lite.engine.worker import stop_process, _helper\n"
              "from ..engine.llm_engine import _load\n"
              "from sarathi_lite.engine import worker\n"
              "import sarathi_lite.engine.llm_engine as engine\n"
              "import sarathi_lite.kernels._flashinfer\n"
              "from os import _exit\n\n"
              "def f():\n"
              "    from sarathi_lite.kernels import _flashinfer\n"
              "    return worker._free_port(), engine._load(), worker.free_port(), _flashinfer.x, self._own\n")
    assert private_imports("sarathi_lite.sim.fake", source, modules) == [
        "sarathi_lite.sim.fake:1 imports sarathi_lite.engine.worker._helper",
        "sarathi_lite.sim.fake:2 imports sarathi_lite.engine.llm_engine._load",
        "sarathi_lite.sim.fake:5 imports the private module sarathi_lite.kernels._flashinfer",
        "sarathi_lite.sim.fake:9 imports the private module sarathi_lite.kernels._flashinfer",
        "sarathi_lite.sim.fake:10 imports sarathi_lite.engine.worker._free_port",
        "sarathi_lite.sim.fake:10 imports sarathi_lite.engine.llm_engine._load",
    ]  # os's names are not ours; a module of the kernels package may use its private _flashinfer
    assert private_imports("sarathi_lite.kernels.fake", "from ._flashinfer import load_flashinfer\n"
                           "from . import _flashinfer\n", modules) == []


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


# The documentation: pages by reader under docs/, raw results beside the scripts that made them.
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
ARCHITECTURE = DOCS / "design" / "architecture.md"
IMPORT_TABLE_HEADING = "## Which package imports which"
README_MAX_LINES = 200  # what it is, the commands, an example per use, one table, links: the rest is in docs/
PROVENANCE = ("command", "commit", "machine")
# A path of the machine a result was made on (its checkout, scratch or home folders), not a repository path.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:root|tmp|home|work|Users|mnt|var|opt|srv|scratch)(?:/|\b)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.MULTILINE | re.DOTALL)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (a repeated heading's later ones get ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in _BLOCK.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            slug = _anchor(line.lstrip("#"))
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def local_links(page: Path) -> list[tuple[Path, str]]:
    """``(file, anchor)`` for every link of a Markdown page to a file of the repository (web addresses left out;
    code spans and blocks are not text); a link to a heading of the page itself names the page."""
    out = []
    for target in _LINK.findall(_CODE.sub("", page.read_text())):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        out.append(((page.parent / path).resolve() if path else page.resolve(), anchor))
    return out


def reachable_pages(start: Path) -> set[Path]:
    """The Markdown pages reachable from ``start`` by following links, ``start`` included."""
    seen: set[Path] = set()
    todo = [start.resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.is_file():
            continue
        seen.add(page)
        todo.extend(target for target, _ in local_links(page))
    return seen


def test_every_docs_page_is_reachable_from_the_readme():
    reached = reachable_pages(ROOT / "README.md")
    pages = sorted(DOCS.rglob("*.md"))
    assert len(pages) > 10
    unreached = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in reached]
    assert not unreached, f"pages no link from README.md leads to: {unreached}"


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail into a docs page and link it"


def test_every_local_link_of_the_readme_and_the_docs_resolves():
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for target, anchor in local_links(page):
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} does not exist")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_link_check_reads_links_and_headings_as_github_does(tmp_path):
    page = tmp_path / "guide.md"
    page.write_text("# A guide\n\n## The token budget: `chunk_size=\"auto\"`\n\n## Replicas and prefill/decode\n\n"
                    "## Sweeps\n\n## Sweeps\n\nSee [the budget](#the-token-budget-chunk_sizeauto), "
                    "[a result](../results/x.md#top), [vLLM](https://docs.vllm.ai/x.md) and `[code](not/a/link.md)`.\n"
                    "```python\n# not a heading\nd[0](x)\n```\n")
    assert anchors(page) == {"a-guide", "the-token-budget-chunk_sizeauto", "replicas-and-prefilldecode", "sweeps",
                             "sweeps-1"}
    assert local_links(page) == [(page.resolve(), "the-token-budget-chunk_sizeauto"),
                                 ((tmp_path / "../results/x.md").resolve(), "top")]


def test_no_raw_result_lies_under_docs():
    stray = sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.json"))
    assert not stray, f"JSON belongs under benchmarks/results/, beside the script that made it: {stray}"


def _strings(value, where: str = "") -> list[tuple[str, str]]:
    """``(where, text)`` for every string in a JSON value, keys included."""
    if isinstance(value, dict):
        return [item for key, v in value.items() for item in [(f"{where}/{key}", key), *_strings(v, f"{where}/{key}")]]
    if isinstance(value, list):
        return [item for i, v in enumerate(value) for item in _strings(v, f"{where}/{i}")]
    return [(where, value)] if isinstance(value, str) else []


def provenance_problems(name: str, data) -> list[str]:
    """What a result file lacks: a top-level object with a ``command`` (text, or a list of commands), the ``commit``
    it was made at (for results older than this rule: the last commit that changed the file under docs/) and the
    ``machine``; and what it holds that it should not: a path of the machine it was made on."""
    if not isinstance(data, dict):
        return [f"{name}: the top level is a {type(data).__name__}, not an object with {', '.join(PROVENANCE)}"]
    problems = [f"{name}: no {key!r}" for key in PROVENANCE if not data.get(key)]
    # "-dirty": made on a checkout with uncommitted changes to tracked files (bench.results.commit() says so)
    if data.get("commit") and not re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", str(data["commit"])):
        problems.append(f"{name}: commit {data['commit']!r} is no commit id")
    problems += [f"{name}: a machine path at {where or '/'}: {text!r}" for where, text in _strings(data)
                 if MACHINE_PATH.search(text)]
    return problems


def test_every_result_says_which_command_commit_and_machine_made_it():
    files = sorted(RESULTS.rglob("*.json"))
    assert len(files) > 40
    problems = [line for path in files
                for line in provenance_problems(str(path.relative_to(ROOT)), json.loads(path.read_text()))]
    assert not problems, "\n".join(problems)


def test_the_provenance_check_catches_what_it_should():
    good = {"command": "python benchmarks/x.py --out benchmarks/results/x.json", "commit": "49a4cb4",
            "machine": "2-core x86_64 VM", "rows": [{"profile": "benchmarks/results/p.json"}]}
    assert provenance_problems("x", good) == []
    assert provenance_problems("x", [1]) == ["x: the top level is a list, not an object with command, commit, machine"]
    assert provenance_problems("x", {**good, "commit": "", "machine": None}) == ["x: no 'commit'", "x: no 'machine'"]
    assert provenance_problems("x", {**good, "commit": "main"}) == ["x: commit 'main' is no commit id"]
    assert provenance_problems("x", {**good, "commit": "49a4cb4-dirty"}) == []
    assert provenance_problems("x", {**good, "commit": "49a4cb4-wip"}) == ["x: commit '49a4cb4-wip' is no commit id"]
    bad = {**good, "args": {"out": "/tmp/x.json"}, "profiles": "/work/some-lab/profiles",
           "runs": [{"python benchmarks/x.py --out /root/x.json": 1}]}
    assert provenance_problems("x", bad) == [
        "x: a machine path at /args/out: '/tmp/x.json'", "x: a machine path at /profiles: '/work/some-lab/profiles'",
        "x: a machine path at /runs/0/python benchmarks/x.py --out /root/x.json: "
        "'python benchmarks/x.py --out /root/x.json'"]
    assert provenance_problems("x", {**good, "url": "https://github.com/microsoft/vidur/data/profiling"}) == []


def documented_arrows(text: str) -> dict[str, set[str]]:
    """The import table of architecture.md: package -> the packages it imports at module level. A row's package is
    its first name in backticks (``sarathi_lite`` is the root package, ``__init__``); its imports are the names in
    backticks of the second column outside parentheses ("-": none)."""
    section = text.split(IMPORT_TABLE_HEADING, 1)[1]
    rows = {}
    for line in section.splitlines():
        if rows and not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or not cells[0].startswith("`"):
            continue
        package = re.findall(r"`([^`]+)`", cells[0])[0]
        rows["__init__" if package == "sarathi_lite" else package] = set(
            re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cells[1])))
    return rows


def real_arrows() -> dict[str, set[str]]:
    """Package -> the packages its modules import at module level (every package, those importing none too)."""
    arrows: dict[str, set[str]] = {}
    for src, dsts in _graph().items():
        arrows.setdefault(_area(src), set()).update(_area(d) for d in dsts if _area(d) != _area(src))
    return arrows


def test_the_architecture_import_table_is_the_real_one():
    documented, real = documented_arrows(ARCHITECTURE.read_text()), real_arrows()
    assert set(documented) == set(real), (f"packages missing from the table: {sorted(set(real) - set(documented))}; "
                                          f"in the table but not in the code: {sorted(set(documented) - set(real))}")
    wrong = [f"{p}: the table says {sorted(documented[p])}, the code imports {sorted(real[p])}"
             for p in sorted(real) if documented[p] != real[p]]
    assert not wrong, "\n".join(wrong)
    assert all(real[p] <= ALLOWED[p] for p in real if p != "__init__")


def test_the_import_table_parser_reads_names_not_remarks():
    table = (f"{IMPORT_TABLE_HEADING}\n\n| package | imports | torch |\n| --- | --- | --- |\n"
             "| `scheduler` | - (stdlib only) | never |\n"
             "| `costs` | `scheduler`, `models` (its `config`) | never |\n"
             "| `sarathi_lite` (`__init__`) | nothing at import | never |\n\nAfter the table: `engine`.\n")
    assert documented_arrows(table) == {"scheduler": set(), "costs": {"scheduler", "models"}, "__init__": set()}
