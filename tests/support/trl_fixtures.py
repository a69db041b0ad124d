"""Shared pieces of the TRL integration tests: a tiny local model, a dataset, a recording trainer."""

from __future__ import annotations

import hashlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hdreplay.integrations.trl import HDRGRPOConfig, HDRGRPOTrainer  # noqa: E402
from hdreplay.integrations.trl.mm import BATCH_KEYS as MM_BATCH_KEYS  # noqa: E402
from hdreplay_lab.sandbox.model import build_tiny_model, load_model  # noqa: E402


def prompts(k: int = 64) -> Dataset:
    """Prompts of different lengths ("3+4=" ... "123+45678="), so batches mix left paddings."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(k):
        a = int(torch.randint(0, 10 ** (1 + i % 3), (1,), generator=g))
        b = int(torch.randint(0, 10 ** (1 + (i // 3) % 5), (1,), generator=g))
        out.append(f"{a}+{b}=")
    return Dataset.from_dict({"prompt": out})


def reward_digit(completions, **kw):
    """1 if a digit appears in the first 3 characters: mixed outcomes under a random model."""
    return [float(any(ch.isdigit() for ch in c[:3])) for c in completions]


def make_args(out_dir, **over) -> HDRGRPOConfig:
    kw = dict(output_dir=str(out_dir), use_cpu=True, report_to="none", max_steps=4, per_device_train_batch_size=8,
              num_generations=4, max_completion_length=6, learning_rate=2e-2, logging_steps=1, save_strategy="no",
              bf16=False, activation_checkpointing=False, seed=0, gradient_accumulation_steps=2,
              ddp_find_unused_parameters=False, replay_tau=10.0, replay_k_rep=3, disable_tqdm=True)
    kw.update(over)
    return HDRGRPOConfig(**kw)


def plain_config(args: HDRGRPOConfig) -> GRPOConfig:
    """The same run for trl's own GRPOTrainer: every non-replay field of ``args``, same steps per generation."""
    plain = GRPOConfig(**{k: v for k, v in args.to_dict().items() if not k.startswith("replay_")
                          and k in GRPOConfig.__dataclass_fields__ and k not in ("generation_batch_size",)})
    plain.steps_per_generation = args.steps_per_generation
    return plain


def grpo_and_replay_none(load, data, args: HDRGRPOConfig, none_args: HDRGRPOConfig, reward):
    """trl's GRPOTrainer on ``args``'s plain config and HDRGRPOTrainer on ``none_args`` (replay_selector="none"),
    each on a fresh ``load()`` -> (model, processing_class) and ``data()``, both trained; returns (plain, hdr)."""
    model, proc = load()
    g = GRPOTrainer(model=model, reward_funcs=reward, args=plain_config(args), train_dataset=data(),
                    processing_class=proc)
    g.train()
    model, proc = load()
    h = HDRGRPOTrainer(model=model, reward_funcs=reward, args=none_args, train_dataset=data(), processing_class=proc)
    h.train()
    return g, h


def loss_log(trainer, keys=("loss", "grad_norm", "reward", "entropy")) -> list[dict]:
    """What the trainer logged per optimizer step, for loss-for-loss comparisons."""
    return [{k: x[k] for k in keys} for x in trainer.state.log_history if "loss" in x]


