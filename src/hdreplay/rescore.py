"""How the selection computes Drift: re-scoring a walk of the buffer, batched, with exact early rejection.

:func:`hdreplay.selection.select_replay` walks the ranked buffer and asks, group by group, for its Drift and
runtime Headroom under the current policy; :class:`Walk` answers in that order while it batches the teacher-forced
passes behind the scenes.  What it reports for each group (:class:`Rescored`) is exact, with one exception: a group
whose forwarded responses already *prove* Drift > tau is not forwarded further ("early rejection").

Why the proof holds: Drift is the mean over the group's loss tokens T(g) of non-negative terms, so the terms summed
over the tokens forwarded so far, divided by |T(g)|, are a lower bound of it (:func:`hdreplay.scores.drift_rejects`
allows for float64 round-off).  So early rejection never rejects a group the full scan accepts, and a group that is
not rejected early is forwarded whole and reported with exactly the Drift the full scan computes: the decisions, the
scanned prefix and the admitted list are the full scan's (for a scorer whose per-response output does not depend on
which other rows share its call).  With ``passes=1`` every group is forwarded whole in one call: the full scan.

Batching: each scorer call takes, breadth-first, the next slice of every unresolved group (``passes`` slices of about
n / passes responses; responses without a loss token are never forwarded), then the first slices of W new groups,
W sized by ``window`` from the groups still needed and the acceptance rate.  With a token ``budget`` per forward on
a ``latency_bound`` device (a GPU: a partly filled forward costs a full one), the call is filled to whole forwards
with further groups (speculative scoring), and groups start whole where slicing cannot save a forward
(``(1 - rate)(1 - 1/passes)`` of the window's tokens < budget), reported as the ``passes`` slices would report them:
the budget and the device change what is forwarded, never a result.  Groups touched beyond the stop are reported
as unused (:meth:`Walk.cost`): results discarded, caches not refreshed.

An early-rejected group's Headroom (``refresh``): that of the responses forwarded ("slice"), or exact because the
rest of the group is forwarded after the decision ("finish", the paper's refresh at the full scan's cost).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from .scores import check_scorer_output, drift_rejects, drift_term_sums, score_group
from .store.record import GroupRecord

#: a group that looks rejectable forwards next what its running mean Drift term says the bound needs, times this
PREDICT_MARGIN = 1.25
_OPEN, _PASS, _REJECT, _EARLY = 0, 1, 2, 3  # a group's state in the walk


@dataclass
class Rescored:
    """One group of the walk, scored under the current policy.

    drift:    Drift(g) in float64; when ``exact`` is False a lower bound already above ``tau`` (rejected early).
    headroom: runtime Headroom from the same pass (when not exact and refresh="slice": of the responses forwarded).
    kl:       mean k3 replay KL over the tokens forwarded.  tau: the threshold this group is gated on.
    tokens:   completion tokens forwarded for it.
    """

    insertion_id: int
    group: GroupRecord
    tau: float
    drift: float
    headroom: float
    kl: float
    exact: bool
    tokens: int


@dataclass
class WalkCost:
    """What the walk forwarded: scorer calls (groups per call), rows and completion tokens, and the groups (and
    their tokens) touched beyond where the selection stopped."""

    calls: int
    chunk_sizes: list
    rows: int
    tokens: int
    unused: int
    unused_tokens: int
    reached: int  # walk positions entered
    forward_tokens: int = 0  # prompt + completion tokens of the rows forwarded (what a full-row forward runs)
    unused_forward_tokens: int = 0  # of them, for groups beyond the stop (speculative scoring's discarded part)
    seconds: float = 0.0  # wall-clock seconds inside the scorer (its output on the host: device work included)
    sliced: bool = False  # the walk cut groups into slices (early rejection) this step


class _Layout:
    """Where a group's responses lie in its flat token arrays, and their loss-token counts."""

    def __init__(self, group: GroupRecord) -> None:
        lens = group.response_lengths.numpy()
        self.starts = np.concatenate([[0], np.cumsum(lens)]).tolist()
        lm = group.loss_mask.numpy().astype(np.int64)
        self.loss = np.add.reduceat(lm, self.starts[:-1]).tolist() if lm.size else [0] * len(lens)
        self.active = [i for i, c in enumerate(self.loss) if c > 0]
        self.num_loss = sum(self.loss)


def response_slices(group: GroupRecord, passes: int) -> list[list[int]]:
    """The responses of ``group`` with a loss token, in order, cut into slices of ceil(active / passes) responses."""
    active = _Layout(group).active
    size = max(1, math.ceil(len(active) / max(1, passes)))
    return [active[i:i + size] for i in range(0, len(active), size)]


