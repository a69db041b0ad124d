"""Core benchmark: storage density and selection bookkeeping cost.

    python benchmarks/core.py            # full run (a few minutes)
    python benchmarks/core.py --quick    # fewer repeats (a few minutes: filling 65,536 groups dominates)

Writes benchmarks/results/core.json with
    bytes_per_response_token          buffer bytes / stored response tokens at full capacity (C = 512)
    padded_bytes_per_response_token   the same groups stored as padded dense per-group tensors the way
                                      TRL's removed replay trainer did (int64 prompt/completion ids and
                                      masks padded to the generation batch's longest row, fp32 log-probs)
    select_ms                         median ms of one selection (K_rep = 64, trivial scorer that returns
                                      the stored log-probs, so the first 64 scanned groups are accepted)
                                      per buffer capacity 512 / 8192 / 65536
    select_scaling_ratio              select_ms[65536] / select_ms[512]  (target <= 3)
    commit_ms                         median ms of commit() (refresh, counters, append 64 groups, evict)
    commit_after_load_ratio           at 65536 groups: the first commit right after a load (median over a few
                                      loads) / the steady commit of the same controller (target <= 1.5);
                                      beside it load_s, save_s and the checkpoint size
    get_copy_us_per_group             what handing out copies costs: ReplayBuffer.get of K_rep = 64 groups
                                      (copies, the only way groups leave the buffer) vs the same groups as
                                      views of the storage (what 0.1 returned), per group, at 65536 groups
    image_bytes_per_group             groups with images (n = 8): multimodal bytes the buffer stores per group
                                      (one copy: ReplayBuffer.mm_nbytes / groups) vs one copy per response
                                      (what TRL's batch and verl's per-row multi_modal_inputs hold), for a
                                      Qwen2-VL processor at a Geometry3K-sized image (fp32 and bf16) and the
                                      geo sandbox's 56x56 image; ``--only image_bytes`` updates just this entry
    save_memory                       ``--only save_memory [--workload select|long] [--label L]``: extra RAM of one
                                      ReplayController.save of 65,536 groups (peak RSS during the save minus RSS
                                      before it, peak reset through /proc/self/clear_refs) and its wall time, with
                                      the checkpoint size; stored under save_memory[workload][label].  ``select``:
                                      the selection workload above (completions median 48 tokens); ``long``: the
                                      storage workload's lengths (median 350, the issue's 2.45 GB).  "before" was
                                      measured by running this file against the src/ of the commit named there.
    load_memory                       ``--only load_memory [--workload select|long] [--label L]``: the same checkpoint
                                      loaded by a fresh ReplayController (the saved one dropped first): peak RSS
                                      during the load minus RSS before it, with and without the loaded buffer's own
                                      bytes (load_extra_ram_mb excludes them), load wall time, and a sha256 of the
                                      loaded state_dict (equal before / after: the same state is loaded).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hdreplay import GroupRecord, ReplayBuffer, ReplayConfig, ReplayController, select_replay  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: the clock timings use: wall (perf_counter) by default; --clock cpu (process_time) on a shared machine
clock = time.perf_counter


def make_groups(k: int, *, n: int, step: int, rng: np.random.Generator, len_median: float, len_max: int,
                prompt_range: tuple[int, int], start: int = 0) -> list[GroupRecord]:
    out = []
    for j in range(k):
        lengths = np.clip(rng.lognormal(np.log(len_median), 0.8, n).astype(np.int64), 1, len_max)
        T = int(lengths.sum())
        rewards = (rng.random(n) < 0.5).astype(np.float32)
        rewards[0], rewards[-1] = 1.0, 0.0
        out.append(GroupRecord(
            group_id=start + j,
            prompt_ids=torch.from_numpy(rng.integers(0, 150_000, int(rng.integers(*prompt_range)), dtype=np.int32)),
            completion_ids=torch.from_numpy(rng.integers(0, 150_000, T, dtype=np.int32)),
            response_lengths=torch.from_numpy(lengths),
            loss_mask=torch.ones(T, dtype=torch.bool),
            logprobs=torch.from_numpy(-rng.exponential(0.5, T).astype(np.float32)),
            advantages=torch.from_numpy(rewards - rewards.mean()),
            rewards=torch.from_numpy(rewards),
            birth_step=step,
        ))
    return out


def padded_bytes(batches: list[list[GroupRecord]]) -> int:
    """Dense per-group storage as TRL's GRPOWithReplayBuffer kept it: rows padded to the batch maximum."""
    total = 0
    for batch in batches:
        P = max(g.prompt_ids.numel() for g in batch)
        L = max(int(g.response_lengths.max()) for g in batch)
        for g in batch:
            n = g.num_responses
            total += n * P * 8 * 2  # prompt_ids + prompt_mask, int64
            total += n * L * 8 * 2  # completion_ids + completion_mask, int64
            total += n * L * 4      # old_per_token_logps, fp32
            total += n * 4          # advantages
    return total


