"""What the TRL and verl integrations share: their own settings, the resume policy, row trimming.

Both trainers expose the core :class:`~hdreplay.config.ReplayConfig` knobs (generated from
:func:`hdreplay.config.knobs`) plus the integration settings declared here once
(:data:`INTEGRATION_KNOBS`).  Nothing here imports a framework.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import baselines as _peers  # noqa: F401  (registers the peers' selectors: every trainer accepts them)
from ..config import Knob
from ..controller import ReplayController
from ..errors import CheckpointError, CheckpointMismatchError, ReplayResumeWarning
from ..store.ingest import split_by_schema  # noqa: F401  (re-exported: its home before hdreplay.store.ingest)
from ..store.padding import PaddedGroups

#: name of the replay-state directory inside a framework checkpoint directory
STATE_DIR = "hdreplay"

#: settings of an integration (not of the primitive): TRL spells them ``replay_<name>``, verl ``hdr.<name>``
INTEGRATION_KNOBS = (
    Knob("diagnostics_dir", str, None, True,
         "directory of steps.jsonl / groups.jsonl; unset = the trainer's default (TRL: <output_dir>/replay, "
         "verl: <default_local_dir>/hdreplay_diagnostics), empty string = off", None),
    Knob("resume_without_state", bool, False, False,
         "allow resuming from a checkpoint that has no replay state (e.g. written without hdreplay), or one whose "
         "replay state belongs to another run or step; the buffer then starts empty. Off by default: losing the buffer "
         "silently changes the run", None),
)


class CheckpointIdentity(dict):
    """What a framework checkpoint says its replay state must belong to (named JSON scalars, None where the checkpoint
    records nothing), plus ``resumes_at``: the first replay step a run resumed from it commits (None: not known), to
    which the diagnostics logs are set back when the replay starts empty (:func:`restore`); ``notes``: what the
    checkpoint lacks and how to restore it, added to a refusal."""

    def __init__(self, values: dict, *, resumes_at: int | None, notes: tuple[str, ...] = ()):
        super().__init__(values)
        self.resumes_at, self.notes = resumes_at, tuple(notes)


@dataclass(frozen=True)
class ResumeDecision:
    """What to do with the replay state of a checkpoint being resumed."""

    path: Path | None  # the state directory to load, or None (start empty)
    warning: str | None


def resume_policy(checkpoint: str | os.PathLike, *, allow_missing: bool, option: str) -> ResumeDecision:
    """Find the replay state of ``checkpoint`` or decide what a missing one means.

    Args:
        checkpoint: the framework checkpoint directory being resumed (``checkpoint-N``, ``global_step_N``).
        allow_missing: the user's ``resume_without_state`` setting.
        option: how that setting is spelled for this front end (named in the error).
    Raises:
        CheckpointError if the state is missing and ``allow_missing`` is false.
    """
    path = Path(checkpoint) / STATE_DIR
    if path.exists():
        return ResumeDecision(path, None)
    if allow_missing:
        return ResumeDecision(None, f"hdreplay: {checkpoint} has no {STATE_DIR}/ replay state; resuming with an "
                                    f"empty buffer ({option}=True)")
    raise CheckpointError(
        f"{checkpoint} has no {STATE_DIR}/ replay state: it was written without hdreplay, or the run stopped "
        f"between the framework's checkpoint and the replay state. Resume from an earlier checkpoint that has "
        f"{STATE_DIR}/, or set {option}=True to resume with an empty buffer (the replay history is lost)."
    )


def restore(controller: ReplayController, checkpoint: str | os.PathLike, *, allow_missing: bool,
            option: str, expect: dict | None = None) -> bool:
    """Apply :func:`resume_policy`: load the state into ``controller``; True if a state was loaded.

    ``expect``: the identity the framework's own checkpoint files give (a :class:`CheckpointIdentity`); a replay state
    that belongs to another run or step, or records no identity, is refused before anything is touched
    (CheckpointMismatchError naming both values and the way out), or with ``allow_missing`` set, left unloaded.  When
    the replay starts empty (no state, or one left unloaded) the diagnostics logs are set back to the checkpoint's
    step (``expect.resumes_at``; the records after it move to side files), so the resumed run writes no step twice."""
    decision = resume_policy(checkpoint, allow_missing=allow_missing, option=option)
    if decision.warning:
        warnings.warn(decision.warning, stacklevel=3)
    if decision.path is None:
        _rewind_to_checkpoint(controller, expect)
        return False
    try:
        controller.load(decision.path, expect=expect)
    except CheckpointMismatchError as e:
        unrecorded, msg = getattr(e, "unrecorded", False), "; ".join([str(e), *getattr(expect, "notes", ())])
        if not allow_missing:
            if unrecorded:
                raise CheckpointMismatchError(f"{msg}. Set {option}=True to resume from this checkpoint with an empty "
                                              "replay state (the replay history is lost), or start a new run") from None
            raise CheckpointMismatchError(
                f"{msg}. Resume from the checkpoint this replay state was saved with (or copy that checkpoint's "
                f"{STATE_DIR}/ back), or set {option}=True to resume with an empty replay state (the replay history "
                "is lost)") from None
        warnings.warn(f"hdreplay: {msg}; resuming with an empty replay state ({option}=True)", ReplayResumeWarning,
                      stacklevel=3)
        _rewind_to_checkpoint(controller, expect)
        return False
    return True


def _rewind_to_checkpoint(controller, expect) -> None:
    """The logs back to the step before the resumed run's first (when the checkpoint says which)."""
    at = getattr(expect, "resumes_at", None)
    if at is not None and hasattr(controller, "rewind_logs"):
        controller.rewind_logs(at - 1 if at > 0 else None)


