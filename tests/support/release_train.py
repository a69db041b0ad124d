"""A short TRL training through ``HDRGRPOTrainer`` as a user of the released package runs it: the README's TRL example
(``report_to="tensorboard"``, ``HDRLogCallback``) on a tiny Qwen2 built here (no download), in whatever environment
runs this file -- tests/release/test_clean_install.py runs it in a fresh venv holding only the wheel and its
``[trl]`` extra.  Imports nothing from the repository.

    python release_train.py OUT_DIR      # prints one JSON line: versions, steps, replay metrics, TensorBoard tags
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PACKAGES = ("hdreplay", "torch", "trl", "transformers", "accelerate", "datasets", "tokenizers", "tensorboard",
            "numpy", "safetensors", "huggingface_hub")


def versions() -> dict[str, str | None]:
    out = {"python": sys.version.split()[0]}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


def tiny_qwen2(path: str):
    """A random-init 2-layer Qwen2 and a character-level tokenizer (digits, '+', '=')."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: 3 + i for i, c in enumerate("0123456789+= ")}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  padding_side="left")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Qwen2ForCausalLM.from_pretrained(path), PreTrainedTokenizerFast.from_pretrained(path)


def reward_digit(completions, **kw):
    """1 if a digit appears in the first 3 characters: mixed outcomes under a random model."""
    return [float(any(ch.isdigit() for ch in c[:3])) for c in completions]


def main(out: str) -> dict:
    from datasets import Dataset
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import hdreplay
    from hdreplay.integrations.trl import HDRGRPOConfig, HDRGRPOTrainer, HDRLogCallback

    model, tok = tiny_qwen2(os.path.join(out, "model"))
    data = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(8) for b in range(8)]})
    os.environ["TENSORBOARD_LOGGING_DIR"] = os.path.join(out, "tb")
    args = HDRGRPOConfig(output_dir=os.path.join(out, "run"), use_cpu=True, report_to="tensorboard", max_steps=3,
                         per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
                         max_completion_length=6, learning_rate=2e-2, logging_steps=1, save_strategy="no", bf16=False,
                         seed=0, replay_k_rep=3, replay_tau=10.0, replay_capacity=64, disable_dropout=True,
                         disable_tqdm=True)
    trainer = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, args=args, train_dataset=data,
                             processing_class=tok, callbacks=[HDRLogCallback()])
    trainer.train()
    log = [e for e in trainer.state.log_history if "loss" in e]
    ev = EventAccumulator(os.path.join(out, "tb"))
    ev.Reload()
    steps = os.path.join(args.output_dir, "replay", "steps.jsonl")
    return {"versions": versions(), "hdreplay_file": hdreplay.__file__, "global_step": trainer.state.global_step,
            "buffer_size": [e.get("replay/buffer_size") for e in log],
            "accepted": [e.get("replay/accepted") for e in log],
            "loss": [e["loss"] for e in log], "tensorboard_tags": sorted(ev.Tags()["scalars"]),
            "steps_jsonl_lines": sum(1 for _ in open(steps)) if os.path.exists(steps) else None,
            "train_log_lines": sum(1 for _ in open(os.path.join(args.output_dir, "train_log.jsonl")))}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--versions"]:
        print(json.dumps(versions()))
    else:
        print(json.dumps(main(sys.argv[1])))
