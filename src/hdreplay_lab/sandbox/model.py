"""Tiny causal LMs built locally and loaded back through ``from_pretrained``.

The tokenizer is character level (tokenizers WordLevel over single characters, Fuse decoder,
left padding) and is saved in ``<dir>/tokenizer``: next to a ``config.json`` of model_type
qwen2, ``AutoTokenizer`` would silently swap in Qwen2's byte-level pre-tokenizer.
:func:`load_model` accepts such a directory or any local causal-LM checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .chartok import DEFAULT_CHARS, EOS, PAD, UNK, build_tokenizer, quiet_hf_progress  # noqa: F401  (their home before chartok.py)


def build_tiny_model(directory: str | os.PathLike, *, arch: str = "qwen2", chars: str = DEFAULT_CHARS,
                     hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     max_positions: int = 256, seed: int = 0) -> Path:
    """Build a random-init tiny model + char tokenizer and save both under ``directory``.

    ``arch`` qwen2 / gpt2 are causal LMs; qwen2vl / llava are vision-language models (see :mod:`.vlm`)."""
    if arch in ("qwen2vl", "llava"):
        from .vlm import build_tiny_vlm

        return build_tiny_vlm(directory, arch=arch, chars=chars, hidden=hidden, layers=layers, heads=heads,
                              kv_heads=kv_heads, seed=seed)
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    tok = build_tokenizer(chars)
    V = len(tok)
    torch.manual_seed(seed)
    if arch == "qwen2":
        cfg = Qwen2Config(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=max_positions,
                          tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
        model = Qwen2ForCausalLM(cfg)
    elif arch == "gpt2":  # absolute position embeddings
        cfg = GPT2Config(vocab_size=V, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1)
        model = GPT2LMHeadModel(cfg)
        with torch.no_grad():  # make positions matter at init, like a trained model
            model.transformer.wpe.weight.normal_(0.0, 0.5)
    else:
        raise ValueError(f"unknown arch {arch!r}; valid: ['qwen2', 'gpt2', 'qwen2vl', 'llava']")
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    with quiet_hf_progress():
        model.save_pretrained(directory)
    tok.save_pretrained(directory / "tokenizer")
    return directory


def load_model(path: str | os.PathLike, *, dtype=torch.float32):
    """(model, tokenizer) from a directory made by :func:`build_tiny_model` or any local causal-LM checkpoint;
    for a VLM checkpoint (a saved processor beside it) (model, processor), see :func:`.vlm.load_vlm`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    from .vlm import is_vlm_dir, load_vlm

    if is_vlm_dir(path):
        return load_vlm(path, dtype=dtype)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; --model must be a local causal-LM checkpoint directory")
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    archs = getattr(cfg, "architectures", None) or []
    if archs and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
        raise ValueError(f"{path}: architectures {archs} is not a causal LM (expected *ForCausalLM)")
    with quiet_hf_progress():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    tok_dir = path / "tokenizer" if (path / "tokenizer").is_dir() else path
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok
