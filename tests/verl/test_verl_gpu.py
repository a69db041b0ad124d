"""GPU smoke test of the full recipe (FSDP workers + vLLM rollout) - skipped without a GPU.

NOT RUN in this repository's CI (CPU only).  On a GPU machine with vllm installed next to
verl 0.9.1, point it at a local model and a verl-format dataset and run:

    HDR_VERL_GPU_MODEL=/models/Qwen2.5-0.5B-Instruct \\
    HDR_VERL_GPU_DATA=~/data/gsm8k \\
    .venv-verl/bin/python -m pytest -q -m verl tests/verl/test_verl_gpu.py

``HDR_VERL_GPU_DATA`` holds ``train.parquet`` / ``test.parquet`` as written by verl's
``examples/data_preprocess/gsm8k.py``.  For each recipe (v1 default, v0) the test runs
``python -m hdreplay.integrations.verl.main`` for 3 steps on one GPU with a checkpoint every step,
then resumes for a 4th step.
"""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
MODEL, DATA = os.environ.get("HDR_VERL_GPU_MODEL"), os.environ.get("HDR_VERL_GPU_DATA")
pytestmark = [
    pytest.mark.verl,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (verl's FSDP workers and vLLM)"),
    pytest.mark.skipif(not (MODEL and DATA), reason="set HDR_VERL_GPU_MODEL and HDR_VERL_GPU_DATA"),
]
pytest.importorskip("verl", minversion="0.9.1")

from hdreplay import ReplayController  # noqa: E402


def _run(ckpt, steps, use_v1):
    data = os.path.expanduser(DATA or "")
    cmd = [
        sys.executable, "-m", "hdreplay.integrations.verl.main",
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet",
        "data.train_batch_size=8", "data.max_prompt_length=512", "data.max_response_length=256",
        f"actor_rollout_ref.model.path={MODEL}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.logger=[console]",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=1",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={ckpt}",
        "hdr.k_rep=4", "hdr.tau=1e-2", "hdr.capacity=64", f"trainer.use_v1={str(use_v1).lower()}",
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=3600)


@pytest.mark.parametrize("use_v1", [True, False], ids=["v1", "v0"])
def test_recipe_trains_checkpoints_and_resumes_on_gpu(tmp_path, use_v1):
    ckpt = tmp_path / "ckpt"
    first = _run(ckpt, 3, use_v1)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert ReplayController.verify(ckpt / "global_step_3" / "hdreplay") is not None
    assert "replay/buffer_size" in first.stdout
    second = _run(ckpt, 4, use_v1)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