@dataclass(frozen=True)
class TrimmedRows:
    """Rows ``idx`` of a :class:`PaddedGroups`, trimmed to the widths those rows need.

    prompt_ids / prompt_mask: (r, P') left-padded;  completion_ids / completion_mask / loss_mask /
    logprobs: (r, C') right-padded;  P' / C' = the longest prompt / completion among the rows.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    extras: dict[str, torch.Tensor]

    def input_ids(self) -> torch.Tensor:
        """(r, P' + C') prompt ; completion."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    def attention_mask(self) -> torch.Tensor:
        """(r, P' + C')."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)


def trim_rows(pg: PaddedGroups, idx: torch.Tensor | slice) -> TrimmedRows:
    """Select rows ``idx`` of ``pg`` and drop the column padding only other rows needed."""
    pm, cm = pg.prompt_mask[idx], pg.completion_mask[idx]
    p_keep = int(pm.sum(1).max()) if pm.numel() else 0
    c_keep = int(cm.sum(1).max()) if cm.numel() else 0
    P = pg.prompt_ids.shape[1]
    return TrimmedRows(
        prompt_ids=pg.prompt_ids[idx, P - p_keep:], prompt_mask=pm[:, P - p_keep:],
        completion_ids=pg.completion_ids[idx, :c_keep], completion_mask=cm[:, :c_keep],
        loss_mask=pg.loss_mask[idx, :c_keep], logprobs=pg.logprobs[idx, :c_keep],
        extras={k: v[idx, :c_keep] for k, v in pg.extras.items()},
    )


def scan_budget(controller, *, rows_per_forward: int, group_size: int, configured: int | None,
                latency_bound: bool) -> dict:
    """``select``'s ``scan_tokens`` / ``latency_bound`` for a trainer whose log-prob forward runs ``rows_per_forward``
    rows per call (every rank's together): those rows at the mean row length of the buffer's largest group, never less
    than that group -- the same on every rank, as the buffer is (issue 37).  {} for a strategy whose controller takes
    no budget; no ``scan_tokens`` when the user ``configured`` one or the buffer is empty."""
    import inspect

    buffer = getattr(controller, "buffer", None)
    if not hasattr(buffer, "forward_tokens") or "scan_tokens" not in inspect.signature(controller.select).parameters:
        return {}
    out = {"latency_bound": bool(latency_bound)}
    if configured is None and len(buffer):
        tokens = int(buffer.forward_tokens(buffer.insertion_ids()).max())
        out["scan_tokens"] = -(-max(rows_per_forward, group_size) * tokens // group_size)
    return out
