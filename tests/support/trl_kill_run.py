"""Train HDRGRPOTrainer and SIGKILL this process at a chosen moment (run by test_trl_checkpoint_kill.py).

    python trl_kill_run.py OUT_DIR MODEL_DIR MAX_STEPS KILL_AT KILL_STEP RESUME

KILL_AT (at optimizer step KILL_STEP; "none" = no kill):
    model          inside the Trainer's checkpoint, after the model/optimizer files, before trainer_state.json
    before_replay  after the Trainer's files, before the replay state is written
    replay_rename  while the replay state is written: at the rename of its temporary directory into place
    rotate         after the replay state, before the Trainer's rotation deletes the previous checkpoint
    train          in the middle of a micro-step's loss computation
RESUME = 1 resumes with ``resume_from_checkpoint=True``.  Writes OUT_DIR/result[_resumed].json.
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))

from transformers import Trainer  # noqa: E402

import hdreplay.integrations.trl.checkpoints as checkpoints_mod  # noqa: E402
from hdreplay import ReplayController  # noqa: E402
from hdreplay_lab.sandbox.model import load_model  # noqa: E402
from trl_fixtures import RecordingTrainer, buffer_hash, make_args, prompts, reward_digit  # noqa: E402


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(kill_at: str, kill_step: int, trainer) -> None:
    at = lambda: trainer.state.global_step == kill_step  # noqa: E731
    if kill_at == "model":
        orig = Trainer._save_rng_state

        def _save_rng_state(self, output_dir):
            if at():
                die()
            return orig(self, output_dir)
        Trainer._save_rng_state = _save_rng_state
    elif kill_at in ("before_replay", "replay_rename"):
        orig_save = ReplayController.save

        def save(self, directory, **kw):
            if not at():
                return orig_save(self, directory, **kw)
            if kill_at == "before_replay":
                die()
            from hdreplay.checkpoint.files import FS

            real_replace = FS.replace

            def replace(src, dst, *a, **k):  # the replay state's commit point: its manifest swapped in
                if str(dst).endswith(os.path.join("hdreplay", "manifest.json")):
                    die()
                return real_replace(src, dst, *a, **k)
            FS.replace = staticmethod(replace)
            return orig_save(self, directory, **kw)
        ReplayController.save = save
    elif kill_at == "rotate":
        orig_rotate = checkpoints_mod.rotate_checkpoints

        def rotate(**kw):
            if at():
                die()
            return orig_rotate(**kw)
        checkpoints_mod.rotate_checkpoints = rotate
    elif kill_at == "train":
        orig_loss = RecordingTrainer._compute_loss

        def _compute_loss(self, model, inputs):
            if at() and self._step % 2 == 1:
                die()
            return orig_loss(self, model, inputs)
        RecordingTrainer._compute_loss = _compute_loss


def main() -> None:
    out, model_dir, max_steps, kill_at, kill_step, resume = sys.argv[1:7]
    model, tok = load_model(model_dir)
    args = make_args(out, max_steps=int(max_steps), save_strategy="steps", save_steps=1, save_total_limit=1,
                     replay_tau=0.05, replay_k_rep=2)
    tr = RecordingTrainer(model=model, reward_funcs=reward_digit, args=args, train_dataset=prompts(),
                          processing_class=tok)
    if kill_at != "none":
        install(kill_at, int(kill_step), tr)
    resumed_from = None
    if resume == "1":
        orig = tr._load_optimizer_and_scheduler

        def load(checkpoint):
            nonlocal resumed_from
            resumed_from = os.path.basename(checkpoint)
            return orig(checkpoint)
        tr._load_optimizer_and_scheduler = load
    tr.train(resume_from_checkpoint=True if resume == "1" else None)
    rec = {"resumed_from": resumed_from,
           "selections": [{"step": s["step"], "groups": s["groups"]} for s in tr.selections],
           "buffer_hashes": tr.buffer_hashes, "final_hash": buffer_hash(tr.replay), "steps": tr.state.global_step}
    with open(os.path.join(out, "result_resumed.json" if resume == "1" else "result.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
