"""The core's import graph: no circle, at most 8 levels (a module stands above everything it imports).

Read from the source with ``ast`` (every ``import``: top level, function-local and ``TYPE_CHECKING`` ones
alike, as a reader of the code sees them), so a circle hidden behind a local import still fails here.
"""

import ast
from pathlib import Path

import hdreplay

CORE = Path(hdreplay.__file__).parent
#: the packages above the core (they may import anything below them)
ABOVE = ("integrations", "baselines", "diagnostics", "staleness")
MAX_LEVELS = 8


def _module(path: Path) -> str:
    rel = path.relative_to(CORE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _targets(path: Path, name: str, modules: set[str]) -> set[str]:
    """Modules of the package that ``path`` (module ``name``) imports."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from . import sampling` names a module
                if f"{target}.{alias.name}" in modules:
                    out.add(f"{target}.{alias.name}")
            if node.module and target in modules:  # (`from . import x` imports x, not the package's face)
                out.add(target)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
    out.discard(name)
    return out


def core_graph() -> dict[str, set[str]]:
    files = {p: _module(p) for p in CORE.rglob("*.py")}
    modules = set(files.values())
    graph = {name: _targets(p, name, modules) for p, name in files.items()}
    return {m: {t for t in ts if not _above(t)} for m, ts in graph.items() if not _above(m)}


def _above(module: str) -> bool:
    return module.split(".")[1:2] and module.split(".")[1] in ABOVE


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Level of each module: 1 + the highest level among what it imports (1 = imports nothing of the package).
    Raises AssertionError naming a circle."""
    level: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> int:
        if m in level:
            return level[m]
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        path.append(m)
        level[m] = 1 + max((visit(t) for t in graph[m]), default=0)
        path.pop()
        return level[m]

    for m in sorted(graph):
        visit(m)
    return level


def test_the_core_has_no_import_circle_and_at_most_8_levels():
    graph = core_graph()
    assert "hdreplay.controller" in graph and "hdreplay.selectors" in graph
    level = levels(graph)
    top = max(level.values())
    assert top <= MAX_LEVELS, sorted(level.items(), key=lambda kv: -kv[1])[:6]


def test_selectors_is_a_leaf_and_arrows_point_down():
    graph = core_graph()
    assert graph["hdreplay.selectors"] == set()
    assert "hdreplay.selection" not in graph["hdreplay.config"]
    assert "hdreplay.store.buffer" not in graph["hdreplay.store.state"]  # slot fields live with the storage
    level = levels(graph)
    for low, high in (("hdreplay.store.record", "hdreplay.store.blocks"),
                      ("hdreplay.store.blocks", "hdreplay.store.buffer"),
                      ("hdreplay.store.buffer", "hdreplay.controller"), ("hdreplay.selection", "hdreplay.controller"),
                      ("hdreplay.store.record", "hdreplay.store.ingest"),
                      ("hdreplay.store.ingest", "hdreplay.controller")):
        assert level[low] < level[high], (low, high, level[low], level[high])


def package_graph(root: Path) -> dict[str, set[str]]:
    """The whole package under ``root`` (integrations, baselines, the lab's subpackages included)."""
    files = {p: ".".join(p.relative_to(root.parent).with_suffix("").parts[:-1] if p.name == "__init__.py"
                         else p.relative_to(root.parent).with_suffix("").parts) for p in root.rglob("*.py")}
    modules = set(files.values())
    return {name: _targets(p, name, modules) for p, name in files.items()}


def test_neither_the_core_nor_the_lab_has_an_import_circle():
    """Every module of src/hdreplay (integrations and baselines too) and of src/hdreplay_lab: no circle at all.
    (The lab's last two, sandbox tasks/geo/search and model/vlm, were broken by rewards.py and chartok.py.)"""
    lab = CORE.parent / "hdreplay_lab"
    for root in (CORE, lab):
        graph = package_graph(root)
        assert len(graph) > 20, root
        levels(graph)  # raises naming the circle


def test_each_folder_is_a_room_and_no_two_rooms_import_each_other():
    """Issue 45 (folders by concern): looking into any package, its modules and its sub-folders (a folder as one room:
    every module under it) import each other one way only -- no circle among them, so every folder stands above or
    below its neighbours as a whole (store/ under the method, checkpoint/ under store/, the TRL seam under its
    asynchronous/ and peers/)."""
    for root in (CORE, CORE.parent / "hdreplay_lab"):
        graph = package_graph(root)
        packages = {m for m in graph if (root.parent / m.replace(".", "/") / "__init__.py").is_file()}
        for pkg in sorted(packages):
            def room(m: str) -> str | None:  # the child of pkg that holds m (None: m is outside pkg, or pkg itself)
                if not m.startswith(pkg + ".") or m == pkg:
                    return None
                return pkg + "." + m[len(pkg) + 1:].split(".")[0]
            rooms: dict[str, set[str]] = {}
            for m, targets in graph.items():
                a = room(m)
                if a is not None:
                    rooms.setdefault(a, set()).update(b for t in targets if (b := room(t)) not in (None, a))
            for r in list(rooms.values()):
                for b in r:
                    rooms.setdefault(b, set())
            levels(rooms)  # raises naming the circle, e.g. "hdreplay.store -> hdreplay.checkpoint -> hdreplay.store"
