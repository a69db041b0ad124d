"""Where the replay state lives in a verl checkpoint directory (shared by the v0 and v1 recipes).

verl writes ``<default_local_dir>/global_step_N/{actor,critic,data.pt[,transfer_queue]}`` and then the
marker ``<default_local_dir>/latest_checkpointed_iteration.txt`` = N, which ``resume_mode=auto`` reads.
The recipes write the controller to ``global_step_N/hdreplay/`` *before* calling verl's save, so a crash
mid-save leaves the previous checkpoint as the latest one, and restore it from the folder verl resumes from.

Identity: ``global_step_N/hdreplay_run.json`` (``{"run_id", "global_step"}``, written first) records the run the
checkpoint belongs to: an id made at the run's start and kept by every resume.  The replay state carries the same id
and step N, and a resume compares them with the folder verl resumes from (its step is the folder's N, as verl reads
it) before anything is touched: another checkpoint's or another run's ``hdreplay/`` copied in is refused by name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import uuid
from typing import Any

from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from ...atomic import atomic_write_text
from ...errors import CheckpointError
from ..common import STATE_DIR, restore

#: the run a verl checkpoint folder belongs to (beside ``hdreplay/``)
RUN_FILE = "hdreplay_run.json"


def step_dir(trainer_config: Any, step: int) -> str:
    """``<trainer.default_local_dir>/global_step_<step>`` (as verl names it)."""
    return os.path.join(trainer_config.default_local_dir, f"global_step_{step}")


def _absolute(path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def resume_folder(trainer_config: Any, *, honours_hdfs: bool) -> str | None:
    """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumes from (None: fresh start).

    ``honours_hdfs``: the v0 trainer skips resuming when ``trainer.default_hdfs_dir`` is set; the v1
    trainer ignores that key.
    """
    tr = trainer_config
    if tr.resume_mode == "disable" or (honours_hdfs and tr.get("default_hdfs_dir", None) is not None):
        return None
    if tr.resume_mode == "resume_path":
        return _absolute(tr.resume_from_path)
    return find_latest_ckpt_path(_absolute(tr.default_local_dir))


def require_replay_state(folder: str) -> None:
    """Refuse a resume from ``folder`` without ``hdreplay/`` before verl loads anything (the workers' weights, the
    dataloader, ``global_steps``).  On a Ray cluster verl's trainer process, on whichever node Ray put it, writes
    ``hdreplay/``, ``data.pt`` and the marker on that node's disk while the workers write ``actor/`` on theirs."""
    if os.path.isdir(os.path.join(folder, STATE_DIR)):
        return
    where = "does not exist" if not os.path.isdir(folder) else f"has no {STATE_DIR}/ replay state"
    raise CheckpointError(
        f"{folder} {where} on {socket.gethostname()}, the node this trainer process runs on: it was written without "
        f"hdreplay, the run stopped between verl's checkpoint and the replay state, or trainer.default_local_dir is "
        f"not shared by the nodes and the trainer that wrote {STATE_DIR}/ ran on another node. Put "
        f"trainer.default_local_dir on a file system every node shares, resume from a checkpoint that has {STATE_DIR}/, "
        "or set hdr.resume_without_state=True to resume with an empty buffer (the replay history is lost)")


def prune_states(trainer_config: Any) -> None:
    """Keep ``hdreplay/`` only in the newest ``trainer.max_actor_ckpt_to_keep`` step folders
    (verl prunes its own actor folders but never extra directories)."""
    tr = trainer_config
    keep = 1 if tr.get("remove_previous_ckpt_in_save", False) else tr.get("max_actor_ckpt_to_keep", None)
    root = tr.default_local_dir
    if not keep or keep <= 0 or not os.path.isdir(root):
        return
    steps = sorted(int(d.split("global_step_")[-1]) for d in os.listdir(root)
                   if d.startswith("global_step_") and d.split("global_step_")[-1].isdigit()
                   and os.path.isdir(os.path.join(root, d, STATE_DIR)))
    for s in steps[:-keep]:
        shutil.rmtree(os.path.join(step_dir(tr, s), STATE_DIR), ignore_errors=True)


def folder_identity(folder: str) -> dict:
    """What the replay state resumed from ``folder`` must belong to: the step verl reads from the folder's name and
    the run id of its :data:`RUN_FILE` (None where the folder has none: written before hdreplay recorded its run)."""
    m = re.search(r"global_step_(\d+)$", os.path.normpath(folder))
    step, run_id, path = int(m.group(1)) if m else None, None, os.path.join(folder, RUN_FILE)
    if os.path.exists(path):
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: unreadable ({e}); the checkpoint is corrupted") from None
        if not (isinstance(run, dict) and isinstance(run.get("run_id"), str) and run.get("global_step") == step):
            raise CheckpointError(f"{path}: expected {{'run_id': str, 'global_step': {step}}} (the folder's step), "
                                  f"got {run!r:.120}; it belongs to another folder or was edited")
        run_id = run["run_id"]
    return {"run_id": run_id, "global_step": step}


class ReplayCheckpoints:
    """``_save_checkpoint`` / ``_load_checkpoint`` of a verl trainer (v0 or v1) extended with the replay state.

    Mixed in before the verl trainer class; uses the recipe trainer's ``replay`` (controller),
    ``replay_active`` and ``hdr`` (settings).  ``RESUME_HONOURS_HDFS``: see :func:`resume_folder`.
    """

    RESUME_HONOURS_HDFS = False

    @property
    def replay_run_id(self) -> str:
        """The run's id (made at the first use, replaced by the checkpoint's on a resume)."""
        if getattr(self, "_replay_run_id", None) is None:
            self._replay_run_id = uuid.uuid4().hex
        return self._replay_run_id

    def _save_checkpoint(self):
        if self.replay_active:  # before verl writes latest_checkpointed_iteration.txt
            seam = getattr(self, "async_seam", None)
            if seam is not None:  # the staleness rule's state rides in the controller's checkpoint
                seam.before_save()
            folder = step_dir(self.config.trainer, self.global_steps)
            identity = {"run_id": self.replay_run_id, "global_step": int(self.global_steps)}
            os.makedirs(folder, exist_ok=True)
            atomic_write_text(os.path.join(folder, RUN_FILE), json.dumps(identity))
            # the state as of the last commit (no step is open when verl saves, after the update)
            self.replay.save(os.path.join(folder, STATE_DIR), allow_open_step=True, identity=identity)
        super()._save_checkpoint()
        if self.replay_active:
            prune_states(self.config.trainer)

    def _load_checkpoint(self):
        folder = resume_folder(self.config.trainer, honours_hdfs=self.RESUME_HONOURS_HDFS) if self.replay_active \
            else None
        if folder is not None and not self.hdr.resume_without_state:
            require_replay_state(folder)  # before verl loads weights and dataloader (a driver on another node)
        result = super()._load_checkpoint()
        if folder is not None:
            identity = folder_identity(folder)
            restore(self.replay, folder, allow_missing=self.hdr.resume_without_state,
                    option="hdr.resume_without_state", expect=identity)
            self._replay_run_id = identity["run_id"] or self.replay_run_id
            if getattr(self, "async_seam", None) is not None:
                self.async_seam.after_load()
        return result
