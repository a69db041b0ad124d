"""What an HDRAsyncGRPOTrainer checkpoint holds beyond TRL's, and how a resumed run picks it up.

``checkpoint-N/hdreplay/`` is the controller's crash-safe checkpoint (:meth:`hdreplay.ReplayController.save`); the
staleness rule's state rides in it (:mod:`hdreplay.staleness.state`), and with it this module's *routing state*
(rank 0's :class:`~.async_queue.GroupRoutingQueue` when the checkpoint was taken, after update N):

* ``sent``: the samples TRL's dataloader had already pulled for update N + 1 (its one-micro-batch prefetch, which
  dies with the process): handed out again first, before anything else;
* ``replay``: replay samples still queued from selections before the last one (the last selection, for update
  N + 1, is not saved: the resumed run makes it again from the restored buffer and weights, and warns if it
  differs from ``selected``, the one the interrupted run made);
* ``out`` / ``partial``: fresh samples routed but not handed out yet, and groups whose samples had not all arrived;
* ``kind_of`` / ``intended``: how those groups are labelled when they train, and the update each replay group was
  selected for (``async/replay_landing_delay_mean``);
* ``shift``: the run's version shift (:class:`~.async_queue.GroupRoutingQueue`); a resumed run's versions restart
  where TRL restarts them, so every restored sample's ``model_version`` is moved by the difference of the shifts.

What cannot be resumed: TRL's rollout worker.  TRL restarts it from its first untrained prompt (``rollout_state.json``,
an ``AsyncRolloutWorker`` only) with the resumed weights; samples it had generated and queued, and requests in
flight, are lost, and the worker generates new ones.  So the replay side resumes exactly -- a resumed run selects
what the uninterrupted one selects given the same arrivals -- but it equals the uninterrupted run only with a
worker whose stream resumes too (the tests' lock-step worker does).  TRL's worker restarts its group ids at 0;
:meth:`~.async_queue.GroupRoutingQueue.resumed` renumbers them past the restored ones.
"""

from __future__ import annotations

import collections
from typing import Any

from ....errors import CheckpointError
from .rows import sample_from_json, sample_to_json

ROUTING_FORMAT = 1


def routing_state(queue, *, step: int, intended: dict) -> dict[str, Any]:
    """Rank 0's routing state after update ``step`` (JSON)."""
    last = queue.selections
    kinds = {}
    for gid in [x[3] for x in queue.sent] + [x[2] for x in queue._out] + [x[2] for x in queue._replay]:
        if gid in queue.kind_of:
            kinds[gid] = queue.kind_of[gid]
    return {"format": ROUTING_FORMAT, "step": int(step), "shift": int(queue.version_shift),
            "samples_per_step": int(queue.samples_per_step), "emitted": int(queue.emitted),
            "sent": [[kind, gid, sample_to_json(s)] for _, s, kind, gid in queue.sent],
            "replay": [[gid, sample_to_json(s)] for s, _, gid, n in queue._replay if n != last],
            "selected": list(dict.fromkeys(gid for _, _, gid, n in queue._replay if n == last)),
            "out": [[kind, gid, sample_to_json(s)] for s, kind, gid in queue._out],
            "partial": [[gid, [sample_to_json(s) for s in samples]] for gid, samples in queue._partial.items()],
            "kind_of": [[gid, kind, int(birth)] for gid, (kind, birth) in kinds.items()],
            "intended": [[gid, int(st)] for gid, st in intended.items()]}


