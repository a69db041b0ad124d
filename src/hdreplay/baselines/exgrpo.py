"""ExGRPO (arXiv 2510.02245; code LUFFY/ExGRPO @01f4ae0, recipe ``exp_scripts/run_exgrpo.sh``): an experience pool
of correct trajectories per prompt, bucketed by the prompt's latest success count, and mixed-policy groups.

The rules as the released code implements them (file names under ``exgrpo/verl/verl/mix_src/``):

* **phase switch** (``mix_trainer_experience.py``): training is on-policy and nothing is collected until a step's
  share of correct rollouts exceeds ``start_solved`` (0.35); from the next step on for good;
* **ingress** (``experience_trainer_ops.collect_experience_entries``): a group with k correct responses,
  ``lbound < k <= rbound`` (0 < k <= n - 1), moves its prompt to bucket k and adds its correct responses, with
  their generation-time log-probs, to the prompt's store unless the same completion is stored already;
* **retirement** (``skip_uid_set``, ``cleanup_experience_buckets``): a prompt whose group was all correct leaves the
  pool for good, in either phase;
* **selection** (``ExperienceMixCollateFn``, ``weighted_bucket_sampler.py``): ``min(valid prompts, int(B x ratio))``
  experience prompts, bucket counts ~ Multinomial(P_k proportional to N(k; n/2, sigma = 1) over non-empty buckets,
  count units as in the code) with the overflow rule of :func:`hdreplay.baselines.sampling.bucket_counts`, uniform
  without replacement within a bucket; per prompt the stored trajectory of lowest mean token entropy under the current
  policy (``exp_metric=ent``, ``argmin``);
* **mixed group** (``mix_vllm_rollout_exp.py``, ``n_prefix=1``): the experience prompt is generated again and one of
  its n rows is the stored trajectory;
* **loss** (``mix_core_alg.compute_token_on_off_policy_loss``): the stored row's tokens get -A f(w),
  w = pi_theta / pi_stored, f(w) = w / (w + gamma) (``off_policy_reshape="p_div_p_0.1"``), no clip
  (:func:`shaped_token_loss`).

This module holds the store and the decisions (pure given the generator); the TRL integration
(:mod:`hdreplay.integrations.trl.peers.exgrpo`) substitutes the prompts, injects the rows and trains the shaped term.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import CheckpointError, ReplayConfigError, ReplayInputError, ReplayProtocolError
from ..sampling import new_rng, rng_from_state, rng_state
from ..selectors import Selection, empty_selection
from ..store.record import GroupRecord
from ..validate import check_int, check_step, is_int, is_real
from . import store as kit
from .repo import key_of
from .rollouts import split_rollouts
from .sampling import bucket_counts, normal_bucket_weights, uniform_order

FORMAT = "hdreplay.exgrpo"
_STATE_KEYS = ("options", "n", "keys", "records", "bucket", "rows", "retired", "started", "rng", "last_step")


@dataclass(frozen=True)
class ExgrpoOptions:
    """ExGRPO's settings (the released recipe's values)."""

    ratio: float = 0.5  # experience_ratio: experience prompts per batch prompt
    start_solved: float = 0.35  # experience_start_sratio
    gamma: float = 0.1  # f(w) = w / (w + gamma)
    sigma: float = 1.0  # bucket weights N(k; n/2, sigma)
    correct: float = 1.0  # a response is correct when its reward is >= this
    lbound: int = 0  # experience_lbound: admit k > lbound
    rbound: int | None = None  # experience_rbound: admit k <= rbound (None: n - 1)
    seed: int | None = None  # the sampler's seed (None: the trainer's seed)

    def __post_init__(self) -> None:
        def real(name, lo, hi=None, lo_open=False):
            v = getattr(self, name)
            ok = type(v) in (int, float) and math.isfinite(v) and (v > lo if lo_open else v >= lo)
            if not ok or (hi is not None and v > hi):
                bound = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi is not None else f"> {lo:g}"
                raise ReplayConfigError(f"exgrpo.{name}: a number {bound}, got {v!r}", field=name)

        real("ratio", 0.0, 1.0, lo_open=True)
        real("start_solved", 0.0, 1.0)
        real("gamma", 0.0, lo_open=True)
        real("sigma", 0.0, lo_open=True)
        real("correct", -math.inf)
        for name in ("lbound", "seed"):
            v = getattr(self, name)
            if (type(v) is not int or v < 0) and not (name == "seed" and v is None):
                raise ReplayConfigError(f"exgrpo.{name}: an int >= 0, got {v!r}", field=name)
        if self.rbound is not None and (type(self.rbound) is not int or self.rbound <= self.lbound):
            raise ReplayConfigError(f"exgrpo.rbound: None or an int > lbound={self.lbound}, got {self.rbound!r}",
                                    field="rbound")


def shaped_token_loss(logps: torch.Tensor, stored_logps: torch.Tensor, advantages: torch.Tensor,
                      gamma: float) -> torch.Tensor:
    """(R, C) ExGRPO's off-policy token loss -A f(w), w = exp(logps - stored_logps), f(w) = w / (w + gamma), unclipped.

    Args: logps (R, C) current log-probs (with grad); stored_logps (R, C) the stored trajectory's generation-time
    log-probs; advantages (R,) or (R, 1).
    """
    if not all(isinstance(t, torch.Tensor) for t in (logps, stored_logps, advantages)):
        raise ReplayInputError("shaped_token_loss: logps, stored_logps and advantages must be tensors")
    if not (is_real(gamma) and math.isfinite(gamma) and gamma > 0):
        raise ReplayInputError(f"shaped_token_loss: gamma must be a finite number > 0, got {gamma!r}")
    if logps.dim() != 2 or logps.shape != stored_logps.shape or advantages.numel() != logps.shape[0]:
        raise ReplayInputError(f"shaped_token_loss: logps {tuple(logps.shape)} and stored_logps "
                               f"{tuple(stored_logps.shape)} must be the same (R, C), advantages (R,), got "
                               f"{tuple(advantages.shape)}")
    w = torch.exp(logps - stored_logps.to(logps.dtype))
    a = advantages.reshape(-1, 1).to(logps.dtype)
    return -a * (w / (w + gamma))


def mean_entropies(entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(R,) mean token entropy of each row over its loss tokens (``mask`` (R, C); a row without one: +inf)."""
    if not (isinstance(entropies, torch.Tensor) and isinstance(mask, torch.Tensor) and entropies.dim() == 2
            and entropies.shape == mask.shape):
        raise ReplayInputError(f"mean_entropies: entropies and mask must be tensors of one (R, C) shape, got "
                               f"{getattr(entropies, 'shape', type(entropies).__name__)} and "
                               f"{getattr(mask, 'shape', type(mask).__name__)}")
    m = mask.to(entropies.dtype)
    tok = m.sum(1)
    return torch.where(tok > 0, (entropies * m).sum(1) / tok.clamp(min=1), torch.full_like(tok, math.inf))


