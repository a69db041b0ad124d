"""The two-node layout matrix: train, checkpoint and resume on two torch.distributed nodes of this machine.

    python benchmarks/two_nodes.py                      # every row (about 30 minutes on 2 cores)
    python benchmarks/two_nodes.py --rows sync:local_each:torchrun async:shared:torchrun

Rows are trainer x layout x launcher.  Trainers: ``sync`` (HDRGRPOTrainer, 4 steps, checkpoints at 2 and 4, resumed
from 2), ``async`` (HDRAsyncGRPOTrainer with the lock-step worker, 7 updates, checkpoint at 5, resumed from 5),
``plain`` (TRL's GRPOTrainer: the sync script with ``replay_selector='none'``, what transformers does alone).
Layouts: ``shared`` (one output_dir both nodes write), ``local_each`` (node-local output_dirs,
``save_on_each_node=True``), ``local_main`` (node-local output_dirs, ``save_on_each_node=False``).  Launchers:
``torchrun --nnodes 2 --node_rank k --nproc_per_node 1`` and ``accelerate launch`` with a two-machine config
(``distributed_type: MULTI_GPU``, which starts torchrun's agent; ``--cpu`` would start an unconnected process per
machine).  All on 127.0.0.1, gloo, the tiny test models.

Each row: the uninterrupted run; its disks as of the resumed checkpoint (the later checkpoint and the run's records
removed: what an interruption after it leaves); ``train(resume_from_checkpoint=True)`` on both nodes.  Where a
resume is refused and the message names a fix that copies files (transformers writes the model's weights from
global rank 0 only), the fix is applied once and the resume retried.  A resumed run is compared with the
uninterrupted one on every rank: selections, losses, replay buffer digest, final weights.  Writes
docs/results/multinode/two_nodes.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "tests" / "support"
sys.path[:0] = [str(ROOT / "src"), str(SUPPORT)]

from two_nodes import launch  # noqa: E402

TRAINERS = ("sync", "async", "plain")
LAYOUTS = ("shared", "local_each", "local_main")
LAUNCHERS = ("torchrun", "accelerate")
DEFAULT_ROWS = [f"{t}:{lay}:torchrun" for t in TRAINERS for lay in LAYOUTS] + \
    [f"sync:{lay}:accelerate" for lay in LAYOUTS]
WEIGHTS = ("config.json", "model.safetensors")


def accelerate(root: Path):
    """The command line of a node through ``accelerate launch --config_file node<k>.yaml`` (one config per machine)."""
    def command(script, node_args, *, rank, nodes, port):
        cfg = root / f"accelerate_node{rank}.yaml"
        cfg.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: {nodes}\n"
                       f"machine_rank: {rank}\nmain_process_ip: 127.0.0.1\nmain_process_port: {port}\n"
                       f"num_processes: {nodes}\nmixed_precision: 'no'\nrdzv_backend: static\nsame_network: true\n")
        return [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file", str(cfg), str(script),
                *map(str, node_args)]
    return command


def run_row(row: str, work: Path, models: dict, timeout: float) -> dict:
    trainer, layout, launcher = row.split(":")
    rdir = work / row.replace(":", "_")
    shared = layout == "shared"
    dirs = lambda name: [rdir / name] * 2 if shared else [rdir / name / "node0", rdir / name / "node1"]  # noqa: E731
    over = {"save_on_each_node": layout == "local_each"}
    if trainer == "plain":
        over["replay_selector"] = "none"
    env = [{"HDR_TEST_ARGS": json.dumps(over)}] * 2
    if trainer == "async":
        script, model, tag = SUPPORT / "async_grpo_run.py", models["async"], ".resumed"
        common, cut, later = [7, "--lockstep", "--save-steps", 5], 5, 7  # (the Trainer also saves at the end)
        node_args = lambda ds, resume: [[d, model, *common, *(["--resume", "--tag", tag] if resume else [])]  # noqa
                                        for d in ds]
    else:
        script, model, tag = SUPPORT / "dist_trl_run.py", models["sync"], ""
        cut, later = 2, 4
        node_args = lambda ds, resume: [[d, model, 4, "true" if resume else "-"] for d in ds]  # noqa: E731

    def go(ds, resume):
        t0 = time.monotonic()
        nodes = launch(script, node_args(ds, resume), env=env, timeout=timeout,
                       **({} if launcher == "torchrun" else {"command": accelerate(rdir)}))
        errors = []
        for k, (n, d) in enumerate(zip(nodes, ds)):
            f = Path(d) / f"rank{k}{tag if resume else ''}_error.txt"
            errors.append(f.read_text() if f.exists() else (None if n.returncode == 0 else n.output[-600:]))
        return {"rc": [n.returncode for n in nodes], "seconds": round(time.monotonic() - t0, 1), "errors": errors}

    out = {"row": row, "trainer": trainer, "layout": layout, "launcher": launcher}
    rdir.mkdir(parents=True)
    whole = dirs("whole")
    out["train"] = go(whole, False)
    if any(out["train"]["rc"]):
        return out
    resumed = dirs("resumed")
    for src, dst in dict(zip(whole, resumed)).items():  # the disks as an interruption after the checkpoint leaves
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("rank*.json", f"checkpoint-{later}"))
    out["resume"] = go(resumed, True)
    if any(out["resume"]["rc"]) and not shared and any(e and "copy them from rank 0's checkpoint" in e
                                                       for e in out["resume"]["errors"]):
        for name in WEIGHTS:  # the fix the message names, once
            shutil.copy(resumed[0] / f"checkpoint-{cut}" / name, resumed[1] / f"checkpoint-{cut}" / name)
        for k, d in enumerate(resumed):
            (d / f"rank{k}{tag}_error.txt").unlink(missing_ok=True)
        out["fix"] = "copied " + ", ".join(WEIGHTS) + " from node 0's checkpoint to node 1's"
        out["resume_after_fix"] = go(resumed, True)
    final = out.get("resume_after_fix", out["resume"])
    if not any(final["rc"]):
        out["equal"] = compare(trainer, whole, resumed, cut, tag)
    return out


def compare(trainer, whole, resumed, cut, tag) -> dict:
    eq = {}
    for k in (0, 1):
        a = json.loads((Path(whole[k]) / f"rank{k}.json").read_text())
        b = json.loads((Path(resumed[k]) / f"rank{k}{tag}.json").read_text())
        if trainer == "async":
            loss = lambda r: [(h["step"], h["loss"]) for h in r["log_history"] if "loss" in h]  # noqa: E731
            eq[k] = {"selections": b["steps"] == a["steps"][cut:], "losses": loss(a) == loss(b),
                     "buffer": a["buffer_digest"] == b["buffer_digest"], "weights": a["weights_digest"] == b[
                         "weights_digest"]}
        else:
            eq[k] = {"selections": b["selections"] == a["selections"][cut:], "losses": a["losses"] == b["losses"],
                     "buffer": a["buffer_hashes"][-1:] == b["buffer_hashes"][-1:],
                     "weights": a["weights_digest"] == b["weights_digest"]}
    return eq


def verdict(r: dict) -> str:
    if any(r["train"]["rc"]):
        return "training failed"
    final = r.get("resume_after_fix", r["resume"])
    if not any(final["rc"]):
        same = all(all(v.values()) for v in r["equal"].values())
        return ("resumed = uninterrupted" if same else "resumed, DIFFERENT from uninterrupted") + (
            " (after the named fix)" if "fix" in r else "")
    named = all(e and ("hdreplay" in e or "CheckpointError" in e) for e in final["errors"])
    return "refused by name on every rank" if named else "failed without a named refusal on every rank"


def first_line(e):
    return (e or "").strip().splitlines()[0][:220] if e else ""


def markdown(rows: list[dict]) -> str:
    lines = ["| trainer | layout | launcher | outcome | train s | resume s | what each rank said at the first resume |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r.get("resume", {})
        said = " / ".join(f"rank {k}: {first_line(e) or 'ok'}" for k, e in enumerate(res.get("errors", [])))
        lines.append(f"| {r['trainer']} | {r['layout']} | {r['launcher']} | {verdict(r)} | {r['train']['seconds']} | "
                     f"{res.get('seconds', '')} | {said.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="*", default=DEFAULT_ROWS, help="trainer:layout:launcher")
    ap.add_argument("--timeout", type=float, default=500, help="seconds per launch (both nodes killed after it)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "multinode"))
    ap.add_argument("--append", action="store_true", help="keep the other rows of an existing two_nodes.json")
    a = ap.parse_args()
    for row in a.rows:
        parts = row.split(":")
        if len(parts) != 3 or parts[0] not in TRAINERS or parts[1] not in LAYOUTS or parts[2] not in LAUNCHERS:
            ap.error(f"--rows: {row!r} is not trainer:layout:launcher with trainer in {TRAINERS}, layout in "
                     f"{LAYOUTS}, launcher in {LAUNCHERS}")
    from hdreplay_lab.sandbox.model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="two_nodes_"))
    models = {"sync": build_tiny_model(work / "model"), "async": build_tiny_model(work / "amodel", hidden=32, layers=2)}
    rows, t0 = [], time.monotonic()
    for i, row in enumerate(a.rows, 1):
        rows.append(run_row(row, work, models, a.timeout))
        print(f"[{i}/{len(a.rows)}] {row}: {verdict(rows[-1])} ({time.monotonic() - t0:.0f} s)", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    commands = ["python benchmarks/two_nodes.py " + " ".join(sys.argv[1:])]
    if a.append and (out / "two_nodes.json").exists():
        old = json.loads((out / "two_nodes.json").read_text())
        mine = {r["row"] for r in rows}
        rows += [r for r in old["rows"] if r["row"] not in mine]
        commands = old["commands"] + commands
        order = {r: i for i, r in enumerate(DEFAULT_ROWS)}
        rows.sort(key=lambda r: order.get(r["row"], len(order)))
    (out / "two_nodes.json").write_text(json.dumps({"commands": commands, "rows": rows}, indent=1))
    (out / "two_nodes.md").write_text("# Two nodes on one machine: train, checkpoint, resume\n\n"
                                      "`python benchmarks/two_nodes.py` (torchrun / accelerate, gloo, 127.0.0.1, "
                                      "tiny models; see its docstring). Resumed rows are compared with the "
                                      "uninterrupted run on both ranks: selections, losses, buffer digest, weights. "
                                      "Seconds are wall-clock on a 2-core machine shared with other work (not a "
                                      "benchmark of speed).\n\nMade by: " + "; ".join(f"`{c}`" for c in commands)
                                      + "\n\n" + markdown(rows))
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out / 'two_nodes.json'} and {out / 'two_nodes.md'}")


if __name__ == "__main__":
    main()
