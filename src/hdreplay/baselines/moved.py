"""Names that moved out of the core (into :mod:`hdreplay.baselines`, or the verl recipe's layout into
:mod:`hdreplay.integrations.layout`), still resolved at their old paths (deprecated).

The core never imports what stands above it (arrows point down), so the old names are hung onto the core modules
from here: reading one (``from hdreplay.sampling import bucket_counts``) warns with a DeprecationWarning and returns
the object from its new home, imported by name when first asked for.  The README's changelog lists them; they go
in the release after next.
"""

from __future__ import annotations

import importlib
import sys
import warnings

#: old module -> {name: new module}
MOVED: dict[str, dict[str, str]] = {
    "hdreplay.sampling": {n: "hdreplay.baselines.sampling" for n in (
        "uniform_order", "proportional_order", "importance_weights", "normal_bucket_weights", "bucket_counts")},
    "hdreplay.selection": {"priorities": "hdreplay.baselines.orders", "PRIORITY_EPS": "hdreplay.baselines.orders"},
    "hdreplay.selectors": {"PRIORITY_EPS": "hdreplay.baselines.orders"},
    "hdreplay.controller": {"split_rollouts": "hdreplay.baselines.rollouts"},
    "hdreplay": {n: "hdreplay.integrations.layout" for n in ("balanced_partition", "minibatch_layout",
                                                             "truncate_to_multiple")},
}


def _hook(module_name: str, names: dict[str, str]):
    module = sys.modules[module_name]
    before = module.__dict__.get("__getattr__")

    def __getattr__(name: str):
        if name in names:
            warnings.warn(f"{module_name}.{name} moved to {names[name]}.{name}; the old path will be removed in the "
                          "release after next", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(names[name]), name)
        if before is not None:
            return before(name)
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__


def install() -> None:
    """Hang the moved names onto their old modules (idempotent)."""
    for module_name, names in MOVED.items():
        module = importlib.import_module(module_name)
        if getattr(module.__dict__.get("__getattr__"), "_hdreplay_moved", False):
            continue
        hook = _hook(module_name, names)
        hook._hdreplay_moved = True
        module.__getattr__ = hook
