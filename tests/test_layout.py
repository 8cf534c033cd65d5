"""The shape of ``src/raypp``: no import cycles, small modules, one place that reads the environment.

Read statically with :mod:`ast` (nothing is imported), so these run in well under a second.

Imports. An edge ``a -> b`` is any ``import``/``from ... import`` in module ``a``
naming raypp module ``b``, at any depth (function-level imports count: they run
too). ``from pkg import name`` points at ``pkg.name`` when that is a module, else
at ``pkg`` (its ``__init__``); importing ``pkg.mod`` is an edge to ``pkg.mod``
only, not to every parent package. No cycle may exist among runtime imports.
Imports under ``if TYPE_CHECKING:`` never run, but a cycle through them is a layering
knot all the same: none may exist either.

Packages. The same edges, each module taken as its room (``raypp.engine.scheduler`` ->
``raypp.engine``; a top-level module such as ``raypp.config`` is a room of its own): no
cycle among rooms either, e.g. engine/ importing executor/ while executor/ imports
engine/.

Bench. :mod:`raypp.bench` holds what ``raypp bench`` runs for users; inside raypp only
the CLI (:mod:`raypp.cli`) imports it, so test helpers and lab code that the
bench shares live elsewhere.

Size. No module over ``MAX_LINES`` lines.

The map. ARCHITECTURE.md's "Rooms" block names every room: each package and top-level
module of ``src/raypp`` and each entry at the repository's root (what git does not
ignore; a folder counts as named when a path inside it is); every path it names
exists. The block's format: one path per name, several separated by ", ", then two
spaces and the description; an indented name lies in the folder named above it; a line
indented by ``MAP_DESCRIPTION_INDENT`` or more continues a description.

Environment. raypp's own settings (``RAYPP_*``) are config defaults: a module
"reads raypp settings" when it imports :mod:`raypp.envs` or names a ``"RAYPP_..."``
string next to ``os.environ``/``os.getenv``. Allowed: :mod:`raypp.envs` (declares
every variable), :mod:`raypp.config` (config defaults), :mod:`raypp.logger` (the
raypp logger's level), and two commands that configure their own process, not the
engine: :mod:`raypp.cli` (the root log level, ``RAYPP_LOG_LEVEL``) and
:mod:`raypp.entrypoints.openai.server` (the server's API key, ``RAYPP_API_KEY``).
Ray's own variables (``RAY_ADDRESS``, ``RAY_AUTH_MODE``, ``RAY_CGRAPH_*``) belong to
whoever starts Ray or its actors: only the modules in ``RAY_ENV_USERS``.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_LINES = 450
MAP_DESCRIPTION_INDENT = 20
# module edges that close a cycle among rooms, until their owners move them
ENV_ALLOWED = {
    "raypp.envs", "raypp.config", "raypp.logger", "raypp.cli",
    "raypp.entrypoints.openai.server",
}
RAY_ENV_USERS = {
    "raypp.executor.stage_pool",  # joins RAY_ADDRESS, copies RAY_CGRAPH_* to the stage actors
    "raypp.bench.hop",  # copies RAY_CGRAPH_* to its actors
    "raypp.testing.multinode",  # starts a simulated cluster
}
_ENV_FUNCTIONS = {"environ", "getenv", "putenv", "unsetenv"}


# -- reading the tree ------------------------------------------------------------------------
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "raypp").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, tree: ast.Module) -> list[tuple[str, bool]]:
    """``(imported name, type-only)`` of every import in the module, at any depth."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.extend((f"{base}.{alias.name}", type_only) for alias in node.names)
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return found


def _target(name: str) -> str | None:
    """The raypp module an imported name resolves to (the longest existing prefix)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph(with_type_only: bool) -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = {_target(name) for name, type_only in _imports(module, tree)
                 if with_type_only or not type_only}
        graph[module] = {t for t in edges if t is not None and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _room(module: str) -> str:
    """``raypp.engine.scheduler`` -> ``raypp.engine``; ``raypp.config`` -> itself."""
    return ".".join(module.split(".")[:2])


def _room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {_room(m): set() for m in graph}
    for module, targets in graph.items():
        rooms[_room(module)] |= {_room(t) for t in targets if _room(t) != _room(module)}
    return rooms


def _map_names() -> dict[Path, int]:
    """Every path ARCHITECTURE.md's Rooms block names, with its line number."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = re.search(r"^## Rooms\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert block, "ARCHITECTURE.md has no fenced block under '## Rooms'"
    first_line = text[:block.start(1)].count("\n") + 1
    names: dict[Path, int] = {}
    parents: list[tuple[int, Path]] = []  # (indent, folder) of the enclosing folders
    for number, line in enumerate(block.group(1).splitlines(), first_line):
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent >= MAP_DESCRIPTION_INDENT:
            continue
        while parents and parents[-1][0] >= indent:
            parents.pop()
        folder = parents[-1][1] if parents else ROOT
        for name in line.strip().split("  ")[0].split(", "):
            assert re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", name), f"line {number}: {name!r} is not a path"
            names[folder / name] = number
            if name.endswith("/"):
                parents.append((indent, folder / name))
    return names


