"""Headroom-Drift Replay for Hugging Face TRL (tested with trl 1.16.*).

    from hdreplay.integrations.trl import HDRGRPOConfig, HDRGRPOTrainer

``HDRGRPOTrainer`` is used exactly like ``trl.GRPOTrainer``; the replay settings are the
``replay_*`` fields of ``HDRGRPOConfig``.
"""

from __future__ import annotations

import os
import warnings

TESTED_TRL = "1.16"
UNTESTED_TRL_ENV = "HDREPLAY_UNTESTED_TRL"  # "1": import under another trl release (a warning instead of the error)

try:
    import trl as _trl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hdreplay.integrations.trl needs TRL: pip install 'hdreplay[trl]' (tested with trl "
        f"{TESTED_TRL}.*)"
    ) from e

if not _trl.__version__.startswith(TESTED_TRL + "."):  # pragma: no cover
    _why = (f"hdreplay.integrations.trl is tested with trl {TESTED_TRL}.*, found trl {_trl.__version__}; TRL's "
            f"GRPOTrainer internals change between minor versions")
    if os.environ.get(UNTESTED_TRL_ENV) != "1":
        raise ImportError(f"{_why}. Install trl=={TESTED_TRL}.* (pip install -c constraints.txt 'hdreplay[trl]').")
    # scripts/trl_releases.py runs the TRL tests against other releases this way, to see what breaks
    warnings.warn(f"{_why}; imported anyway because {UNTESTED_TRL_ENV}=1", stacklevel=2)

from .callback import HDRLogCallback  # noqa: E402
from .config import HDRGRPOConfig  # noqa: E402
from .trainer import HDRGRPOTrainer  # noqa: E402

__all__ = ["HDRGRPOConfig", "HDRGRPOTrainer", "HDRLogCallback", "TESTED_TRL"]