def sub_group(group: GroupRecord, responses: Sequence[int], layout: _Layout | None = None) -> GroupRecord:
    """``group`` restricted to ``responses`` (in order; same id, prompt and multimodal inputs): what one slice
    forwards.  Built from views of the validated group, without re-validation (like :meth:`GroupRecord.clone`)."""
    responses = list(responses)
    if responses == list(range(group.num_responses)):
        return group
    st = (layout or _Layout(group)).starts
    runs, a = [], 0  # contiguous runs of responses -> token ranges
    for j in range(1, len(responses) + 1):
        if j == len(responses) or responses[j] != responses[j - 1] + 1:
            runs.append((st[responses[a]], st[responses[j - 1] + 1]))
            a = j

    def take(t: torch.Tensor) -> torch.Tensor:
        return t[runs[0][0]:runs[0][1]] if len(runs) == 1 else torch.cat([t[x:y] for x, y in runs])

    idx = torch.as_tensor(responses, dtype=torch.int64)
    rec, put = object.__new__(GroupRecord), object.__setattr__
    for f in ("group_id", "prompt_ids", "birth_step", "mm_inputs"):
        put(rec, f, getattr(group, f))
    for f in ("response_lengths", "advantages", "rewards"):
        put(rec, f, getattr(group, f)[idx])
    for f in ("completion_ids", "loss_mask", "logprobs"):
        put(rec, f, take(getattr(group, f)))
    put(rec, "extras", {k: take(v) for k, v in group.extras.items()})
    return rec


class _Group:
    """One group of the walk: its active responses are forwarded in order, a slice at a time."""

    def __init__(self, insertion_id: int, group: GroupRecord, tau: float, passes: int) -> None:
        self.id, self.group, self.tau, self.layout = insertion_id, group, tau, _Layout(group)
        self.canon = max(1, math.ceil(len(self.layout.active) / passes))  # the first slice of ``passes`` slices
        self.first = self.canon  # responses of the first slice (the walk's mode may change it before any forward)
        self.prompt = group.prompt_ids.numel()
        self.done = self.loss_fwd = self.rows = self.tokens = self.fwd = 0  # active responses / loss tokens forwarded
        self.state, self.finish = _OPEN, False  # finish: early-rejected, forwarded to the end (refresh="finish")
        self.sum64 = 0.0  # float64 sum of the Drift terms forwarded
        self.pieces: dict[int, torch.Tensor] = {}  # response index -> (L_i,) current log-probs
        self.result: Rescored | None = None

    @property
    def rest(self) -> int:
        return len(self.layout.active) - self.done

    @property
    def waiting(self) -> bool:
        return self.state == _OPEN or (self.finish and self.rest > 0)

    def next_slice(self) -> list[int]:
        """The first slice; then the rest of a group that looks admissible (mean term within tau) or is being
        finished; else the responses that, at the running mean, would take the partial sum past tau |T(g)|."""
        act, k = self.layout.active, self.rest
        if self.done == 0:
            k = min(k, self.first)
        elif self.state == _OPEN and self.sum64 > self.tau * self.loss_fwd:
            need = PREDICT_MARGIN * self.tau * self.layout.num_loss * self.loss_fwd / self.sum64 - self.loss_fwd
            take, got = 1, self.layout.loss[act[self.done]]
            while take < k and got < need:
                got += self.layout.loss[act[self.done + take]]
                take += 1
            k = take
        return act[self.done:self.done + k]

    def canonical_rejection(self, norm: str) -> "_Group | None":
        """For a group forwarded whole in one slice and rejected: where the canonical slicing (first slice ``canon``
        responses, then :meth:`next_slice`) would have proved the rejection, replayed on the log-probs already
        forwarded -- so that its refresh (``refresh="slice"``) and reported Drift bound do not depend on the mode --
        or None when the canonical slicing forwards the whole group too."""
        shadow = _Group(self.id, self.group, self.tau, 1)
        shadow.canon = shadow.first = self.canon
        while shadow.rest:
            sl = shadow.next_slice()
            shadow.sum64 += drift_term_sums([sub_group(self.group, sl, self.layout)], [self.current(sl)],
                                            drift_norm=norm)[0]
            shadow.done, shadow.loss_fwd = shadow.done + len(sl), shadow.loss_fwd + sum(self.layout.loss[i] for i in sl)
            if shadow.rest and drift_rejects(shadow.sum64, self.layout.num_loss, self.tau):
                return shadow
        return None

    def forward_tokens(self, responses: Sequence[int]) -> int:
        """Tokens a full-row forward of ``responses`` runs (prompt + response per row)."""
        lens = self.layout.starts
        return sum(self.prompt + lens[i + 1] - lens[i] for i in responses)

    def current(self, responses: Sequence[int]) -> torch.Tensor:
        lens = self.group.response_lengths.tolist()  # responses never forwarded (no loss token): zeros
        return torch.cat([self.pieces.get(i, torch.zeros(lens[i])) for i in responses])


