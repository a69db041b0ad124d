"""Where the replay state lives in a verl checkpoint directory (shared by the v0 and v1 recipes).

verl writes ``<default_local_dir>/global_step_N/{actor,critic,data.pt[,transfer_queue]}`` and then the
marker ``<default_local_dir>/latest_checkpointed_iteration.txt`` = N, which ``resume_mode=auto`` reads.
The recipes write the controller to ``global_step_N/hdreplay/`` *before* calling verl's save, so a crash
mid-save leaves the previous checkpoint as the latest one, and restore it from the folder verl resumes from.

Identity: what ``global_step_N/hdreplay`` belongs to is read from files that do not travel with it:

* the run: ``<default_local_dir>/hdreplay_run.json`` (:data:`RUN_FILE`, ``{"run_id"}``), one record per checkpoint
  directory beside verl's marker (an id made at the run's start, kept by every resume, written before any replay
  state); a resume reads the record of the directory the folder is in;
* the step: the folder's N, as verl reads it;
* verl's own file of that step: a digest of the dataloader state verl saves as ``global_step_N/data.pt``
  (:func:`dataloader_digest`).  It is known before verl's save -- the recipe computes ``train_dataloader.state_dict()``
  itself, the dict verl's ``_save_checkpoint`` then saves, nothing iterating in between -- so the replay state is
  still written before verl's files and marker; a resume digests the ``data.pt`` verl is about to load.

A resume compares all three with the replay state's before anything is touched: another step's or another run's
``hdreplay/`` (with or without the step-folder run record an earlier hdreplay wrote) is refused by name, and so is a
checkpoint directory whose run record was deleted, a ``data.pt`` of another run or step, and a replay state that
records no identity (written before hdreplay recorded one); ``hdr.resume_without_state=true`` starts the replay empty
instead.  What verl offers to bind to per step is its data position: two runs with the same data seed have equal
``data.pt`` at the same step (the run record tells them apart); the actor's files (weights, optimizer) would tell any
two saves apart but are gigabytes, and are written after the replay state.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from typing import Any

import numpy as np
import torch
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from ...checkpoint.atomic import atomic_write_text
from ...errors import CheckpointError
from ..common import STATE_DIR, CheckpointIdentity, restore

#: the run a verl checkpoint directory belongs to (``<default_local_dir>/hdreplay_run.json``, beside verl's marker)
RUN_FILE = "hdreplay_run.json"
#: verl's dataloader state in a step folder
DATA_FILE = "data.pt"


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
        f"trainer.default_local_dir on a file system every node shares, resume from a checkpoint that has "
        f"{STATE_DIR}/, or set hdr.resume_without_state=True to resume with an empty buffer "
        "(the replay history is lost)")


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


def _feed(h, x) -> None:
    """Hash ``x`` (nested dicts / lists / tuples of scalars, tensors and arrays) canonically into ``h``."""
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        h.update(repr((type(x).__name__, x)).encode())
    elif isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(x, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(x)
        h.update(f"array {a.dtype} {a.shape}".encode())
        h.update(a.tobytes())
    elif isinstance(x, dict):
        h.update(f"dict {len(x)}".encode())
        for k in sorted(x, key=repr):
            _feed(h, k)
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(f"{type(x).__name__} {len(x)}".encode())
        for v in x:
            _feed(h, v)
    else:
        raise TypeError(type(x).__name__)


def dataloader_digest(state: Any) -> str | None:
    """sha256 of a dataloader state (``StatefulDataLoader.state_dict()``, or the ``data.pt`` verl saved it to), the
    same before ``torch.save`` and after ``torch.load``; None if it holds something other than dicts, lists, scalars,
    tensors and arrays (nothing stable to bind to: not compared)."""
    h = hashlib.sha256()
    try:
        _feed(h, state)
    except TypeError:
        return None
    return h.hexdigest()


def _scalar(v: Any) -> Any:
    """A value read from a checkpoint, as it is when a JSON scalar (a wrong type is then named, not unrecorded)."""
    if v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 200):
        return v
    return f"<a {type(v).__name__}: {str(v)[:60]}>"


def run_record(root: str) -> Any:
    """The run id ``<root>/hdreplay_run.json`` records (None: no record; a malformed record is described, so that it
    differs from every run id and is named by the comparison)."""
    path = os.path.join(root, RUN_FILE)
    if not os.path.lexists(path):
        return None
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, ValueError) as e:
        return f"<unreadable {RUN_FILE}: {str(e)[:60]}>"
    return _scalar(run.get("run_id")) if isinstance(run, dict) else _scalar(run)


def folder_identity(folder: str, *, updates_per_step: int = 1) -> CheckpointIdentity:
    """What the replay state resumed from ``folder`` must belong to: the run id of the checkpoint directory's
    :data:`RUN_FILE` (None where there is none), the step verl reads from the folder's name and the digest of its
    ``data.pt`` (None if missing).  ``resumes_at``: the first replay step a run resumed from it commits (the replay
    step counts ``updates_per_step`` actor updates per global step)."""
    folder = os.path.normpath(folder)
    m = re.search(r"global_step_(\d+)$", folder)
    step = int(m.group(1)) if m else None
    data, digest, notes = os.path.join(folder, DATA_FILE), None, []
    if os.path.exists(data):
        try:
            digest = dataloader_digest(torch.load(data, weights_only=False))
        except Exception as e:  # noqa: BLE001 - verl's own load would fail on it too: said, not compared
            digest = f"<unreadable {DATA_FILE}: {type(e).__name__}>"
    else:
        notes.append(f"{data} (verl's dataloader state of this step) is missing")
    root = os.path.dirname(folder)
    run_id = run_record(root)
    if run_id is None:
        notes.append(f"{os.path.join(root, RUN_FILE)} (the run record of this checkpoint directory) is missing: if "
                     f"{os.path.basename(folder)} was copied out of its run's directory, copy that directory's "
                     f"{RUN_FILE} beside it")
    return CheckpointIdentity({"run_id": run_id, "global_step": step, "dataloader": digest},
                              resumes_at=None if step is None else (step + 1) * updates_per_step, notes=notes)


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
            tr = self.config.trainer
            folder = step_dir(tr, self.global_steps)
            identity = {"run_id": self.replay_run_id, "global_step": int(self.global_steps),
                        "dataloader": dataloader_digest(self.train_dataloader.state_dict())}  # what verl saves next
            os.makedirs(folder, exist_ok=True)
            if run_record(tr.default_local_dir) != self.replay_run_id:  # (the directory's record: once per run)
                atomic_write_text(os.path.join(tr.default_local_dir, RUN_FILE),
                                  json.dumps({"run_id": self.replay_run_id}))
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
        if folder is not None and os.path.isdir(folder):  # (a missing folder: verl's own error)
            # the replay state first: a refusal leaves verl's weights, dataloader and the files as they were
            identity = folder_identity(folder, updates_per_step=int(getattr(self, "parameter_sync_step", 1)))
            restore(self.replay, folder, allow_missing=self.hdr.resume_without_state,
                    option="hdr.resume_without_state", expect=identity)
            run_id = identity["run_id"]
            self._replay_run_id = run_id if isinstance(run_id, str) and not run_id.startswith("<") \
                else self.replay_run_id
        result = super()._load_checkpoint()
        if folder is not None and getattr(self, "async_seam", None) is not None:
            self.async_seam.after_load()
        return result