def storage(capacity: int, per_step: int, rng) -> dict:
    cfg = ReplayConfig(capacity=capacity, k_rep=0)
    ctrl = ReplayController(cfg)
    kept: list[list[GroupRecord]] = []
    step = 0
    while ctrl.buffer.next_insertion_id < capacity + per_step:  # fill past capacity so eviction has run
        batch = make_groups(per_step, n=8, step=step, rng=rng, len_median=350, len_max=2048,
                            prompt_range=(64, 512), start=ctrl.buffer.next_insertion_id)
        ctrl.select(step=step)
        ctrl.stage(batch, step=step)
        ctrl.commit()
        kept.append(batch)
        step += 1
    live = set(ctrl.buffer.insertion_ids().tolist())
    live_batches = [[g for g in b if g.group_id in live] for b in kept]
    live_batches = [b for b in live_batches if b]
    tokens = ctrl.buffer.stored_response_tokens()
    return {
        "capacity": capacity,
        "groups": len(ctrl.buffer),
        "responses_per_group": 8,
        "stored_response_tokens": tokens,
        "buffer_bytes": ctrl.buffer.nbytes(),
        "bytes_per_response_token": ctrl.buffer.nbytes() / tokens,
        "padded_bytes_per_response_token": padded_bytes(live_batches) / tokens,
    }


def select_timing(capacity: int, *, k_rep: int, repeats: int, rng) -> tuple[dict, ReplayController]:
    """Selection and steady commit cost on a full buffer; returns the controller for the load measurements."""
    cfg = ReplayConfig(capacity=capacity, k_rep=k_rep, tau=1e-3)
    ctrl = ReplayController(cfg)
    buf, step, per = ctrl.buffer, 0, max(k_rep, capacity // 16)
    while len(buf) < capacity:  # large appends: the buffer cuts them into blocks of BLOCK_GROUPS groups
        batch = make_groups(per, n=8, step=step, rng=rng, len_median=48, len_max=256, prompt_range=(16, 64),
                            start=buf.next_insertion_id)
        buf.append(batch, ref_headroom=rng.random(len(batch)), step=step)
        step += 1
    ctrl.last_step = step - 1
    scorer = lambda groups: [g.logprobs for g in groups]  # noqa: E731  trivial: Drift 0
    times = []
    for _ in range(repeats):
        t0 = clock()
        sel = select_replay(buf, cfg, scorer, step=step, acceptance_rate=1.0)
        times.append((clock() - t0) * 1e3)
    assert len(sel.accepted) == k_rep
    # commit cost through the controller: refresh + counters + append k_rep groups + evict
    ctimes = []
    for _ in range(repeats):
        ctimes.append(timed_commit(ctrl, step, scorer, rng, k_rep=k_rep))
        step += 1
    return {"select_ms": statistics.median(times), "select_ms_p90": float(np.percentile(times, 90)),
            "commit_ms": statistics.median(ctimes), "scanned": len(sel.scanned), "steady_commits_ms": ctimes}, ctrl


def timed_commit(ctrl: ReplayController, step: int, scorer, rng, *, k_rep: int) -> float:
    fresh = make_groups(k_rep, n=8, step=step, rng=rng, len_median=48, len_max=256, prompt_range=(16, 64),
                        start=10**9 + step * k_rep)
    ctrl.select(step=step, scorer=scorer)
    ctrl.stage(fresh, step=step)
    t0 = clock()
    ctrl.commit()
    return (clock() - t0) * 1e3


def commit_after_load(ctrl: ReplayController, steady: list[float], *, loads: int, rng) -> dict:
    """The first commit right after a load of ``ctrl``'s checkpoint vs its ``steady`` commits (ms)."""
    import tempfile

    cfg, k_rep, step = ctrl.config, ctrl.config.k_rep, ctrl.last_step + 1
    scorer = lambda groups: [g.logprobs for g in groups]  # noqa: E731
    first, later, load_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()  # wall: a save waits for fsync
        ctrl.save(Path(tmp) / "ck")
        save_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in (Path(tmp) / "ck").rglob("*") if f.is_file())
        for _ in range(loads):
            fresh_ctrl = ReplayController(cfg)
            t0 = time.perf_counter()
            fresh_ctrl.load(Path(tmp) / "ck")
            load_s.append(time.perf_counter() - t0)
            first.append(timed_commit(fresh_ctrl, step, scorer, rng, k_rep=k_rep))
            later += [timed_commit(fresh_ctrl, step + i, scorer, rng, k_rep=k_rep) for i in range(1, 4)]
            del fresh_ctrl
    steady_ms = statistics.median(steady)
    return {"steady_commit_ms": steady_ms, "first_commit_after_load_ms": statistics.median(first),
            "first_commits_after_load_ms": first, "next_commits_after_load_ms": statistics.median(later),
            "commit_after_load_ratio": statistics.median(first) / steady_ms, "load_s": statistics.median(load_s),
            "save_s": save_s, "checkpoint_mb": size / 2**20, "groups": len(ctrl.buffer)}


