"""Ranks agree on the replay selection, or training stops with a message instead of hanging.

Every rank holds the same buffer because every rank computes the same decisions from gathered values (rewards,
re-scored log-probs, ingress rows).  A bug or a nondeterministic path that broke this would give the ranks different
replay rows, hence a different number of rows or micro-steps, and the job would hang in the next collective with no
message.  So each update, right after the selection and before any of its rows is used, the ranks compare a digest
of it in one small collective (one int64 per rank): :func:`selection_digest` covers the step, the selector, the
replayed group ids in order, the size of the buffer it was selected from and the groups admitted to the buffer so
far; :func:`check_rank_agreement` raises :class:`RankMismatchError` on every rank, naming the step and the differing
digests, when they are not all equal.  Cost: one digest (microseconds) and one all-gather of 8 bytes per rank per
update (``benchmarks/trl_step.py`` measures both).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ...errors import ReplayProtocolError


class RankMismatchError(ReplayProtocolError):
    """Ranks computed different replay selections for one update (see :mod:`.agreement`)."""


def selection_digest(step: int, selection: Any, controller: Any) -> int:
    """A 63-bit digest of one update's selection: step, selector, replayed group ids (in order), the buffer size it
    was selected from, and the groups admitted so far (``buffer.next_insertion_id`` of a ReplayController; a
    strategy's store size otherwise)."""
    buffer = getattr(controller, "buffer", None)
    admitted = getattr(buffer, "next_insertion_id", None)
    if admitted is None:
        store = getattr(controller, "store", getattr(controller, "pool", None))
        admitted = len(store) if store is not None else -1
    ids = [g.group_id for g in selection.groups]
    text = repr((int(step), str(selection.selector), ids, int(selection.buffer_size), int(admitted)))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def check_rank_agreement(accelerator: Any, step: int, digest: int) -> None:
    """All-gather ``digest`` (one int64 per rank) and raise RankMismatchError on every rank unless all are equal
    (a single process: nothing to compare)."""
    if accelerator.num_processes == 1:
        return
    mine = torch.tensor([digest], dtype=torch.int64, device=accelerator.device)
    digests = [int(d) for d in accelerator.gather(mine).tolist()]
    if len(set(digests)) > 1:
        by_rank = ", ".join(f"rank {r}: {d:016x}" for r, d in enumerate(digests))
        raise RankMismatchError(
            f"hdreplay: the ranks selected different replay groups at step {step} ({by_rank}); every rank must make "
            "the same replay decisions from the same gathered values. A nondeterministic scorer, reward function or "
            "ingress rule, or ranks given different replay settings, break that; training stops here instead of "
            "hanging in the next collective")
