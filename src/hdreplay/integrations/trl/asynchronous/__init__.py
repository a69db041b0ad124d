"""Headroom-Drift Replay on TRL's asynchronous GRPO (experimental): stale groups diverted to the buffer, replay routed
through TRL's rollout queue.  Open ``trainer.py`` first (``HDRAsyncGRPOTrainer``; ``config.py``: its settings).

    from hdreplay.integrations.trl.asynchronous import HDRAsyncGRPOConfig, HDRAsyncGRPOTrainer

(both loaded on first use: importing a helper module of this package does not import TRL's async trainer)
"""

__all__ = ["HDRAsyncGRPOConfig", "HDRAsyncGRPOTrainer"]


def __getattr__(name):
    if name == "HDRAsyncGRPOConfig":
        from .config import HDRAsyncGRPOConfig

        return HDRAsyncGRPOConfig
    if name == "HDRAsyncGRPOTrainer":
        from .trainer import HDRAsyncGRPOTrainer

        return HDRAsyncGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
