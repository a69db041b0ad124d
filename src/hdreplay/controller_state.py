"""A controller's checkpoint: what :class:`~hdreplay.controller.ReplayController` saves and how it restores it.

The controller's state is its buffer, the running acceptance rate, the last committed step, tau, the observers'
states, the starved-step count, the random orders' generator state and the configuration it ran under;
:mod:`hdreplay.checkpoint.files` writes it crash-safely and :func:`parse_controller_state` (with the buffer's
:func:`~hdreplay.store.state.parse_buffer_state`) validates all of it before a load changes anything.  A mixin of
the controller (the checkpoints concern of the core, apart from the step protocol); it reads and writes the
controller's own attributes.

Resuming under a different configuration (the decision this module encodes):

* refused (:class:`~hdreplay.errors.CheckpointError`): ``capacity``; ``group_size`` when a stored
  group does not have that many responses (otherwise warned); ``headroom_weighting`` (the stored cached and
  reference Headroom are in the saved weighting's units, and mixing units would silently reorder
  the buffer);
* allowed with a :class:`~hdreplay.errors.ReplayResumeWarning` that names every change:
  ``selector``, ``k_rep``, ``tau``, ``drift_norm``, ``ingress``, ``answer_threshold``,
  ``truncate_multiple``, ``max_scan``, ``acceptance_ema`` and the rest of the scan's and the peers' settings
  (the stored groups and their priorities stay valid under these, but the resumed run no longer reproduces the
  uninterrupted one).  The observers' states (:mod:`hdreplay.diagnostics`) are handed to the observers, which
  check them (an adaptive-tau state outside the new bounds is clamped into them).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from . import sampling
from .checkpoint.files import check_identity, identity_of, open_checkpoint_dir, write_checkpoint_dir
from .errors import CheckpointError, ReplayConfigError, ReplayInputError, ReplayProtocolError, ReplayResumeWarning
from .records import rewind_stamp
from .store.blocks import SLOT_FIELDS, materialize
from .store.state import BufferState, parse_buffer_state
from .validate import MAX_CAPACITY, MAX_STEP, check_bool, check_int, check_path, check_step, is_int, is_real

CONTROLLER_FORMAT = "hdreplay.controller"
#: 2: the manifest layout (see :mod:`hdreplay.checkpoint.files`); 1, the unreleased 0.1's layout, is not read
CONTROLLER_VERSION = 2
CONTROLLER_VERSIONS = (2,)

#: configuration fields whose change at resume is refused / reported with a warning
CONFIG_REFUSED = ("capacity", "headroom_weighting")
CONFIG_WARNED = ("selector", "k_rep", "tau", "drift_norm", "ingress", "answer_threshold", "truncate_multiple",
                 "max_scan", "acceptance_ema", "group_size", "seed", "priority_alpha", "age_decay",
                 "is_beta", "max_age", "scan_refresh", "skip_rejected")


@dataclass
class ControllerState:
    buffer: BufferState
    acceptance_rate: float
    last_step: int | None
    observers: dict[str, Any]  # name -> saved state of an observer (hdreplay.diagnostics)
    starved_steps: int
    changes: list[str]  # "name: saved -> configured" for every warned configuration change
    rng_state: dict | None = None  # the random orders' generator (None: saved before it existed)


def parse_controller_state(tensors: Any, meta: Any, *, config: Any, where: str = "controller state"
                           ) -> ControllerState:
    """Validate a controller's ``(tensors, meta)`` for a controller configured with ``config``."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{where}: {msg}")

    if not isinstance(meta, Mapping):
        raise bad(f"meta must be a mapping, got {type(meta).__name__}")
    missing = [k for k in ("buffer", "acceptance_rate", "last_step", "config") if k not in meta]
    if missing:
        raise bad(f"missing entries {missing}; the checkpoint is incomplete or foreign")
    saved, now = meta["config"], config.to_dict()
    if not isinstance(saved, Mapping):
        raise bad("config must be a mapping")
    for name in CONFIG_REFUSED:
        if saved.get(name) != now[name]:
            raise bad(f"saved with {name} {saved.get(name)!r}, configured {now[name]!r}; resume with the same "
                      f"{name} (the stored buffer depends on it) or start a new run")
    rate, last = meta["acceptance_rate"], meta["last_step"]
    if not is_real(rate) or not 0.0 <= rate <= 1.0:
        raise bad(f"acceptance_rate {rate!r} is not a number in [0, 1]")
    if last is not None and not (is_int(last) and 0 <= last < MAX_STEP):
        raise bad(f"last_step {last!r} is not None or a step in [0, 2**53)")
    starved = meta.get("starved_steps", 0)
    if not (is_int(starved) and 0 <= starved < MAX_STEP):
        raise bad(f"starved_steps {starved!r} is not an int >= 0")
    buf = parse_buffer_state(tensors, meta["buffer"], capacity=config.unit_capacity,
                             group_size=1 if config.unit == "rollout" else config.group_size,
                             slot_fields=SLOT_FIELDS, where=f"{where} (buffer)")
    if buf.size and (last is None or buf.slots["birth_step"].max() > last or buf.slots["refresh_step"].max() > last):
        raise bad(f"stored groups were born or refreshed after last_step {last!r}")
    observers = meta.get("observers", {})
    if not isinstance(observers, Mapping) or not all(isinstance(k, str) for k in observers):
        raise bad("observers must map observer names to their states")
    observers = dict(observers)
    if meta.get("tau_state") is not None and "adaptive_tau" not in observers:  # written before observers existed
        observers["adaptive_tau"] = meta["tau_state"]
    rng = meta.get("sampler_state")
    if rng is not None:
        sampling.rng_from_state(rng, where=f"{where}: sampler_state")  # raises CheckpointError if malformed
    defaults = {f.name: f.default for f in fields(type(config))}  # settings added after a checkpoint was written
    changes = [f"{k}: {saved.get(k, defaults[k])!r} -> {now[k]!r}" for k in CONFIG_WARNED
               if saved.get(k, defaults[k]) != now[k]]
    return ControllerState(buf, float(rate), last, observers, starved, changes, rng)

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
            changed settings (see this module's docstring).
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
        """Write the controller (buffer included) to ``directory`` crash-safely (see :mod:`hdreplay.checkpoint.files`).

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

