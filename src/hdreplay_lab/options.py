"""Dataclasses as command-line commands (the CleanRL pattern, on Typer).

A command is one dataclass: each field with a ``help`` in its metadata (:func:`arg`) is an option -- or, with
``positional=True``, an argument -- whose type, default and help come from the field.  A field whose type is a
dataclass contributes that dataclass's fields (flattened); a field declared with ``arg(knobs=True)`` is a ``dict``
of replay settings and gets one ``--replay.<name>`` option per :func:`hdreplay.config.knobs` entry (unset options
stay out of the dict).  :func:`add_command` registers a dataclass with a Typer app; the command *returns* the
built dataclass (whose ``__post_init__`` validates), so parsing and running stay apart.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, Literal, Optional, Union

from hdreplay.config import knobs

#: short spellings kept for the replay knobs the README and the paper's sandbox commands use
KNOB_ALIASES = {"tau": "--tau", "capacity": "--capacity", "ingress": "--ingress",
                "answer_threshold": "--answer-threshold"}


def arg(default: Any = dataclasses.MISSING, help: str = "", *, positional: bool = False, flag: str | None = None,
        knobs: bool = False, default_factory: Any = dataclasses.MISSING):
    """Declare a command field: its default and its one help text (``flag`` overrides ``--field-name``)."""
    meta = {"help": help, "positional": positional, "flag": flag, "knobs": knobs}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def _unoptional(typ: Any) -> Any:
    if typing.get_origin(typ) in (Union, types.UnionType):
        rest = [a for a in typing.get_args(typ) if a is not type(None)]
        return rest[0] if len(rest) == 1 else typ
    return typ


def _comma(kind: type):
    """Parser of a comma-separated tuple option (``--taus 1e-3,1e-2``)."""
    def parse(text: Any) -> tuple:
        if text is None or isinstance(text, tuple):
            return text
        try:
            return tuple(kind(x.strip()) for x in str(text).split(",") if x.strip())
        except ValueError:
            raise ValueError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None
    return parse


def _param(name: str, typ: Any, default: Any, help: str, decls: list[str], positional: bool = False):
    """One inspect.Parameter carrying a Typer Option / Argument; tuples are comma-separated text."""
    import typer

    extra, inner = {}, _unoptional(typ)
    if typing.get_origin(inner) is tuple:
        extra["parser"], typ = _comma(typing.get_args(inner)[0]), Optional[str]
        default = ",".join(map(str, default)) if isinstance(default, tuple) else default
    required = ... if default is dataclasses.MISSING else default
    info = (typer.Argument(required, help=help, show_default=False) if positional
            else typer.Option(required, *decls, help=help, **extra))
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=typ)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _params(cls: type, defaults: dict[str, Any], hide: set[str], prefix: str = "") -> list[inspect.Parameter]:
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        meta, typ = f.metadata, hints[f.name]
        if dataclasses.is_dataclass(typ):
            out += _params(typ, defaults, hide, prefix=f"{prefix}{f.name}__")
        elif meta.get("knobs"):
            for k in knobs():
                if f"replay.{k.name}" in hide:
                    continue
                kt = Literal[tuple(k.choices)] if k.choices else str if k.flat == "json" else k.flat
                decls = ([f"--replay.{k.name}/--replay.no-{k.name}"] if kt is bool
                         else [f"--replay.{k.name}", *filter(None, [KNOB_ALIASES.get(k.name)])])
                out.append(_param(f"{prefix}{f.name}__{k.name}", Optional[kt], None,
                                  f"{k.help} [unset: {k.default!r}]", decls))
        elif "help" in meta and f.name not in hide:
            flag = meta.get("flag") or "--" + f.name.replace("_", "-")
            if typ is bool and "/" not in flag:
                flag += "/--no-" + flag[2:]
            out.append(_param(prefix + f.name, typ, defaults.get(f.name, _default(f)), meta["help"], [flag],
                              meta.get("positional", False)))
    return out


def build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """The dataclass ``cls`` from the flat parameter values of a command (its ``__post_init__`` validates)."""
    hints, kw = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        typ, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(typ):
            kw[f.name] = build(typ, values, prefix=f"{key}__")
        elif f.metadata.get("knobs"):
            kw[f.name] = {k.name: values[f"{key}__{k.name}"] for k in knobs() if values.get(f"{key}__{k.name}") is not None}
        elif key in values:
            inner = _unoptional(typ)
            kw[f.name] = _comma(typing.get_args(inner)[0])(values[key]) if typing.get_origin(inner) is tuple else values[key]
    return cls(**kw)


def add_command(app, name: str, cls: type, *, hide: tuple[str, ...] = (), help: str | None = None, **defaults) -> None:
    """Register dataclass ``cls`` as command ``name`` of the Typer ``app``.  ``defaults`` override field defaults;
    ``hide`` names fields (``"seeds"``) and knobs (``"replay.tau"``) this command does not offer."""
    def command(**values):
        return build(cls, values)

    command.__signature__ = inspect.Signature(_params(cls, defaults, set(hide)))
    app.command(name, help=help or inspect.getdoc(cls))(command)
