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

Identity: the run has an id (:class:`HDReplayRun`, made at its start and kept by every resume) that the Trainer writes
into ``trainer_state.json`` (``stateful_callbacks``); the replay state of ``checkpoint-N`` carries the same id, the
global step N and a digest of the ``trainer_state.json`` the Trainer wrote for this checkpoint (step 2 above, before
the replay state: :func:`replay_identity`; the file holds the run's own log history, so it differs between runs and
steps).  A resume compares them with the checkpoint's file (:func:`checkpoint_identity`) before it touches anything:
another checkpoint's or another run's ``hdreplay/`` copied in, a checkpoint whose run id was removed or is not a
string, or a replay state that records no identity (written before hdreplay recorded one: not resumed) is refused by
name, with the way out (``replay_resume_without_state``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path

from transformers.trainer_callback import ExportableState, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ...errors import CheckpointError
from ..common import STATE_DIR, CheckpointIdentity

PENDING = "hdreplay.pending"
TRAINER_STATE = "trainer_state.json"
_CKPT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
#: ``trainer_state.json`` fields that differ between the processes writing it (each node's first one with
#: ``save_on_each_node``): left out of its digest, with the log's wall-clock entries (TRL's ``step_time`` is each
#: rank's own; ``train_runtime``, ``*_per_second``)
PER_PROCESS_FIELDS = ("is_local_process_zero", "is_world_process_zero")
_WALL_CLOCK = re.compile(r".*(time|runtime|_per_second|seconds)$")


class HDReplayRun(TrainerCallback, ExportableState):
    """The run's id, written by the Trainer into ``trainer_state.json`` (``stateful_callbacks``) with every checkpoint
    and carried by the replay state saved beside it."""

    def __init__(self, run_id: str | None = None):
        self.run_id = run_id or uuid.uuid4().hex
        self.agreed = False  # every rank holds rank 0's id (broadcast at the first save, or read on a resume)

    def state(self) -> dict:
        return {"args": {"run_id": self.run_id}, "attributes": {}}


def _trainer_state(ckpt: str | os.PathLike) -> dict:
    path = Path(ckpt) / TRAINER_STATE
    try:
        st = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); the checkpoint is incomplete or corrupted") from None
    if not isinstance(st, dict):
        raise CheckpointError(f"{path}: not a JSON object; the checkpoint is corrupted")
    return st


def _digest(state: dict) -> str:
    body = {k: v for k, v in state.items() if k not in PER_PROCESS_FIELDS}
    if isinstance(body.get("log_history"), list):
        body["log_history"] = [{k: v for k, v in e.items() if not _WALL_CLOCK.fullmatch(str(k))}
                               if isinstance(e, dict) else e for e in body["log_history"]]
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def trainer_state_digest(ckpt: str | os.PathLike) -> str:
    """sha256 of ``ckpt/trainer_state.json`` as the Trainer wrote it (its JSON with sorted keys, without
    :data:`PER_PROCESS_FIELDS` and the log's wall-clock entries: the same on every node's copy)."""
    return _digest(_trainer_state(ckpt))


def replay_identity(trainer, run_id: str) -> dict:
    """What ``checkpoint-N/hdreplay`` carries: the run id, the global step and the :func:`trainer_state_digest` of the
    ``trainer_state.json`` the Trainer has just written into ``checkpoint-N`` (:func:`save_with_replay` writes the
    replay state after the Trainer's files), computed from the ``trainer.state`` it was written from (so that no
    process reads a file another node's process may be writing into a shared directory)."""
    written = json.loads(json.dumps(dataclasses.asdict(trainer.state)))  # (what TrainerState.save_to_json writes)
    return {"run_id": run_id, "global_step": trainer.state.global_step, "trainer_state": _digest(written)}


def _scalar(v):
    """``v`` as the checkpoint holds it when a JSON scalar (a wrong type is then named, not taken as unrecorded)."""
    if v is None or isinstance(v, (bool, int, float)):
        return v
    if isinstance(v, str):
        return v if len(v) <= 200 else v[:200] + "..."
    return f"<a {type(v).__name__}: {json.dumps(v)[:60]}>"


