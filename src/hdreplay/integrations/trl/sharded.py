"""How replay's extra passes behave under DDP, DeepSpeed ZeRO and FSDP2.

**Chunked micro-steps.**  How one part of a micro-step that is not its last defers gradient synchronisation.

In ``replay_micro_step="chunk"`` a micro-step runs TRL's loss on its fresh rows and then on each replay chunk,
one forward + backward per part (:mod:`.microstep`).  Only the micro-step's last part may behave as the
micro-step itself would: every earlier part must

* **not reduce gradients** across processes (DDP ``no_sync``; FSDP2 ``set_requires_gradient_sync(False)``);
* **not be an accumulation boundary**: accelerate's ``sync_gradients`` is False during it.  Under DeepSpeed this
  is what decides the optimizer boundary: accelerate's engine wrapper calls
  ``engine.set_gradient_accumulation_boundary(sync_gradients)`` before ``engine.backward`` and ``engine.step()``
  only when it is True, so a part with it False is one more accumulation pass (ZeRO-2/3 reduce-scatter and
  accumulate its gradient partition as for any non-boundary micro-batch) and the optimizer steps once per update.
  TRL's adaptive entropy controller steps on the same flag, so it too steps once per update.

:func:`deferred_sync` restores what it found, so it nests inside the Trainer's own ``no_sync`` of a non-final
micro-step.  (accelerate 1.15's FSDP2 ``no_sync`` turns sync back on unconditionally at exit: nested inside the
Trainer's, it would make the last part of every non-final micro-step reduce-scatter.)

**Re-scoring.**  Replay candidates are re-scored through the wrapped model (TRL's forward), one call per
``replay_score_batch_size`` rows on every rank; under ZeRO-3 and FSDP2 each call gathers the parameters once.  The
one-prompt-pass-per-group path (:mod:`.rescore`) calls the backbone and the model apart -- two calls per batch, a
count that depends on each rank's prompts -- so it runs only where parameters are not gathered per call
(:func:`shards_parameters`).
"""

from __future__ import annotations

from contextlib import contextmanager

from accelerate.utils import DistributedType


def fsdp2_param_groups(model) -> list:
    """The FSDP2 parameter groups under ``model`` (empty when it is not sharded with ``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            out += list(m._get_fsdp_state()._fsdp_param_groups)
    return out


@contextmanager
def _fsdp2_no_reduce(model):
    """FSDP2 ``set_requires_gradient_sync(False)`` for the block; every group's flags restored to what they were."""
    groups = fsdp2_param_groups(model)
    saved = [(g, g.reduce_grads, g.all_reduce_grads) for g in groups]
    for g in groups:
        g.reduce_grads = g.all_reduce_grads = False
    try:
        yield
    finally:
        for g, reduce, all_reduce in saved:
            g.reduce_grads, g.all_reduce_grads = reduce, all_reduce


@contextmanager
def deferred_sync(accelerator, model):
    """Run a non-final part of a micro-step: no gradient reduction, not an accumulation boundary (see module doc)."""
    state = accelerator.gradient_state
    was = state.sync_gradients
    state._set_sync_gradients(False)
    try:
        if accelerator.is_fsdp2:
            with _fsdp2_no_reduce(model):
                yield
        else:  # DDP restores its previous flag; DeepSpeed ZeRO >= 2 has no no_sync (the boundary flag does it)
            with accelerator.no_sync(model):
                yield
    finally:
        state._set_sync_gradients(was)


def shards_parameters(accelerator) -> bool:
    """True when a forward call gathers parameters across ranks (FSDP, DeepSpeed ZeRO-3): every rank must then make
    the same forward calls, and a call outside the wrapped model may see sharded weights."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    ds = getattr(accelerator.state, "deepspeed_plugin", None)
    return ds is not None and int(ds.zero_stage or 0) >= 3


def backward_kwargs(accelerator) -> dict:
    """What the Trainer passes to ``accelerator.backward``: under DeepSpeed ``scale_wrt_gas=False`` (TRL's loss is
    already divided by the accumulation steps; the engine would divide it again)."""
    return {"scale_wrt_gas": False} if accelerator.distributed_type == DistributedType.DEEPSPEED else {}
