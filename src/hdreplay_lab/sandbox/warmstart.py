"""Supervised warm start: bring a tiny model to a starting accuracy where GRPO groups are mixed.

A short teacher-forced loop (AdamW, cross-entropy on the answer tokens and EOS) rather than TRL's
SFTTrainer: the sandbox needs a few hundred steps on ~20-token sequences, and the loop stops as soon
as held-out Mean@n enters the target range, which a fixed-epoch trainer would have to be driven
around; it also keeps the warm start deterministic and fast on 2 CPU cores.

The result is cached under ``cache_dir/<key>`` (model + tokenizer through ``save_pretrained`` and a
``warmstart.json``), keyed by a hash of the task and every setting, and reused by later runs.  The default
cache directory is shared by ``demo``, ``compare`` and ``calibrate``: ``$HDREPLAY_CACHE/warmstart``, else
``~/.cache/hdreplay/warmstart`` (:func:`default_cache_dir`), so a warm start is built once per settings
hash on a machine, not once per output directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..env import configure_threads
from .evaluate import evaluate
from .model import build_tiny_model, load_model, quiet_hf_progress
from .tasks import Task


@dataclass(frozen=True)
class WarmStartConfig:
    arch: str = "qwen2"
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    seed: int = 0
    lr: float = 1e-3
    batch: int = 128
    clip: float = 1.0
    max_steps: int = 2500
    eval_every: int = 100
    eval_n: int = 4
    eval_prompts: int = 48  # per benchmark, for the stopping check
    target: float = 0.25  # stop once held-out Mean@n reaches this
    #: if set, stop instead once at most this share of fresh groups (``zero_variance_n`` samples on
    #: ``zero_variance_prompts`` training prompts, sampled as GRPO samples them) is zero-variance: the regime
    #: is calibrated directly (the mix task: 0.5, checked every 50 steps; it stops at 0.39, and GRPO then
    #: raises it slowly, 0.39 -> 0.44 over 80 steps, as the easy sizes saturate: docs/results/fidelity)
    zero_variance_target: float | None = None
    zero_variance_prompts: int = 128
    zero_variance_n: int = 8

    def key(self, task: Task) -> str:
        setting = {"task": task.name, "vocab": task.vocab, **asdict(self)}
        if getattr(task, "warmstart_kinds", None):  # the recorded zero-variance share depends on the question mix
            setting["kinds"] = [list(task.train_kinds), list(task.warmstart_kinds)]
        blob = json.dumps(setting, sort_keys=True)
        return (f"{task.name}-{self.arch}-h{self.hidden}l{self.layers}-s{self.seed}-"
                + hashlib.sha1(blob.encode()).hexdigest()[:10])


def _batch(tok, task: Task, problems, rng: random.Random) -> dict:
    """The model's keyword arguments for one teacher-forced step (``labels`` included)."""
    if getattr(task, "is_multimodal", False):  # tok is the VLM's processor; the image goes with the prompt
        from .vlm import sft_batch

        return sft_batch(tok, [p.prompt for p in problems], [p.image() for p in problems],
                         [task.target(p, rng) for p in problems])
    seqs, labels = [], []
    for p in problems:
        if task.is_multiturn:  # the ideal trajectory; loss on the assistant turns only (tool text masked)
            from .search import render_with_mask

            ids, mask = render_with_mask(tok, task.conversation(p))
            seqs.append(ids)
            labels.append([t if m else -100 for t, m in zip(ids, mask)])
            continue
        prompt = tok(p.prompt, add_special_tokens=False)["input_ids"]
        target = tok(task.target(p, rng), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), tok.pad_token_id)
    lab = torch.full((len(seqs), L), -100)
    att = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (s, y) in enumerate(zip(seqs, labels)):  # right padding: positions are the same as unpadded
        ids[i, :len(s)], lab[i, :len(y)], att[i, :len(s)] = torch.tensor(s), torch.tensor(y), 1
    return {"input_ids": ids, "attention_mask": att, "labels": lab}


CACHE_ENV = "HDREPLAY_CACHE"