def copy_cost(buf: ReplayBuffer, *, k_rep: int, repeats: int) -> dict:
    """ReplayBuffer.get (copies) vs views of the same groups, per group."""
    ids = buf.order_by_cached_headroom(k_rep).tolist()

    def views():
        return [(lambda b, j: b.view(j))(*buf._locate(i)) for i in ids]

    out = {}
    for name, fn in (("copy", lambda: buf.get(ids)), ("view", views)):
        ts = []
        for _ in range(repeats):
            t0 = clock()
            fn()
            ts.append((clock() - t0) * 1e6 / len(ids))
        out[name] = statistics.median(ts)
    return {"get_copy_us_per_group": out["copy"], "get_view_us_per_group": out["view"]}


def image_bytes(n: int = 8, groups: int = 64) -> dict:
    """Stored multimodal bytes per group vs n copies, measured on a buffer of ``groups`` image groups."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cases = {"qwen2vl_geo3k_336px_fp32": (336, torch.float32, None), "qwen2vl_geo3k_336px_bf16": (336, torch.bfloat16,
                                                                                                  None),
             "geo_sandbox_56px_fp32": (56, torch.float32, 56 * 56)}
    out = {}
    rng = np.random.default_rng(1)
    for name, (side, dtype, pixels) in cases.items():
        proc = Qwen2VLImageProcessorPil(**({"min_pixels": pixels, "max_pixels": pixels} if pixels else {}))
        img = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
        enc = proc(images=[img], return_tensors="pt")
        P = int(enc["image_grid_thw"].prod()) // 4 + 64  # image tokens (2x2 merge) + 64 text tokens
        sample = {"pixel_values": enc["pixel_values"].to(dtype), "image_grid_thw": enc["image_grid_thw"],
                  "mm_token_type_ids": torch.zeros(P, dtype=torch.int64)}
        gs = make_groups(groups, n=n, step=0, rng=rng, len_median=200, len_max=1024, prompt_range=(P, P + 1))
        gs = [GroupRecord.from_responses(group_id=g.group_id, prompt_ids=g.prompt_ids, completion_ids=g.responses(),
                                         logprobs=g.split(g.logprobs), advantages=g.advantages, rewards=g.rewards,
                                         birth_step=0, mm_inputs={k: v.clone() for k, v in sample.items()})
              for g in gs]
        buf = ReplayBuffer(groups)
        buf.append(gs, ref_headroom=[0.0] * groups, step=0)
        one = sum(v.numel() * v.element_size() for v in sample.values())
        stored = buf.mm_nbytes() / groups
        out[name] = {"stored_bytes_per_group": stored, "one_copy_per_response_bytes": n * one,
                     "ratio_per_response_over_stored": n * one / stored, "sample_bytes": one,
                     "pixel_values_shape": list(sample["pixel_values"].shape), "dtype": str(dtype),
                     "image_grid_thw": enc["image_grid_thw"][0].tolist(), "prompt_tokens": P, "n": n,
                     "buffer_bytes_per_group_total": buf.nbytes() / groups}
    return out


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _filled(workload: str, groups: int, batch: int) -> tuple[ReplayController, float]:
    """A controller holding ``groups`` groups of the ``workload``'s lengths, and the seconds it took to fill."""
    rng = np.random.default_rng(0)
    shape = (dict(len_median=48, len_max=256, prompt_range=(16, 64)) if workload == "select"
             else dict(len_median=350, len_max=2048, prompt_range=(64, 512)))
    ctrl = ReplayController(ReplayConfig(capacity=groups, k_rep=64, tau=1e-3))
    t0, step = time.perf_counter(), 0
    while len(ctrl.buffer) < groups:
        batch_groups = make_groups(batch, n=8, step=step, rng=rng, start=ctrl.buffer.next_insertion_id, **shape)
        ctrl.buffer.append(batch_groups, ref_headroom=rng.random(batch), step=step)
        del batch_groups
        step += 1
    ctrl.last_step = step - 1
    return ctrl, time.perf_counter() - t0


