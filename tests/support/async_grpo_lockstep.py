"""A lock-step rollout worker: TRL async GRPO's rollout stream made deterministic and resumable, for resume tests.

TRL's own worker (and ``async_grpo_cpu.CPURolloutWorker``) generates on a thread, so which policy version a group is
generated with depends on timing, and a resumed run loses what was queued and in flight (hdreplay.integrations.trl.
async_resume).  :class:`LockstepWorker` generates on the trainer's thread instead: at each new policy version
(``update_model_version``, right after TRL streamed the weights into its copy) it releases the slow groups whose
time has come, starts that version's slow groups and tops the queue up with fresh ones; and when TRL's dataset finds
the queue empty it generates one more fresh group on the spot (:class:`OnDemandQueue`), so it never runs dry.  The
stream is then a function of the weights alone, and :meth:`LockstepWorker.state` / :meth:`~LockstepWorker.restore`
(saved beside TRL's checkpoint by :class:`SaveWorker`) carry it across a resume.  Its own torch RNG use is isolated
from the trainer's.
"""

from __future__ import annotations

import collections
import os
import pickle

import torch
from transformers import TrainerCallback

from async_grpo_cpu import CPURolloutWorker

WORKER_FILE = "lockstep_worker.pkl"


class OnDemandQueue:
    """The worker's ``rollout_buffer``: a FIFO that generates a fresh group when it is read empty."""

    def __init__(self, worker: "LockstepWorker"):
        self.worker, self.items = worker, collections.deque()

    def put(self, sample) -> None:
        self.items.append(sample)

    def get(self, timeout=None):
        if not self.items:
            self.worker._put(self.worker._group(self.worker.version))
        return self.items.popleft()

    def qsize(self) -> int:
        return len(self.items)


class LockstepWorker(CPURolloutWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollout_buffer = OnDemandQueue(self)
        self._restored_at = None  # the version the saved state was taken at (until the resumed run's first sync)

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version: int):
        v = int(model_version)
        if self._restored_at is not None:  # the resumed run's first sync: the saved state already covers it
            delta, self._restored_at = v - self._restored_at, None
            for s in [*self.rollout_buffer.items, *(s for _, ss in self.pending for s in ss)]:
                s.model_version += delta
            self.pending = [(at + delta, ss) for at, ss in self.pending]
            self.produced = {x + delta for x in self.produced}
            self.version = v
            return
        self.version = v
        if self.slow and v not in self.produced:
            self.produced.add(v)
            self.pending.extend((v + self.slow_lag, self._group(v)) for _ in range(self.slow))
        ready = sorted((p for p in self.pending if p[0] <= v), key=lambda p: p[0])
        self.pending = [p for p in self.pending if p[0] > v]
        for _, samples in ready:
            self._put(samples)
        while self.rollout_buffer.qsize() < self.fresh * self.n:
            self._put(self._group(v))

    def _group(self, version: int) -> list:
        with torch.random.fork_rng(devices=[]):
            return super()._group(version)

    def _put(self, samples) -> None:
        for s in samples:
            s.enqueued_at = None  # (TRL reads it for a timing metric only)
            self.rollout_buffer.put(s)

    def state(self) -> dict:
        return {"version": self.version, "produced": set(self.produced), "pending": list(self.pending),
                "queue": list(self.rollout_buffer.items), "next": (self._next_group, self._next_prompt),
                "log": list(self.log), "samples_by_group": dict(self.samples_by_group)}

    def restore(self, state: dict) -> None:
        self.version, self.produced, self.pending = state["version"], set(state["produced"]), list(state["pending"])
        self.rollout_buffer.items = collections.deque(state["queue"])
        self._next_group, self._next_prompt = state["next"]
        self.log, self.samples_by_group = list(state["log"]), dict(state["samples_by_group"])
        self._restored_at = state["version"]


class SaveWorker(TrainerCallback):
    """Writes the worker's state into each checkpoint (``on_save``: after the checkpoint is complete), from the global
    main process only: the worker lives there (TRL hands every other rank ``rollout_worker=None``), and a second
    writer of the same file, last one in, replaces it with its own (issue 43)."""

    def __init__(self, worker: LockstepWorker):
        self.worker = worker

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", WORKER_FILE)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(self.worker.state(), f)
        os.replace(path + ".tmp", path)


class MainSavesFirst(TrainerCallback):
    """A barrier in ``on_save``: added after :class:`SaveWorker` on rank 0 and before any other rank's own
    ``on_save`` work, it makes every other rank's later ``on_save`` callbacks run after rank 0 wrote the worker state.
    The order in which a second writer of that file, written last, made the 2-process resume flaky (issue 43); here
    forced, so a test sees it every time instead of one run in three to six."""

    def on_save(self, args, state, control, **kwargs):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()


class StopAt(TrainerCallback):
    """Stops training after optimizer step ``step`` (the run is interrupted there, after its checkpoint)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def load_worker_state(ckpt) -> dict:
    with open(os.path.join(ckpt, WORKER_FILE), "rb") as f:
        return pickle.load(f)
