"""Fingerprints of TRL / transformers objects: where each is defined, its signature, the SHA-256 of its normalized
source (dedented; comments, docstrings and blank lines removed; trailing spaces stripped), a constant's value, or the
framework methods that assign an instance attribute.  Used by :mod:`trl_seam`."""

from __future__ import annotations

import ast
import dis
import hashlib
import importlib
import inspect
import io
import re
import textwrap
import tokenize
from functools import lru_cache

FRAMEWORKS = ("trl", "transformers")
PRINT_FIELDS = ("owner", "signature", "source_sha256", "value", "assigned_in", "missing")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def normalized_source(src: str) -> str:
    """``src`` dedented, without comments, docstrings, blank lines and trailing spaces (text kept otherwise, so the
    result does not depend on the Python version's tokenizer or unparser)."""
    src = textwrap.dedent(src)
    lines = src.splitlines()
    drop: list[tuple[int, int, int, int]] = []  # (line, col) -> (end line, end col), 1-based lines
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            drop.append((*tok.start, *tok.end))
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            d = body[0]
            drop.append((d.lineno, d.col_offset, d.end_lineno, d.end_col_offset))
    for l0, c0, l1, c1 in sorted(drop, reverse=True):  # from the end, so earlier positions stay valid
        if l0 == l1:
            lines[l0 - 1] = lines[l0 - 1][:c0] + lines[l0 - 1][c1:]
        else:
            lines[l0 - 1:l1] = [lines[l0 - 1][:c0] + lines[l1 - 1][c1:]]
    return "\n".join(s.rstrip() for s in lines if s.strip())


def _cached(fn):
    """``fn`` memoized on the object itself (a function's source does not change; a monkeypatched replacement is
    another object); unhashable objects are computed each time."""
    memo = lru_cache(maxsize=None)(fn)

    def call(obj):
        try:
            return memo(obj)
        except TypeError:
            return fn(obj)
    return call


@_cached
def _source_sha(obj) -> str | None:
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(normalized_source(src).encode()).hexdigest()


@_cached
def _signature(obj) -> str | None:
    try:
        return _ADDRESS.sub("", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return None


def _callable_print(obj) -> dict:
    """owner / signature / source of a function, property, classmethod, staticmethod or class."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        parts = [p for p in (obj.fget, obj.fset, obj.fdel) if p is not None]
        shas = [_source_sha(p) for p in parts]
        return {"signature": "property" + ("" if obj.fset is None else " (settable)"),
                "source_sha256": hashlib.sha256("|".join(map(str, shas)).encode()).hexdigest()}
    if callable(obj):
        return {"signature": _signature(obj), "source_sha256": _source_sha(obj)}
    text = _ADDRESS.sub("", repr(obj))
    return {"value": text if len(text) <= 200 else hashlib.sha256(text.encode()).hexdigest()}


def _framework(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in FRAMEWORKS


def public_path(cls: type) -> str:
    """The shortest dotted path that imports ``cls`` (``trl.GRPOTrainer``,
    ``trl.experimental.async_grpo.AsyncGRPOTrainer``), else ``module.QualName``."""
    parts = cls.__module__.split(".")
    for i in range(1, len(parts)):
        try:
            if getattr(importlib.import_module(".".join(parts[:i])), cls.__name__, None) is cls:
                return f"{'.'.join(parts[:i])}.{cls.__name__}"
        except ImportError:
            continue
    return f"{cls.__module__}.{cls.__qualname__}"


def _load(path: str):
    """The object at a dotted path (``trl.GRPOTrainer``, ``trl.trainer.utils.split_tensor_dict``); None if absent."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p, None)
            if obj is None:
                return None
        return obj
    return None


def _code_objects(code):
    yield code
    for c in code.co_consts:
        if inspect.iscode(c):
            yield from _code_objects(c)


@lru_cache(maxsize=None)
def instance_attributes(anchor: type) -> dict[str, tuple[str, ...]]:
    """``{name: (module.Class.method, ...)}``: the attributes that methods of the framework classes of ``anchor``'s MRO
    assign (``STORE_ATTR`` in their bytecode, nested functions included; read from the code, no source parsing)."""
    out: dict[str, set[str]] = {}
    for k in anchor.__mro__:
        if not _framework(k):
            continue
        for name, v in vars(k).items():
            v = v.__func__ if isinstance(v, (classmethod, staticmethod)) else v
            fns = [v.fget, v.fset] if isinstance(v, property) else [v]
            for fn in fns:
                code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
                for c in (_code_objects(code) if code is not None else ()):
                    for ins in dis.get_instructions(c):
                        if ins.opname == "STORE_ATTR":
                            out.setdefault(ins.argval, set()).add(f"{k.__module__}.{k.__qualname__}.{name}")
    return {name: tuple(sorted(v)) for name, v in out.items()}


def attribute_print(anchor: type, name: str) -> dict:
    """Fingerprint of ``anchor.<name>``: a class attribute of a framework class of its MRO, else an instance attribute
    the framework assigns, else ``missing``."""
    for k in anchor.__mro__:
        if _framework(k) and name in vars(k):
            return {"owner": f"{k.__module__}.{k.__qualname__}", **_callable_print(vars(k)[name])}
    assigned = instance_attributes(anchor).get(name)
    if assigned:
        return {"assigned_in": list(assigned)}
    return {"missing": True}


def item_print(item: dict) -> dict:
    """The current fingerprint of a recorded item (``anchor`` + ``name``, or ``module`` + ``name``)."""
    if "anchor" in item:
        anchor = _load(item["anchor"])
        if not isinstance(anchor, type):
            return {"missing": True}
        return attribute_print(anchor, item["name"])
    try:
        module = importlib.import_module(item["module"])
    except ImportError:
        return {"missing": True}
    if not hasattr(module, item["name"]):
        return {"missing": True}
    return _callable_print(getattr(module, item["name"]))
