"""The one-step protocol trainers call.

For each training step t::

    sel = ctrl.select(step=t, scorer=score_fn)   # replay groups from the PRE-EXISTING buffer
    ctrl.stage(fresh_groups, step=t)             # this step's ingress candidates (held aside)
    ...  train on [sel.groups ; fresh groups]     # replay rows first
    metrics = ctrl.commit()                      # refresh scanned caches, count uses, append, evict

``select`` and ``stage`` may come in either order; staged groups enter the buffer
only at ``commit``, so a group born at step t can never be replayed at step t.
Steps must increase.  ``state_dict``/``save`` capture everything that influences
later selections (buffer, running acceptance rate, last step, the observers' state), so a run
resumed from a checkpoint makes exactly the selections the uninterrupted run makes.

Observers (:mod:`hdreplay.diagnostics`: the same-buffer counterfactual, the ungated diagnosis, adaptive tau) stand
around the method: after a selection one may score more groups (a selection it returns must keep the decisions);
at commit one may add fields to the step record's ``extras`` and move ``tau`` for the next step.

All-or-nothing: every call checks all of its arguments (and runs the user's scorer / ingress
rule) before it changes anything, so a refused call leaves the controller as it was and never
opens a step.  What a call hands out cannot change the stored state: ``sel.groups`` are copies,
the selection's arrays are read-only, staged groups are copied when staged.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from . import sampling
from .buffer import ReplayBuffer
from .checkpoint import open_checkpoint_dir, write_checkpoint_dir
from .checkpoint_schema import ControllerState, parse_buffer_state, parse_controller_state
from .config import ReplayConfig
from .records import DiagnosticsWriter, StepRecord, metrics_from_record, step_record
from .errors import (
    CheckpointError, ReplayConfigError, ReplayInputError, ReplayProtocolError, ReplayResumeWarning,
    ReplayStarvedWarning,
)
from .ingress import make_ingress_rule
from .record import GroupRecord
from .scores import reference_headroom
from .selection import Scorer, Tau, select_replay
from .selectors import SELECTORS, Selection, empty_selection
from .storage import materialize
from .validate import (MAX_COUNT, check_bool, check_int, check_path, check_real, check_sequence, check_step, is_int,
                       is_real)

#: consecutive starved steps (budget unfilled, gate pass rate < STARVED_RATE) before a ReplayStarvedWarning
STARVED_STEPS = 5
STARVED_RATE = 1 / 8

CONTROLLER_FORMAT = "hdreplay.controller"
#: 2: the manifest layout (see :mod:`hdreplay.checkpoint`); 1, the unreleased 0.1's layout, is not read
CONTROLLER_VERSION = 2
CONTROLLER_VERSIONS = (2,)


class ReplayController:
    """Owns a :class:`ReplayBuffer` and runs the select -> stage -> commit protocol.

    Args:
        config:          the replay configuration.
        diagnostics_dir: if given, step and group-lifetime records are appended there as JSONL.
        observers:       what stands around the method (:mod:`hdreplay.diagnostics`); each has a unique ``name``
                         and any of ``on_select(controller, selection, scorer) -> Selection | None``,
                         ``on_commit(controller, record) -> dict | None`` (fields for ``record.extras``),
                         ``state_dict() -> dict`` with ``check_state(state or None) -> parsed`` (raises
                         CheckpointError, changes nothing) and ``restore(controller, parsed)``.

    >>> from hdreplay import GroupRecord, ReplayConfig
    >>> g = GroupRecord.from_responses(group_id="g0", prompt_ids=[5, 6], completion_ids=[[1, 2], [3]],
    ...                                logprobs=[[-0.1, -0.2], [-0.3]], advantages=[1.0, -1.0],
    ...                                rewards=[1.0, 0.0], birth_step=0)
    >>> ctrl = ReplayController(ReplayConfig(k_rep=1, tau=1e-3, capacity=8))
    >>> ctrl.select(step=0).groups, ctrl.stage([g], step=0)  # nothing buffered yet; g is mixed: admitted
    ([], [True])
    >>> _ = ctrl.commit()  # after the update: g enters the buffer
    >>> unchanged = lambda groups: [x.logprobs for x in groups]  # the scorer: current log-probs (here: pi_gen)
    >>> sel = ctrl.select(step=1, scorer=unchanged)
    >>> [x.group_id for x in sel.groups], sel.scanned_drift.tolist()  # Drift 0 <= tau: replayed
    (['g0'], [0.0])
    """

    def __init__(self, config: ReplayConfig, *, diagnostics_dir: str | os.PathLike | None = None,
                 observers: Sequence[Any] = ()) -> None:
        if not isinstance(config, ReplayConfig):
            raise ReplayConfigError(f"config: must be a ReplayConfig, got {type(config).__name__}", field="config")
        if diagnostics_dir is not None and not isinstance(diagnostics_dir, (str, os.PathLike)):
            raise ReplayConfigError(f"diagnostics_dir: must be a path or None, got {type(diagnostics_dir).__name__}",
                                    field="diagnostics_dir")
        names = [getattr(o, "name", None) for o in check_sequence("observers", observers, err=ReplayConfigError)]
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise ReplayConfigError(f"observers: each needs a unique str `name`, got {names}", field="observers")
        self.observers = list(observers)
        self.config = config
        self.buffer = ReplayBuffer(config.unit_capacity, group_size=buffer_group_size(config))
        self.ingress_rule = make_ingress_rule(config.ingress, answer_threshold=config.answer_threshold)
        self.acceptance_rate = 1.0
        self._tau = float(config.tau)  # the current Drift threshold: config.tau, unless an observer moves it
        self.last_step: int | None = None
        try:
            self.diagnostics = DiagnosticsWriter(diagnostics_dir) if diagnostics_dir is not None else None
        except ReplayInputError as e:
            raise ReplayConfigError(f"diagnostics_dir: {str(e).removeprefix('directory: ')}",
                                    field="diagnostics_dir") from None
        self.last_record: StepRecord | None = None
        self._open_step: int | None = None
        self._selection: Selection | None = None
        self._staged: list[GroupRecord] = []
        self._staged_ref: list[float] = []
        self._candidates = 0
        self._starved_steps = 0
        #: the random orders' generator state as of the last commit (a selection draws from a copy)
        self.rng_state = sampling.rng_state(sampling.new_rng(config.seed))

    # ------------------------------------------------------------------ protocol
    def _check_step(self, step: int, what: str) -> int:
        """The step ``what`` may run at (nothing changes; the caller opens it once it succeeded)."""
        step = check_step(f"{what}: step", step)
        if self._open_step is None:
            if self.last_step is not None and step <= self.last_step:
                raise ReplayProtocolError(
                    f"{what}(step={step}): step {self.last_step} is already committed; steps must increase"
                )
        elif step != self._open_step:
            raise ReplayProtocolError(
                f"{what}(step={step}) while step {self._open_step} is open; call commit() first"
            )
        return step

    def select(self, *, step: int, scorer: Scorer | None = None, tau: Tau | None = None) -> Selection:
        """Choose replay groups for ``step`` from the buffer as it was before this step's ingress.

        ``tau``: per-group thresholds instead of :attr:`tau` (:data:`hdreplay.selection.Tau`; the asynchronous
        rule of :mod:`hdreplay.staleness` adds a measured floor for groups scored against a sampler).  Returns a
        :class:`Selection` whose arrays are read-only and whose ``groups`` are copies."""
        step = self._check_step(step, "select")
        if self._selection is not None:
            raise ReplayProtocolError(f"select(step={step}) called twice; one selection per step")
        if tau is not None and not callable(tau):
            raise ReplayInputError(f"select: tau must be a per-group callable or None (the controller's own tau is "
                                   f"`controller.tau`), got {type(tau).__name__}")
        sel = select_replay(self.buffer, self.config, scorer, step=step, acceptance_rate=self.acceptance_rate,
                            tau=self.tau if tau is None else tau, rng=sampling.rng_from_state(self.rng_state))
        for obs in self.observers:  # diagnostics may score more; the decisions stay the selection's
            seen = getattr(obs, "on_select", lambda *a: None)(self, sel, scorer)
            if seen is not None:
                if not (isinstance(seen, Selection) and np.array_equal(seen.accepted, sel.accepted)):
                    raise ReplayProtocolError(f"observer {obs.name!r}: on_select must return None or a Selection "
                                              "with the same accepted groups")
                sel = seen
        self._open_step, self._selection = step, sel
        return sel

    @property
    def tau(self) -> float:
        """The Drift threshold the next selection uses (``config.tau`` unless an observer such as adaptive tau
        moves it; set it with a number >= 0)."""
        return self._tau

    @tau.setter
    def tau(self, value: float) -> None:
        self._tau = check_real("tau", value, lo=0.0)

    def stage(self, groups: Sequence[GroupRecord], *, step: int, born_earlier: bool = False) -> list[bool]:
        """Offer this step's fresh groups (a list) for ingress; returns which the ingress rule admitted.

        Groups must be born at ``step`` (with ``born_earlier``: at ``step`` or before -- an asynchronous
        pipeline's groups generated by an older policy, :mod:`hdreplay.staleness`); admitted ones are copied
        (editing them later changes nothing here).  Nothing enters the buffer before :meth:`commit`.  Raises
        ReplayInputError (and stages nothing) if any group is malformed for this buffer.
        """
        step = self._check_step(step, "stage")
        groups = check_sequence("stage: groups", groups)
        born_earlier = check_bool("stage: born_earlier", born_earlier)
        for g in groups:
            if not isinstance(g, GroupRecord):
                raise ReplayInputError(f"stage: groups must be GroupRecords, got {type(g).__name__}")
            if born_earlier and g.birth_step > step:
                raise ReplayInputError(f"group {g.group_id!r} has birth_step {g.birth_step} after step {step}; a "
                                       "group cannot be staged before it was generated")
            if not born_earlier and g.birth_step != step:
                raise ReplayInputError(
                    f"group {g.group_id!r} has birth_step {g.birth_step} but is staged at step {step}; "
                    "stage fresh groups at the step they were generated"
                )
        if self.config.unit == "group":
            self.buffer.validate([*self._staged, *groups])
        else:
            bad = [g.group_id for g in groups if g.num_responses != self.config.group_size]
            if bad:
                raise ReplayInputError(f"group {bad[0]!r} does not have group_size={self.config.group_size} "
                                       "responses; rollouts are stored from whole groups")
        admitted = [self._admit(g) for g in groups]
        chosen = [g.clone() for g, ok in zip(groups, admitted) if ok]
        split = SELECTORS[self.config.selector].split
        if split is not None:  # a rollout-unit peer (hdreplay.baselines.orders) stores single responses
            chosen = [r for g in chosen for r in split(g)]
            self.buffer.validate([*self._staged, *chosen])
        ref = reference_headroom(chosen, weighting=self.config.headroom_weighting).tolist() if chosen else []
        self._open_step = step
        self._staged.extend(chosen)
        self._staged_ref.extend(ref)
        self._candidates += len(groups)
        return admitted

    def _admit(self, group: GroupRecord) -> bool:
        out = self.ingress_rule(group)
        if isinstance(out, torch.Tensor) and out.numel() == 1 and out.dtype == torch.bool:
            out = bool(out)
        if not isinstance(out, (bool, np.bool_)):
            raise ReplayInputError(f"the ingress rule returned {out!r} for group {group.group_id!r}; it must "
                                   "return a bool")
        return bool(out)

    def commit(self, *, num_fresh_groups: int | None = None, counters: Mapping[str, Any] | None = None
               ) -> dict[str, float]:
        """Close the open step after the policy update.

        Args:
            num_fresh_groups: fresh groups in this step's actor batch (default: groups staged),
                so that |A_t| = fresh + replayed for the exposure weights W.
            counters: what the integration measured beyond the selection, written into the step record:
                ``generated_rows`` (fresh responses generated), ``rescored_rows`` / ``rescored_tokens``
                (added to the selection's own), ``strategy`` (a name) and ``strategy_counters``
                (name -> number).
        Returns:
            flat ``replay/*`` metrics of the step.
        """
        if self._open_step is None:
            raise ReplayProtocolError("commit() without an open step; call select()/stage() first")
        fresh = self._candidates if num_fresh_groups is None else check_int(
            "commit: num_fresh_groups", num_fresh_groups, hi=MAX_COUNT)
        extra = _check_counters(counters)
        step = self._open_step
        sel = self._selection or empty_selection(step, "none", len(self.buffer), self.tau)
        actor = fresh + len(sel.accepted)
        ages = step - self.buffer.slot_values("birth_step", sel.accepted) if len(sel.accepted) else np.zeros(0)
        # everything was validated when it was selected / staged: from here on nothing is refused
        if sel.scored and len(sel.scanned):
            self.buffer.refresh(sel.scanned, sel.scanned_headroom, step=step)  # Alg. 1 l.12: the scanned groups' cache
            if SELECTORS[sel.selector].gate:
                self.buffer.record_scan(sel.scanned, sel.scanned_pass, skip_until(sel, self.config.skip_rejected))
            rate = float(sel.scanned_pass.mean())
            a = self.config.acceptance_ema
            self.acceptance_rate = (1 - a) * self.acceptance_rate + a * rate
        if len(sel.accepted):
            self.buffer.record_use(sel.accepted, weight=1.0 / actor)
        first_new = self.buffer.next_insertion_id
        evicted = [] if self.config.max_age is None else self.buffer.evict_older_than(self.config.max_age, step=step)
        evicted += self.buffer.append(self._staged, ref_headroom=self._staged_ref, step=step)
        if sel.rng_state is not None:
            self.rng_state = sel.rng_state
        if self._staged and actor:
            # the fresh use at birth counts toward W_T(g) (paper Appendix A.4)
            self.buffer.add_exposure(np.arange(first_new, self.buffer.next_insertion_id), 1.0 / actor)
        rec = step_record(sel, k_rep=self.config.k_rep, tau=sel.tau,
                          ingress_candidates=self._candidates, ingress_admitted=len(self._staged),
                          evicted=len(evicted), num_fresh_groups=fresh, accepted_ages=np.asarray(ages),
                          buffer_size_after=len(self.buffer),
                          replayed_rows=sum(g.num_responses for g in sel.groups),
                          replayed_tokens=sum(g.num_tokens for g in sel.groups),
                          unit_size=self.config.group_size if self.config.unit == "rollout" else 1)
        rec.rescored_rows += extra.pop("rescored_rows", 0)
        rec.rescored_tokens += extra.pop("rescored_tokens", 0)
        if "generated_rows" in extra:
            rec.generated_rows = extra.pop("generated_rows")
        rec.extras.update(extra)  # a peer's strategy and its counters
        for obs in self.observers:
            rec.extras.update(getattr(obs, "on_commit", lambda *a: None)(self, rec) or {})
        starved = self._count_starved(rec)
        self.last_record = rec
        self.last_step = step
        self._open_step, self._selection = None, None
        self._staged, self._staged_ref, self._candidates = [], [], 0
        if self.diagnostics is not None:  # the step is committed even if writing the log fails
            self.diagnostics.write_step(rec)
            self.diagnostics.write_groups(evicted)
        if starved:
            self._warn_starved(rec)
        return metrics_from_record(rec)

    def _count_starved(self, rec: StepRecord) -> bool:
        starved = (rec.k_rep > 0 and rec.buffer_size > 0 and rec.accepted < rec.k_rep
                   and rec.accept_rate is not None and rec.accept_rate < STARVED_RATE)
        self._starved_steps = self._starved_steps + 1 if starved else 0
        return self._starved_steps == STARVED_STEPS

    def _warn_starved(self, rec: StepRecord) -> None:
        capped = " and the scan stopped at its budget (max_scan)" if rec.scan_capped else ""
        warnings.warn(
            f"hdreplay: replay starved for {STARVED_STEPS} steps (through step {rec.step}): the Drift gate passed "
            f"{rec.accept_rate:.1%} of {rec.scanned} scanned groups at tau={self.tau:g}{capped}, replaying "
            f"{rec.accepted} of k_rep={rec.k_rep}. Loosen tau (`hdreplay calibrate` sweeps it), or let "
            "hdreplay.diagnostics.AdaptiveTau move it.", ReplayStarvedWarning, stacklevel=3)

    def close(self) -> None:
        """Write lifetime records of the groups still buffered (end of training)."""
        if self.diagnostics is not None:
            self.diagnostics.write_groups(
                self.buffer.lifetime_record(int(i)) for i in self.buffer.insertion_ids()
            )

    # ------------------------------------------------------------------ checkpointing
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
            observed = [(o, o.check_state(state.observers.get(o.name))) for o in self.observers
                        if hasattr(o, "check_state")]
        except CheckpointError as e:
            raise CheckpointError(f"controller state (observers): {e}") from None
        # every check passed: now the files (a refused load leaves them too), then memory
        if self.diagnostics is not None and state.last_step is not None:
            self.diagnostics.rewind(state.last_step)  # before any assignment: a failure here changes nothing
        for obs, parsed in observed:
            if hasattr(obs, "rewind_files"):
                obs.rewind_files(parsed)
        self._install(state, observed)
        if state.changes:
            warnings.warn("hdreplay: resumed under a changed replay configuration (" + "; ".join(state.changes)
                          + "); the resumed run will not reproduce the uninterrupted one", ReplayResumeWarning,
                          stacklevel=3)

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

    def save(self, directory: str | os.PathLike, *, allow_open_step: bool = False) -> None:
        """Write the controller (buffer included) to ``directory`` crash-safely (see :mod:`hdreplay.checkpoint`)."""
        check_path("save", directory)
        tensors, meta = self.checkpoint_state(allow_open_step=allow_open_step)
        write_checkpoint_dir(directory, format_name=CONTROLLER_FORMAT, version=CONTROLLER_VERSION,
                             tensors=tensors, meta=meta)

    def load(self, directory: str | os.PathLike) -> None:
        """Restore from a directory written by :meth:`save`; on error nothing changes."""
        check_path("load", directory)
        if self._open_step is not None:
            raise ReplayProtocolError(f"load() while step {self._open_step} is open; commit() first")
        with open_checkpoint_dir(directory, format_name=CONTROLLER_FORMAT, versions=CONTROLLER_VERSIONS) as (t, meta):
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
                ReplayBuffer(cap)
            except ReplayConfigError:
                raise CheckpointError(f"{directory}: buffer state holds an invalid capacity {cap!r}") from None
            parse_buffer_state(t, bmeta, capacity=cap, group_size=None, slot_fields=ReplayBuffer._SLOT_FIELDS,
                               where=f"{directory}: buffer state")
        last = meta.get("last_step")
        if last is not None:
            try:
                check_step("last_step", last)
            except ReplayInputError:
                raise CheckpointError(f"{directory}: last_step {last!r} is not a step") from None
        return last


def skip_until(sel: Selection, max_skip: int) -> np.ndarray:
    """(s,) per scanned group, the first step the scan may consider it again: the next step, or for a group rejected
    with Drift D (its lower bound when rejected early) after sitting out min(max_skip, 1 + floor(log2(D / tau)))
    steps (0 everywhere when max_skip is 0: nothing is skipped)."""
    nxt = np.full(len(sel.scanned), sel.step + 1, dtype=np.int64)
    if max_skip == 0:
        return np.zeros(len(sel.scanned), dtype=np.int64)
    tau = sel.scanned_tau
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(sel.scanned_pass, 1.0, np.where(tau > 0, sel.scanned_drift / np.where(tau > 0, tau, 1), np.inf))
    steps = np.where(sel.scanned_pass, 0.0, 1.0 + np.floor(np.log2(np.maximum(ratio, 1.0))))
    return nxt + np.minimum(steps, max_skip).astype(np.int64)


def buffer_group_size(config: ReplayConfig) -> int | None:
    """Responses per stored unit: 1 for a rollout-unit selector, else ``config.group_size``."""
    return 1 if config.unit == "rollout" else config.group_size


#: what ``commit(counters=...)`` accepts
COUNTER_KEYS = ("generated_rows", "rescored_rows", "rescored_tokens", "strategy", "strategy_counters")


def _check_counters(counters: Mapping[str, Any] | None) -> dict[str, Any]:
    if counters is None:
        return {}
    if not isinstance(counters, Mapping) or set(counters) - set(COUNTER_KEYS):
        raise ReplayInputError(f"commit: counters must be a mapping with keys from {list(COUNTER_KEYS)}, got "
                               f"{counters!r:.100}")
    out = dict(counters)
    for k in ("generated_rows", "rescored_rows", "rescored_tokens"):
        if k in out and not (is_int(out[k]) and out[k] >= 0):
            raise ReplayInputError(f"commit: counters[{k!r}] must be an int >= 0, got {out[k]!r}")
        if k in out:
            out[k] = int(out[k])
    if "strategy" in out and not isinstance(out["strategy"], str):
        raise ReplayInputError(f"commit: counters['strategy'] must be a name, got {out['strategy']!r}")
    sc = out.get("strategy_counters")
    if sc is not None:
        if not isinstance(sc, Mapping) or not all(isinstance(k, str) and is_real(v) for k, v in sc.items()):
            raise ReplayInputError(f"commit: counters['strategy_counters'] must map names to numbers, got {sc!r:.100}")
        out["strategy_counters"] = {k: float(v) for k, v in sc.items()}
    return out