def _root_entries() -> set[Path]:
    """What git tracks at the repository's root (a developer's own untracked folders are
    not rooms); without git, what lies there less .git and what .gitignore names."""
    try:
        tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True,
                                 text=True, check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        patterns = [p.strip().strip("/") for p in (ROOT / ".gitignore").read_text().splitlines()
                    if p.strip() and not p.startswith("#")]
        return {p for p in ROOT.iterdir() if p.name != ".git"
                and not any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns)}
    return {ROOT / path.split("/", 1)[0] for path in tracked}


def _touches_environment(module: str) -> bool:
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in _ENV_FUNCTIONS
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            return True
        if (isinstance(node, ast.ImportFrom) and node.module == "os"
                and any(alias.name in _ENV_FUNCTIONS for alias in node.names)):
            return True
    return _reads_raypp_settings(module)


def _reads_raypp_settings(module: str) -> bool:
    tree = ast.parse(MODULES[module].read_text())
    if any(_target(name) == "raypp.envs" for name, _ in _imports(module, tree)):
        return True
    names = {n.value for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return _touches_os_environment(tree) and any(s.startswith("RAYPP_") for s in names)


def _touches_os_environment(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr in _ENV_FUNCTIONS
               and isinstance(node.value, ast.Name) and node.value.id == "os"
               for node in ast.walk(tree))


def _lines(module: str) -> int:
    return len(MODULES[module].read_text().splitlines())


# -- the checks ------------------------------------------------------------------------------
def test_the_graph_sees_function_level_and_relative_imports():
    tree = ast.parse("def f():\n    from raypp.entrypoints import args\n"
                     "from . import metrics\nif TYPE_CHECKING:\n    import raypp.llm\n")
    assert _imports("raypp.entrypoints.generate", tree) == [
        ("raypp.entrypoints.args", False), ("raypp.entrypoints.metrics", False),
        ("raypp.llm", True)]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    known = RAY_ENV_USERS
    assert known <= set(MODULES)  # every exception names a module that exists


def test_no_import_cycles():
    assert _cycles(_graph(with_type_only=False)) == set()


def test_type_only_imports_add_no_cycle():
    assert _cycles(_graph(with_type_only=True)) == set()


def test_no_cycles_among_rooms():
    assert _cycles(_room_graph(_graph(with_type_only=True))) == set()


def test_rooms_are_packages_and_top_level_modules():
    assert _room("raypp.engine.scheduler") == "raypp.engine" and _room("raypp.llm") == "raypp.llm"
    graph = {"raypp.a.x": {"raypp.b.y"}, "raypp.b.y": set(), "raypp.b.z": {"raypp.a"},
             "raypp.a": set(), "raypp.c": {"raypp.a.x"}}
    assert _cycles(_room_graph(graph)) == {frozenset({"raypp.a", "raypp.b"})}


def test_the_map_names_every_room_and_nothing_that_is_gone():
    names = _map_names()
    missing = {f"{path.relative_to(ROOT)} (line {n})" for path, n in names.items() if not path.exists()}
    assert missing == set(), "ARCHITECTURE.md's Rooms name paths that do not exist"
    package = SRC / "raypp"
    rooms = {p for p in package.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    named = set(names) | {parent for path in names for parent in path.parents}  # src/ by src/raypp/
    unnamed = sorted(str(p.relative_to(ROOT)) for p in (rooms | _root_entries()) - named)
    assert unnamed == [], "ARCHITECTURE.md's Rooms must name these"
    assert SRC / "raypp" / "engine" in names and ROOT / "tests" in names  # the parse sees rooms


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_only_the_cli_imports_bench():
    importers = {m for m, targets in _graph(with_type_only=True).items()
                 if not _inside(m, "raypp.bench") and any(_inside(t, "raypp.bench") for t in targets)}
    assert importers == {"raypp.cli"}


def test_config_does_not_import_the_stage_or_driver_side():
    """Config validates itself (the fault grammar included) without worker/, engine/ or executor/."""
    sides = ("raypp.worker", "raypp.engine", "raypp.executor")
    assert {t for t in _graph(with_type_only=True)["raypp.config"]
            if any(_inside(t, side) for side in sides)} == set()


def test_modules_are_small():
    large = {m: _lines(m) for m in MODULES if _lines(m) > MAX_LINES}
    assert large == {}


def test_raypp_settings_are_read_only_where_config_is_made():
    readers = {m for m in MODULES if _reads_raypp_settings(m)}
    assert readers <= ENV_ALLOWED, readers - ENV_ALLOWED
    assert {"raypp.envs", "raypp.config"} <= readers  # the checks see real readers


def test_the_environment_is_touched_only_by_config_and_ray_starters():
    touching = {m for m in MODULES if _touches_environment(m)}
    assert touching <= ENV_ALLOWED | RAY_ENV_USERS, touching - ENV_ALLOWED - RAY_ENV_USERS
    assert touching >= RAY_ENV_USERS  # the allow-list names real users only