class Walk:
    """Drift and runtime Headroom of the groups of ``order``, in order, from batched teacher-forced passes.

    Iterate it to get one :class:`Rescored` per group, in walk order; stop whenever you have enough, then read
    :meth:`cost`.

    Args:
        order: limit -> the first ``limit`` insertion ids of the walk.  get: ids -> the stored groups.
        scorer: the caller's :data:`hdreplay.selection.Scorer`.  limit: walk positions at most.
        k: groups the caller needs (only sizes the batches).  gate: False = every group is forwarded whole.
        tau: the threshold, or groups -> their thresholds (a float each).  passes, refresh: see the module docstring.
        window: groups still needed -> new groups per scorer call.  budget: tokens of one forward, or None (no
        filling, every group sliced).  rate: the running acceptance rate in [0, 1] (with a budget: whether to slice).
        max_groups: groups per scorer call at most (the speculative fill stops there).  latency_bound: above.
    """

    def __init__(self, order: Callable[[int], np.ndarray], get: Callable[[list], list], scorer: Callable, *,
                 limit: int, k: int, gate: bool, tau: float | Callable, passes: int, refresh: str,
                 window: Callable[[int], int], drift_norm: str, headroom_weighting: str, budget: int | None = None,
                 rate: float = 1.0, max_groups: int = 1 << 30, latency_bound: bool = True) -> None:
        self.order, self.get, self.scorer, self.limit, self.k, self.gate = order, get, scorer, limit, k, gate
        self.tau, self.passes, self.refresh, self.window = tau, (passes if gate else 1), refresh, window
        self.norm, self.weighting, self.budget, self.rate = drift_norm, headroom_weighting, budget, rate
        self.max_groups, self.latency_bound = max_groups, latency_bound
        # how the walk's groups start: "canonical" (first slice of ``passes``) or "whole"; with a budget on a
        # latency-bound device it is decided at the first entry (None until then)
        self.mode = "whole" if self.passes == 1 else ("canonical" if budget is None or not latency_bound else None)
        self.groups: list[_Group] = []
        self.prefix = np.zeros(0, dtype=np.int64)
        self.calls, self.sizes, self.rows, self.tokens, self.yielded = 0, [], 0, 0, 0
        self.fwd_tokens, self.seconds = 0, 0.0
        self._peeked: _Group | None = None  # the next group of the walk, read to see whether it fits a forward

    def __iter__(self) -> Iterator[Rescored]:
        while self.yielded < self.limit:
            if self.yielded < len(self.groups) and self.groups[self.yielded].result is not None:
                self.yielded += 1
                yield self.groups[self.yielded - 1].result
            elif not self._call():
                return

    def cost(self) -> WalkCost:
        rest = self.groups[self.yielded:]
        return WalkCost(self.calls, self.sizes, self.rows, self.tokens, len(rest), sum(g.tokens for g in rest),
                        len(self.groups), self.fwd_tokens, sum(g.fwd for g in rest), self.seconds,
                        self.mode == "canonical")

    def _kth_pass(self) -> int | None:
        seen = 0
        for j, g in enumerate(self.groups):
            seen += g.state == _PASS
            if seen == self.k:
                return j
        return None

    def _read(self, n: int) -> list[_Group]:
        """The next ``n`` groups of the walk (not yet entered), read from the buffer."""
        out = [self._peeked] if self._peeked is not None and n > 0 else []
        self._peeked = None if out else self._peeked
        at, n = len(self.groups) + len(out), n - len(out)
        if n > 0:
            if at + n > len(self.prefix):
                self.prefix = self.order(min(self.limit, max(2 * len(self.prefix), at + n)))
            ids = self.prefix[at:at + n].tolist()
            records = self.get(ids)
            taus = [float(self.tau)] * len(ids) if not callable(self.tau) else [float(t) for t in self.tau(records)]
            out += [_Group(i, g, t, self.passes) for i, g, t in zip(ids, records, taus)]
        return out

    def _enter(self, n: int) -> list[_Group]:
        """Enter the next ``n`` groups; with a budget the first entry decides the walk's mode (module docstring)."""
        new = self._read(n)
        if self.mode is None and new:
            whole = sum(g.forward_tokens(g.layout.active) for g in new)
            self.mode = "canonical" if (1 - self.rate) * (1 - 1 / self.passes) * whole >= self.budget else "whole"
        for g in new:
            self._start(g)
        self.groups += new
        return new

    def _start(self, g: _Group) -> None:
        g.first = g.canon if self.mode == "canonical" else len(g.layout.active)

    def _fill(self, todo: list[_Group], slices: list[list[int]]) -> None:
        """Speculative scoring: enter further groups while their first slice fits in the last forward's room."""
        room = -sum(g.forward_tokens(sl) for g, sl in zip(todo, slices)) % self.budget
        while room and self.mode is not None and len(self.groups) < self.limit and len(todo) < self.max_groups:
            g = self._read(1)[0]
            self._start(g)
            sl = g.next_slice()
            if g.forward_tokens(sl) > room:
                self._peeked = g  # kept for the next call: it is not read twice
                return
            self.groups.append(g)
            todo.append(g)
            slices.append(sl)
            room -= g.forward_tokens(sl)

    def _call(self) -> bool:
        """One scorer call over the groups that need it; False when nothing is left to forward."""
        kth = self._kth_pass()
        if kth is not None:  # k passed: only undecided groups before the k-th can still change the outcome
            todo = [g for g in self.groups[:kth + 1] if g.waiting]
        else:  # open groups count as likely passes; new groups fill the rest of the window
            todo = [g for g in self.groups if g.waiting]
            need = self.k - sum(g.state == _PASS for g in self.groups) - sum(g.state == _OPEN for g in todo)
            new = min(self.limit - len(self.groups), self.window(need)) if need > 0 else 0
            todo += self._enter(new) if new > 0 else []
        slices = [g.next_slice() for g in todo]
        if kth is None and self.budget is not None and self.latency_bound:
            self._fill(todo, slices)
        if not todo:
            return False
        subs = [sub_group(g.group, sl, g.layout) for g, sl in zip(todo, slices)]
        t0 = time.perf_counter()
        out = self.scorer(subs)
        self.seconds += time.perf_counter() - t0
        lps = check_scorer_output(subs, out)
        self.calls += 1
        for g, sl in zip(todo, slices):
            g.fwd += g.forward_tokens(sl)
            self.fwd_tokens += g.forward_tokens(sl)
        self.sizes.append(len(todo))
        open_ = [j for j, g in enumerate(todo) if g.state == _OPEN]
        sums = drift_term_sums([subs[j] for j in open_], [lps[j] for j in open_], drift_norm=self.norm)
        sums = dict(zip(open_, sums))
        for j, (g, sl, sub, lp) in enumerate(zip(todo, slices, subs, lps)):
            g.pieces.update(zip(sl, sub.split(lp)))
            g.done += len(sl)
            g.rows, g.tokens, g.loss_fwd = g.rows + sub.num_responses, g.tokens + sub.num_tokens, \
                g.loss_fwd + sum(g.layout.loss[i] for i in sl)
            self.rows, self.tokens = self.rows + sub.num_responses, self.tokens + sub.num_tokens
            if j in sums:
                g.sum64 += sums[j]
                if self.gate and g.rest and drift_rejects(g.sum64, g.layout.num_loss, g.tau):
                    g.state, g.finish = _EARLY, self.refresh == "finish"
            self._resolve(g)
        return True

    def _resolve(self, g: _Group) -> None:
        """Score ``g`` once nothing more will be forwarded for it."""
        if g.rest and (g.state == _OPEN or g.finish):
            return
        if g.rest == 0:
            d, h, kl = score_group(g.group, g.current(range(g.group.num_responses)), drift_norm=self.norm,
                                   headroom_weighting=self.weighting)
            if g.state == _OPEN:
                g.state = _PASS if (not self.gate or d <= g.tau) else _REJECT
            shadow = g.canonical_rejection(self.norm) if (
                g.state == _REJECT and self.refresh == "slice" and g.first > g.canon) else None
            if shadow is not None:  # forwarded whole: reported as the canonical slicing would report it
                g.done, g.sum64, g.state = shadow.done, shadow.sum64, _EARLY
        if g.rest:  # rejected early: Drift's lower bound; Headroom and replay KL of the responses forwarded
            fwd = g.layout.active[:g.done]
            _, h, kl = score_group(sub_group(g.group, fwd, g.layout), g.current(fwd), drift_norm=self.norm,
                                   headroom_weighting=self.weighting)
            d = g.sum64 / g.layout.num_loss
        # exact: forwarded to the end (an early-rejected group finished for refresh="finish" included)
        g.result = Rescored(g.id, g.group, g.tau, float(d), float(h), float(kl), not g.rest, g.tokens)
