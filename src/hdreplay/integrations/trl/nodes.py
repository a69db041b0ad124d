"""Checkpoints past one machine: which process writes ``hdreplay/`` where, and a resume every rank agrees on.

A node's first process has ``LOCAL_RANK`` 0 on every node; transformers writes a checkpoint from the global main
process (``save_on_each_node=False``: one shared ``output_dir``) or from each node's first process
(``save_on_each_node=True``: node-local disks).  hdreplay follows the Trainer:

* **Save** (:func:`.checkpoints.writes_state`): the replay state is written by every process that saves the
  Trainer's files (``args.should_save``), once per directory: the writers take turns in rank order, and one that
  finds an earlier writer's ``hdreplay.pending`` marker of this very save (a per-save nonce) sees a directory it
  shares with that writer and leaves it to it.  Every rank holds the same replay state, so each copy is that state.
* **Resume** (:func:`resume_together`): before anything is loaded, every rank says in one small all-gather what it
  sees: the checkpoint on its disk (complete or not, with its replay state or not; for ``resume_from_checkpoint=True``
  the complete checkpoints of its ``output_dir``) and which of the Trainer's files its copy holds.  ``True`` resumes
  the newest checkpoint complete on *every* node.  A rank that lacks what it needs (or whose copy lacks files rank
  0's has) makes every rank refuse by name (:class:`~hdreplay.errors.CheckpointError` listing each rank's problem
  and the fixes) -- never one rank raising while the others die in the next collective.  Then the replay states
  load: the other ranks first, the main process (the only one whose load rewinds diagnostics files) last, a failure
  anywhere raised on every rank; so a refused resume changes no file.
* **Settings** (:func:`check_settings`): at ``train()`` every rank compares its hdreplay version and replay settings
  with rank 0's (one all-gather): nodes launched with different ``replay_*`` settings are refused by name on every
  rank before the first step.

A single process does none of this (no collective; the checks of :mod:`.checkpoints` as before).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

from ... import errors
from ...errors import CheckpointError
from ..common import STATE_DIR
from .agreement import RankMismatchError
from .checkpoints import checkpoint_identity, checkpoint_problem, checkpoints, refuse_incomplete, resume_target

#: what the Trainer loads from its own copy of a checkpoint on every rank at a resume: the model's config and weights
#: (whole, sharded, PEFT adapters), optimizer, scheduler, scaler, the Trainer's state, DeepSpeed / FSDP folders (the
#: per-process RNG states, the tokenizer and files of the user's own callbacks are not compared)
_LOADED = re.compile(r"config\.json|(model|pytorch_model|adapter_model)[\w.-]*\.(safetensors|bin|json)|"
                     r"adapter_config\.json|(optimizer|scheduler|scaler)\.pt|trainer_state\.json|global_step\d+|"
                     r"pytorch_model_fsdp_\d+|optimizer_\d+")
#: replay settings that may differ between nodes (paths of the node's own disk)
NODE_LOCAL_SETTINGS = ("replay_diagnostics_dir",)


def _gather(accelerator, item) -> list:
    from accelerate.utils import gather_object

    return gather_object([item])


def _where(acc) -> str:
    return f"rank {acc.process_index} (host {socket.gethostname()}, local rank {acc.local_process_index})"


# ---------------------------------------------------------------------------------------------------- settings
def replay_settings(args) -> dict[str, Any]:
    """The settings every rank must share: the hdreplay version and every ``replay_*`` field of ``args`` but the
    node-local ones (:data:`NODE_LOCAL_SETTINGS`)."""
    import hdreplay

    out = {"hdreplay version": hdreplay.__version__}
    for f in fields(args):
        if f.name.startswith("replay_") and f.name not in NODE_LOCAL_SETTINGS:
            v = getattr(args, f.name)
            out[f.name] = v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)
    return out


def check_settings(trainer) -> None:
    """Raise :class:`RankMismatchError` on every rank if any rank runs another hdreplay version or other replay
    settings than rank 0 (naming each differing setting and rank)."""
    acc = trainer.accelerator
    if acc.num_processes == 1:
        return
    mine = replay_settings(trainer.args)
    every = _gather(acc, (_where(acc), mine))
    (where0, first), diffs = every[0], []
    for where, theirs in every[1:]:
        for key in sorted(set(first) | set(theirs)):
            if first.get(key, "<unset>") != theirs.get(key, "<unset>"):
                diffs.append(f"{key}: {where0} {first.get(key, '<unset>')!r}, {where} {theirs.get(key, '<unset>')!r}")
    if diffs:
        raise RankMismatchError(
            "hdreplay: the ranks were launched with different replay settings (" + "; ".join(diffs) + "). Every "
            "node must run the same hdreplay version with the same replay_* settings (one config file, or the same "
            "command line on every node); training stops before its first step")


# ---------------------------------------------------------------------------------------------------- resume
def _view(trainer, resume, *, allow_missing: bool) -> dict:
    """What this rank sees of the checkpoint to resume (nothing is loaded or changed)."""
    view = {"where": _where(trainer.accelerator), "steps": None, "problem": None, "files": None}
    try:
        if resume is True:  # the complete checkpoints of this node's output_dir
            complete = {}
            for p in checkpoints(trainer.args.output_dir):
                if checkpoint_problem(p, replay=True) is None and (allow_missing or (p / STATE_DIR).is_dir()):
                    complete[int(p.name.rsplit("-", 1)[1])] = (str(p), _trainer_files(p))
            view["steps"] = complete
            if not complete:
                resume_target(trainer.args.output_dir)  # raises, saying why
        elif not os.path.isdir(resume):
            view["problem"] = f"{resume} does not exist on this node"
        else:
            refuse_incomplete(resume)
            checkpoint_identity(resume)
            if not allow_missing and not (Path(resume) / STATE_DIR).is_dir():
                view["problem"] = f"{resume} has no {STATE_DIR}/ replay state"
            view["files"] = _trainer_files(resume)
    except CheckpointError as e:
        view["problem"] = str(e)
    return view


def _trainer_files(ckpt) -> list[str]:
    """The names in ``ckpt`` that every rank loads from its own copy (:data:`_LOADED`)."""
    return sorted(p.name for p in Path(ckpt).iterdir() if _LOADED.fullmatch(p.name))


def _missing(views: list[dict]) -> list[str]:
    """Per rank, what its checkpoint lacks of the main process's (a node-local copy the Trainer wrote in part)."""
    main = set(views[0]["files"] or ())
    out = []
    for v in views[1:]:
        lacks = sorted(main - set(v["files"] or ()))
        if v["files"] is not None and lacks:
            out.append(f"{v['where']}: its copy lacks {', '.join(lacks)} (rank 0's has them; transformers writes the "
                       "model's config and weights from global rank 0 only, even with save_on_each_node=True: copy "
                       "them from rank 0's checkpoint)")
    return out


