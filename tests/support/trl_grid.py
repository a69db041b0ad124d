"""One cell of the TRL settings grid: train through ``HDRGRPOTrainer.train()`` and check every replay.

A cell is (GA, steps_per_generation, num_iterations, loss_type, mask_truncated_completions, generation
backend: transformers / vLLM stand-in colocate / server).  :func:`run_cell` trains long enough for two
generations and returns what :func:`check_cell` asserts:

* replay happened (replay rows went through TRL's loss);
* every replayed group was born (``birth_step`` = optimizer updates completed when it was generated, recorded
  independently at each generation) before the update it is trained in: ``global_step`` at the replay chunk
  > birth step, i.e. at least one weight update since its birth;
* the observable consequence: each replayed row with loss tokens has a ratio pi_theta / pi_gen != 1 somewhere
  (a same-update replay has Drift 0 and ratio exactly 1);
* every replay chunk is trained in the optimizer update whose selection (gate) admitted its groups
  (``replay_train_scope="update"``), however many updates the generation spans.
"""

from __future__ import annotations

import math

import torch

from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit, tiny_model

EOS_BIAS = {"sequence_bias": [[[1], 2.5]]}  # EOS likely enough that some completions finish, some are truncated
GEN_MODES = ("hf", "colocate", "server")


class GridTrainer(RecordingTrainer):
    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.records[-1]["selection"] = len(self.selections) - 1
        return loss


def cell_args(out_dir, *, ga, spg, mu, loss, trunc, gen):
    gs = spg * mu
    steps = max(2, math.ceil(gs / ga)) + 1  # at least two generations
    return make_args(
        out_dir, per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=ga,
        steps_per_generation=spg, num_iterations=mu, loss_type=loss, mask_truncated_completions=trunc,
        max_steps=steps, replay_k_rep=1, replay_tau=10.0, learning_rate=3e-2, generation_kwargs=dict(EOS_BIAS),
        epsilon_high=0.28 if loss in ("dapo", "cispo") else None, max_completion_length=6, logging_steps=1,
        use_vllm=gen != "hf", vllm_mode=gen if gen != "hf" else "colocate",
        vllm_importance_sampling_mode="token_truncate" if gen == "server" else "sequence_mask",
    )


def run_cell(model_dir, out_dir, *, ga, spg, mu, loss, trunc, gen, monkeypatch=None):
    if gen != "hf":
        import vllm_standin

        vllm_standin.install(monkeypatch, model_dir / "tiny-qwen2")
    model, tok = tiny_model(model_dir)
    tr = GridTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                     args=cell_args(out_dir, ga=ga, spg=spg, mu=mu, loss=loss, trunc=trunc, gen=gen))
    tr.train()
    return tr


def cell_outcome(tr) -> dict:
    """Counts of what the cell did (the grid table's columns)."""
    rep = [r for r in tr.records if bool(r["is_replay"].any())]
    births = {}
    for s in tr.selections:
        for gid, b in zip(s["groups"], s["births"]):
            births[gid] = b
    same_update = 0  # replay chunks trained before any update since the birth of one of their groups
    later_update = 0  # replay chunks trained in an update after the one whose gate admitted them
    ratio_one = 0  # replayed rows with loss tokens whose ratio is exactly 1 (no update seen)
    rows = 0
    for r in rep:
        sel = tr.selections[r["selection"]]
        if r["global_step"] <= max(sel["births"]):
            same_update += 1
        if r["global_step"] != sel["step"]:
            later_update += 1
        m = r["mask"].bool()
        for i in range(len(r["is_replay"])):
            if m[i].any():
                rows += 1
                if float((r["now"][i][m[i]] - r["old"][i][m[i]]).abs().max()) == 0.0:
                    ratio_one += 1
    bad_births = sum(b not in tr.generation_steps for b in births.values())
    steps = [h for h in tr.state.log_history if "loss" in h]
    return {
        "replay_chunks": len(rep), "replay_rows": rows, "same_update": same_update, "ratio_one": ratio_one,
        "later_update": later_update,
        "bad_births": bad_births, "ingress": sum(h.get("replay/ingress_admitted", 0) for h in steps),
        "empty_groups": sum(h.get("replay/ingress_empty", 0) for h in steps),
        "steps": tr.state.global_step, "generations": len(tr.generation_steps),
        "finite_loss": all(math.isfinite(h["loss"]) for h in steps),
        "sel_after_birth": all(s["step"] > b for s in tr.selections for b in s["births"]),
        "sel_at_generation": all(s["step"] in tr.generation_steps for s in tr.selections),
    }


def check_cell(tr) -> dict:
    o = cell_outcome(tr)
    assert o["replay_chunks"] > 0 and o["replay_rows"] > 0, o
    assert o["same_update"] == 0 and o["ratio_one"] == 0, o
    assert o["later_update"] == 0, o  # replay_train_scope="update": trained only in the update that gated it
    assert o["bad_births"] == 0 and o["sel_after_birth"] and o["sel_at_generation"], o
    assert o["finite_loss"], o
    assert all(torch.isfinite(r["now"]).all() for r in tr.records)
    return o


def main(argv=None) -> None:
    """Run every cell of the grid in this process and write the outcome table (JSON + markdown).

        python tests/support/trl_grid.py OUT_DIR
    """
    import json
    import sys
    import tempfile
    import time
    import traceback
    from pathlib import Path

    import pytest

    out = Path((argv or sys.argv[1:])[0])
    out.mkdir(parents=True, exist_ok=True)
    layouts = sorted({(ga, spg, mu) for ga in (1, 2, 4) for spg in (1, ga, 2 * ga) for mu in (1, 2)})
    cells = [(*lay, loss, trunc, gen) for lay in layouts for loss in ("dapo", "grpo", "cispo")
             for trunc in (False, True) for gen in GEN_MODES]
    root = Path(tempfile.mkdtemp(prefix="trl-grid-"))
    rows = []
    for i, (ga, spg, mu, loss, trunc, gen) in enumerate(cells):
        mp = pytest.MonkeyPatch()
        t0 = time.perf_counter()
        try:
            tr = run_cell(root, root / f"cell{i}", ga=ga, spg=spg, mu=mu, loss=loss, trunc=trunc, gen=gen,
                          monkeypatch=mp)
            o = cell_outcome(tr)
            try:
                check_cell(tr)
                o["result"] = "pass"
            except AssertionError as e:
                o["result"] = f"FAIL {e}"
        except Exception as e:  # a refusal or a crash: recorded, the grid goes on
            o = {"result": f"ERROR {type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        finally:
            mp.undo()
        o.update(ga=ga, spg=spg, mu=mu, loss=loss, trunc=trunc, gen=gen, seconds=round(time.perf_counter() - t0, 1))
        rows.append(o)
        print(f"[{i + 1}/{len(cells)}] {o['result'][:80]} ga={ga} spg={spg} mu={mu} {loss} trunc={trunc} {gen}",
              flush=True)
        (out / "grid.json").write_text(json.dumps(rows, indent=1))
    cols = ("ga", "spg", "mu", "loss", "trunc", "gen", "result", "generations", "ingress", "empty_groups",
            "replay_rows", "same_update", "ratio_one", "seconds")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    (out / "grid.md").write_text("\n".join(lines) + "\n")
    print(f"{sum(r['result'] == 'pass' for r in rows)}/{len(rows)} cells pass; wrote {out / 'grid.md'}")


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    main()
