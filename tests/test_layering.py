"""The shape of the code that docs/architecture.md draws, held by tests: which part may import which, no import
circles between modules, no back arrows, every module named in the doc, and a test suite whose files share
through tests/conftest.py and helper modules, never by importing one another.

Everything installs under one name, `rlm`: the layout's folders reader/, retriever/ and app/ are the packages
`rlm.reader`, `rlm.retriever` and `rlm.app` (rlm/reader etc. link to them), and `rlm.base` holds what all of them
use. Each layer imports only the layers below it (`LAYERS`, lowest first); `rlm.reader` and `rlm.retriever`
share a layer and import neither each other nor anything above `rlm.base`. No arrow points up.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The folders whose modules are `rlm.<folder>` although they sit beside rlm/ (rlm/<folder> links to them).
LINKED = ("reader", "retriever", "app")
# Lowest first; a module of a layer may import its own layer and the ones before it.
LAYERS = [
    {"rlm.base"},
    {"rlm.reader", "rlm.retriever"},
    {"rlm", "rlm.errors", "rlm.precision", "rlm.cache"},  # rlm/__init__.py is empty
    {"rlm.config"},
    {"rlm.data"},
    {"rlm.components"},
    {"rlm.inference"},
    {"rlm.training"},
    {"rlm.quickstart"},
    {"rlm.app"},
    {"rlm.commands"},
    {"rlm.cli", "rlm.__main__", "rlm.train"},
]
APART = {"rlm.reader": "rlm.retriever", "rlm.retriever": "rlm.reader"}  # one layer, no arrow between them


def library_files() -> list[Path]:
    """Every module the wheel installs, each once: rlm/ without its links, and the linked folders."""
    found = [p for p in (ROOT / "rlm").rglob("*.py") if "metrics_module" not in p.parts]
    for folder in LINKED:
        assert (ROOT / "rlm" / folder).resolve() == (ROOT / folder), f"rlm/{folder} must link to {folder}/"
        found += (ROOT / folder).rglob("*.py")
    return sorted(found)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] in LINKED:
        parts = ("rlm", *parts)
    return ".".join(parts).removesuffix(".__init__")


def imports(path: Path, at_run_time: bool = False) -> list[str]:
    """Every module path `path` imports, functions' lazy imports included (`from a import b` gives a and a.b);
    `at_run_time`: not the ones under `if TYPE_CHECKING:`, which only type checkers follow."""
    tree = ast.parse(path.read_text(), str(path))
    if at_run_time:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in (
                "TYPE_CHECKING",
                "typing.TYPE_CHECKING",
            ):
                node.body = []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def rlm_layer(name: str) -> str:
    """The layer a module belongs to: its sub-package of rlm, or itself for a module directly in rlm/."""
    parts = name.split(".")
    if len(parts) > 1 and ((ROOT / "rlm" / parts[1]).is_dir() or parts[1] in LINKED):
        return f"rlm.{parts[1]}"
    return ".".join(parts[:2])


def module_graph() -> dict[str, set[str]]:
    """Module -> the library modules it imports (a name resolved to the longest module it starts with), types
    named for the checker only (`if TYPE_CHECKING:`) included: a circle a type checker or a reader follows is
    a circle all the same."""
    modules = {module_name(p): p for p in library_files()}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for target in imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def test_every_module_imports_only_its_own_layer_and_the_ones_below():
    rank = {layer: i for i, group in enumerate(LAYERS) for layer in group}
    wrong = []
    for path in library_files():
        own = rlm_layer(module_name(path))
        assert own in rank, f"{own} is in no layer of LAYERS: add it where it belongs"
        for target in imports(path):
            if target.split(".")[0] in LINKED + ("atomicio", "evalmode"):
                wrong.append(f"{path.relative_to(ROOT)} imports {target}: the installed name is rlm.{target}")
            if target.split(".")[0] != "rlm" or target == "rlm":
                continue
            other = rlm_layer(target)
            if rank.get(other, -1) > rank[own] or APART.get(own) == other:
                wrong.append(f"{path.relative_to(ROOT)} imports {target} ({own} may not import {other})")
    assert not wrong, "\n".join(wrong)


def test_the_layer_rule_sees_an_arrow_up_and_one_between_the_model_packages():
    rank = {layer: i for i, group in enumerate(LAYERS) for layer in group}
    assert rank[rlm_layer("rlm.retriever.index")] < rank[rlm_layer("rlm.inference.indexing")]
    assert rank[rlm_layer("rlm.commands.demo")] > rank[rlm_layer("rlm.app.service")]
    assert APART[rlm_layer("rlm.reader.fid")] == rlm_layer("rlm.retriever.search")
    assert module_name(ROOT / "app" / "service.py") == "rlm.app.service"


def test_the_import_graph_has_no_circles():
    graph = module_graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, circles


def test_every_library_module_is_named_in_the_architecture_doc_and_every_package_in_the_readme():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = [
        str(p.relative_to(ROOT))
        for p in library_files()
        if p.name != "__init__.py" and f"`{p.name}`" not in doc and str(p.relative_to(ROOT)) not in doc
    ]
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"
    readme = (ROOT / "README.md").read_text()
    packages = {p.parent.relative_to(ROOT).parts[-1] for p in library_files() if p.name == "__init__.py"}
    assert not [name for name in sorted(packages) if f"`{name}/`" not in readme]


def test_tests_launch_several_processes_only_through_local_port():
    """`make test` runs two pytest-xdist workers: a launch on the default port (accelerate's and torchrun's
    29500) collides with the other worker's and fails with the port in use. tests/local_port.py gives each
    launch a free port."""
    launchers = (
        "accelerate.commands.launch",
        "torch.distributed.run",
        "--main_process_port",
        "--master_port",
    )
    fixed = [
        f"{path.name}: {word}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        if path.name not in ("local_port.py", "test_layering.py")
        for word in launchers
        if word in path.read_text()
    ]
    assert not fixed, fixed


def test_no_test_file_imports_a_test_module():
    """A test module imported by another ties the two files together (a helper moved or renamed in one breaks
    the other; a test or fixture imported by name is collected twice). What tests share lives in
    tests/conftest.py (fixtures) or a helper module that is not a test module (tiny_run.py, local_port.py,
    faiss_gpu_fakes.py, ...)."""
    found = sorted(
        {
            f"{path.name} imports {name.split('.')[0]}"
            for path in (ROOT / "tests").glob("*.py")
            for name in imports(path)
            if name.split(".")[0].startswith("test_")
        }
    )
    assert not found, found
