"""A controller's checkpoint: what :class:`~hdreplay.controller.ReplayController` saves and how it restores it.

The controller's state is its buffer, the running acceptance rate, the last committed step, tau, the observers'
states, the starved-step count, the random orders' generator state and the configuration it ran under;
:mod:`hdreplay.checkpoint` writes it crash-safely and :mod:`hdreplay.checkpoint_schema` validates all of it before a
load changes anything.  A mixin of the controller (the checkpoints concern of the core, apart from the step
protocol); it reads and writes the controller's own attributes.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from . import sampling
from .checkpoint import check_identity, identity_of, open_checkpoint_dir, write_checkpoint_dir
from .checkpoint_schema import ControllerState, parse_buffer_state, parse_controller_state
from .errors import CheckpointError, ReplayConfigError, ReplayInputError, ReplayProtocolError, ReplayResumeWarning
from .records import rewind_stamp
from .storage import SLOT_FIELDS, materialize
from .validate import MAX_CAPACITY, check_bool, check_int, check_path, check_step

CONTROLLER_FORMAT = "hdreplay.controller"
#: 2: the manifest layout (see :mod:`hdreplay.checkpoint`); 1, the unreleased 0.1's layout, is not read
CONTROLLER_VERSION = 2
CONTROLLER_VERSIONS = (2,)


class ControllerCheckpoint:
    """``state_dict`` / ``load_state_dict`` / ``save`` / ``load`` / ``verify`` of a ReplayController."""

    def state_dict(self, *, allow_open_step: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, meta) of everything that influences later selections (new tensors: copies).

        While a step is open the buffer still holds exactly the state of the last commit (selection
        never mutates it, staged groups are held aside), so ``allow_open_step=True`` snapshots that
        committed state; the open step's selection and staged groups are not included.
        """
        tensors, meta = self.checkpoint_state(allow_open_step=allow_open_step)
        return materialize(tensors), meta

    def checkpoint_state(self, *, allow_open_step: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """What :meth:`state_dict` returns with the buffer's payload as views of its storage (what :meth:`save`
        streams to disk, see :meth:`ReplayBuffer.checkpoint_state`)."""
        allow_open_step = check_bool("allow_open_step", allow_open_step)
        if self._open_step is not None and not allow_open_step:
            raise ReplayProtocolError(
                f"state_dict() while step {self._open_step} is open; checkpoint after commit() "
                "(or pass allow_open_step=True to save the state as of the last commit)"
            )
        tensors, bmeta = self.buffer.checkpoint_state()
        meta = {
            "buffer": bmeta,
            "acceptance_rate": self.acceptance_rate,
            "last_step": self.last_step,
            "tau": self._tau,
            "observers": {o.name: o.state_dict() for o in self.observers if hasattr(o, "state_dict")},
            "starved_steps": self._starved_steps,
            "sampler_state": self.rng_state,
            "config": self.config.to_dict(),
        }
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; all of it is validated first, so a refused load changes nothing.

        Raises:
            CheckpointError if the state is malformed or was saved under a capacity / headroom
            weighting / group size this controller cannot hold; a ReplayResumeWarning lists other
            changed settings (see :mod:`hdreplay.checkpoint_schema`).
        """
        if self._open_step is not None:
            raise ReplayProtocolError(f"load_state_dict() while step {self._open_step} is open; commit() first")
        state = parse_controller_state(tensors, meta, config=self.config)
        try:
            observed = [(o, o.check_state(state.observers.get(o.name), state)) for o in self.observers
                        if hasattr(o, "check_state")]
        except CheckpointError as e:
            raise CheckpointError(f"controller state (observers): {e}") from None
        # every check passed: now the files (a refused load leaves them too), then memory
        self.rewind_logs(state.last_step)  # before any assignment: a failure here changes nothing
        self._install(state, observed)
        if state.changes:
            warnings.warn("hdreplay: resumed under a changed replay configuration (" + "; ".join(state.changes)
                          + "); the resumed run will not reproduce the uninterrupted one", ReplayResumeWarning,
                          stacklevel=3)

    def rewind_logs(self, step: int | None) -> list[Path]:
        """Set the diagnostics logs (``steps.jsonl``, ``groups.jsonl``, the observers' logs such as the staleness
        ledger) back to a checkpoint whose last committed step is ``step`` (None: nothing committed), so that a resumed
        run writes no step twice: the records after it move to side files beside each log, never deleted
        (:func:`hdreplay.records.rewind_jsonl`); a :class:`~hdreplay.errors.ReplayResumeWarning` lists them.
        :meth:`load` calls it with the loaded state's step; a resume without the state, with the checkpoint's."""
        if self._open_step is not None:
            raise ReplayProtocolError(f"rewind_logs() while step {self._open_step} is open; commit() first")
        stamp = rewind_stamp()  # (one time names every side file of this rewind)
        moved = self.diagnostics.rewind(step, stamp) if self.diagnostics is not None else []
        for obs in self.observers:
            if hasattr(obs, "rewind_files"):
                moved += obs.rewind_files(step, stamp)
        if moved:
            at = f"after step {step}" if step is not None else "before any committed step"
            warnings.warn(f"hdreplay: resumed {at}: the records of later steps were moved from the logs to "
                          f"{', '.join(str(p) for p in moved)} (the resumed run writes those steps again; nothing was "
                          "deleted)", ReplayResumeWarning, stacklevel=3)
        return moved

    def _install(self, state: ControllerState, observed: list) -> None:
        self.buffer._apply(state.buffer)
        self.acceptance_rate = state.acceptance_rate
        self.last_step = state.last_step
        self._tau = float(self.config.tau)  # a fixed tau is the configured one; an observer may restore its own
        for obs, parsed in observed:
            obs.restore(self, parsed)
        self._starved_steps = state.starved_steps
        self.rng_state = state.rng_state or sampling.rng_state(sampling.new_rng(self.config.seed))
        self.last_record = None

    def save(self, directory: str | os.PathLike, *, allow_open_step: bool = False,
             identity: dict[str, Any] | None = None) -> None:
        """Write the controller (buffer included) to ``directory`` crash-safely (see :mod:`hdreplay.checkpoint`).

        ``identity``: what the state belongs to, as named JSON scalars (a trainer's run id and global step), written
        with it and compared by :meth:`load`'s ``expect``."""
        check_path("save", directory)
        identity = identity_of("identity", identity, ReplayInputError)
        tensors, meta = self.checkpoint_state(allow_open_step=allow_open_step)
        if identity:
            meta["identity"] = identity
        write_checkpoint_dir(directory, format_name=CONTROLLER_FORMAT, version=CONTROLLER_VERSION,
                             tensors=tensors, meta=meta)

    def load(self, directory: str | os.PathLike, *, expect: dict[str, Any] | None = None) -> None:
        """Restore from a directory written by :meth:`save`; on error nothing changes.

        ``expect``: the identity the state must carry (every named value equal, None meaning not recorded; a state
        saved without an identity is refused when anything is expected); else
        :class:`~hdreplay.errors.CheckpointMismatchError` naming both values, before any file or state is touched."""
        check_path("load", directory)
        expect = identity_of("expect", expect, ReplayInputError)
        if self._open_step is not None:
            raise ReplayProtocolError(f"load() while step {self._open_step} is open; commit() first")
        with open_checkpoint_dir(directory, format_name=CONTROLLER_FORMAT, versions=CONTROLLER_VERSIONS) as (t, meta):
            check_identity(meta, expect, directory)
            try:
                self.load_state_dict(t, meta)  # (the groups are read block by block)
            except CheckpointError as e:
                raise CheckpointError(f"{directory}: {e}") from None

    @staticmethod
    def verify(directory: str | os.PathLike) -> int | None:
        """Check that ``directory`` holds a complete, intact controller checkpoint without loading it.

        Returns the checkpoint's last committed step (None if saved before the first commit).
        Raises CheckpointError saying what is missing or wrong (used to pick the newest complete
        checkpoint when resuming)."""
        check_path("verify", directory)
        with open_checkpoint_dir(directory, format_name=CONTROLLER_FORMAT, versions=CONTROLLER_VERSIONS) as (t, meta):
            bmeta = meta.get("buffer")
            cap = bmeta.get("capacity") if isinstance(bmeta, dict) else None
            try:
                check_int("capacity", cap, lo=1, hi=MAX_CAPACITY, err=ReplayConfigError)  # what a buffer accepts
            except ReplayConfigError:
                raise CheckpointError(f"{directory}: buffer state holds an invalid capacity {cap!r}") from None
            parse_buffer_state(t, bmeta, capacity=cap, group_size=None, slot_fields=SLOT_FIELDS,
                               where=f"{directory}: buffer state")
        last = meta.get("last_step")
        if last is not None:
            try:
                check_step("last_step", last)
            except ReplayInputError:
                raise CheckpointError(f"{directory}: last_step {last!r} is not a step") from None
        return last