def _code() -> str | None:
    import subprocess
    return subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or None


def _reset_peak() -> int:
    """Reset the peak RSS (VmHWM) to the current RSS, which is returned."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status("VmRSS")


def save_memory(workload: str, groups: int = 65536, batch: int = 256) -> dict:
    """Extra RAM and wall time of one controller save at ``groups`` groups (Linux: peak RSS reset before the save)."""
    import gc
    import tempfile

    ctrl, build_s = _filled(workload, groups, batch)
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        ReplayController(ReplayConfig(capacity=4)).save(Path(tmp) / "warm")  # first-use costs are not the save's
        rss = _reset_peak()
        t0 = time.perf_counter()  # wall: a save waits for fsync
        ctrl.save(Path(tmp) / "ck")
        save_s = time.perf_counter() - t0
        peak = _proc_status("VmHWM")
        size = sum(f.stat().st_size for f in (Path(tmp) / "ck").rglob("*") if f.is_file())
    extra = peak - rss
    return {"groups": len(ctrl.buffer), "stored_response_tokens": ctrl.buffer.stored_response_tokens(),
            "buffer_mb": ctrl.buffer.nbytes() / 2**20, "checkpoint_mb": size / 2**20, "rss_before_save_mb": rss / 2**20,
            "save_extra_ram_mb": extra / 2**20, "save_extra_ram_fraction_of_checkpoint": extra / size,
            "save_s": save_s, "build_s": build_s, "code": _code(), "torch": torch.__version__}


def load_memory(workload: str, groups: int = 65536, batch: int = 256) -> dict:
    """Extra RAM and wall time of one ReplayController.load of a checkpoint of ``groups`` groups: the checkpoint is
    saved, the saved controller dropped, then the peak RSS reset and a fresh controller loads it.  ``load_extra_ram``
    is the peak RSS during the load minus the RSS before it minus the loaded buffer's own bytes (what the load needs
    beyond the state it builds); ``load_peak_minus_rss_before`` includes the loaded state."""
    import ctypes
    import gc
    import hashlib
    import tempfile

    ctrl, build_s = _filled(workload, groups, batch)
    cfg, tokens = ctrl.config, ctrl.buffer.stored_response_tokens()
    with tempfile.TemporaryDirectory() as tmp:
        ReplayController(cfg).save(Path(tmp) / "warm")
        ReplayController(cfg).load(Path(tmp) / "warm")  # first-use costs are not the load's
        ctrl.save(Path(tmp) / "ck")
        del ctrl
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)  # (glibc) return the dropped buffer's freed heap: the load must not reuse it
        size = sum(f.stat().st_size for f in (Path(tmp) / "ck").rglob("*") if f.is_file())
        fresh = ReplayController(cfg)
        rss = _reset_peak()
        t0 = time.perf_counter()
        fresh.load(Path(tmp) / "ck")
        load_s = time.perf_counter() - t0
        peak, after = _proc_status("VmHWM"), _proc_status("VmRSS")
    state = fresh.buffer.nbytes()
    tensors, meta = fresh.state_dict()  # (after the measurement) a digest of the loaded state, to compare before/after
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().reshape(-1).view(torch.uint8).numpy())
    return {"groups": len(fresh.buffer), "stored_response_tokens": tokens, "checkpoint_mb": size / 2**20,
            "loaded_buffer_mb": state / 2**20, "rss_before_load_mb": rss / 2**20,
            "load_peak_minus_rss_before_mb": (peak - rss) / 2**20, "rss_after_minus_before_mb": (after - rss) / 2**20,
            "load_extra_ram_mb": (peak - rss - state) / 2**20,
            "load_extra_ram_fraction_of_checkpoint": (peak - rss - state) / size, "load_s": load_s,
            "loaded_state_sha256": h.hexdigest(), "build_s": build_s, "code": _code(), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller storage run (< 30 s)")
    ap.add_argument("--out", default=str(RESULTS / "core.json"))
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time with this process's CPU time (process_time), robust on a machine shared with "
                         "other jobs; wall: perf_counter")
    ap.add_argument("--only", choices=("image_bytes", "save_memory", "load_memory"), default=None,
                    help="run one section and update its entry in an existing --out file")
    ap.add_argument("--workload", choices=("select", "long"), default="select",
                    help="save_memory / load_memory: group lengths")
    ap.add_argument("--label", default="after", help="save_memory / load_memory: the entry to write (before / after)")
    args = ap.parse_args()
    if args.only in ("save_memory", "load_memory"):
        torch.set_num_threads(1)
        out = Path(args.out)
        result = json.loads(out.read_text()) if out.exists() else {}
        got = (save_memory if args.only == "save_memory" else load_memory)(args.workload)
        entry = result.setdefault(args.only, {"target": "extra RAM <= max(10 % of the checkpoint, a few "
                                                        "hundred MB)"}).setdefault(args.workload, {})
        entry[args.label] = got
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(got, indent=2))
        return
    if args.only == "image_bytes":
        out = Path(args.out)
        result = json.loads(out.read_text()) if out.exists() else {}
        result["image_bytes_per_group"] = image_bytes()
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["image_bytes_per_group"], indent=2))
        return
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    t_start = time.perf_counter()
    st = storage(512, 64 if not args.quick else 128, rng)
    print(f"storage: {st['bytes_per_response_token']:.2f} B/token (padded dense: "
          f"{st['padded_bytes_per_response_token']:.2f})", flush=True)
    repeats = 15 if args.quick else 60
    sel = {}
    for cap in (512, 8192, 65536):
        sel[cap], ctrl = select_timing(cap, k_rep=64, repeats=repeats, rng=rng)
        print(f"capacity {cap:6d}: select {sel[cap]['select_ms']:.2f} ms, commit {sel[cap]['commit_ms']:.2f} ms",
              flush=True)
    cal = commit_after_load(ctrl, sel[65536].pop("steady_commits_ms"), loads=2 if args.quick else 5, rng=rng)
    print(f"commit after load at 65536 groups: {cal['first_commit_after_load_ms']:.2f} ms vs steady "
          f"{cal['steady_commit_ms']:.2f} ms (ratio {cal['commit_after_load_ratio']:.2f}); load {cal['load_s']:.2f} s",
          flush=True)
    cc = copy_cost(ctrl.buffer, k_rep=64, repeats=repeats)
    print(f"get: {cc['get_copy_us_per_group']:.1f} us/group as copies, {cc['get_view_us_per_group']:.1f} as views",
          flush=True)
    result = {
        "bytes_per_response_token": st["bytes_per_response_token"],
        "padded_bytes_per_response_token": st["padded_bytes_per_response_token"],
        "select_ms": {str(c): v["select_ms"] for c, v in sel.items()},
        "select_scaling_ratio": sel[65536]["select_ms"] / sel[512]["select_ms"],
        "commit_ms": {str(c): v["commit_ms"] for c, v in sel.items()},
        "select_ms_p90": {str(c): v["select_ms_p90"] for c, v in sel.items()},
        "commit_after_load_ratio": cal["commit_after_load_ratio"],
        "commit_after_load": cal,
        **cc,
        "image_bytes_per_group": image_bytes(),
        "targets": {"bytes_per_response_token": "<= 10", "select_scaling_ratio": "<= 3",
                    "commit_after_load_ratio": "<= 1.5"},
        "storage_workload": {k: v for k, v in st.items() if k not in ("bytes_per_response_token",
                                                                     "padded_bytes_per_response_token")}
        | {"completion_length": "lognormal median 350, sigma 0.8, cap 2048", "prompt_length": "U[64, 512)",
           "ingress_per_step": 128 if args.quick else 64},
        "select_workload": {"k_rep": 64, "n": 8, "completion_length": "lognormal median 48, cap 256",
                            "scorer": "returns stored log-probs (no model)", "repeats": repeats},
        "quick": args.quick,
        "clock": args.clock,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "wall_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("bytes_per_response_token", "padded_bytes_per_response_token",
                                             "select_ms", "select_scaling_ratio", "commit_after_load_ratio",
                                             "get_copy_us_per_group", "get_view_us_per_group")}, indent=2))
    print(f"wrote {out} in {result['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
