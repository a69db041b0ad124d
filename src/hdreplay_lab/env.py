"""Process settings for lab commands, applied explicitly (never at import time).

The sandbox never downloads anything: models and tokenizers are built locally and loaded with
``from_pretrained`` from disk, so the Hugging Face hub is switched off and telemetry disabled.

Threads: torch's default intra-op pool has one thread per core.  On a 2-core machine shared with other
work that oversubscribes the cores and the tiny sandbox models slow down many times (OpenMP threads spin
waiting for each other); one thread per process was faster or equal in every measurement
(docs/results/fidelity/threads.md), so the sandbox, the warm start and each worker of a parallel
comparison run with :data:`DEFAULT_THREADS` unless ``HDREPLAY_THREADS`` says otherwise.
"""

from __future__ import annotations

import os

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

#: torch intra-op threads per sandbox process (measured: docs/results/fidelity/threads.md)
DEFAULT_THREADS = 1
THREADS_ENV = "HDREPLAY_THREADS"


def offline_env() -> None:
    """Set the offline defaults for this process (values the user already set are kept)."""
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)


def sandbox_threads() -> int:
    """The intra-op thread count for sandbox work: ``$HDREPLAY_THREADS`` or :data:`DEFAULT_THREADS`."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return DEFAULT_THREADS
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{THREADS_ENV}={raw!r}: expected a whole number of threads >= 1 (unset it for "
                         f"the default {DEFAULT_THREADS})")
    return n


def configure_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads for this process (``n`` or :func:`sandbox_threads`); returns the count.

    OpenMP pools started later (e.g. by a child process) follow ``OMP_NUM_THREADS``, which is set too
    unless the user set it.
    """
    import torch

    n = sandbox_threads() if n is None else n
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
