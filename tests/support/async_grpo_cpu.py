"""CPU stand-ins for TRL 1.16's async GRPO trainer (``trl.experimental.async_grpo``), narrow at each boundary.

Only what needs a GPU or a vLLM server is replaced; the trainer, its dataset (``RolloutQueueDataset``), batcher,
tree packing (``TreeRow``), collator, loss, weight-sync callbacks and logging are TRL's:

* ``packing._flash_attn``: the flash-attention-3 kernel's ``flash_attn_varlen_func`` -> a pure-torch per-segment
  causal attention (bottom-right aligned, grouped-query heads repeated), the same contract;
* ``async_grpo_trainer.get_peak_flops_per_device`` -> None (it asks CUDA for the device name; MFU is then off);
* ``async_grpo_trainer.VLLMClient`` -> a client that is never contacted (the test passes ``token_budget=0``,
  ``weight_transfer=`` and ``rollout_worker=``, so TRL never calls the server);
* :class:`CPURolloutWorker` through TRL's public ``rollout_worker=`` injection point: a thread sampling groups from
  a CPU copy of the model, scoring them and putting TRL's own ``RolloutSample`` objects on a ``queue.Queue``;
  its sampler log-probs come from bfloat16-rounded logits (an inference engine's log-probs differ from the
  trainer's fp32 ones, so the Drift floor is not 0);
* :class:`CopyWeights` through ``weight_transfer=``: ``send_weights`` loads TRL's streamed ``(name, tensor)`` pairs
  into the worker's copy (what the NCCL transfer does into vLLM).

The worker keeps ``fresh_per_version`` groups' worth of samples waiting in the queue (generated with the weights
current when it tops the queue up, like a server with bounded in-flight requests), and at each new policy version
generates ``slow_per_version`` groups released ``slow_lag`` versions later (long rollouts): those arrive stale.
"""

from __future__ import annotations

import queue
import threading
import time
import types

import numpy as np
import torch
import trl.experimental.async_grpo.async_grpo_trainer as _agt
import trl.experimental.async_grpo.packing as _packing
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample


def varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1),
                     **_):
    """``flash_attn_varlen_func``'s contract in pure torch: q (Nq, H, D), k / v (Nk, Hkv, D), segment s attends
    its queries ``cu_q[s]:cu_q[s+1]`` to its keys ``cu_k[s]:cu_k[s+1]`` (causal: query j of Lq sees keys up to
    Lk - Lq + j)."""
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv != H:
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        qs, ks, vs = q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)
        att = (qs @ ks.transpose(-1, -2)) * scale
        if causal:
            Lq, Lk = q1 - q0, k1 - k0
            allowed = torch.arange(Lk)[None, :] <= (Lk - Lq + torch.arange(Lq))[:, None]
            att = att.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = (att.softmax(-1) @ vs).transpose(0, 1)
    return out


class _NoServer:
    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        raise AssertionError(f"the test's vLLM client was called ({name}); pass token_budget / weight_transfer")


def install() -> None:
    """Put the three module-level stand-ins in place (idempotent)."""
    _packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    _agt.get_peak_flops_per_device = lambda *a, **k: None
    _agt.VLLMClient = _NoServer


class CopyWeights:
    """``WeightTransferProtocol``: streams TRL's weights into the worker's CPU copy."""

    def __init__(self, worker: "CPURolloutWorker"):
        self.worker, self.sends = worker, 0

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        params = dict(self.worker.model.named_parameters())
        with self.worker.lock, torch.no_grad():
            for name, t in iterator:
                params[name].copy_(t.detach().to(params[name].dtype))
        self.sends += 1

    def resume(self):
        pass

    def destroy(self):
        pass


