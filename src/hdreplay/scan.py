"""The scan of a selection: walk an order, re-score, gate, stop at K_rep -- with exact early rejection.

Drift is the mean over a group's loss tokens T(g) of non-negative terms, so the sum of the terms over any
subset of T(g), divided by |T(g)|, is a lower bound of the group's Drift.  The scan forwards each candidate's
responses in slices (``scan_passes`` slices of about n / passes responses; responses without a loss token are
never forwarded), batched across candidates so that one scorer call holds one slice of every group in the scan
window, and stops forwarding a group once that bound exceeds tau (:func:`hdreplay.scores.drift_bound_rejects`,
which allows for the full scan's float32 round-off).  A group that is not rejected early is forwarded whole and
gated on exactly the Drift the full scan computes, so **every gate decision, the scanned prefix and the accepted
list are the full scan's** (for a scorer whose per-response output does not depend on which other rows share
its call; the tests compare the two on random groups and slicings).

The window: each scorer call takes the next slice of the first W unresolved groups in scan order, W sized from
the groups still needed and the running acceptance rate as the full scan sizes its chunks; new groups enter it
as earlier ones resolve.  The scan is decided once K_rep groups passed with every group before the K-th resolved
(the stopping index m*), or when the order (up to the scan budget) is exhausted.  Groups touched beyond m* are
``scored_unused`` (not scanned, their cache not refreshed), as the full scan's discarded chunk tail.

What an early-rejected group reports (``refresh``): its Drift is the lower bound (``exact`` False); its runtime
Headroom is that of the responses forwarded ("slice", the default), its cached value unchanged ("keep": the
controller re-writes the value it had), or exact because the rest of the group is forwarded after the decision
("finish": the full scan's refresh, hence the full scan's whole run, at the full scan's cost for those groups).
With ``passes=1`` every group is forwarded whole in one call: the full scan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .record import GroupRecord
from .selectors import SCAN_REFRESH  # noqa: F401  (re-exported)
from .scores import check_scorer_output, drift_bound_rejects, drift_term_sums, score_group

#: per-group states of the scan
_OPEN, _PASS, _REJECT, _EARLY = 0, 1, 2, 3


def response_slices(group: GroupRecord, passes: int) -> list[list[int]]:
    """The responses of ``group`` with at least one loss token, in order, cut into slices of ceil(active / passes)
    responses (one slice: the whole group): the first slice is what the scan forwards first."""
    active = _Layout(group).active
    size = max(1, math.ceil(len(active) / max(1, passes)))
    return [active[i:i + size] for i in range(0, len(active), size)]


class _Layout:
    """Where a group's responses lie in its flat token arrays, and their loss-token counts."""

    def __init__(self, group: GroupRecord) -> None:
        lens = group.response_lengths.numpy()
        self.starts = np.concatenate([[0], np.cumsum(lens)]).tolist()
        lm = group.loss_mask.numpy().astype(np.int64)
        self.loss = np.add.reduceat(lm, self.starts[:-1]).tolist() if lm.size else [0] * len(lens)
        self.active = [i for i, c in enumerate(self.loss) if c > 0]
        self.num_loss = sum(self.loss)


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
    rec = object.__new__(GroupRecord)
    put = object.__setattr__
    put(rec, "group_id", group.group_id)
    put(rec, "prompt_ids", group.prompt_ids)
    put(rec, "birth_step", group.birth_step)
    put(rec, "mm_inputs", group.mm_inputs)
    put(rec, "response_lengths", group.response_lengths[idx])
    for f in ("completion_ids", "loss_mask", "logprobs"):
        put(rec, f, take(getattr(group, f)))
    put(rec, "advantages", group.advantages[idx])
    put(rec, "rewards", group.rewards[idx])
    put(rec, "extras", {k: take(v) for k, v in group.extras.items()})
    return rec


#: a group that looks rejectable forwards next what its running mean Drift term says the bound needs, times this
PREDICT_MARGIN = 1.25


