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
from .config import ReplayConfig
from .controller_state import CONTROLLER_FORMAT, CONTROLLER_VERSION, CONTROLLER_VERSIONS, ControllerCheckpoint  # noqa: F401  (re-exported)
from .errors import ReplayConfigError, ReplayCostWarning, ReplayInputError, ReplayProtocolError, ReplayStarvedWarning
from .ingress import make_ingress_rule
from .records import DiagnosticsWriter, StepRecord, check_counters, metrics_from_record, step_record
from .scores import reference_headroom
from .selection import Scorer, Tau, select_replay
from .selectors import SELECTORS, Selection, empty_selection
from .store.buffer import ReplayBuffer
from .store.record import GroupRecord
from .validate import MAX_COUNT, check_bool, check_int, check_real, check_sequence, check_step

#: consecutive starved steps (budget unfilled, gate pass rate < STARVED_RATE) before a ReplayStarvedWarning
STARVED_STEPS = 5
STARVED_RATE = 1 / 8
#: a ReplayCostWarning after COST_STEPS consecutive steps whose gate forwarded more than COST_FACTOR x the tokens of
#: the fresh batch's forward (tokens, not seconds: the gate's forward runs as fast per token as the trainer's own, and
#: a token count is the same on every run; the seconds are in the step record)
COST_FACTOR = 4.0
COST_STEPS = 3



class ReplayController(ControllerCheckpoint):
    """Owns a :class:`ReplayBuffer` and runs the select -> stage -> commit protocol.

    Args:
        config:          the replay configuration.
        diagnostics_dir: if given, step and group-lifetime records are appended there as JSONL.
        observers:       what stands around the method (:mod:`hdreplay.diagnostics`); each has a unique ``name``
                         and any of ``on_select(controller, selection, scorer) -> Selection | None``,
                         ``on_commit(controller, record) -> dict | None`` (fields for ``record.extras``),
                         ``state_dict() -> dict`` with ``check_state(saved or None, loading) -> parsed``
                         (``loading``: the validated controller state being loaded; raises CheckpointError,
                         changes nothing) and ``restore(controller, parsed)``.

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
        self._candidates = self._fresh_tokens = 0
        self._starved_steps = self._costly_steps = 0  # (the cost counter is not checkpointed: a warning's patience)
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

    def select(self, *, step: int, scorer: Scorer | None = None, tau: Tau | None = None,
               scan_tokens: int | None = None, latency_bound: bool = True) -> Selection:
        """Choose replay groups for ``step`` from the buffer as it was before this step's ingress.

        ``tau``: per-group thresholds instead of :attr:`tau` (:data:`hdreplay.selection.Tau`; the asynchronous
        rule of :mod:`hdreplay.staleness` adds a measured floor for groups scored against a sampler).  Returns a
        :class:`Selection` whose arrays are read-only and whose ``groups`` are copies.  ``scan_tokens``: the token
        budget of the caller's scorer forward, used when ``config.scan_tokens`` is unset (the trainers pass theirs);
        ``latency_bound``: whether the scorer's device is (see :func:`select_replay`)."""
        step = self._check_step(step, "select")
        if self._selection is not None:
            raise ReplayProtocolError(f"select(step={step}) called twice; one selection per step")
        if tau is not None and not callable(tau):
            raise ReplayInputError(f"select: tau must be a per-group callable or None (the controller's own tau is "
                                   f"`controller.tau`), got {type(tau).__name__}")
        sel = select_replay(self.buffer, self.config, scorer, step=step, acceptance_rate=self.acceptance_rate,
                            tau=self.tau if tau is None else tau, rng=sampling.rng_from_state(self.rng_state),
                            scan_tokens=scan_tokens, latency_bound=latency_bound)
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
        self._fresh_tokens += sum(g.num_responses * g.prompt_ids.numel() + g.num_tokens for g in groups)
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
        extra = check_counters(counters)
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
        rec.fresh_forward_tokens, rec.fresh_forward_seconds = self._fresh_tokens, extra.pop("fresh_forward_seconds")
        if "generated_rows" in extra:
            rec.generated_rows = extra.pop("generated_rows")
        rec.extras.update(extra)  # a peer's strategy and its counters
        for obs in self.observers:
            rec.extras.update(getattr(obs, "on_commit", lambda *a: None)(self, rec) or {})
        starved = self._count_starved(rec)
        self.last_record = rec
        self.last_step = step
        self._open_step, self._selection = None, None
        self._staged, self._staged_ref, self._candidates, self._fresh_tokens = [], [], 0, 0
        if self.diagnostics is not None:  # the step is committed even if writing the log fails
            self.diagnostics.write_step(rec)
            self.diagnostics.write_groups(evicted)
        if starved:
            self._warn_starved(rec)
        self._warn_cost(rec)
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

    def _warn_cost(self, rec: StepRecord) -> None:
        costly = rec.fresh_forward_tokens > 0 and rec.rescore_forward_tokens > COST_FACTOR * rec.fresh_forward_tokens
        self._costly_steps = self._costly_steps + 1 if costly else 0
        if self._costly_steps != COST_STEPS:
            return
        warnings.warn(
            f"hdreplay: for {COST_STEPS} steps (through step {rec.step}) the Drift gate re-scored more than "
            f"{COST_FACTOR:g}x the tokens of the fresh batch's forward ({rec.rescore_forward_tokens} vs "
            f"{rec.fresh_forward_tokens} at step {rec.step}: {rec.scanned} groups scanned for {rec.accepted} of "
            f"k_rep={rec.k_rep}, acceptance {rec.accept_rate if rec.accept_rate is not None else float('nan'):.1%}). "
            "Knobs that bound it: max_scan (a cap on groups re-scored per step: the scan stops there, so fewer groups "
            "may be admitted than the paper's scan would), skip_rejected (a widely rejected group sits out a few "
            "steps: the walk changes, not the gate), a larger k_rep (the walk stops sooner per admitted group), or a "
            "looser tau (more groups pass; `hdreplay calibrate` sweeps it).", ReplayCostWarning, stacklevel=3)

    def close(self) -> None:
        """Write lifetime records of the groups still buffered (end of training)."""
        if self.diagnostics is not None:
            self.diagnostics.write_groups(
                self.buffer.lifetime_record(int(i)) for i in self.buffer.insertion_ids()
            )


def skip_until(sel: Selection, max_skip: int) -> np.ndarray:
    """(s,) per scanned group, the first step the scan may consider it again: the next step, or for a group rejected
    with Drift D (its lower bound when rejected early) after sitting out min(max_skip, 1 + floor(log2(D / tau)))
    steps (0 everywhere when max_skip is 0: nothing is skipped)."""
    nxt = np.full(len(sel.scanned), sel.step + 1, dtype=np.int64)
    if max_skip == 0:
        return np.zeros(len(sel.scanned), dtype=np.int64)
    tau = sel.scanned_tau
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(sel.scanned_pass, 1.0, np.where(tau > 0, sel.scanned_drift / np.where(tau > 0, tau, 1), np.inf))  # noqa: E501
    steps = np.where(sel.scanned_pass, 0.0, 1.0 + np.floor(np.log2(np.maximum(ratio, 1.0))))
    return nxt + np.minimum(steps, max_skip).astype(np.int64)


def buffer_group_size(config: ReplayConfig) -> int | None:
    """Responses per stored unit: 1 for a rollout-unit selector, else ``config.group_size``."""
    return 1 if config.unit == "rollout" else config.group_size
