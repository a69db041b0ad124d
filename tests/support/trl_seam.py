"""The TRL seam, found by introspection, and its fingerprint against the installed TRL / transformers.

What counts as the seam (nothing here is a hand list; re-running the scan on changed code finds the new set):

* **override**: a name that an hdreplay class (anywhere under src/, nested classes included) defines in its body
  and that also exists on one of its TRL / transformers bases, e.g. ``trl.GRPOTrainer._prepare_inputs``;
* **private**: an attribute ``_x`` (not a dunder) that hdreplay code reads, writes or calls and that resolves on a
  TRL / transformers class hdreplay subclasses (``self._x`` / ``super()._x`` inside such a subclass; any other
  receiver, e.g. ``trainer._x``, checked against every such class): a class attribute, or an instance attribute
  that a method of a framework class of the MRO assigns (``STORE_ATTR`` in its bytecode);
* **import**: a name imported from ``trl.*`` / ``transformers.*`` that the package does not export at its top level
  (``trl.trainer.utils.split_tensor_dict``, ``transformers.trainer_utils.rotate_checkpoints``) or that starts with
  ``_``;
* **protocol**: a framework function, used by the modules of those classes, that installs a patch taking keywords
  of its own (a nested function with parameters the outer one lacks) when hdreplay passes one of those keywords:
  ``model(..., fused_lm_head=True)`` works only on a model TRL's ``add_fused_lm_head`` patched.

Each item's fingerprint (:mod:`trl_seam_print`): where it is defined (``owner``), ``inspect.signature`` and the
SHA-256 of its normalized source — or its ``value`` (a constant), or the framework methods that assign it (an instance
attribute), or ``missing``.

The record keeps two sections apart: ``items``, the TRL seam (every item the library, package ``hdreplay``, uses;
what a user's install depends on), and ``lab``, the lab's own uses (items only ``hdreplay_lab`` uses: the sandbox's
trainer, its tiny VLM processors, the search task).  A change in the lab's uses is the lab's to adapt, not a change
of the seam.

    PYTHONPATH=src .venv/bin/python scripts/trl_seam_record.py    # rewrite the record (RECORD) from the installed TRL
"""

from __future__ import annotations

import ast
import dis
import importlib
import importlib.util
import inspect
import json
import platform
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from trl_seam_print import (
    FRAMEWORKS,
    PRINT_FIELDS,
    _code_objects,
    _framework,
    _load,
    instance_attributes,
    item_print,
    public_path,
)

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
RECORD = ROOT / "tests" / "trl" / "data" / "trl_seam.json"
REGENERATE = "PYTHONPATH=src .venv/bin/python scripts/trl_seam_record.py"
SECTIONS = ("items", "lab")  # the TRL seam; the lab's own uses
LAB_PACKAGE = "hdreplay_lab"


# ---------------------------------------------------------------------------------------------- the scan
@dataclass
class Item:
    """One seam item: ``key`` (``trl.GRPOTrainer._prepare_inputs``), how hdreplay uses it, where to find it."""

    key: str
    kind: str  # "override" | "private" | "import" | "protocol"
    locate: dict  # {"anchor": "trl.GRPOTrainer", "name": ...} or {"module": "trl.trainer.utils", "name": ...}
    used_by: set[str] = field(default_factory=set)

    @property
    def section(self) -> str:
        """"lab" when only the lab (``hdreplay_lab``) uses it, else "items" (the TRL seam)."""
        lab = all(u == LAB_PACKAGE or u.startswith(LAB_PACKAGE + ".") for u in self.used_by)
        return "lab" if self.used_by and lab else "items"


_IMPORTS = re.compile(r"^\s*(from|import)\s+(trl|transformers)\b|integrations\.trl\b", re.M)
_PRIVATE = re.compile(r"\.(_[A-Za-z]\w*)")
TRL_PACKAGE = SRC / "hdreplay" / "integrations" / "trl"


def seam_files(src: Path = SRC) -> list[Path]:
    """Every Python file under ``src``; :func:`scan` parses only those that import TRL / transformers (or the TRL
    integration), lie in the integration's package, or use a private name the framework classes have."""
    return sorted(src.rglob("*.py"))


