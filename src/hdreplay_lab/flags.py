"""Option types the ``hdreplay`` commands' dataclasses share (tyro reads them; see cli.py).

* ``CommaStr`` / ``CommaInt`` / ``CommaFloat``: a tuple written as one comma-separated value (``--taus 1e-3,1e-2``),
  or None (a default: "unset").
* :func:`replay_options`: a ``TypedDict`` with one optional key per :func:`hdreplay.config.knobs` entry and per
  :class:`hdreplay.diagnostics.DiagnosticsConfig` field; as a field named ``replay`` it is one option
  ``--replay.<name>`` per setting (``--replay.<name>`` / ``--replay.no-<name>`` for booleans), and the options left
  unset stay out of the dict.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Literal, TypedDict

import tyro

import hdreplay.baselines  # noqa: F401  (registers the peers' selectors: the commands accept them)
from hdreplay.config import knobs
from hdreplay.diagnostics import DiagnosticsConfig

#: short spellings kept for the replay knobs the README and the paper's sandbox commands use
KNOB_ALIASES = {"tau": ("--tau",), "capacity": ("--capacity",), "ingress": ("--ingress",),
                "answer_threshold": ("--answer-threshold",)}


def _comma(kind: type) -> tyro.constructors.PrimitiveConstructorSpec:
    def parse(args: list[str]) -> tuple:
        try:
            return tuple(kind(x.strip()) for x in args[0].split(",") if x.strip())
        except ValueError:
            raise ValueError(f"expected comma-separated {kind.__name__} values, got {args[0]!r}") from None

    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar=f"{kind.__name__.upper()},...", instance_from_str=parse,
        is_instance=lambda v: v is None or isinstance(v, tuple),
        str_from_instance=lambda v: ["unset" if v is None else ",".join(map(str, v))])


CommaStr = Annotated[tuple[str, ...] | None, _comma(str)]
CommaInt = Annotated[tuple[int, ...] | None, _comma(int)]
CommaFloat = Annotated[tuple[float, ...] | None, _comma(float)]


def replay_options(exclude: tuple[str, ...] = ()) -> type:
    """The ``--replay.<name>`` options of every ReplayConfig knob but ``exclude`` (see the module docstring)."""
    keys = {}
    for k in knobs():
        if k.name not in exclude:
            typ = Literal[tuple(k.choices)] if k.choices else str if k.flat == "json" else k.flat
            keys[k.name] = Annotated[typ, tyro.conf.arg(help=k.help, aliases=KNOB_ALIASES.get(k.name),
                                                        help_behavior_hint=f"(unset: {k.default!r})")]
    for f in fields(DiagnosticsConfig):
        if f.name not in exclude:
            typ = bool if f.default is False else str  # adaptive_tau: a JSON object
            keys[f.name] = Annotated[typ, tyro.conf.arg(help=f.metadata["help"], help_behavior_hint="(unset: off)")]
    return TypedDict("ReplayOptions", keys, total=False)  # type: ignore[operator]


ReplayOptions = replay_options()
