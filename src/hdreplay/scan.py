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
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from .record import GroupRecord
from .scores import check_scorer_output, drift_bound_rejects, drift_term_sums, score_groups

#: per-group states of the scan
_OPEN, _PASS, _REJECT, _EARLY = 0, 1, 2, 3
SCAN_REFRESH = ("slice", "keep", "finish")


def response_slices(group: GroupRecord, passes: int) -> list[list[int]]:
    """The responses of ``group`` with at least one loss token, in order, cut into at most ``passes`` slices of
    ceil(active / passes) responses (one slice: the whole group)."""
    active = [i for i, m in enumerate(group.split(group.loss_mask)) if bool(m.any())]
    size = max(1, math.ceil(len(active) / max(1, passes)))
    return [active[i:i + size] for i in range(0, len(active), size)]


def sub_group(group: GroupRecord, responses: Sequence[int]) -> GroupRecord:
    """``group`` restricted to ``responses`` (same id, prompt and multimodal inputs): what one slice forwards.

    Built without re-validation (the parts of a validated group), like :meth:`GroupRecord.clone`."""
    idx = torch.as_tensor(list(responses), dtype=torch.int64)
    if len(responses) == group.num_responses:
        return group
    ri = group.response_index()
    tok = torch.isin(ri, idx)
    rec = object.__new__(GroupRecord)
    put = object.__setattr__
    put(rec, "group_id", group.group_id)
    put(rec, "prompt_ids", group.prompt_ids)
    put(rec, "birth_step", group.birth_step)
    put(rec, "mm_inputs", group.mm_inputs)
    put(rec, "response_lengths", group.response_lengths[idx])
    for f in ("completion_ids", "loss_mask", "logprobs"):
        put(rec, f, getattr(group, f)[tok])
    put(rec, "advantages", group.advantages[idx])
    put(rec, "rewards", group.rewards[idx])
    put(rec, "extras", {k: v[tok] for k, v in group.extras.items()})
    return rec


@dataclass
class _Candidate:
    """One group of the order as the scan sees it."""

    insertion_id: int
    group: GroupRecord
    slices: list[list[int]]
    done: int = 0  # slices forwarded
    state: int = _OPEN
    sum64: float = 0.0
    pieces: dict = field(default_factory=dict)  # response index -> (L_i,) current log-probs
    rows: int = 0  # rows forwarded
    tokens: int = 0  # completion tokens forwarded
    scores: tuple | None = None  # (drift, headroom, kl) once known (exact, or of the slice for _EARLY)
    finish: bool = False  # early-rejected, but forwarded to the end for its exact Headroom (refresh="finish")
    loss_tokens: int = 0  # loss tokens forwarded

    def grow(self, tau: float) -> None:
        """A group whose forwarded tokens' mean Drift term is within tau looks admissible: its next slice is the
        rest of it (an admitted group costs two calls, not ``passes``); otherwise slicing goes on."""
        looks_ok = self.state == _OPEN and self.sum64 <= tau * self.loss_tokens
        if (looks_ok or self.finish) and 0 < self.done < len(self.slices) - 1:
            self.slices[self.done:] = [[i for s in self.slices[self.done:] for i in s]]

    @property
    def waiting(self) -> bool:
        """Needs another forward: undecided, or early-rejected and to be finished."""
        return self.state == _OPEN or (self.finish and self.done < len(self.slices))

    def current(self, responses: Sequence[int]) -> torch.Tensor:
        """The flat current log-probs of ``responses`` (zeros for responses never forwarded: no loss token)."""
        lens = self.group.response_lengths.tolist()
        return torch.cat([self.pieces.get(i, torch.zeros(lens[i])) for i in responses])


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
             window: Callable[[int], int], drift_norm: str, headroom_weighting: str) -> ScanOutcome:
    """Scan ``order`` (a function limit -> the first ids) up to ``limit`` ids until ``k`` groups pass.

    Args:
        get: insertion ids -> the stored groups.  scorer: the caller's :data:`hdreplay.selection.Scorer`.
        gate: accept iff Drift <= tau (False: every scored group passes; forwarded whole).
        passes: response slices per group (1 = whole groups, the full scan).  refresh: see the module docstring.
        window: groups still needed -> groups per scorer call (the chunk size of the full scan).
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
                fresh = [_Candidate(i, g, response_slices(g, passes)) for i, g in zip(ids, get(ids))]
                cands += fresh
                todo += fresh
        if not todo:
            break
        for c in todo:
            c.grow(tau)
        subs = [sub_group(c.group, c.slices[c.done]) for c in todo]
        lps = check_scorer_output(subs, scorer(subs))
        calls += 1
        sizes.append(len(todo))
        for c, s, lp in zip(todo, subs, lps):
            for i, piece in zip(c.slices[c.done], s.split(lp)):
                c.pieces[i] = piece
            c.done += 1
            c.rows += s.num_responses
            c.tokens += s.num_tokens
            c.loss_tokens += s.num_loss_tokens
            rows += s.num_responses
            tokens += s.num_tokens
        open_ = [(c, s, lp) for c, s, lp in zip(todo, subs, lps) if c.state == _OPEN]
        if gate and open_:
            sums = drift_term_sums([s for _, s, _ in open_], [lp for _, _, lp in open_], drift_norm=drift_norm)
            for (c, _, _), x in zip(open_, sums):
                c.sum64 += x
                if c.done < len(c.slices) and drift_bound_rejects(c.sum64, c.group.num_loss_tokens, tau):
                    c.state = _EARLY
        complete = [c for c in todo if c.done == len(c.slices) and c.state in (_OPEN, _EARLY)]
        _score_whole(complete, gate=gate, tau=tau, drift_norm=drift_norm, headroom_weighting=headroom_weighting)
        if refresh == "finish":
            for c in todo:
                c.finish = c.state == _EARLY
    kth = _kth_pass(cands, k)
    m = len(cands) if kth is None else kth + 1
    scanned, rest = cands[:m], cands[m:]
    early = [c for c in scanned if c.state == _EARLY and c.scores is None]
    _score_slices(early, drift_norm=drift_norm, headroom_weighting=headroom_weighting)
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


def _score_whole(cands: list[_Candidate], *, gate: bool, tau: float, drift_norm: str, headroom_weighting: str) -> None:
    """Exact scores of fully forwarded groups; decide those still open.  Each group is scored on its own row, so
    its Drift is the same float32 number however the scan batched it (and equals a one-group-at-a-time scan's)."""
    for c in cands:
        cur = c.current(range(c.group.num_responses))
        sc = score_groups([c.group], [cur], drift_norm=drift_norm, headroom_weighting=headroom_weighting)
        d = float(sc.drift[0])
        c.scores = (d, float(sc.headroom[0]), float(sc.replay_kl[0]))
        if c.state == _OPEN:
            c.state = _PASS if (not gate or d <= tau) else _REJECT


def _score_slices(cands: list[_Candidate], *, drift_norm: str, headroom_weighting: str) -> None:
    """Early-rejected groups: Drift = the lower bound, Headroom and replay KL of the responses forwarded."""
    if not cands:
        return
    subs = [sub_group(c.group, [i for s in c.slices[:c.done] for i in s]) for c in cands]
    cur = [c.current([i for s in c.slices[:c.done] for i in s]) for c in cands]
    sc = score_groups(subs, cur, drift_norm=drift_norm, headroom_weighting=headroom_weighting)
    for c, h, kl in zip(cands, sc.headroom.tolist(), sc.replay_kl.tolist()):
        c.scores = (c.sum64 / c.group.num_loss_tokens, h, kl)