def _module_name(path: Path) -> str | None:
    try:
        parts = list(path.resolve().relative_to(SRC).with_suffix("").parts)
    except ValueError:
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _File:
    """One source file, walked once: its imports (at any depth, relative ones resolved), its classes and its
    private attribute uses, each with the innermost class around it."""

    def __init__(self, path: Path, text: str):
        self.path, self.module = path, _module_name(path)
        self.user = self.module or path.name
        package = None if self.module is None else (
            self.module if path.name == "__init__.py" else self.module.rpartition(".")[0])
        self.imports: dict[str, tuple[str, str | None]] = {}  # local name -> (module, attribute or None)
        self.framework_imports: list[tuple[str, str]] = []  # (framework module, name)
        self.classes: list[ast.ClassDef] = []
        self.attributes: list[tuple[ast.Attribute, ast.ClassDef | None]] = []
        self.keywords: set[str] = set()  # keyword argument names at this file's call sites
        stack: list[tuple[ast.AST, ast.ClassDef | None]] = [(ast.parse(text), None)]
        while stack:
            node, cls = stack.pop()
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    self.imports[a.asname or top] = (a.name if a.asname else top, None)
            elif isinstance(node, ast.ImportFrom) and not (node.level and package is None):
                mod = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else node.module
                for a in node.names:
                    self.imports[a.asname or a.name] = (mod, a.name)
                    if not node.level and mod.split(".")[0] in FRAMEWORKS:
                        self.framework_imports.append((mod, a.name))
            elif isinstance(node, ast.ClassDef):
                self.classes.append(node)
                cls = node
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                self.attributes.append((node, cls))
            elif isinstance(node, ast.Call):
                self.keywords.update(k.arg for k in node.keywords if k.arg)
            stack.extend((c, cls) for c in ast.iter_child_nodes(node))

    def resolve(self, expr: ast.expr):
        if isinstance(expr, ast.Attribute):
            base = self.resolve(expr.value)
            return None if base is None else getattr(base, expr.attr, None)
        if not isinstance(expr, ast.Name):
            return None
        try:
            if expr.id in self.imports:
                mod, attr = self.imports[expr.id]
                m = importlib.import_module(mod)
                return m if attr is None else getattr(m, attr, None)
            return None if self.module is None else getattr(importlib.import_module(self.module), expr.id, None)
        except ImportError:
            return None


def _anchors(bases: list) -> list[type]:
    """The first TRL / transformers class of each base's MRO (the framework class the hdreplay class extends)."""
    out = []
    for b in bases:
        first = next((k for k in getattr(b, "__mro__", ()) if _framework(k)), None)
        if first is not None and first not in out:
            out.append(first)
    return out


def _body_names(node: ast.ClassDef, bases: list) -> set[str]:
    """Names a class defines: its body's defs and assignments, plus those of hdreplay mixins among its bases."""
    names = set()
    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
    for b in bases:  # a mixin (no framework class in its MRO): its names shadow the framework's in this class
        mro = getattr(b, "__mro__", ())
        if any(_framework(k) for k in mro):
            continue
        for k in mro[:-1]:  # not object
            for name, v in vars(k).items():
                fn = v.__func__ if isinstance(v, (classmethod, staticmethod)) else v
                code = getattr(getattr(fn, "fget", fn), "__code__", None)  # dunders a dataclass made are not ours
                if not name.startswith("__") or (code is not None and str(SRC) in code.co_filename):
                    names.add(name)
    return names


def _on_framework(anchor: type, name: str) -> bool:
    return any(_framework(k) and name in vars(k) for k in anchor.__mro__)


