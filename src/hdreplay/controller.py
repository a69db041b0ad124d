"""The one-step protocol trainers call.

For each training step t::

    sel = ctrl.select(step=t, scorer=score_fn)   # replay groups from the PRE-EXISTING buffer
    ctrl.stage(fresh_groups, step=t)             # this step's ingress candidates (held aside)
    ...  train on [sel.groups ; fresh groups]     # replay rows first
    metrics = ctrl.commit()                      # refresh scanned caches, count uses, append, evict

``select`` and ``stage`` may come in either order; staged groups enter the buffer
only at ``commit``, so a group born at step t can never be replayed at step t.
Steps must increase.  ``state_dict``/``save`` capture everything that influences
later selections (buffer, running acceptance rate, last step), so a run resumed
from a checkpoint makes exactly the selections the uninterrupted run makes.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

import numpy as np
import torch

from .adaptive import TauState, update_tau
from .scores import reference_headroom
from .buffer import ReplayBuffer
from .checkpoint import read_checkpoint_dir, require_keys, write_checkpoint_dir
from .config import ReplayConfig
from .diagnostics import DiagnosticsWriter, StepRecord, metrics_from_record, step_record
from .errors import CheckpointError, ReplayInputError, ReplayProtocolError, ReplayStarvedWarning
from .ingress import make_ingress_rule
from .selection import Scorer, Selection, select_replay
from .record import GroupRecord

#: consecutive starved steps (budget unfilled, gate pass rate < STARVED_RATE) before a ReplayStarvedWarning
STARVED_STEPS = 5
STARVED_RATE = 1 / 8

CONTROLLER_FORMAT = "hdreplay.controller"
CONTROLLER_VERSION = 1


class ReplayController:
    """Owns a :class:`ReplayBuffer` and runs the select -> stage -> commit protocol.

    Args:
        config:          the replay configuration.
        diagnostics_dir: if given, step and group-lifetime records are appended there as JSONL.
    """

    def __init__(self, config: ReplayConfig, *, diagnostics_dir: str | os.PathLike | None = None) -> None:
        if not isinstance(config, ReplayConfig):
            raise TypeError(f"config must be a ReplayConfig, got {type(config).__name__}")
        self.config = config
        self.buffer = ReplayBuffer(config.capacity, group_size=config.group_size)
        self.ingress_rule = make_ingress_rule(config.ingress, answer_threshold=config.answer_threshold)
        self.acceptance_rate = 1.0
        self.tau_state = TauState(tau=float(config.tau)) if config.adaptive_tau is not None else None
        self.last_step: int | None = None
        self.diagnostics = DiagnosticsWriter(diagnostics_dir) if diagnostics_dir is not None else None
        self.last_record: StepRecord | None = None
        self._open_step: int | None = None
        self._selection: Selection | None = None
        self._staged: list[GroupRecord] = []
        self._staged_ref: list[float] = []
        self._candidates = 0
        self._starved_steps = 0

    # ------------------------------------------------------------------ protocol
    def _open(self, step: int, what: str) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ReplayInputError(f"{what}: step must be an int >= 0, got {step!r}")
        if self._open_step is None:
            if self.last_step is not None and step <= self.last_step:
                raise ReplayProtocolError(
                    f"{what}(step={step}): step {self.last_step} is already committed; steps must increase"
                )
            self._open_step = step
        elif step != self._open_step:
            raise ReplayProtocolError(
                f"{what}(step={step}) while step {self._open_step} is open; call commit() first"
            )

    def select(self, *, step: int, scorer: Scorer | None = None) -> Selection:
        """Choose replay groups for ``step`` from the buffer as it was before this step's ingress."""
        self._open(step, "select")
        if self._selection is not None:
            raise ReplayProtocolError(f"select(step={step}) called twice; one selection per step")
        self._selection = select_replay(self.buffer, self.config, scorer, step=step,
                                        acceptance_rate=self.acceptance_rate, tau=self.tau)
        return self._selection

    @property
    def tau(self) -> float:
        """The Drift threshold the next selection uses (moves only with ``adaptive_tau``)."""
        return self.tau_state.tau if self.tau_state is not None else float(self.config.tau)

    def stage(self, groups: Sequence[GroupRecord], *, step: int) -> list[bool]:
        """Offer this step's fresh groups for ingress; returns which the ingress rule admitted.

        Groups must be born at ``step``.  Nothing enters the buffer before :meth:`commit`.
        Raises ReplayInputError (and stages nothing) if any group is malformed for this buffer.
        """
        self._open(step, "stage")
        groups = list(groups)
        for g in groups:
            if isinstance(g, GroupRecord) and g.birth_step != step:
                raise ReplayInputError(
                    f"group {g.group_id!r} has birth_step {g.birth_step} but is staged at step {step}; "
                    "stage fresh groups at the step they were generated"
                )
        self.buffer.validate([*self._staged, *groups])
        admitted = [bool(self.ingress_rule(g)) for g in groups]
        chosen = [g for g, ok in zip(groups, admitted) if ok]
        ref = reference_headroom(chosen, weighting=self.config.headroom_weighting).tolist() if chosen else []
        self._staged.extend(chosen)
        self._staged_ref.extend(ref)
        self._candidates += len(groups)
        return admitted

    def commit(self, *, num_fresh_groups: int | None = None) -> dict[str, float]:
        """Close the open step after the policy update.

        Args:
            num_fresh_groups: fresh groups in this step's actor batch (default: groups staged),
                so that |A_t| = fresh + replayed for the exposure weights W.
        Returns:
            flat ``replay/*`` metrics of the step.
        """
        if self._open_step is None:
            raise ReplayProtocolError("commit() without an open step; call select()/stage() first")
        step = self._open_step
        sel = self._selection or select_replay(self.buffer, _none_config(self.config), None, step=step, tau=self.tau)
        fresh = self._candidates if num_fresh_groups is None else int(num_fresh_groups)
        if fresh < 0:
            raise ReplayInputError(f"num_fresh_groups must be >= 0, got {fresh}")
        actor = fresh + len(sel.accepted)
        ages = step - self.buffer.slot_values("birth_step", sel.accepted) if len(sel.accepted) else np.zeros(0)
        if sel.scored and len(sel.scanned):
            self.buffer.refresh(sel.scanned, sel.scanned_headroom, step=step)
            rate = float(sel.scanned_pass.mean())
            a = self.config.acceptance_ema
            self.acceptance_rate = (1 - a) * self.acceptance_rate + a * rate
        if len(sel.accepted):
            self.buffer.record_use(sel.accepted, weight=1.0 / actor)
        first_new = self.buffer.next_insertion_id
        evicted = self.buffer.append(self._staged, ref_headroom=self._staged_ref, step=step)
        if self._staged and actor:
            # the fresh use at birth counts toward W_T(g) (paper Appendix A.4)
            self.buffer.add_exposure(np.arange(first_new, self.buffer.next_insertion_id), 1.0 / actor)
        rec = step_record(sel, k_rep=self.config.k_rep, tau=sel.tau,
                          ingress_candidates=self._candidates, ingress_admitted=len(self._staged),
                          evicted=len(evicted), num_fresh_groups=fresh, accepted_ages=np.asarray(ages),
                          buffer_size_after=len(self.buffer))
        if self.tau_state is not None:
            self.tau_state = update_tau(self.tau_state, rec, self.config.adaptive_tau)
            rec.tau_next, rec.tau_action = self.tau_state.tau, self.tau_state.last_action
        self._watch_starvation(rec)
        if self.diagnostics is not None:
            self.diagnostics.write_step(rec)
            self.diagnostics.write_groups(evicted)
        self.last_record = rec
        self.last_step = step
        self._open_step, self._selection = None, None
        self._staged, self._staged_ref, self._candidates = [], [], 0
        return metrics_from_record(rec)

    def _watch_starvation(self, rec: StepRecord) -> None:
        starved = (rec.k_rep > 0 and rec.buffer_size > 0 and rec.accepted < rec.k_rep
                   and rec.accept_rate is not None and rec.accept_rate < STARVED_RATE)
        self._starved_steps = self._starved_steps + 1 if starved else 0
        if self._starved_steps == STARVED_STEPS:
            capped = " and the scan stopped at its budget (max_scan)" if rec.scan_capped else ""
            warnings.warn(
                f"hdreplay: replay starved for {STARVED_STEPS} steps (through step {rec.step}): the Drift gate passed "
                f"{rec.accept_rate:.1%} of {rec.scanned} scanned groups at tau={rec.tau:g}{capped}, replaying "
                f"{rec.accepted} of k_rep={rec.k_rep}. Loosen tau (`hdreplay calibrate` sweeps it), or set "
                "adaptive_tau to let it move.", ReplayStarvedWarning, stacklevel=3)

    def close(self) -> None:
        """Write lifetime records of the groups still buffered (end of training)."""
        if self.diagnostics is not None:
            self.diagnostics.write_groups(
                self.buffer.lifetime_record(int(i)) for i in self.buffer.insertion_ids()
            )

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self, *, allow_open_step: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, meta) of everything that influences later selections.

        While a step is open the buffer still holds exactly the state of the last commit (selection
        never mutates it, staged groups are held aside), so ``allow_open_step=True`` snapshots that
        committed state; the open step's selection and staged groups are not included.
        """
        if self._open_step is not None and not allow_open_step:
            raise ReplayProtocolError(
                f"state_dict() while step {self._open_step} is open; checkpoint after commit() "
                "(or pass allow_open_step=True to save the state as of the last commit)"
            )
        tensors, bmeta = self.buffer.state_dict()
        meta = {
            "buffer": bmeta,
            "acceptance_rate": self.acceptance_rate,
            "last_step": self.last_step,
            "tau_state": None if self.tau_state is None else self.tau_state.to_dict(),
            "config": self.config.to_dict(),
        }
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        require_keys("controller state", meta, ("buffer", "acceptance_rate", "last_step", "config"))
        saved = meta["config"]
        if saved.get("capacity") != self.config.capacity:
            raise CheckpointError(
                f"controller state: saved with capacity {saved.get('capacity')}, configured {self.config.capacity}; "
                "resume with the same capacity"
            )
        if self._open_step is not None:
            raise ReplayProtocolError("load_state_dict() while a step is open")
        self.buffer.load_state_dict(tensors, meta["buffer"])
        self.acceptance_rate = float(meta["acceptance_rate"])
        self.last_step = meta["last_step"]
        if self.tau_state is not None and meta.get("tau_state") is not None:
            self.tau_state = TauState(**meta["tau_state"])
        if self.diagnostics is not None and self.last_step is not None:
            self.diagnostics.rewind(self.last_step)

    def save(self, directory: str | os.PathLike, *, allow_open_step: bool = False) -> None:
        """Atomically write the controller (buffer included) to ``directory``."""
        tensors, meta = self.state_dict(allow_open_step=allow_open_step)
        write_checkpoint_dir(directory, format_name=CONTROLLER_FORMAT, version=CONTROLLER_VERSION,
                             tensors=tensors, meta=meta)

    def load(self, directory: str | os.PathLike) -> None:
        """Restore from a directory written by :meth:`save`; on error nothing changes."""
        tensors, meta = read_checkpoint_dir(directory, format_name=CONTROLLER_FORMAT,
                                            versions=(CONTROLLER_VERSION,))
        self.load_state_dict(tensors, meta)


def _none_config(config: ReplayConfig) -> ReplayConfig:
    from dataclasses import replace

    return replace(config, selector="none")