def _refuse(trainer, problems: list[str], what: str) -> None:
    raise CheckpointError(
        f"hdreplay: the ranks cannot resume {what} together: " + "; ".join(problems) + ". Every node must see the "
        "whole checkpoint: one output_dir every node shares, or a complete copy in every node's output_dir "
        "(save_on_each_node=True writes the Trainer's state and hdreplay's replay state on every node). Nothing was "
        "loaded and no file changed")


def resume_together(trainer, resume, *, load: Callable[[str, dict], None]):
    """Resolve ``train(resume_from_checkpoint=resume)`` on every rank and load the replay state; returns what to
    hand to the Trainer.  ``load(path, identity)`` loads this rank's replay state (``identity``: from the
    checkpoint's ``trainer_state.json``).  One process: the single-node checks of :mod:`.checkpoints`."""
    acc = trainer.accelerator
    allow = bool(trainer.args.replay_resume_without_state)
    if acc.num_processes == 1:
        if resume is True:
            resume = str(resume_target(trainer.args.output_dir))
        if isinstance(resume, (str, os.PathLike)) and os.path.isdir(resume):  # (missing: the Trainer's own error)
            refuse_incomplete(resume)  # before anything is loaded
            load(str(resume), checkpoint_identity(resume))
        return resume
    if resume is None or resume is False:
        return resume
    resume = resume if resume is True else str(resume)
    views = _gather(acc, _view(trainer, resume, allow_missing=allow))
    problems = [f"{v['where']}: {v['problem']}" for v in views if v["problem"]] or _missing(views)
    if resume is True and not problems:
        common = set.intersection(*(set(v["steps"]) for v in views))
        if not common:
            problems = [f"{v['where']}: complete checkpoints {sorted(v['steps']) or 'none'}" for v in views]
            _refuse(trainer, problems, "a checkpoint complete on every node (resume_from_checkpoint=True)")
        step = max(common)
        newer = [f"{v['where']}: checkpoint-{s} is complete here only" for v in views for s in v["steps"] if s > step]
        if newer:
            import warnings

            warnings.warn(f"hdreplay: resuming checkpoint-{step}, the newest complete on every node ("
                          + "; ".join(newer) + ")", stacklevel=3)
        for v in views:
            v["files"] = v["steps"][step][1]
        problems = _missing(views)
        resume = views[acc.process_index]["steps"][step][0]
    if problems:
        _refuse(trainer, problems, os.path.basename(str(resume)) if resume is not True else "the newest checkpoint")
    main = acc.is_main_process
    for turn in (False, True):  # the other ranks first: the main process's load is the one that rewinds files
        failed = None
        if main is turn:
            try:
                load(resume, checkpoint_identity(resume))
            except Exception as e:  # noqa: BLE001  (raised again on every rank below)
                failed = (type(e).__name__, str(e))
        outcomes = _gather(acc, (_where(acc), failed))
        bad = [(where, f) for where, f in outcomes if f is not None]
        if bad:
            name, _ = bad[0][1]
            cls = getattr(errors, name, None)
            cls = cls if isinstance(cls, type) and issubclass(cls, CheckpointError) else CheckpointError
            raise cls("hdreplay: the replay state could not be resumed on every rank (" + "; ".join(
                f"{where}: {n}: {msg}" for where, (n, msg) in bad) + ")" + (
                ". Nothing was loaded on the main process, and no file changed" if not turn else ""))
    return resume