def scan(files: list[Path] | None = None) -> dict[str, Item]:
    """Every seam item of ``files`` (default: :func:`seam_files`), by key."""
    files = seam_files() if files is None else files
    items: dict[str, Item] = {}

    def add(key, kind, locate, user):
        items.setdefault(key, Item(key, kind, locate)).used_by.add(user)

    texts = {p: p.read_text() for p in files}
    first = [_File(p, t) for p, t in texts.items() if _IMPORTS.search(t) or TRL_PACKAGE in p.resolve().parents]
    anchors_of: dict[ast.ClassDef, list[type]] = {}

    def classes(f: _File) -> None:
        for node in f.classes:
            bases = [b for b in (f.resolve(e) for e in node.bases) if isinstance(b, type)]
            anchors_of[node] = anchors = _anchors(bases)
            for name in sorted(_body_names(node, bases)):
                for a in anchors:
                    if _on_framework(a, name):
                        add(f"{public_path(a)}.{name}", "override", {"anchor": public_path(a), "name": name},
                            f"{f.user}.{node.name}")

    for f in first:
        classes(f)
    every_anchor = list(dict.fromkeys(a for anchors in anchors_of.values() for a in anchors))
    names = {n for a in every_anchor for k in a.__mro__ if _framework(k) for n in vars(k) if _private(n)}
    names |= {n for a in every_anchor for n in instance_attributes(a) if _private(n)}
    done = {f.path for f in first}
    more = [_File(p, t) for p, t in texts.items() if p not in done and names & set(_PRIVATE.findall(t))]
    for f in more:  # a helper that reaches into a trainer without importing TRL
        classes(f)

    for f in first + more:
        for node, cls in f.attributes:
            v = node.value
            own = (isinstance(v, ast.Name) and v.id == "self") or (
                isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super")
            # self / super() inside a class: that class's framework bases (none: not a framework object); any
            # other receiver (``trainer._x``) may be any of them: an item for each on which the name resolves
            for a in (anchors_of.get(cls, []) if own and cls is not None else every_anchor):
                if _on_framework(a, node.attr) or node.attr in instance_attributes(a):
                    add(f"{public_path(a)}.{node.attr}", "private", {"anchor": public_path(a), "name": node.attr},
                        f.user)
        for mod, name in f.framework_imports:
            if _private_import(mod, name):
                add(f"{mod}.{name}", "import", {"module": mod, "name": name}, f.user)
        for (mod, name), keywords in patched_keywords(tuple(every_anchor)).items():
            if keywords & f.keywords:
                add(f"{mod}.{name}", "protocol", {"module": mod, "name": name}, f.user)
    return items


@lru_cache(maxsize=None)
def patched_keywords(anchors: tuple[type, ...]) -> dict[tuple[str, str], frozenset[str]]:
    """``{(module, function): keywords}`` for the framework functions the anchors' modules use that assign an attribute
    and define (``def``) a nested function taking keywords the outer one does not: a patch they install
    (``add_fused_lm_head`` sets a model's ``forward`` to one that takes ``fused_lm_head=``). hdreplay passing such a
    keyword relies on that patch."""
    out: dict[tuple[str, str], frozenset[str]] = {}
    modules = {k.__module__ for a in anchors for k in a.__mro__ if _framework(k)}
    for m in sorted(modules):
        for fn in vars(sys.modules[m]).values():
            if not (inspect.isfunction(fn) and _framework(fn)):
                continue
            code = fn.__code__
            if not any(i.opname == "STORE_ATTR" for i in dis.get_instructions(code)):
                continue  # installs nothing on an object
            outer = set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
            inner = {a for c in list(_code_objects(code))[1:] if not c.co_name.startswith("<")  # def, not a lambda
                     for a in c.co_varnames[:c.co_argcount + c.co_kwonlyargcount]}
            inner -= outer | {"self", "args", "kwargs"}
            if inner:
                out[(fn.__module__, fn.__name__)] = frozenset(inner)
    return out


def _private_import(module: str, name: str) -> bool:
    """A name imported from a framework module that its package does not export at the top level (or ``_x``).

    A module that exists but fails to import here (it needs what this environment lacks: pillow for an image
    processor) is judged by the top level's name alone, so the scan does not depend on optional packages; a module
    that does not exist is private (moved or removed)."""
    top = importlib.import_module(module.split(".")[0])
    try:
        obj = getattr(importlib.import_module(module), name, None)
    except ImportError:
        try:
            exists = importlib.util.find_spec(module) is not None
        except ImportError:
            exists = False
        return _private(name) or not exists or not hasattr(top, name)
    if inspect.ismodule(obj):
        return False
    return _private(name) or obj is None or getattr(top, name, None) is not obj


# ---------------------------------------------------------------------------------------------- record and compare
def versions() -> dict[str, str]:
    import transformers
    import trl

    return {"trl": trl.__version__, "transformers": transformers.__version__}


def build_record(items: dict[str, Item] | None = None) -> dict:
    """The record of ``items`` (default: :func:`scan`) against the installed TRL / transformers: the seam in
    ``items``, the lab's own uses in ``lab``."""
    items = scan() if items is None else items
    return {
        "recorded_with": versions(),
        "python": platform.python_version(),  # signatures print annotations as this Python does
        "regenerate": REGENERATE,
        **{section: {key: {"kind": it.kind, **it.locate, "used_by": sorted(it.used_by), **item_print(it.locate)}
                     for key, it in sorted(items.items()) if it.section == section} for section in SECTIONS},
    }


def write_record(path: Path = RECORD) -> dict:
    record = build_record()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def load_record(path: Path = RECORD) -> dict:
    return json.loads(path.read_text())


def preload(record: dict) -> None:
    """Import every module the record names, now.  transformers' HfArgumentParser (TrlParser) rewrites in place the
    type of every dataclass field it parses (``str | None`` -> ``str``), on the Field objects TrainingArguments shares
    with every TRL config class; a config class first imported after such a parse (``AsyncGRPOConfig``) is built from
    the rewritten types and prints another signature than the record's.  The contract test calls this when pytest
    collects it, before any test parses arguments."""
    for section in SECTIONS:
        for item in record.get(section, {}).values():
            _load(item.get("anchor") or item["module"])


@dataclass
class Change:
    key: str
    kind: str
    what: list[str]  # one phrase per changed aspect, e.g. "signature (self, a) -> (self, a, b)"


def _describe(old: dict, new: dict) -> list[str]:
    if new.get("missing") and not old.get("missing"):
        return ["missing: no longer defined in the installed version"]
    out = []
    for f in PRINT_FIELDS:
        if old.get(f) == new.get(f):
            continue
        if f == "source_sha256":
            out.append(f"source ({str(old.get(f))[:12]} -> {str(new.get(f))[:12]})")
        else:
            out.append(f"{f.replace('_', ' ')} {old.get(f)!r} -> {new.get(f)!r}")
    return out


def compare(record: dict, section: str = "items") -> list[Change]:
    """The recorded items of ``section`` ("items": the seam; "lab": the lab's own uses) whose fingerprint differs in
    the installed TRL / transformers."""
    changes = []
    for key, item in record.get(section, {}).items():
        locate = {k: item[k] for k in ("anchor", "module", "name") if k in item}
        old = {f: item[f] for f in PRINT_FIELDS if f in item}
        what = _describe(old, item_print(locate))
        if what:
            changes.append(Change(key, item["kind"], what))
    return changes


def change_message(record: dict, changes: list[Change], section: str = "items") -> str:
    rec, now = record["recorded_with"], versions()
    what = ("The TRL seam changed: {n} item(s) hdreplay overrides or uses privately differ" if section == "items" else
            "The lab's own uses changed (not the TRL seam: the library is unaffected): {n} item(s) the lab (sandbox, "
            "VLM sandbox, search task) overrides or imports differ")
    lines = [what.format(n=len(changes))
             + f" between the record (trl {rec['trl']}, transformers {rec['transformers']}; "
             f"{_rel(RECORD)}) and the installed trl {now['trl']}, transformers {now['transformers']}:"]
    for c in changes:
        users = ", ".join(record[section][c.key]["used_by"])
        lines.append(f"  {c.key} [{c.kind}; used by {users}]: " + "; ".join(c.what))
    if record.get("python") not in (None, platform.python_version()):
        lines.append(f"(recorded on Python {record['python']}, running {platform.python_version()}: a signature may "
                     "differ only in how this Python prints annotations)")
    doc = "'The seam'" if section == "items" else "'The lab's own uses'"
    lines.append(f"Read each against hdreplay's use of it (docs/trl.md, {doc}); once hdreplay is adapted to this "
                 f"version, regenerate the record: {REGENERATE}")
    return "\n".join(lines)


def coverage_problem(items: dict[str, Item], record: dict, *, strict: bool) -> str:
    """'' when the record lists exactly the seam the code has; else what differs and how to regenerate.
    ``strict=False`` (another TRL / transformers than the record's) ignores recorded items the scan no longer finds
    (a method TRL removed is reported by :func:`compare`, not here).  An item in the other section than its users
    put it in (a lab-only use the library now makes, or no longer makes) is a difference too."""
    recorded = {k: {**it, "section": sec} for sec in SECTIONS for k, it in record.get(sec, {}).items()}
    new = sorted(set(items) - set(recorded))
    gone = sorted(set(recorded) - set(items)) if strict else []
    both = sorted(set(items) & set(recorded))
    moved = [k for k in both if items[k].kind != recorded[k]["kind"]]
    crossed = [k for k in both if items[k].section != recorded[k]["section"]]
    if not new and not gone and not moved and not crossed:
        return ""
    lines = ["The TRL seam record does not match hdreplay's code:"]
    lines += [f"  not recorded: {k} [{items[k].kind}; used by {', '.join(sorted(items[k].used_by))}]" for k in new]
    lines += [f"  recorded but no longer used: {k}" for k in gone]
    lines += [f"  recorded as {recorded[k]['kind']}, now {items[k].kind}: {k}" for k in moved]
    lines += [f"  recorded as {'the lab' if recorded[k]['section'] == 'lab' else 'the seam'}'s, now "
              f"{'the lab' if items[k].section == 'lab' else 'the seam'}'s: {k} (used by "
              f"{', '.join(sorted(items[k].used_by))})" for k in crossed]
    lines.append(f"Regenerate the record against trl {record['recorded_with']['trl']}: {REGENERATE} -- and give each "
                 "new item its one line in docs/trl.md ('The seam', or 'The lab's own uses' for a lab-only one), or "
                 "drop the lines of removed ones.")
    return "\n".join(lines)


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)