def default_cache_dir() -> Path:
    """``$HDREPLAY_CACHE/warmstart`` or ``~/.cache/hdreplay/warmstart``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hdreplay")
    return Path(root) / "warmstart"


def warm_start(task: Task, cache_dir: str | os.PathLike | None = None, cfg: WarmStartConfig | None = None,
               log=print) -> Path:
    """Return the directory of a warm-started model for ``task`` (built once, then reused).

    ``cache_dir`` None = :func:`default_cache_dir`.
    """
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    if cfg is None:
        from dataclasses import replace

        cfg = replace(WarmStartConfig(), **dict(getattr(task, "warmstart_overrides", ())))
    out = Path(cache_dir) / cfg.key(task)
    if (out / "warmstart.json").is_file():
        return out
    t0 = time.perf_counter()
    threads = configure_threads()
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".warm-", dir=cache_dir))
    try:
        build_tiny_model(tmp, arch=cfg.arch, chars=task.vocab, hidden=cfg.hidden, layers=cfg.layers,
                         heads=cfg.heads, kv_heads=cfg.kv_heads, seed=cfg.seed, max_positions=512)
        model, tok = load_model(tmp)
        if task.is_multiturn:
            from .search import install_chat_format

            install_chat_format(tok)
            tok.save_pretrained(tmp / "tokenizer")
        torch.manual_seed(cfg.seed)
        rng = random.Random(cfg.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
        problems = getattr(task, "warmstart_problems", task.train_problems)  # search_mix: a kind left to GRPO
        train = problems(cfg.max_steps * cfg.batch // 4 + cfg.batch, seed=cfg.seed)
        history, acc, step = [], 0.0, 0
        model.train()
        for step in range(1, cfg.max_steps + 1):
            loss = model(**_batch(tok, task, rng.sample(train, cfg.batch), rng)).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            if step % cfg.eval_every == 0:
                rec = {"step": step, "loss": loss.item()}
                msg = f"  warm start step {step}: loss {loss.item():.3f}"
                if cfg.zero_variance_target is None:
                    rec["mean_at_n"] = acc = _quick_eval(model, tok, task, cfg)
                    done = acc >= cfg.target
                else:  # held-out accuracy only at the stop (evaluation never touches the training RNG)
                    rec["zero_variance_share"] = zv = zero_variance_share(model, tok, task, cfg)
                    msg += f", zero-variance share of fresh groups {zv:.2f}"
                    done = zv <= cfg.zero_variance_target
                    if done:
                        rec["mean_at_n"] = acc = _quick_eval(model, tok, task, cfg)
                if "mean_at_n" in rec:
                    msg += f", held-out Mean@{cfg.eval_n} {acc:.3f}"
                history.append(rec)
                log(msg)
                if done:
                    break
        if history and "mean_at_n" not in history[-1]:  # max_steps reached before the zero-variance target
            history[-1]["mean_at_n"] = acc = _quick_eval(model, tok, task, cfg)
        if history and "zero_variance_share" not in history[-1] and getattr(task, "zero_variance_band", None):
            history[-1]["zero_variance_share"] = zero_variance_share(model, tok, task, cfg)  # what check_regime reads
        with quiet_hf_progress():
            model.save_pretrained(tmp)
        meta = {"task": task.name, "config": asdict(cfg), "steps": step, "mean_at_n": acc, "history": history,
                "zero_variance_share": history[-1].get("zero_variance_share") if history else None,
                "seconds": time.perf_counter() - t0, "torch_threads": threads,
                "method": "teacher-forced AdamW loop (hdreplay_lab.sandbox.warmstart)"}
        (tmp / "warmstart.json").write_text(json.dumps(meta, indent=2))
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _quick_eval(model, tok, task: Task, cfg: WarmStartConfig) -> float:
    from dataclasses import replace

    small = replace(task, benchmarks=tuple(replace(b, size=min(b.size, cfg.eval_prompts)) for b in task.benchmarks))
    if task.is_multiturn:
        from .search import install_chat_format

        install_chat_format(tok)
    return evaluate(model, tok, small, n=cfg.eval_n, seed=cfg.seed)["macro_mean_at_n"]


def zero_variance_share(model, tok, task: Task, cfg: WarmStartConfig) -> float:
    """Share of training prompts whose ``zero_variance_n`` samples (temperature 1) all score the same."""
    from .evaluate import sample_completions

    probe = task.train_problems(cfg.zero_variance_prompts, seed=10_000 + cfg.seed)
    if task.is_multiturn:  # whole episodes through the tool loop, as GRPO samples them; the caller's RNG kept
        from .search import install_chat_format, rollout

        install_chat_format(tok)
        state = torch.get_rng_state()
        try:
            torch.manual_seed(cfg.seed)
            comps = rollout(model, tok, probe, n=cfg.zero_variance_n, max_tool_calls=task.max_tool_calls)
        finally:
            torch.set_rng_state(state)
    else:
        width = max(len(p.answer) for p in probe) + 2
        comps = sample_completions(model, tok, [p.prompt for p in probe], n=cfg.zero_variance_n,
                                   max_new_tokens=width, seed=cfg.seed)
    same = [len({task.score(c, p.answer) for c in cs}) == 1 for cs, p in zip(comps, probe)]
    return sum(same) / len(same)


class RegimeOutOfBand(ValueError):
    """A task's warm start leaves a zero-variance share outside the band the task asks for (``zero_variance_band``)."""


def check_regime(task: Task, model_dir: str | os.PathLike, log=print) -> float | None:
    """The zero-variance share of fresh groups ``model_dir`` starts a comparison with, checked against the task's
    ``zero_variance_band`` (None: the task asks for no regime; nothing is measured).

    Reads the share the warm start measured at its stop (``warmstart.json``); a checkpoint without one (``--model``)
    is measured here with the task's warm-start probe.  Raises :class:`RegimeOutOfBand`, naming the measured share,
    when it lies outside the band: the comparison must stop before training."""
    band = getattr(task, "zero_variance_band", None)
    if band is None:
        return None
    model_dir = Path(model_dir)
    meta = model_dir / "warmstart.json"
    share = json.loads(meta.read_text()).get("zero_variance_share") if meta.is_file() else None
    if share is None:
        from dataclasses import replace

        cfg = replace(WarmStartConfig(), **dict(getattr(task, "warmstart_overrides", ())))
        model, tok = load_model(model_dir)
        share = zero_variance_share(model, tok, task, cfg)
    lo, hi = band
    if not lo <= share <= hi:
        raise RegimeOutOfBand(
            f"task {task.name}: {share:.0%} of fresh groups are zero-variance after the warm start ({model_dir.name}), "
            f"outside the {lo:.0%}-{hi:.0%} this setting asks for; the comparison stops before training. Change the "
            "task's question mix or its warm start (zero_variance_target), or use a task that asks for no regime")
    log(f"regime: {share:.0%} of fresh groups zero-variance after the warm start (asked {lo:.0%}-{hi:.0%})")
    return float(share)