class _Candidate:
    """One group of the order as the scan sees it: its active responses are forwarded in order, a prefix at a time."""

    def __init__(self, insertion_id: int, group: GroupRecord, passes: int) -> None:
        self.insertion_id, self.group, self.layout = insertion_id, group, _Layout(group)
        self.first = max(1, math.ceil(len(self.layout.active) / passes))  # responses of the first slice
        self.done = 0  # active responses forwarded
        self.state = _OPEN
        self.sum64 = 0.0  # float64 sum of the Drift terms forwarded
        self.loss_fwd = 0  # loss tokens forwarded
        self.pieces: dict[int, torch.Tensor] = {}  # response index -> (L_i,) current log-probs
        self.rows = self.tokens = 0  # forwarded
        self.scores: tuple | None = None  # (drift, headroom, kl): exact, or for _EARLY the bound and the slice's
        self.finish = False  # early-rejected, forwarded to the end for its exact Headroom (refresh="finish")
        self.floor = 0.0  # Drift floor subtracted before the gate (asynchronous pipelines): passes iff Drift <= tau + floor

    @property
    def rest(self) -> int:
        return len(self.layout.active) - self.done

    @property
    def waiting(self) -> bool:
        """Needs another forward: undecided, or early-rejected and to be finished."""
        return self.state == _OPEN or (self.finish and self.rest > 0)

    def next_slice(self, tau: float) -> list[int]:
        """The responses the next call forwards: the first slice; then the rest of a group whose forwarded tokens'
        mean Drift term is within tau (it looks admissible: an admitted group costs two calls) or that is being
        finished; else the responses that, at the running mean, would take the partial sum past tau |T(g)|."""
        act, k = self.layout.active, self.rest
        if self.done == 0:
            k = min(k, self.first)
        elif self.state == _OPEN and self.sum64 > tau * self.loss_fwd:
            need = PREDICT_MARGIN * tau * self.layout.num_loss * self.loss_fwd / self.sum64 - self.loss_fwd
            take, got = 1, self.layout.loss[act[self.done]]
            while take < k and got < need:
                got += self.layout.loss[act[self.done + take]]
                take += 1
            k = take
        return act[self.done:self.done + k]

    def current(self, responses: Sequence[int]) -> torch.Tensor:
        """The flat current log-probs of ``responses`` (zeros for responses never forwarded: no loss token)."""
        lens = self.group.response_lengths.tolist()
        return torch.cat([self.pieces.get(i, torch.zeros(lens[i])) for i in responses])

    def forwarded(self) -> list[int]:
        return self.layout.active[:self.done]


@dataclass
class ScanOutcome:
    """The decided scan: ``scanned`` candidates in scan order (up to m*), what was forwarded, the calls."""

    scanned: list[_Candidate]
    unused: int
    calls: int
    chunk_sizes: list[int]
    rows: int
    tokens: int
    unused_tokens: int
    reached: int  # order positions entered (for the scan-capped test)


