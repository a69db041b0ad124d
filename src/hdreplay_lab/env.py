"""Process settings for lab commands, applied explicitly (never at import time).

The sandbox never downloads anything: models and tokenizers are built locally and loaded with
``from_pretrained`` from disk, so the Hugging Face hub is switched off and telemetry disabled.
"""

from __future__ import annotations

import os

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def offline_env() -> None:
    """Set the offline defaults for this process (values the user already set are kept)."""
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
