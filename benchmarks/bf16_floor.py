"""The bf16 Drift floor on the CPU: Drift of groups re-scored at UNCHANGED weights in another layout than at birth.

    python benchmarks/bf16_floor.py            # sandbox model + a ~0.1B Qwen2-shaped model (~30 min on 2 free cores)
    python benchmarks/bf16_floor.py --tiny     # the same code on tiny models (the test suite's run, seconds)

Models (built locally, saved with ``save_pretrained`` and loaded back with ``from_pretrained``):

* ``sandbox``: the sandbox's model (:mod:`hdreplay_lab.sandbox.model`, qwen2 hidden 128, 4 layers, the mix task's
  character vocabulary), warm-started on the mix task when the warm-start cache holds one (``--warm-start`` builds it
  into the cache, ``$HDREPLAY_CACHE``), else random-init (the output says which).  Groups: mix-task training prompts,
  n = 8 completions sampled from the model, each ending at its EOS (at most 8 tokens) as the sandbox's do.
* ``qwen0.1b``: a random-init Qwen2-shaped model of 112M parameters (hidden 640, 12 layers, 10 heads / 2 KV heads,
  MLP 3456, vocabulary 32768, tied embeddings).  Groups: random prompts of 48-96 tokens, n = 8 completions of 96
  tokens sampled from the model.

Completions are sampled once per model in fp32 and re-scored in every precision (paired across precisions):
``fp32`` (control; sandbox model only by default), ``bf16_autocast`` (fp32 weights, ``torch.autocast(bfloat16)``:
TRL with ``bf16=True``), ``bf16_autocast_fp32_head`` (the same with the LM head in fp32: TRL's
``cast_lm_head_to_fp32=True``; sandbox model only by default) and ``bf16_weights`` (weights loaded in bf16: TRL with
``dtype="auto"`` on a bf16 checkpoint, verl's FSDP mixed
precision).  Layouts (:mod:`hdreplay_lab.drift_floor`): ``batch`` (rows shuffled among other groups' rows, 8 rows
per forward), ``padding`` (extra left padding), ``chunking`` (one row per forward), ``shared_prompt`` (hdreplay's
prompt-shared re-score against a birth through TRL's fused LM head).  Drift l2 (and l1) per group; percentiles
against the default tau 1e-3 and the calibrated range 1e-3 .. 1e-1 (docs/results/calibrate).

Writes ``benchmarks/results/bf16_floor.json`` and ``docs/results/bf16_floor.md`` / ``.png`` (beside the H200 figures
of ``docs/results/gpu_check.json``); ``--tiny`` writes ``*_tiny.*`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from hdreplay_lab import drift_floor as df  # noqa: E402

TAU_DEFAULT, TAU_RANGE = 1e-3, (1e-3, 1e-1)
QWEN = dict(vocab=32768, hidden=640, mlp=3456, layers=12, heads=10, kv_heads=2)
BF16 = ("bf16_autocast", "bf16_weights")
#: per model: groups, n, lengths (``natural``: completions end at EOS, at most ``completion`` tokens; else exactly
#: ``completion`` tokens), rows per forward in the batch layout, extra left pad, and the precisions measured by default
#: (the fp32 control and the fp32 LM head on the sandbox model only: on the 0.1B model each costs as much as autocast)
FULL = {"sandbox": dict(groups=24, n=8, completion=8, natural=True, batch_rows=8, extra_pad=4, modes=df.MODES),
        "qwen0.1b": dict(groups=12, n=8, prompt=96, completion=96, natural=False, batch_rows=8, extra_pad=24,
                         modes=BF16, **QWEN)}
TINY = {"sandbox": dict(groups=3, n=4, completion=4, natural=True, batch_rows=4, extra_pad=3, modes=df.MODES),
        "qwen0.1b": dict(groups=3, n=4, prompt=12, completion=6, natural=False, batch_rows=4, extra_pad=3,
                         modes=("fp32", "bf16_weights"), vocab=97, hidden=32, mlp=64, layers=2, heads=4, kv_heads=2)}
EOS = 1  # both models' EOS id (sandbox tokenizer; the Qwen2 config below)


# ----------------------------------------------------------------------------------------------- models and groups
def sandbox_model(directory: Path, *, tiny: bool, warm_start: bool) -> tuple[Path, str]:
    """(model dir, how it was made): the mix task's cached warm start if there is one (or ``warm_start`` builds
    it), else a random-init model of the same shape."""
    from dataclasses import replace

    from hdreplay_lab.sandbox.model import build_tiny_model
    from hdreplay_lab.sandbox.tasks import get_task
    from hdreplay_lab.sandbox.warmstart import WarmStartConfig, default_cache_dir
    from hdreplay_lab.sandbox.warmstart import warm_start as build_warm

    task = get_task("mix")
    cfg = replace(WarmStartConfig(), **dict(task.warmstart_overrides))
    cached = default_cache_dir() / cfg.key(task)
    if not tiny and (warm_start or (cached / "warmstart.json").is_file()):
        path = build_warm(task)
        info = json.loads((path / "warmstart.json").read_text())
        return path, f"warm-started on the mix task ({cached.name}; {info.get('steps', '?')} steps)"
    shape = dict(hidden=32, layers=2) if tiny else dict(hidden=cfg.hidden, layers=cfg.layers, heads=cfg.heads,
                                                        kv_heads=cfg.kv_heads)
    build_tiny_model(directory, chars=task.vocab, max_positions=512, seed=0, **shape)
    return directory, "random-init (no warm start in the cache; --warm-start builds one)"


def qwen_model(directory: Path, s: dict) -> tuple[Path, str]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["mlp"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                      bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(directory)
    return directory, "random-init"


def load(path: Path, mode: str):
    from transformers import AutoModelForCausalLM

    from hdreplay_lab.sandbox.model import quiet_hf_progress

    with quiet_hf_progress():
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16 if mode == "bf16_weights" else torch.float32, local_files_only=True)
    return model.eval()


def group_prompts(name: str, s: dict, path: Path, *, seed: int) -> tuple[list[torch.Tensor], int]:
    """(R prompts, one per row, groups of n consecutive rows sharing one; pad token id)."""
    if name == "sandbox":
        from hdreplay_lab.sandbox.model import load_model
        from hdreplay_lab.sandbox.tasks import get_task

        _, tok = load_model(path)
        probs = get_task("mix").train_problems(s["groups"], seed=seed)
        ids = [torch.tensor(tok(p.prompt, add_special_tokens=False)["input_ids"]) for p in probs]
        return [p for p in ids for _ in range(s["n"])], int(tok.pad_token_id)
    prompts, _ = df.random_groups(num_groups=s["groups"], n=s["n"], prompt_len=s["prompt"], completion_len=1,
                                  vocab=s["vocab"], seed=seed, low_id=2)
    return prompts, 0


# ----------------------------------------------------------------------------------------------- measurement
def measure(name: str, path: Path, s: dict, *, modes: list[str], seed: int, log) -> dict:
    prompts, pad = group_prompts(name, s, path, seed=seed)
    t0 = time.perf_counter()
    eos = EOS if s["natural"] else None
    completions = df.sample_completions(load(path, "fp32"), prompts, completion_len=s["completion"], pad_token_id=pad,
                                        mode="fp32", seed=seed, batch_rows=32, eos_token_id=eos)
    cm = df.completion_mask(completions, eos)
    log(f"{name}: {len(prompts)} completions sampled in {time.perf_counter() - t0:.0f} s, mean length "
        f"{cm.sum(1).float().mean():.1f} tokens")
    out = {}
    for mode in modes:
        t0 = time.perf_counter()
        model = df.prepare(load(path, mode), mode, fused=True)
        lps = df.layout_logps(model, prompts, completions, n=s["n"], pad_token_id=pad, mode=mode, completion_mask=cm,
                              batch_rows=s["batch_rows"], extra_pad=s["extra_pad"], seed=seed, shared=True)
        drift = {norm: {k: df.group_drift(lp, b, n=s["n"], norm=norm, completion_mask=cm) for k, (b, lp) in lps.items()}
                 for norm in df.NORMS}
        out[mode] = {"mean_completion_tokens": float(cm.sum(1).float().mean()),
                     "l2": df.summarize(drift["l2"], tau=TAU_DEFAULT, tau_range=TAU_RANGE),
                     "l1": df.summarize(drift["l1"], tau=TAU_DEFAULT, tau_range=TAU_RANGE)["settings"],
                     "per_group": drift, "wall_s": time.perf_counter() - t0}
        worst = out[mode]["l2"]["settings"]["all"]
        log(f"{name} {mode}: l2 p99 {worst['p99']:.2e} max {worst['max']:.2e} ({out[mode]['wall_s']:.0f} s)")
        del model
    return out


# ----------------------------------------------------------------------------------------------- outputs
def h200_rows() -> dict | None:
    path = ROOT / "docs" / "results" / "gpu_check.json"
    if not path.is_file():
        return None
    res = json.loads(path.read_text())
    return {"device": res["device"], "params_m": res["params_m"], "settings": res["settings"], "floor": res["floor"]}


def write_markdown(path: Path, res: dict) -> None:
    runs = "; ".join(f"`{c}`" for c in res["commands"])
    lines = ["# bf16 Drift floor (CPU)" + (" --tiny" if res["tiny"] else ""), "",
             f"Command{'s' if len(res['commands']) > 1 else ''}: {runs} (on {res['machine']}; torch "
             f"{res['versions']['torch']}, transformers {res['versions']['transformers']}). Drift of a group re-scored "
             "at unchanged weights in another layout than at birth (its n rows alone, one forward); l2 = mean over "
             "the group's completion tokens of the squared log-prob difference. p99 over groups ~ the largest of "
             f"{min(m['groups'] for m in res['models'].values())}-{max(m['groups'] for m in res['models'].values())} "
             "groups. Default tau 1e-3; calibrated range 1e-3 .. 1e-1 (docs/results/calibrate).", ""]
    for name, m in res["models"].items():
        lines += [f"## {name}: {m['params_m']:.1f}M parameters, {m['source']}", "",
                  f"{m['groups']} groups x n = {m['n']}, completions "
                  + (f"ending at EOS (at most {m['completion']} tokens, mean "
                     f"{next(iter(res['results'][name].values()))['mean_completion_tokens']:.1f})" if m.get("natural")
                     else f"of {m['completion']} tokens")
                  + (f", prompts {m['prompt'] // 2}-{m['prompt']} tokens" if "prompt" in m else ", mix-task prompts")
                  + f", {m['batch_rows']} rows per forward in `batch`, {m['extra_pad']} extra pad tokens in `padding`; "
                  f"{m['wall_s'] / 60:.0f} min wall (`{m['command']}`).", "",
                  "| precision | layout | p50 | p90 | p99 | max | p99 / tau (1e-3) | l1 p99 |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode, r in res["results"][name].items():
            l1 = r["l1"]
            for row in df.markdown_rows(mode, r["l2"]):
                layout = row.split("|")[2].strip()
                lines.append(f"{row} {l1[layout]['p99']:.2e} |")
        lines.append("")
    h = res.get("h200")
    if h:
        lines += [f"## Beside it: {h['device']} (docs/results/gpu_check.md)", "",
                  f"{h['params_m']:.0f}M-parameter random-init Qwen2-shaped model, "
                  f"{h['settings']['floor_groups']} groups "
                  f"x n = {h['settings']['n']}, prompts <= {h['settings']['prompt']}, completions "
                  f"{h['settings']['completion']} tokens (no shared_prompt layout, no l1).", "",
                  "| precision | layout | p50 | p90 | p99 | max | p99 / tau (1e-3) |", "|---|---|---|---|---|---|---|"]
        for mode, summary in h["floor"].items():
            lines += df.markdown_rows(mode, summary)
        lines.append("")
    lines += ["## Verdict (l2 p99 over all layouts, against tau/10 = 1e-4 for the default tau)", ""]
    for name, by_mode in res["results"].items():
        for mode, r in by_mode.items():
            p = r["l2"]["settings"]["all"]["p99"]
            lines.append(f"* {name} {mode}: p99 {p:.2e} = {p / TAU_DEFAULT:.3f} x tau 1e-3 "
                         f"({p / TAU_RANGE[1]:.1e} x the range's top 1e-1) -> "
                         + ("**reaches tau/10**" if p >= TAU_DEFAULT / 10 else "below tau/10"))
    if h:
        for mode, summary in h["floor"].items():
            p = summary["settings"]["all"]["p99"]
            lines.append(f"* {h['device']} {mode}: p99 {p:.2e} = {p / TAU_DEFAULT:.3f} x tau 1e-3 "
                         f"({p / TAU_RANGE[1]:.1e} x the range's top 1e-1) -> "
                         + ("**reaches tau/10**" if p >= TAU_DEFAULT / 10 else "below tau/10"))
    lines += ["", f"![p99 Drift floor per layout]({path.with_suffix('.png').name})", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    labels, x = [], 0
    marks = {"batch": "o", "padding": "s", "chunking": "^", "shared_prompt": "D"}
    series = [(f"{name}\n{mode}", r["l2"]["settings"]) for name, by in res["results"].items() for mode, r in by.items()]
    if res.get("h200"):
        series += [(f"H200 494M\n{mode}", s["settings"]) for mode, s in res["h200"]["floor"].items()]
    for label, rows in series:
        for j, (layout, mk) in enumerate(marks.items()):
            if layout in rows and rows[layout]["p99"] > 0:  # 0 (bit-identical) has no place on a log axis
                ax.scatter(x + 0.12 * (j - 1.5), rows[layout]["p99"], marker=mk, color=f"C{j}",
                           label=layout if layout not in ax.get_legend_handles_labels()[1] else None)
        labels.append(label)
        x += 1
    for y, txt, style in ((TAU_DEFAULT, "tau = 1e-3", "-"), (TAU_DEFAULT / 10, "tau / 10", "--")):
        ax.axhline(y, color="k", ls=style, lw=0.8)
        ax.text(x - 0.5, y * 1.15, txt, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), [lb.replace("_fp32_head", "\n+fp32 head") for lb in labels], fontsize=7)
    ax.set_ylabel("p99 Drift (l2) at unchanged weights")
    ax.set_title("Drift floor per layout (zero = bit-identical, not drawn)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny models (the test suite's run)")
    ap.add_argument("--models", default="sandbox,qwen0.1b")
    ap.add_argument("--modes", default=None, help=f"precisions, some of {list(df.MODES)} (default: per model, FULL)")
    ap.add_argument("--groups", type=int, default=None, help="groups per model (default: 24 sandbox, 12 qwen0.1b)")
    ap.add_argument("--update", action="store_true",
                    help="keep the results of models this run does not measure from the existing JSON")
    ap.add_argument("--warm-start", action="store_true", help="build the sandbox warm start if it is not cached")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(HERE / "results" / "bf16_floor.json"))
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "results"))
    a = ap.parse_args(argv)
    spec = TINY if a.tiny else FULL
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    modes = None if a.modes is None else [m.strip() for m in a.modes.split(",") if m.strip()]
    if not models or any(m not in spec for m in models):
        ap.error(f"--models must name some of {sorted(spec)}, got {a.models!r}")
    if modes is not None and (not modes or any(m not in df.MODES for m in modes)):
        ap.error(f"--modes must name some of {list(df.MODES)}, got {a.modes!r}")
    if a.groups is not None and a.groups < 1:
        ap.error(f"--groups must be >= 1, got {a.groups}")
    import transformers

    out_dir = Path(a.out_dir)
    stem = "bf16_floor_tiny" if a.tiny else "bf16_floor"
    json_path = out_dir / f"{stem}.json" if a.tiny else Path(a.json)
    t_all = time.perf_counter()
    log = lambda msg: print(f"[bf16_floor {time.perf_counter() - t_all:5.0f} s] {msg}", flush=True)  # noqa: E731
    command = " ".join(["python benchmarks/bf16_floor.py", *(sys.argv[1:] if argv is None else argv)])
    res = {"tiny": a.tiny, "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                                      f"{torch.get_num_threads()} torch threads",
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
           "tau_default": TAU_DEFAULT, "tau_range": list(TAU_RANGE), "models": {}, "results": {}}
    if a.update and json_path.is_file():
        prev = json.loads(json_path.read_text())
        for name in prev["models"]:
            if name not in models:
                res["models"][name], res["results"][name] = prev["models"][name], prev["results"][name]
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            t_model = time.perf_counter()
            s = dict(spec[name], **({"groups": a.groups} if a.groups else {}))
            s["modes"] = list(modes or s["modes"])
            directory = Path(tmp) / name
            path, source = (sandbox_model(directory, tiny=a.tiny, warm_start=a.warm_start) if name == "sandbox"
                            else qwen_model(directory, s))
            params = sum(p.numel() for p in load(path, "fp32").parameters()) / 1e6
            res["models"][name] = {**s, "params_m": params, "source": source}
            log(f"{name}: {params:.1f}M parameters, {source}")
            res["results"][name] = measure(name, path, s, modes=s["modes"], seed=a.seed, log=log)
            res["models"][name].update(command=command, wall_s=time.perf_counter() - t_model)
    res["h200"] = None if a.tiny else h200_rows()
    res["commands"] = list(dict.fromkeys(m["command"] for m in res["models"].values()))
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(res, indent=1) + "\n")
    write_markdown(out_dir / f"{stem}.md", res)
    plot(out_dir / f"{stem}.png", res)
    print((out_dir / f"{stem}.md").read_text())
    return res


if __name__ == "__main__":
    main()