def checkpoint_identity(ckpt: str | os.PathLike) -> CheckpointIdentity:
    """What the replay state resumed with ``ckpt`` must belong to, from its ``trainer_state.json``: the run id
    (:class:`HDReplayRun`'s entry; None where there is none), ``global_step`` (as the file holds them: a value of the
    wrong type is compared, and refused, as it is) and the file's digest; ``resumes_at``: the global step (the resumed
    run's first replay step)."""
    st = _trainer_state(ckpt)
    callbacks = st.get("stateful_callbacks")
    run = callbacks.get(HDReplayRun.__name__) if isinstance(callbacks, dict) else None
    run_id = run["args"].get("run_id") if isinstance(run, dict) and isinstance(run.get("args"), dict) else None
    step = st.get("global_step")
    at = step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
    return CheckpointIdentity({"run_id": _scalar(run_id), "global_step": _scalar(step),
                               "trainer_state": _digest(st)}, resumes_at=at)


def run_of(trainer) -> HDReplayRun:
    """The trainer's :class:`HDReplayRun` callback (added at construction)."""
    return next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, HDReplayRun))


def resumed_run(trainer, identity: dict) -> None:
    """After a resume: the run goes on under the checkpoint's run id (if it recorded one)."""
    if isinstance(identity.get("run_id"), str):  # (every rank reads the same trainer_state.json: the ranks agree)
        run = run_of(trainer)
        run.run_id, run.agreed = identity["run_id"], True


def mark_pending(ckpt: str | os.PathLike, save: str = "") -> None:
    """Write ``ckpt/hdreplay.pending`` (this checkpoint is being written), naming the save (``save``: its nonce)."""
    path = Path(ckpt)
    path.mkdir(parents=True, exist_ok=True)
    (path / PENDING).write_text("hdreplay: this checkpoint is being written; it is complete once this file is gone\n"
                                f"save {save}\n")


def writes_state(trainer, ckpt: str) -> bool:
    """Whether this rank writes ``ckpt``'s replay state (its pending marker is written here if so); collective.

    The processes that save the Trainer's files (``args.should_save``: the main process, or each node's first one
    with ``save_on_each_node``) write it, once per directory: in turn, in rank order, each writes its marker naming
    this save (a nonce of rank 0's) unless an earlier writer's marker of this save is already there (a directory
    they share).  Every rank holds the same replay state, so each node's copy is that state."""
    acc = trainer.accelerator
    if acc.num_processes == 1:
        if trainer.args.should_save:
            mark_pending(ckpt)
        return bool(trainer.args.should_save)
    from accelerate.utils import broadcast_object_list, gather_object

    nonce = broadcast_object_list([uuid.uuid4().hex], from_process=0)[0]
    savers = [r for r, s in enumerate(gather_object([bool(trainer.args.should_save)])) if s]
    write = False
    for r in savers:  # (a rank that does not save still takes part in every barrier)
        if r == acc.process_index:
            try:
                shared = f"save {nonce}" in (Path(ckpt) / PENDING).read_text()
            except OSError:
                shared = False
            if not shared:
                mark_pending(ckpt, nonce)
            write = not shared
        acc.wait_for_everyone()
    return write


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
    the Trainer's files (``save_trainer(model, trial)``, rotation held back), ``write_state(<checkpoint>/hdreplay,
    identity)`` on the ranks :func:`writes_state` picks (crash-safe: ``ReplayController.save``; ``identity``: the run
    id and global step), the markers removed once every copy is written, then the rotation."""
    run_dir = trainer._get_output_dir(trial=trial)
    ckpt = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    run = run_of(trainer)
    if trainer.accelerator.num_processes > 1 and not run.agreed:  # one id: rank 0's, on every rank
        from accelerate.utils import broadcast_object_list

        ids = broadcast_object_list([run.run_id], from_process=0)
        run.run_id, run.agreed = ids[0], True
    # (a checkpoint resumed from one written before the run id was recorded has no entry the Trainer can update)
    trainer.state.stateful_callbacks.setdefault(HDReplayRun.__name__, run.state())
    write = writes_state(trainer, ckpt)
    with rotation_held(trainer.args) as limit:
        save_trainer(model, trial)
    if write:  # every rank holds the same replay state
        write_state(os.path.join(ckpt, STATE_DIR), replay_identity(trainer, run.run_id))
    trainer.accelerator.wait_for_everyone()  # every copy written before any marker goes
    if write:
        clear_pending(ckpt)
    trainer.accelerator.wait_for_everyone()
    if trainer.args.should_save:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