class CPURolloutWorker:
    """``RolloutWorkerProtocol``: samples ``n`` completions per prompt from a CPU copy of the model."""

    def __init__(self, model, tok, prompts, answers, *, n: int, max_new_tokens: int, fresh_per_version: int,
                 slow_per_version: int = 0, slow_lag: int = 3, versions: int = 1000, seed: int = 0,
                 hold_version: int | None = None, reward=None):
        self.model, self.tok, self.prompts, self.answers = model.eval(), tok, prompts, answers
        self.reward = reward or (lambda text, answer: float(text.strip() == answer))
        self.n, self.max_new_tokens, self.seed = n, max_new_tokens, seed
        self.fresh, self.slow, self.slow_lag, self.versions = fresh_per_version, slow_per_version, slow_lag, versions
        self.hold_version = hold_version  # stop producing from this version on (a worker that runs dry)
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()
        self.lock, self.version, self.produced = threading.Lock(), 0, set()
        self.pending: list[tuple[int, list]] = []  # (release version, samples)
        self.log: list[dict] = []  # per group: id, version, rewards
        self.samples_by_group: dict[int, list] = {}  # per group: (input_ids, completion_mask, old_log_probs, advantage)
        self._stop, self._thread, self._next_group, self._next_prompt = threading.Event(), None, 0, 0
        self.error: BaseException | None = None

    # RolloutWorkerProtocol
    def start(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def update_model_version(self, model_version: int):
        self.version = int(model_version)

    def check_health(self, stale_after_s: float):
        if self.error is not None:
            raise RuntimeError("rollout worker failed") from self.error

    # the loop
    def _run(self):
        try:
            while not self._stop.is_set():
                v = self.version
                live = self.hold_version is None or v < self.hold_version
                if live and self.slow and v not in self.produced:
                    self.produced.add(v)
                    self.pending.extend((v + self.slow_lag, self._group(v)) for _ in range(self.slow))
                ready = [p for p in self.pending if p[0] <= self.version]
                self.pending = [p for p in self.pending if p[0] > self.version]
                for _, samples in sorted(ready, key=lambda p: p[0]):
                    self._put(samples)
                if live and self.rollout_buffer.qsize() < self.fresh * self.n:
                    self._put(self._group(v))
                else:
                    time.sleep(0.005)
        except BaseException as e:  # surfaced through check_health
            self.error = e

    def _put(self, samples) -> None:
        for s in samples:
            s.enqueued_at = time.time()
            self.rollout_buffer.put(s)

    @torch.no_grad()
    def _group(self, version: int) -> list:
        p = self._next_prompt % len(self.prompts)
        self._next_prompt += 1
        gid = self._next_group
        self._next_group += 1
        tok = self.tok
        prompt = tok(self.prompts[p], add_special_tokens=False)["input_ids"]
        torch.manual_seed(self.seed * 100_003 + gid)
        with self.lock:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=self.n,
                                      max_new_tokens=self.max_new_tokens, output_logits=True,
                                      return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id)
        seqs = out.sequences[:, len(prompt):]
        logits = torch.stack(out.logits, 1)[:, :seqs.shape[1]]
        lps = torch.log_softmax(logits.to(torch.bfloat16).float(), -1).gather(-1, seqs[..., None])[..., 0]
        comps, rewards = [], []
        for r in range(self.n):
            row = seqs[r].tolist()
            end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            comps.append((row[:end], lps[r, :end].tolist()))
            rewards.append(float(self.reward(tok.decode(row[:end], skip_special_tokens=True), self.answers[p])))
        rw = np.asarray(rewards)
        adv = rw - rw.mean()
        self.log.append({"group_id": gid, "version": version, "rewards": rewards})
        self.samples_by_group[gid] = []
        samples = []
        for (c, lp), a, r in zip(comps, adv, rewards):
            ids = np.asarray(prompt + c, dtype=np.int64)
            mask = np.asarray([0] * len(prompt) + [1] * len(c), dtype=np.int64)
            old = np.asarray([0.0] * len(prompt) + lp, dtype=np.float32)
            self.samples_by_group[gid].append((ids.tolist(), mask.tolist(), old.tolist(), float(a)))
            samples.append(RolloutSample(prompt=[], completion=[], input_ids=ids, completion_mask=mask,
                                         old_log_probs=old, advantage=float(a), model_version=version, group_id=gid,
                                         metrics={"reward": r}))
        return samples
