"""Crash-safe TRL checkpoints with the replay state inside.

``HDRGRPOTrainer._save_checkpoint`` writes ``checkpoint-N`` in this order:

1. ``checkpoint-N/hdreplay.pending`` (marker: this checkpoint is being written);
2. the Trainer's own files (model, optimizer, scheduler, RNG, ``trainer_state.json``), with the
   Trainer's checkpoint rotation held back;
3. ``checkpoint-N/hdreplay/`` (crash-safe: ``ReplayController.save`` commits it by swapping in its manifest);
4. the marker is removed; only then may the Trainer's rotation (``save_total_limit``) delete older
   checkpoints.

So a crash at any moment leaves the previous complete checkpoint on disk, and an incomplete one is
recognisable: :func:`checkpoint_problem` says what is missing and why, and
:func:`newest_complete_checkpoint` is what ``resume_from_checkpoint=True`` resumes.
"""

from __future__ import annotations

import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ...errors import CheckpointError
from ..common import STATE_DIR

PENDING = "hdreplay.pending"
TRAINER_STATE = "trainer_state.json"
_CKPT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def mark_pending(ckpt: str | os.PathLike) -> None:
    path = Path(ckpt)
    path.mkdir(parents=True, exist_ok=True)
    (path / PENDING).write_text("hdreplay: this checkpoint is being written; it is complete once this file is gone\n")


def clear_pending(ckpt: str | os.PathLike) -> None:
    marker = Path(ckpt) / PENDING
    marker.unlink(missing_ok=True)
    fd = os.open(Path(ckpt), os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - platforms without directory fsync
        pass
    finally:
        os.close(fd)


def checkpoint_problem(ckpt: str | os.PathLike, *, replay: bool) -> str | None:
    """None if ``ckpt`` is a complete checkpoint, else what is missing (one sentence)."""
    path = Path(ckpt)
    pending = (path / PENDING).exists()
    if not (path / TRAINER_STATE).is_file():
        why = "the run was killed while writing it" if pending else "it is not a complete Trainer checkpoint"
        return f"{path} has no {TRAINER_STATE}: {why}"
    if replay and not (path / STATE_DIR).is_dir():
        if pending:
            return (f"{path} has no {STATE_DIR}/ replay state: the run was killed after the Trainer's files and before "
                    f"the replay state was written ({PENDING} is still there)")
        return None  # no marker either: written without hdreplay; the resume policy decides
    if pending:
        return f"{path} is incomplete: the run was killed before its replay state was confirmed ({PENDING})"
    return None


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """``checkpoint-N`` directories of ``output_dir``, newest (largest N) first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CKPT.match(p.name))]
    return [p for _, p in sorted(found, key=lambda t: t[0], reverse=True)]


def newest_complete_checkpoint(output_dir: str | os.PathLike, *, replay: bool) -> tuple[Path | None, list[str]]:
    """(the newest complete checkpoint or None, one sentence per newer incomplete checkpoint skipped)."""
    skipped = []
    for p in checkpoints(output_dir):
        problem = checkpoint_problem(p, replay=replay)
        if problem is None:
            return p, skipped
        skipped.append(problem)
    return None, skipped


@contextmanager
def rotation_held(args):
    """Hold back the Trainer's checkpoint rotation inside ``Trainer._save_checkpoint`` (it reads
    ``args.save_total_limit``); the caller rotates once the checkpoint is complete."""
    limit = args.save_total_limit
    args.save_total_limit = None
    try:
        yield limit
    finally:
        args.save_total_limit = limit


def resume_target(output_dir: str | os.PathLike) -> Path:
    """What ``resume_from_checkpoint=True`` resumes: the newest complete checkpoint (newer incomplete ones are
    skipped with a warning saying why); CheckpointError if there is none."""
    newest, skipped = newest_complete_checkpoint(output_dir, replay=True)
    for s in skipped:
        warnings.warn(f"hdreplay: skipping an incomplete checkpoint: {s}", stacklevel=3)
    if newest is None:
        raise CheckpointError(f"resume_from_checkpoint=True: no complete checkpoint in {output_dir}"
                              + (f" ({'; '.join(skipped)})" if skipped else ""))
    return newest


def refuse_incomplete(checkpoint: str | os.PathLike) -> None:
    """Raise CheckpointError, naming the newest complete checkpoint beside it, if ``checkpoint`` is incomplete."""
    problem = checkpoint_problem(checkpoint, replay=True)
    if problem:
        newest, _ = newest_complete_checkpoint(Path(os.path.abspath(checkpoint)).parent, replay=True)
        hint = f"resume from {newest}" if newest else "no complete checkpoint is left beside it"
        raise CheckpointError(f"{problem}. It cannot be resumed: {hint} (resume_from_checkpoint=True picks the "
                              "newest complete checkpoint).")


def save_with_replay(trainer, model, trial, *, save_trainer, write_state) -> None:
    """``Trainer._save_checkpoint`` with the replay state, in the order of the module doc: the pending marker,
    the Trainer's files (``save_trainer(model, trial)``, rotation held back), ``write_state(<checkpoint>/hdreplay)``
    on the main process (crash-safe: ``ReplayController.save``), the marker removed, then the rotation."""
    run_dir = trainer._get_output_dir(trial=trial)
    ckpt = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    if trainer.accelerator.is_main_process:
        mark_pending(ckpt)
    with rotation_held(trainer.args) as limit:
        save_trainer(model, trial)
    if trainer.accelerator.is_main_process:  # every rank holds the same replay state
        write_state(os.path.join(ckpt, STATE_DIR))
        clear_pending(ckpt)
    trainer.accelerator.wait_for_everyone()
    if trainer.args.should_save:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