class ExgrpoController(kit.StoredState):
    """ExGRPO as a controller of the TRL integration (the protocol of :class:`~hdreplay.controller.ReplayController`:
    select -> stage -> commit once per optimizer update; select replays nothing, since the stored rows enter the
    fresh groups at generation: :meth:`plan` names the experience prompts, :meth:`pick` the trajectory per prompt).

    Args: options; n: responses per group; seed: the sampler's seed when ``options.seed`` is None.
    """

    FORMAT = FORMAT

    separate_term = False

    def __init__(self, options: ExgrpoOptions, *, n: int, seed: int = 0) -> None:
        kit.check_options("exgrpo", options, ExgrpoOptions)
        if not is_int(seed) or seed < 0:
            raise ReplayConfigError(f"exgrpo: seed must be an int >= 0, got {seed!r}", field="seed")
        if type(n) is not int or n < 2:
            raise ReplayConfigError(f"exgrpo: n (num_generations) must be an int >= 2, got {n!r}", field="n")
        rb = options.rbound if options.rbound is not None else n - 1
        if rb > n:
            raise ReplayConfigError(f"exgrpo.rbound={rb} exceeds n={n}", field="rbound")
        self.options, self.n, self.rbound = options, n, rb
        self.pool: dict[str, list[GroupRecord]] = {}  # prompt key -> correct single responses, oldest first
        self.bucket: dict[str, int] = {}  # prompt key -> latest success count
        self.rows: dict[str, Any] = {}  # prompt key -> the dataset row that regenerates it
        self.retired: set[str] = set()
        self.started = False
        self.rng = new_rng(options.seed if options.seed is not None else seed)
        self.last_step: int | None = None
        self._staged: list[GroupRecord] = []
        self._injected = 0
        self._rescored = 0

    # ------------------------------------------------------------------ generation seam
    def valid(self) -> list[str]:
        return [k for k, v in self.pool.items() if v and k not in self.retired and k in self.rows]

    def plan(self, prompts: int) -> list[str]:
        """Keys of the experience prompts of a batch of ``prompts`` prompts (empty before the switch): bucket
        counts ~ Multinomial(N(k; n/2, sigma)), uniform without replacement within a bucket, in bucket order."""
        prompts = check_int("plan: prompts", prompts)
        if not self.started:
            return []
        valid = self.valid()
        total = min(len(valid), int(prompts * self.options.ratio))
        if total == 0:
            return []
        ks = sorted({self.bucket[k] for k in valid})
        members = [[k for k in valid if self.bucket[k] == b] for b in ks]
        counts = bucket_counts(self.rng, [len(m) for m in members],
                               normal_bucket_weights(ks, self.n, self.options.sigma), total)
        out = []
        for m, c in zip(members, counts):
            out += [m[int(i)] for i in uniform_order(self.rng, len(m), int(c))]
        return out

    def candidates(self, key: str) -> list[GroupRecord]:
        if not isinstance(key, str) or key not in self.pool:
            raise ReplayInputError(f"candidates: {key!r} is not a stored prompt key (plan() names them)")
        return self.pool[key]

    @staticmethod
    def pick(entropies: Sequence[float]) -> int:
        """Index of the stored trajectory to inject: the lowest mean entropy (the first on ties)."""
        try:
            e = np.asarray(entropies, dtype=np.float64)
        except (TypeError, ValueError):
            e = np.zeros(0)
        if e.ndim != 1 or e.size == 0 or np.isnan(e).any():
            raise ReplayInputError(f"pick: a non-empty 1-D sequence of entropies (numbers), got {entropies!r:.80}")
        return int(np.argmin(e))

    def remember(self, key: str, row: Any) -> None:
        """The dataset row of prompt ``key`` (what TRL's generation takes), kept to substitute it later."""
        if not isinstance(key, str):
            raise ReplayInputError(f"remember: key must be a prompt key (str), got {type(key).__name__}")
        if key not in self.retired:
            self.rows.setdefault(key, row)

    def note_injected(self, rows: int, rescored: int) -> None:
        rows, rescored = check_int("note_injected: rows", rows), check_int("note_injected: rescored", rescored)
        self._injected += rows
        self._rescored += rescored

    # ------------------------------------------------------------------ controller protocol
    def select(self, *, step: int, scorer=None) -> Selection:
        return empty_selection(check_step("select: step", step), "exgrpo", len(self), float("nan"))

    def stage(self, groups: Sequence[GroupRecord], *, step: int) -> None:
        step = check_step("stage: step", step)
        groups = kit.check_groups("exgrpo stage", groups, n=self.n)
        if self.last_step is not None and step < self.last_step:
            raise ReplayProtocolError(f"stage(step={step}) after step {self.last_step}; steps must not go back")
        self._staged.extend(groups)
        self.last_step = step

    def commit(self, *, num_fresh_groups: int | None = None, counters: Mapping[str, Any] | None = None
               ) -> dict[str, float]:
        """Retire all-correct prompts; after the switch, admit 0 < k <= n - 1 groups' new correct responses; switch
        when this step's share of correct rollouts exceeds ``start_solved``."""
        kit.check_commit(num_fresh_groups, counters)
        good = self.options.correct
        total = solved = admitted = retired = 0
        for g in self._staged:
            key = key_of(g.prompt_ids)
            ok = g.rewards.float() >= good
            k = int(ok.sum())
            total, solved = total + g.num_responses, solved + k
            if k == self.n:
                retired += key not in self.retired
                self.retired.add(key)
                self.pool.pop(key, None)
                self.bucket.pop(key, None)
                self.rows.pop(key, None)
            elif self.started and self.options.lbound < k <= self.rbound and key not in self.retired:
                self.bucket[key] = k
                have = {tuple(r.completion_ids.tolist()) for r in self.pool.get(key, [])}
                for r in split_rollouts(g, keep_zero_advantage=True):
                    c = tuple(r.completion_ids.tolist())
                    if float(r.rewards[0]) >= good and c not in have:
                        self.pool.setdefault(key, []).append(r)
                        have.add(c)
                        admitted += 1
        switched = not self.started and total > 0 and solved / total > self.options.start_solved
        self.started = self.started or switched
        out = {"replay/replayed_rows": float(self._injected), "replay/accepted": float(self._injected),
               "replay/rescored_rows": float(self._rescored), "replay/buffer_size": float(len(self)),
               "exgrpo/started": float(self.started), "exgrpo/prompts": float(len(self.valid())),
               "exgrpo/admitted": float(admitted), "exgrpo/retired": float(retired),
               "exgrpo/solved": solved / total if total else float("nan")}
        self._staged, self._injected, self._rescored = [], 0, 0
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self.pool.values())

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        keys = [k for k, v in self.pool.items() for _ in v]
        tensors, meta = kit.pack([r for v in self.pool.values() for r in v], "pool")
        return tensors, {"options": asdict(self.options), "n": self.n, "keys": keys, "records": meta,
                         "bucket": dict(self.bucket), "rows": dict(self.rows), "retired": sorted(self.retired),
                         "started": self.started, "rng": rng_state(self.rng), "last_step": self.last_step}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`, every field checked first (a refused load changes nothing).  Refused
        option changes: ``correct`` (the pool holds the responses correct under the saved threshold) and
        ``lbound`` / ``rbound`` when a stored bucket falls outside the new range; the others are warned about."""
        where = "exgrpo state"
        meta = kit.checked_meta(meta, _STATE_KEYS, where)
        tensors = kit.only_tensors(tensors, "pool", where)
        if meta["n"] != self.n:
            raise CheckpointError(f"{where}: saved with n={meta['n']!r}, this run has n={self.n}; resume with the "
                                  "saved num_generations")
        saved, changes = kit.options_changes(ExgrpoOptions, meta["options"], self.options, where)
        last = kit.step_or_none(meta["last_step"], "last_step", where)
        records = kit.unpack(tensors, meta["records"], "pool", where, single=True, last_step=last)
        keys = kit.keys_of(meta["keys"], records, where, lambda r: key_of(r.prompt_ids))
        pool = kit.keyed(records, keys)
        bucket, rows, retired, started = meta["bucket"], meta["rows"], meta["retired"], meta["started"]
        lo, hi = saved.lbound, saved.rbound if saved.rbound is not None else self.n - 1
        if not isinstance(bucket, dict) or not all(isinstance(k, str) and is_int(v) and lo < v <= hi
                                                   for k, v in bucket.items()):
            raise CheckpointError(f"{where}: bucket must map prompt keys to success counts in ({lo}, {hi}]")
        if not isinstance(rows, dict) or not all(isinstance(k, str) for k in rows):
            raise CheckpointError(f"{where}: rows must map prompt keys to dataset rows")
        if not isinstance(retired, list) or not all(isinstance(k, str) for k in retired) or \
                len(set(retired)) != len(retired):
            raise CheckpointError(f"{where}: retired must be a list of distinct prompt keys")
        if not isinstance(started, bool):
            raise CheckpointError(f"{where}: started must be true or false, got {started!r}")
        if set(pool) - set(bucket):
            raise CheckpointError(f"{where}: stored prompts without a bucket: {sorted(set(pool) - set(bucket))[:3]}")
        gone = set(retired) & (set(bucket) | set(rows))
        if gone:
            raise CheckpointError(f"{where}: retired prompts are still stored: {sorted(gone)[:3]}")
        if bad := [r.group_id for r in records if float(r.rewards[0]) < saved.correct]:
            raise CheckpointError(f"{where}: stored responses {bad[:3]} are not correct (reward < {saved.correct})")
        for k, v in pool.items():
            if len({tuple(r.completion_ids.tolist()) for r in v}) != len(v):
                raise CheckpointError(f"{where}: prompt {k!r} stores the same completion twice")
        if (pool or bucket or retired or started) and last is None:
            raise CheckpointError(f"{where}: a store with prompts (or switched on) needs a last_step, got None")
        if pool and not started:
            raise CheckpointError(f"{where}: responses are stored but started is false (nothing is collected "
                                  "before the switch)")
        rng = rng_from_state(meta["rng"], where=where)
        now_hi = self.rbound
        if saved.correct != self.options.correct:
            raise kit.refuse_option(where, "correct", saved.correct, self.options.correct,
                                "the pool holds the responses correct under the saved threshold")
        if outside := [v for v in bucket.values() if not self.options.lbound < v <= now_hi]:
            raise kit.refuse_option(where, "lbound/rbound", (lo, hi), (self.options.lbound, now_hi),
                                f"stored buckets {sorted(set(outside))} fall outside the configured range")
        self.pool, self.bucket, self.rows = pool, {k: int(v) for k, v in bucket.items()}, dict(rows)
        self.retired, self.started, self.rng, self.last_step = set(retired), started, rng, last
        kit.warn_changes("exgrpo", changes)

