"""Own TRL runs in the analyses: HDRLogCallback on real GRPOTrainer / HDRGRPOTrainer runs (tiny local model), and
``hdreplay report`` on a plain TRL output directory (trainer_state.json log_history, TensorBoard events)."""

import json

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hdreplay.integrations.trl import HDRGRPOTrainer  # noqa: E402
from hdreplay.integrations.trl.callback import HDRLogCallback  # noqa: E402
from hdreplay_lab.cli import main  # noqa: E402
from trl_fixtures import make_args, prompts, reward_digit, tiny_model  # noqa: E402

PLAIN = dict(use_cpu=True, max_steps=4, per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
             learning_rate=2e-2, logging_steps=1, bf16=False, activation_checkpointing=False, seed=0,
             disable_tqdm=True)


def history(trainer, key):
    """{step: value} of TRL's own log history (the independent source the files are checked against)."""
    return {e["step"]: e[key] for e in trainer.state.log_history if key in e}


def report(run_dir, out, capsys):
    rc = main(["report", str(run_dir), "--out", str(out), "--no-progress", "--no-figures"])
    err = capsys.readouterr().err
    assert rc == 0, err
    (label, a), = json.loads((out / "report.json").read_text())["runs"].items()
    return a


def test_callback_on_hdrgrpo_trainer_writes_a_complete_run_directory(tmp_path, capsys):
    model, tok = tiny_model(tmp_path)
    args = make_args(tmp_path / "out", max_steps=4)
    cb = HDRLogCallback()
    tr = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, args=args, train_dataset=prompts(),
                        processing_class=tok, callbacks=[cb])
    tr.train()
    out = tmp_path / "out"
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3, 4] and len(cb.step_times) == 4
    assert {e["step"]: e["reward"] for e in log} == history(tr, "reward")
    assert {e["step"]: e["entropy"] for e in log} == history(tr, "entropy")
    logged = {e["step"]: e for e in tr.state.log_history if "loss" in e}
    assert all({k: v for k, v in e.items() if k.startswith("replay/")}
               == {k: v for k, v in logged[e["step"]].items() if k.startswith("replay/")} for e in log)
    steps = [json.loads(x) for x in (out / "replay" / "steps.jsonl").read_text().splitlines()]
    assert [e["replay/buffer_size"] for e in log] == [s["buffer_size"] for s in steps] == [0, 4, 8, 12]
    walls = [e["wall_s"] for e in log]
    assert walls == sorted(walls) and walls[0] > 0
    run = json.loads((out / "run.json").read_text())
    assert run["replay"] == args.to_replay_config().to_dict() and run["seed"] == 0

    a = report(out, tmp_path / "rep", capsys)
    s = a["training"]["score"]
    assert (s["available"] and s["step"] == [1, 2, 3, 4]
            and s["value"] == [history(tr, "reward")[k] for k in (1, 2, 3, 4)])
    assert a["training"]["entropy"]["n"] == 4 and a["entropy_timing"]["available"]
    assert a["acceptance"]["available"] and a["acceptance"]["n_steps"] == 4  # replay/steps.jsonl, same directory
    assert a["info"]["selector"] == "headroom_drift" and a["info"]["log_source"].endswith("train_log.jsonl")


def test_resumed_run_keeps_one_entry_per_step(tmp_path):
    model, tok = tiny_model(tmp_path)
    out = tmp_path / "out"

    def trainer(**over):
        return HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                              args=make_args(out, save_strategy="steps", save_steps=2, **over),
                              callbacks=[HDRLogCallback()])

    first = trainer(max_steps=4)
    first.train()
    before = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    second = trainer(max_steps=4)
    second.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    after = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in after] == [1, 2, 3, 4]
    assert after[:2] == before[:2]  # kept from the first run up to the checkpoint
    assert {e["step"]: e["reward"] for e in after[2:]} == {k: v for k, v in history(second, "reward").items() if k > 2}
    assert after[2]["wall_s"] >= after[1]["wall_s"]  # the wall clock continues across the resume


def test_report_reads_a_plain_trl_output_directory(tmp_path, capsys):
    """No callback, no hdreplay: GRPOTrainer's checkpoints (trainer_state.json) are the trainer log."""
    model, tok = tiny_model(tmp_path)
    out = tmp_path / "plain"
    tr = GRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                     args=GRPOConfig(output_dir=str(out), report_to="none", save_strategy="steps", save_steps=2,
                                     **PLAIN))
    tr.train()
    assert not (out / "train_log.jsonl").exists() and not (out / "trainer_state.json").exists()
    a = report(out, tmp_path / "rep", capsys)
    rewards = history(tr, "reward")
    assert a["training"]["score"]["value"] == [rewards[k] for k in sorted(rewards)]
    assert a["training"]["score"]["step"] == [1, 2, 3, 4] and a["training"]["entropy"]["n"] == 4
    assert a["info"]["log_source"] == str(out / "checkpoint-4" / "trainer_state.json")
    assert not a["acceptance"]["available"] and "without replay" in a["acceptance"]["reason"]


def test_report_reads_tensorboard_events(tmp_path, capsys):
    model, tok = tiny_model(tmp_path)
    out = tmp_path / "tb"
    tr = GRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                     args=GRPOConfig(output_dir=str(out), report_to=["tensorboard"], save_strategy="no", **PLAIN))
    tr.train()
    assert list(out.rglob("events.out.tfevents.*")) and not list(out.rglob("trainer_state.json"))
    a = report(out, tmp_path / "rep", capsys)
    rewards = history(tr, "reward")
    assert a["training"]["score"]["step"] == sorted(rewards)
    assert a["training"]["score"]["value"] == pytest.approx([rewards[k] for k in sorted(rewards)], rel=1e-6)
    assert a["info"]["log_source"].endswith("(TensorBoard events)")