def run_scan(order: Callable[[int], np.ndarray], get: Callable[[list[int]], list[GroupRecord]],
             scorer: Callable, *, limit: int, k: int, gate: bool, tau: float, passes: int, refresh: str,
             window: Callable[[int], int], drift_norm: str, headroom_weighting: str,
             floors: Callable[[list[GroupRecord]], list[float]] | None = None) -> ScanOutcome:
    """Scan ``order`` (a function limit -> the first ids) up to ``limit`` ids until ``k`` groups pass.

    Args:
        get: insertion ids -> the stored groups.  scorer: the caller's :data:`hdreplay.selection.Scorer`.
        gate: accept iff Drift <= tau (False: every scored group passes; forwarded whole).
        passes: response slices per group (1 = whole groups, the full scan).  refresh: see the module docstring.
        window: groups still needed -> groups per scorer call (the chunk size of the full scan).
        floors: groups -> their Drift floors (>= 0; None = 0): a group passes iff Drift - floor <= tau, so its
            early-rejection bound is tau + floor; reported Drift is max(Drift - floor, 0) (a lower bound if early).
    """
    passes = passes if gate else 1
    cands: list[_Candidate] = []
    prefix = np.zeros(0, dtype=np.int64)
    calls, sizes, rows, tokens = 0, [], 0, 0
    while True:
        kth = _kth_pass(cands, k)
        if kth is not None:  # K passed: only undecided groups before the K-th can still change the outcome
            todo = [c for c in cands[:kth + 1] if c.waiting]
        else:  # open groups count as likely passes; new groups fill the rest of the window
            todo = [c for c in cands if c.waiting]
            need = k - sum(c.state == _PASS for c in cands) - sum(c.state == _OPEN for c in todo)
            new = min(limit - len(cands), window(need)) if need > 0 else 0
            if new > 0:
                if len(cands) + new > len(prefix):
                    prefix = order(min(limit, max(2 * len(prefix), len(cands) + new)))
                ids = prefix[len(cands):len(cands) + new].tolist()
                groups = get(ids)
                fresh = [_Candidate(i, g, passes) for i, g in zip(ids, groups)]
                for c, f in zip(fresh, floors(groups) if floors is not None else ()):
                    c.floor = float(f)
                cands += fresh
                todo += fresh
        if not todo:
            break
        slices = [c.next_slice(tau + c.floor) for c in todo]
        subs = [sub_group(c.group, sl, c.layout) for c, sl in zip(todo, slices)]
        lps = check_scorer_output(subs, scorer(subs))
        calls += 1
        sizes.append(len(todo))
        for c, sl, sub, lp in zip(todo, slices, subs, lps):
            for i, piece in zip(sl, sub.split(lp)):
                c.pieces[i] = piece
            c.done += len(sl)
            c.rows += sub.num_responses
            c.tokens += sub.num_tokens
            c.loss_fwd += sum(c.layout.loss[i] for i in sl)
            rows += sub.num_responses
            tokens += sub.num_tokens
        open_ = [j for j, c in enumerate(todo) if c.state == _OPEN]
        if gate and open_:
            sums = drift_term_sums([subs[j] for j in open_], [lps[j] for j in open_], drift_norm=drift_norm)
            for j, x in zip(open_, sums):
                c = todo[j]
                c.sum64 += x
                if c.rest and drift_bound_rejects(c.sum64, c.layout.num_loss, tau + c.floor):
                    c.state = _EARLY
                    c.finish = refresh == "finish"
        for c in todo:
            if c.rest == 0 and c.scores is None:
                c.scores = score_group(c.group, c.current(range(c.group.num_responses)), drift_norm=drift_norm,
                                       headroom_weighting=headroom_weighting)
                if c.floor:
                    c.scores = (max(c.scores[0] - c.floor, 0.0), *c.scores[1:])
                if c.state == _OPEN:
                    c.state = _PASS if (not gate or c.scores[0] <= tau) else _REJECT
    kth = _kth_pass(cands, k)
    m = len(cands) if kth is None else kth + 1
    scanned, rest = cands[:m], cands[m:]
    for c in scanned:  # early-rejected: Drift = the lower bound, Headroom and replay KL of the responses forwarded
        if c.state == _EARLY and c.scores is None:
            sub = sub_group(c.group, c.forwarded(), c.layout)
            _, h, kl = score_group(sub, c.current(c.forwarded()), drift_norm=drift_norm,
                                   headroom_weighting=headroom_weighting)
            c.scores = (max(c.sum64 / c.layout.num_loss - c.floor, 0.0), h, kl)
    return ScanOutcome(scanned=scanned, unused=len(rest), calls=calls, chunk_sizes=sizes, rows=rows, tokens=tokens,
                       unused_tokens=sum(c.tokens for c in rest), reached=len(cands))


def _kth_pass(cands: list[_Candidate], k: int) -> int | None:
    """Position of the k-th passing group in scan order (None if fewer than k passed so far)."""
    seen = 0
    for j, c in enumerate(cands):
        seen += c.state == _PASS
        if seen == k:
            return j
    return None
