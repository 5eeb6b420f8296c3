"""The library's layout, checked from its source (pure: no imports of it, no processes).

The import graph of swarm/ is read with `ast`, imports inside functions included (an import that only a
function makes still ties the two modules together): no module may reach itself through it, and the layers keep
their direction (wire/ is the contract both sides use; client/ calls other peers and never reaches into server/;
watch/ reads what a peer hands it). The rest keeps the tree easy to find one's way in: few plain modules at the
top of swarm/, every package saying what it owns, no file too long to read, and a test suite that needs nothing
from benchmarks/.

`python tests/test_layout.py` prints the figures: plain modules at the top, import cycles, the largest files;
`-v` also prints the whole graph.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "swarm"
SOURCE_FOLDERS = ("swarm", "peers", "tests", "benchmarks", "examples")
MAX_LINES = 450
MAX_TOP_LEVEL_MODULES = 8
# (package, packages it must not import): the direction of the layers
LAYERS = [
    ("swarm.client", ("swarm.server",)),
    ("swarm.watch", ("swarm.server", "swarm.client")),
    ("swarm.wire", ("swarm.server", "swarm.client")),
]


def module_name(path: Path) -> str:
    """swarm/server/service.py -> swarm.server.service; swarm/wire/__init__.py -> swarm.wire"""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse(path: Path) -> ast.Module:
    """ast.parse, tried again on CPython 3.11.7's SystemError "AST constructor recursion depth mismatch": that
    version keeps the AST builder's depth counter in interpreter-wide state, so a parse in another thread of the
    same xdist worker (a library's) can corrupt ours (python/cpython#106905, fixed in 3.11.8)."""
    for attempt in range(5):
        try:
            return ast.parse(path.read_text(), filename=str(path))
        except SystemError:
            if attempt == 4:
                raise
            time.sleep(0.1)
    raise AssertionError("unreachable")


def imported_names(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every module that the file at `path` (module `name`) imports, at any depth of its code, relative imports
    resolved: `from a.b import c` gives a.b.c if that is one of `modules`, else a.b (c is a name in a.b)."""
    tree = parse(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """module -> the swarm modules it imports (itself excluded)."""
    files = {module_name(path): path for path in sorted(LIBRARY.rglob("*.py"))}
    modules = set(files)
    return {name: frozenset(imported_names(path, name, modules) & modules - {name}) for name, path in files.items()}


def cycles(graph: dict[str, frozenset[str]]) -> list[set[str]]:
    """The groups of modules that reach each other through their imports (Tarjan's strongly connected
    components), each of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return groups


def shortest_loop(graph: dict[str, frozenset[str]], group: set[str]) -> list[str]:
    """The shortest path from the group's first module back to itself, within the group (breadth first)."""
    start = min(group)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    return sorted(group)  # not reached: a strongly connected group always has a loop


def describe_cycle(graph: dict[str, frozenset[str]], group: set[str]) -> str:
    """The modules that reach each other, and one loop among them."""
    return f"{', '.join(sorted(group))} (for one: {' -> '.join(shortest_loop(graph, group))})"


def python_files() -> list[Path]:
    return [path for folder in SOURCE_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def top_level_modules() -> list[str]:
    return sorted(path.name for path in LIBRARY.glob("*.py") if path.name != "__init__.py")


def packages() -> list[Path]:
    """Every folder of swarm/ that holds Python files (at any depth below it)."""
    return sorted({path.parent for path in LIBRARY.rglob("*.py")} | {LIBRARY})


# ------------------------------------------------------------------------------------------ the checks


def test_swarm_has_no_import_cycle():
    graph = import_graph()
    groups = cycles(graph)
    assert not groups, "import cycles in swarm/ (imports inside functions count too):\n" + "\n".join(
        describe_cycle(graph, group) for group in groups
    )


def package_of(module: str) -> str:
    """swarm.server.stage -> swarm.server; swarm.routing (a plain module at the top) -> swarm.routing."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    """package -> the packages its modules import. swarm itself (its __init__) is left out: every module imports
    it by being in it, and it only installs what the whole library needs (codecs, fixes to hivemind)."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == "swarm":
            continue
        packages.setdefault(package_of(module), set()).update(
            package_of(target) for target in targets if target != "swarm" and package_of(target) != package_of(module)
        )
    return {package: frozenset(targets) for package, targets in packages.items()}


def test_packages_import_each_other_in_one_direction():
    """A package that imports one that imports it back (at any distance) is one layer cut in two: move the module
    that makes the loop to the package it belongs with."""
    modules, graph = import_graph(), package_graph(import_graph())
    groups = [group for group in cycles(graph) if len(group) > 1]
    culprits = [
        f"{module} imports {target}"
        for group in groups
        for module, targets in sorted(modules.items())
        for target in sorted(targets)
        if package_of(module) in group and package_of(target) in group and package_of(module) != package_of(target)
    ]
    assert not groups, (
        "packages of swarm/ that import each other:\n"
        + "\n".join(describe_cycle(graph, group) for group in groups)
        + "\nthrough:\n"
        + "\n".join(culprits)
    )


# the programs that start peer processes themselves; every other program, and every module a peer runs, does not
LAUNCHERS = ("peers/swarm_demo.py", "peers/gpu_peers.py")


def test_what_starts_local_swarms_stays_out_of_a_peer():
    """swarm/local/ (peer processes on loopback, emulated links) is for swarm-demo, the tests and the benchmarks:
    no module of the library a peer runs imports it, nor any program but those that start peers."""
    graph = import_graph()
    wrong = [
        f"{module} imports {target}"
        for module, targets in sorted(graph.items())
        if not module.startswith("swarm.local")
        for target in sorted(targets)
        if target.startswith("swarm.local")
    ]
    for path in sorted((ROOT / "peers").glob("*.py")):
        if str(path.relative_to(ROOT)) not in LAUNCHERS:
            names = imported_names(path, module_name(path), set())
            wrong += [
                f"{path.relative_to(ROOT)} imports {name}" for name in sorted(names) if name.startswith("swarm.local")
            ]
    assert not wrong, "swarm/local/ imported where a peer runs:\n" + "\n".join(wrong)


def test_every_module_is_on_its_package_map():
    """Each package's __init__ docstring lists its modules (and subpackages) by file name: a newcomer reads one
    docstring to find where a thing lives. A map that names a file that is not there is stale."""
    unlisted, stale = [], []
    for folder in packages():
        init = folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or "" if init.exists() else ""
        names = [path.name for path in folder.glob("*.py") if path.name != "__init__.py"]
        names += [path.name + "/" for path in folder.iterdir() if (path / "__init__.py").exists()]
        unlisted += [f"{folder.relative_to(ROOT)}/{name}" for name in sorted(names) if name not in doc]
        stale += [
            f"{init.relative_to(ROOT)} names {name}"
            for name in re.findall(r"^- ([\w]+\.py)", doc, re.MULTILINE)
            if not (folder / name).exists()
        ]
    assert not unlisted, "modules missing from their package's __init__ map:\n" + "\n".join(unlisted)
    assert not stale, "package maps naming files that are not there:\n" + "\n".join(stale)


@pytest.mark.parametrize(("package", "forbidden"), LAYERS, ids=[package for package, _ in LAYERS])
def test_layers_import_in_one_direction(package: str, forbidden: tuple[str, ...]):
    graph = import_graph()
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module == package or module.startswith(package + ".")
        for target in targets
        if any(target == other or target.startswith(other + ".") for other in forbidden)
    )
    assert not wrong, f"{package} must not import {' or '.join(forbidden)}:\n" + "\n".join(wrong)


def test_few_plain_modules_at_the_top_of_swarm():
    modules = top_level_modules()
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, (
        f"{len(modules)} plain modules at the top of swarm/ (at most {MAX_TOP_LEVEL_MODULES}; "
        f"move each into the package of its family): {', '.join(modules)}"
    )


def test_every_package_says_what_it_owns():
    missing, silent = [], []
    for folder in packages():
        init = folder / "__init__.py"
        if not init.exists():
            missing.append(str(folder.relative_to(ROOT)))
        elif not ast.get_docstring(ast.parse(init.read_text())):
            silent.append(str(init.relative_to(ROOT)))
    assert not missing, f"packages without an __init__.py: {', '.join(missing)}"
    assert not silent, f"__init__.py files without a docstring saying what the package owns: {', '.join(silent)}"


def test_no_python_file_is_too_long():
    long = sorted(
        ((line_count(path), str(path.relative_to(ROOT))) for path in python_files() if line_count(path) > MAX_LINES),
        reverse=True,
    )
    assert not long, f"files over {MAX_LINES} lines (split them by concept):\n" + "\n".join(
        f"{path}: {lines}" for lines, path in long
    )


def benchmark_imports(path: Path) -> list[str]:
    """How the test file at `path` reaches into benchmarks/: imports of it, and benchmarks/ put on sys.path (after
    which its modules import under their bare names)."""
    found = [
        f"imports {name}"
        for name in sorted(imported_names(path, module_name(path), set()))
        if name == "benchmarks" or name.startswith("benchmarks.")
    ]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append"):
            if "benchmarks" in ast.unparse(node):
                found.append(f"puts benchmarks/ on sys.path (line {node.lineno})")
    return found


def test_tests_import_nothing_from_benchmarks():
    wrong = [
        f"{path.relative_to(ROOT)} {how}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for how in benchmark_imports(path)
    ]
    assert not wrong, "tests must not import benchmarks/ (shared helpers live in tests/ or swarm/):\n" + "\n".join(
        wrong
    )


if __name__ == "__main__":
    graph = import_graph()
    print(f"plain modules at the top of swarm/: {len(top_level_modules())} ({', '.join(top_level_modules())})")
    groups = cycles(graph)
    print(f"import cycles in swarm/: {len(groups)}")
    for group in groups:
        print("  " + describe_cycle(graph, group))
    print("largest files:")
    for lines, path in sorted(((line_count(p), p.relative_to(ROOT)) for p in python_files()), reverse=True)[:10]:
        print(f"  {lines:5d} {path}")
    if "-v" in sys.argv:
        for module in sorted(graph):
            print(module, "->", " ".join(sorted(graph[module])))