def _gid(x) -> bool:
    return isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_routing(d: Any, *, samples_per_step: int, step: int | None = None) -> dict[str, Any]:
    """A validated :func:`routing_state` with its samples rebuilt (CheckpointError saying what is wrong); ``step``:
    the global step of the checkpoint it is resumed with (None: not known), which the routing state must name."""
    keys = {"format", "step", "shift", "samples_per_step", "emitted", "sent", "replay", "selected", "out", "partial",
            "kind_of", "intended"}
    if not isinstance(d, dict) or set(d) != keys or d["format"] != ROUTING_FORMAT:
        raise CheckpointError(f"expected a routing state of format {ROUTING_FORMAT} with {sorted(keys)}, got "
                              f"{sorted(d) if isinstance(d, dict) else d!r:.80}")
    if d["samples_per_step"] != samples_per_step:
        raise CheckpointError(
            f"it was written with {d['samples_per_step']} samples per optimizer step, this run takes "
            f"{samples_per_step} (per_device_train_batch_size x gradient_accumulation_steps x processes): the queued "
            "samples would land in other steps; resume with the same batch settings")
    if not all(_int(d[k]) for k in ("step", "shift", "emitted")) or d["step"] < 0:
        raise CheckpointError(f"step, shift and emitted must be ints, got {d['step']!r:.20} / {d['shift']!r:.20} / "
                              f"{d['emitted']!r:.20}")
    if step is not None and d["step"] != step:
        raise CheckpointError(f"it was taken after update {d['step']}, the checkpoint after update {step} "
                              "(trainer_state.json's global_step): it belongs to another checkpoint")
    lists = {k: d[k] for k in ("sent", "replay", "selected", "out", "partial", "kind_of", "intended")}
    if not all(isinstance(v, list) for v in lists.values()):
        raise CheckpointError("sent, replay, selected, out, partial, kind_of and intended must be lists")
    if d["emitted"] - len(d["sent"]) != d["step"] * samples_per_step:
        raise CheckpointError(f"{len(d['sent'])} samples pulled ahead after {d['emitted']} handed out do not end "
                              f"update {d['step']} ({d['step'] * samples_per_step} samples)")

    def entries(name, arity, check):
        out = []
        for e in lists[name]:
            if not (isinstance(e, list) and len(e) == arity and check(e)):
                raise CheckpointError(f"{name}: malformed entry {e!r:.80}")
            out.append(e)
        return out

    kind = lambda k: k in ("fresh", "replay")  # noqa: E731
    sent = [(sample_from_json(s), k, g) for k, g, s in entries("sent", 3, lambda e: kind(e[0]) and _gid(e[1]))]
    out = [(sample_from_json(s), k, g) for k, g, s in entries("out", 3, lambda e: kind(e[0]) and _gid(e[1]))]
    replay = [(sample_from_json(s), "replay", g) for g, s in entries("replay", 2, lambda e: _gid(e[0]))]
    partial = {g: [sample_from_json(s) for s in ss]
               for g, ss in entries("partial", 2, lambda e: _gid(e[0]) and isinstance(e[1], list))}
    kinds = {g: (k, b) for g, k, b in entries("kind_of", 3, lambda e: _gid(e[0]) and kind(e[1]) and _int(e[2]))}
    intended = {g: st for g, st in entries("intended", 2, lambda e: _gid(e[0]) and _int(e[1]))}
    if not all(_gid(g) for g in lists["selected"]):
        raise CheckpointError(f"selected must hold group ids, got {lists['selected']!r:.80}")
    return {"step": d["step"], "shift": d["shift"], "emitted": d["emitted"], "sent": sent, "replay": replay,
            "selected": list(lists["selected"]), "out": out, "partial": partial, "kind_of": kinds,
            "intended": intended}


def apply_routing(queue, parsed: dict[str, Any]) -> dict:
    """Put a parsed routing state into a fresh ``queue`` whose ``version_shift`` is set; returns ``intended``."""
    delta = queue.version_shift - parsed["shift"]

    def rebased(s):
        s.model_version = int(s.model_version) + delta
        return s

    queue._resend = collections.deque(parsed["sent"])
    queue.emitted = parsed["emitted"] - len(parsed["sent"])
    queue._replay = collections.deque((rebased(s), "replay", g, 0) for s, _, g in parsed["replay"])
    queue._out = collections.deque((rebased(s), k, g) for s, k, g in parsed["out"])
    queue._partial = {g: [rebased(s) for s in ss] for g, ss in parsed["partial"].items()}
    queue.kind_of.update(parsed["kind_of"])
    return dict(parsed["intended"])
