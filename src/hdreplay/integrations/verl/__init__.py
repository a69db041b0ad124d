"""Headroom-Drift Replay recipe for verl (tested with verl 0.9.1).

    python -m hdreplay.integrations.verl.main <verl overrides> hdr.k_rep=128 hdr.tau=1e-3

runs verl's v1 ``PPOTrainer`` (``trainer.use_v1=true``, the default; :mod:`.v1_trainer`) or, with
``trainer.use_v1=false``, the v0 ``RayPPOTrainer`` (:mod:`.trainer`).  From Python::

    from hdreplay.integrations.verl import HDRPPOTrainerSync  # v1: verl's PPOTrainerSync + replay
    from hdreplay.integrations.verl import HDRRayPPOTrainer   # v0: drop-in for RayPPOTrainer

The replay settings are the ``hdr`` section of ``config/hdr_trainer.yaml``; everything else
is verl's own ``ppo_trainer.yaml``.  See ``docs/verl.md``.  The v1 trainers need TransferQueue
(part of the ``[verl]`` extra); they are imported on first use.
"""

from __future__ import annotations

TESTED_VERL = "0.9.1"

try:
    import verl as _verl

    if getattr(_verl, "__file__", None) is None:  # a bare directory named verl/ on sys.path, not the library
        raise ImportError(f"`verl` resolves to a namespace package at {list(_verl.__path__)}")
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hdreplay.integrations.verl needs verl: pip install -c constraints-verl.txt 'hdreplay[verl]' "
        f"(tested with verl=={TESTED_VERL}); import failed with: {e}"
    ) from e

if getattr(_verl, "__version__", None) != TESTED_VERL:  # pragma: no cover
    raise ImportError(
        f"hdreplay.integrations.verl is tested with verl=={TESTED_VERL}, found verl "
        f"{getattr(_verl, '__version__', '?')}; RayPPOTrainer internals change between releases. Install "
        f"verl=={TESTED_VERL} (pip install -c constraints-verl.txt 'hdreplay[verl]')."
    )

from ..common import STATE_DIR  # noqa: E402
from .settings import HDRSettings, validate_verl_config, verl_truncate_multiple  # noqa: E402
from .trainer import HDRRayPPOTrainer  # noqa: E402

#: the v1 names, imported from .v1_trainer on first access (it needs TransferQueue)
_V1 = ("HDRPPOTrainerSync", "HDRPPOTrainerColocateAsync", "HDRPPOTrainerSeparateAsync", "HDRTaskRunnerV1",
       "HDR_TRAINERS")


def __getattr__(name: str):
    if name in _V1:
        from . import v1_trainer

        return getattr(v1_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HDRRayPPOTrainer", "HDRSettings", "STATE_DIR", "TESTED_VERL", "validate_verl_config", "verl_truncate_multiple",
    *_V1,
]
