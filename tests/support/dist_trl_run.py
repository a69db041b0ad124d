"""Run under ``torchrun --nproc_per_node 2`` by test_trl_distributed.py: trains through HDRGRPOTrainer
and writes what each rank saw to ``<out>/rank<r>.json``.

    torchrun --nproc_per_node 2 tests/dist_trl_run.py OUT_DIR MODEL_DIR [max_steps] [resume_checkpoint]

``resume_checkpoint``: a path, ``true`` (the newest complete checkpoint) or ``-`` (none).  Environment:
``HDR_TEST_ARGS`` (JSON) overrides training arguments on this process (a node's own settings);
``HDR_TEST_VERSION`` pretends this process runs another hdreplay version.

A MODEL_DIR with a saved processor (hdreplay_lab.sandbox.vlm.build_tiny_vlm) trains the VLM on the geo task's images.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hdreplay_lab.sandbox.model import load_model  # noqa: E402
from hdreplay_lab.sandbox.vlm import is_vlm_dir, load_vlm  # noqa: E402
from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit, weights_digest  # noqa: E402


class CountingTrainer(RecordingTrainer):
    """Counts the model's forward calls made while re-scoring (backbone calls: a prompt-shared batch makes two)."""

    forward_calls = 0
    shared_calls = 0
    _scoring = False

    def _replay_scorer(self, groups):
        CountingTrainer._scoring = True
        try:
            return super()._replay_scorer(groups)
        finally:
            CountingTrainer._scoring = False

    def _shared_logps(self, *a, **k):
        CountingTrainer.shared_calls += 1
        return super()._shared_logps(*a, **k)


def _count_forward(module, args, kwargs):
    if CountingTrainer._scoring:
        CountingTrainer.forward_calls += 1


def reward_digit_chat(completions, **kw):
    return reward_digit([c[0]["content"] if isinstance(c, list) else c for c in completions])


def diverge(tr) -> None:
    """The injected fault: this rank drops the last group of its first non-empty replay selection (as a
    nondeterministic path would), so its rows differ from the other rank's."""
    from dataclasses import replace

    select, done = tr.replay.select, []

    def diverging(**kw):
        sel = select(**kw)
        if sel.groups and not done:
            done.append(kw["step"])
            return replace(sel, groups=sel.groups[:-1], accepted=sel.accepted[:-1])
        return sel
    tr.replay.select = diverging


def main() -> None:
    out, model_dir = sys.argv[1], sys.argv[2]
    max_steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    resume = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    resume = True if resume == "true" else resume
    data, reward, over = prompts(), reward_digit, {}
    if os.environ.get("HDR_TEST_SHARE") == "1":  # the prompt-shared re-scoring path, whatever the token counts
        import hdreplay.integrations.trl.rescore as rescore

        rescore.SHARE_BELOW_TOKEN_RATIO = 10.0
    if is_vlm_dir(model_dir):
        from hdreplay_lab.sandbox.geo import GeoTask

        model, tok = load_vlm(model_dir)
        with torch.no_grad():  # larger weights, as in test_trl_multimodal: images change the log-probs visibly
            for p in model.parameters():
                p.mul_(3.0)
        task = GeoTask()
        data, reward = task.dataset(task.train_problems(64, seed=0)), reward_digit_chat
        over = dict(replay_tau=10.0, max_completion_length=4)
    else:
        model, tok = load_model(model_dir)
    over.update(json.loads(os.environ.get("HDR_TEST_ARGS", "{}")))  # per node (test_trl_two_nodes.py)
    if os.environ.get("HDR_TEST_VERSION"):  # a node running another hdreplay version
        import hdreplay

        hdreplay.__version__ = os.environ["HDR_TEST_VERSION"]
    # 2 rows per rank and micro-step, groups of 4: every group spans both ranks
    args = make_args(out, **{**dict(max_steps=max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                    num_generations=4, replay_k_rep=2, replay_tau=0.1, learning_rate=5e-3,
                                    save_strategy="steps", save_steps=2, replay_scan_chunk=3), **over})
    tr = CountingTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                         processing_class=tok)
    if os.environ.get("HDR_TEST_SHARE") == "1":
        tr._share_prompt = True
    tr.accelerator.unwrap_model(tr.model).base_model.register_forward_pre_hook(_count_forward, with_kwargs=True)
    r = tr.accelerator.process_index
    if os.environ.get("HDR_DIVERGE_RANK1") and r == 1:
        diverge(tr)
    try:
        tr.train(resume_from_checkpoint=resume)
    except Exception as e:  # the rank-agreement check (or anything else): each rank says what it saw
        os.makedirs(out, exist_ok=True)  # (a node that failed before writing anything)
        with open(os.path.join(out, f"rank{r}_error.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    rec = {
        "world": tr.accelerator.num_processes,
        "buffer_hashes": tr.buffer_hashes,
        "selections": [{"step": s["step"], "groups": s["groups"], "births": s["births"]} for s in tr.selections],
        "micro": [{"global_step": x["global_step"], "micro": x["micro"], "is_replay": x["is_replay"].tolist(),
                   "mask_sum": int(x["mask"].sum()), "nib": x["nib"],
                   "replay_ratio_dev": float((torch.exp(x["now"] - x["old"])[x["is_replay"]][
                       x["mask"][x["is_replay"]].bool()] - 1).abs().max()) if x["is_replay"].any() else None,
                   "images": x["images"].get("num_images"),
                   "replay_old_vs_now": float((x["now"] - x["old"]).abs().max()) if x["old"] is not None else None}
                  for x in tr.records],
        "forward_calls": CountingTrainer.forward_calls,
        "shared_calls": CountingTrainer.shared_calls,
        "rescored_rows": [h.get("replay/rescored_rows") for h in tr.state.log_history if "loss" in h],
        "early_rejected": [h.get("replay/early_rejected") for h in tr.state.log_history if "loss" in h],
        "losses": [h["loss"] for h in tr.state.log_history if "loss" in h],
        "accepted": [h.get("replay/accepted") for h in tr.state.log_history if "loss" in h],
        "weights_digest": weights_digest(tr.accelerator.unwrap_model(tr.model)),
    }
    with open(os.path.join(out, f"rank{r}.json"), "w") as f:
        json.dump(rec, f)
    if dist.is_initialized():
        dist.barrier()
    # Leave without running destructors: torch 2.13's gloo ProcessGroup destructor (reached through DDP's
    # Reducer at interpreter teardown) joins its worker thread while holding the GIL, and that thread may
    # need the GIL to free a finished all-gather's tensors: an occasional deadlock (seen with py-spy).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