class RecordingTrainer(HDRGRPOTrainer):
    """Records what every loss call trains on (one fresh part or one replay chunk), through the real loss path."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.records: list[dict] = []
        self.selections: list[dict] = []
        self.buffer_hashes: list[str] = []
        self.generation_steps: list[int] = []

    def _generate_and_score_completions(self, inputs):
        if self.model.training:
            self.generation_steps.append(self.state.global_step)
        return super()._generate_and_score_completions(inputs)

    def _select(self, step):
        super()._select(step)
        sel = step.selection
        self.selections.append({"step": sel.step, "groups": [g.group_id for g in sel.groups],
                                "births": [g.birth_step for g in sel.groups],
                                "stored_logps": [g.logprobs.clone() for g in sel.groups],
                                "stored_mask": [g.loss_mask.clone() for g in sel.groups],
                                "stored_ref": [g.extras.get("ref_logprobs") for g in sel.groups],
                                "stored_extras": [{k: v.clone() for k, v in g.extras.items()} for g in sel.groups],
                                "lengths": [g.response_lengths.tolist() for g in sel.groups]})

    def _commit_step(self):
        had = self._replay_step is not None
        super()._commit_step()
        if had:
            self.buffer_hashes.append(buffer_hash(self.replay))

    def _compute_loss(self, model, inputs):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        C = inputs["completion_ids"].shape[1]
        images = {k: inputs[k] for k in MM_BATCH_KEYS if inputs.get(k) is not None}  # a VLM's chunks carry them
        with torch.no_grad():
            now, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(self, model, ids, attn, C, **images)
        mask = inputs["completion_mask"] * inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))
        rows = inputs["hdr_row"].cpu() if "hdr_row" in inputs else torch.zeros(ids.shape[0], dtype=torch.long)
        get = lambda k: None if inputs.get(k) is None else inputs[k].detach().cpu().clone()  # noqa: E731
        self.records.append({
            "global_step": self.state.global_step, "micro": self._step, "is_replay": rows < 0, "hdr_row": rows,
            "old": get("old_per_token_logps"), "ref": get("ref_per_token_logps"),
            "is_ratio": get("importance_sampling_ratio"), "sampling": get("sampling_per_token_logps"),
            "now": now.cpu(), "mask": mask.cpu(), "nib": int(inputs["num_items_in_batch"]),
            "completion_ids": inputs["completion_ids"].cpu(), "advantages": inputs["advantages"].cpu(),
            "images": {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else list(v))
                       for k, v in images.items()},
        })
        loss = super()._compute_loss(model, inputs)
        self.records[-1]["loss"] = float(loss.detach())
        self.records[-1]["old_after"] = get("old_per_token_logps")
        return loss


def weights_digest(model) -> str:
    """sha256 of a model's state dict (names and bytes)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def buffer_hash(ctrl) -> str:
    tensors, meta = ctrl.buffer.state_dict()
    h = hashlib.sha256(repr(sorted((k, v) for k, v in meta.items() if k != "group_ids")).encode())
    h.update(repr(meta["group_ids"]).encode())
    for k in sorted(tensors):
        h.update(k.encode())
        t = tensors[k]
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    return h.hexdigest()


def tiny_model(tmp_dir, arch="qwen2"):
    path = os.path.join(str(tmp_dir), f"tiny-{arch}")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model(path, arch=arch)
    return load_model(path)


TOOL_TEXT = "[ok]"


def tool_rollout(prompts_batch, trainer):
    """A two-turn rollout through TRL's ``rollout_func`` hook: the model writes, an environment inserts
    ``[ok]`` (env_mask 0, like retrieved text), the model writes again."""
    tok = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    tool = tok(TOOL_TEXT, add_special_tokens=False)["input_ids"]
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    for p in prompts_batch:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            first = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=True, min_new_tokens=3,
                                   pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
            ctx = ids + first + tool
            second = model.generate(torch.tensor([ctx]), max_new_tokens=2, do_sample=True, min_new_tokens=2,
                                    pad_token_id=tok.pad_token_id)[0, len(ctx):].tolist()
        comp = first + tool + second
        out["prompt_ids"].append(ids)
        out["completion_ids"].append(comp)
        out["logprobs"].append([0.0] * len(comp))
        out["env_mask"].append([1] * len(first) + [0] * len(tool) + [1] * len(second))
    return out


def decoded_rows(tok, rec) -> list[tuple[str, str]]:
    """(prompt, completion) text of every row a recorded loss call trained on (masks applied)."""
    out = []
    for i in range(rec["prompt_ids"].shape[0]):
        p = rec["prompt_ids"][i][rec["prompt_mask"][i].bool()]
        c = rec["completion_ids"][i][rec["completion_mask"][i].bool()]
        out.append((tok.decode(p, skip_special_tokens=True), tok.decode(c, skip_special_tokens=True)))
    return out
