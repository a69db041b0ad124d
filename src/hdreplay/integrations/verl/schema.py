"""The ``hdr`` config section as an OmegaConf structured config, generated from the core declarations.

:func:`hdr_schema` is a dataclass with one field per :func:`hdreplay.config.knobs` entry and per
:data:`hdreplay.integrations.common.INTEGRATION_KNOBS` entry (same names, types, defaults; the help
texts are the core's).  :func:`register_hdr_schema` puts it in Hydra's ConfigStore as ``hdr_schema``,
which ``config/hdr_trainer.yaml`` lists in its defaults, so every knob can be overridden as
``hdr.<name>=...`` and unknown keys or wrong types are refused by OmegaConf itself.
"""

from __future__ import annotations

import functools
from dataclasses import field, fields, is_dataclass, make_dataclass
from typing import Any, Mapping, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ...adaptive import AdaptiveTau
from ...config import Knob, knobs
from ...errors import ReplayConfigError
from ..common import INTEGRATION_KNOBS

SCHEMA_NAME = "hdr_schema"


def adaptive_tau_node() -> type:
    """``hdr.adaptive_tau``: the fields of :class:`~hdreplay.AdaptiveTau` plus ``enabled`` (off by default), so
    ``hdr.adaptive_tau.enabled=true hdr.adaptive_tau.tau_min=1e-4`` works as ordinary dotted overrides."""
    specs = [("enabled", Any, field(default=False))]  # a bool, checked strictly (see _node_type)
    specs += [(f.name, float if f.type in ("float", float) else int, field(default=f.default))
              for f in fields(AdaptiveTau)]
    return make_dataclass("AdaptiveTauSection", specs)


def _node_type(k: Knob):
    """The OmegaConf type of a knob.  Booleans are declared ``Any``: OmegaConf reads any int as a bool (``2`` ->
    true, ``0`` -> false) and 'yes'/'off' strings too; :func:`checked_section` accepts true / false only."""
    if k.flat == "json":
        return adaptive_tau_node()
    if k.flat is bool:
        return Any
    return Optional[k.flat] if k.optional else k.flat


def _bool_keys() -> set[str]:
    return {f"hdr.{k.name}" for k in (*knobs(), *INTEGRATION_KNOBS) if k.flat is bool} | {"hdr.adaptive_tau.enabled"}


@functools.lru_cache(maxsize=None)
def hdr_schema() -> type:
    """The dataclass behind the ``hdr`` section (generated once)."""
    specs = []
    for k in (*knobs(), *INTEGRATION_KNOBS):
        typ = _node_type(k)
        default = field(default_factory=typ) if k.flat == "json" else field(default=k.default)
        default.metadata = {"help": k.help + (" (hdr.adaptive_tau.enabled=true turns it on)" if k.flat == "json"
                                              else "")}
        specs.append((k.name, typ, default))
    return make_dataclass("HDRSection", specs)


@functools.lru_cache(maxsize=None)
def _structured() -> DictConfig:
    return OmegaConf.structured(hdr_schema())


def knob_help() -> dict[str, str]:
    """``hdr.<name>`` -> help text (for docs and ``--help`` style listings)."""
    return {f"hdr.{k.name}": k.help for k in (*knobs(), *INTEGRATION_KNOBS)}


def register_hdr_schema() -> None:
    """Register the schema in Hydra's ConfigStore (idempotent); call before composing ``hdr_trainer``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=hdr_schema(), package="hdr")


def _strict_types(raw: Mapping[str, Any], prefix: str = "hdr", schema: type | None = None) -> None:
    """Refuse what OmegaConf would coerce silently: anything but true / false for a bool knob, a bool for an int
    knob, a non-mapping for the adaptive_tau section."""
    bools = _bool_keys()
    for f in fields(schema or hdr_schema()):
        if f.name not in raw:
            continue
        v, key = raw[f.name], f"{prefix}.{f.name}"
        if is_dataclass(f.type):
            if v is not None and not isinstance(v, Mapping):
                raise ReplayConfigError(f"{key}: must be a mapping (e.g. {key}.enabled=true), got {v!r}", field=key)
            _strict_types(v or {}, key, f.type)
        elif key in bools and not isinstance(v, bool):
            raise ReplayConfigError(f"{key}: must be true or false, got {v!r}", field=key)
        elif f.type in (int, Optional[int]) and isinstance(v, bool):
            raise ReplayConfigError(f"{key}: must be an int, got {v!r}", field=key)


def checked_section(hdr: Any) -> dict[str, Any]:
    """Validate an ``hdr`` section (DictConfig or mapping) against the schema; plain dict of every knob.

    Raises ReplayConfigError naming ``hdr.<key>`` for an unknown key or a value of the wrong type.
    Interpolations (the packaged ``diagnostics_dir: ${trainer.default_local_dir}/...``) are resolved
    against the full config the section belongs to, before the merge detaches it."""
    if not isinstance(hdr, (DictConfig, Mapping)):
        raise ReplayConfigError(f"hdr: must be a mapping of replay settings (hdr.<name>: value), got "
                                f"{type(hdr).__name__}; e.g. hdr.selector=headroom_drift hdr.k_rep=64", field="hdr")
    try:
        raw = OmegaConf.to_container(hdr, resolve=True) if isinstance(hdr, DictConfig) else dict(hdr)
        _strict_types(raw)
        node = OmegaConf.merge(_structured(), OmegaConf.create(raw))  # (merge copies: the cached node is unchanged)
        values = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
        valid = sorted(k.name for k in (*knobs(), *INTEGRATION_KNOBS))
        raise ReplayConfigError(f"hdr.{key}: {e.msg if hasattr(e, 'msg') else e} (valid hdr keys: {valid})",
                                field=f"hdr.{key}") from None
    node = dict(values.get("adaptive_tau") or {})
    enabled = node.pop("enabled", False)
    changed = sorted(k for k, v in node.items() if v != getattr(AdaptiveTau, k))
    if changed and not enabled:
        raise ReplayConfigError(f"hdr.adaptive_tau: {['hdr.adaptive_tau.' + k for k in changed]} set while "
                                "hdr.adaptive_tau.enabled=false; set hdr.adaptive_tau.enabled=true to use the "
                                "adaptive schedule, or drop those overrides", field="hdr.adaptive_tau")
    values["adaptive_tau"] = node if enabled else None
    return values
