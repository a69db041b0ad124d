"""summary.md from summary.json's numbers (summary.py): tables and plain-language verdict lines."""

from __future__ import annotations

from ..analysis.markdown import table


def _f(x, spec: str = ".3f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _cell(best: dict, mean: dict) -> str:
    f = lambda s: "n/a" if s["mean"] is None else (f"{s['mean']:.3f}" + (f"±{s['std']:.3f}" if s["n"] > 1 else ""))  # noqa: E731
    return f"{f(best)} / {f(mean)}"


def _count(s: dict) -> str:
    """A per-run count, seed mean (and its spread when seeds differ, e.g. dynamic sampling's generations)."""
    if s["mean"] is None:
        return "n/a"
    return f"{s['mean']:,.0f}" + (f" ± {s['std']:,.0f}" if s["n"] > 1 and s["std"] else "")


def render_markdown(summary: dict) -> str:
    ms = summary["methods"]
    names = list(ms)
    n = summary["n"]
    seeds = max(e["seeds"] for e in ms.values())
    lines = [f"# hdreplay compare: task `{summary['task']}`", "",
             f"Each cell: Best@{n} / Mean@{n} on the held-out benchmark"
             + (f", mean ± standard deviation over {seeds} seeds." if seeds > 1 else f", {seeds} seed.")
             + " Costs are per run (seed mean): fresh responses generated (dynamic sampling's discarded ones and "
             "BAPO's re-evaluations included), stored responses forwarded under the current policy to select replay, "
             "groups replayed (single-rollout replay: rows / n), training wall-clock.", ""]
    cells = lambda fn: [fn(ms[k]) for k in names]  # noqa: E731
    rows = [[f"{b} (n={size})",
             *cells(lambda e: _cell(e["benchmarks"][b]["best_at_n"], e["benchmarks"][b]["mean_at_n"]))]
            for b, size in summary["benchmarks"].items()]
    rows += [["Macro Avg", *cells(lambda e: _cell(e["macro_best_at_n"], e["macro_mean_at_n"]))],
             ["Weighted Avg", *cells(lambda e: _cell(e["weighted_best_at_n"], e["weighted_mean_at_n"]))],
             ["Fresh responses generated", *cells(lambda e: _count(e["fresh_responses"]))],
             ["Rows re-scored to select", *cells(lambda e: _count(e["rescored_rows"]))],
             ["Groups replayed", *cells(lambda e: _count(e["replayed_groups"]))],
             ["Train wall-clock (s)", *cells(lambda e: _f(e["train_wall_s"]["mean"]))],
             ["Step time (s)", *cells(lambda e: _f(e["mean_step_s"]["mean"]))]]
    lines.append(table(["Metric", *(ms[k]["label"] for k in names)], rows))
    if summary.get("multiturn"):
        lines += _tool_table(summary)
    lines += _gate(summary) + _regime(summary) + _intervals(summary) + _paired(summary, seeds) + _efficiency(summary)
    lines += _environment(summary)
    return "\n".join(lines) + "\n"


def _gate(summary: dict) -> list[str]:
    g = summary.get("gate") or {}
    hdr, rec = g.get("headroom_drift"), g.get("recency_matched")
    if not hdr:
        return []
    out = ["", "## What did the gate do?", ""]
    out.append(f"* **Acceptance.** The Drift gate (tau = {summary['tau']:g}) passed "
               f"{_pct(hdr['acceptance'])} of the buffered groups it re-scored, scanning "
               f"{_f(hdr['scanned_per_step'], '.1f')} groups per step in Headroom order to fill "
               f"{_pct(hdr['budget_fill'])} of the replay budget.")
    if rec and rec.get("replay_kl") is not None and hdr.get("replay_kl") is not None:
        ratio = rec["replay_kl"] / hdr["replay_kl"] if hdr["replay_kl"] > 0 else float("inf")
        out.append(f"* **Replay KL, gated vs ungated.** At the same replay budget, the groups Headroom-Drift "
                   f"replayed were {ratio:.1f}x closer to the current policy than recency replay's "
                   f"(mean k3 KL {hdr['replay_kl']:.4f} vs {rec['replay_kl']:.4f}).")
    if rec and hdr.get("mean_age") is not None and rec.get("mean_age") is not None:
        out.append(f"* **Ages replayed.** Headroom-Drift mixed ages 1-{hdr['max_age']} (mean {hdr['mean_age']:.2f} "
                   f"steps; {_pct(1 - hdr['share_age_1'])} older than one step); recency replayed "
                   + ("only age 1" if rec["max_age"] == 1 else
                      f"ages 1-{rec['max_age']} ({_pct(rec['share_age_1'])} age 1, mean {rec['mean_age']:.2f})")
                   + ".")
    zv = summary["methods"].get("headroom_drift", {}).get("regime", {}).get("zero_variance_share")
    if zv is not None:
        out.append(f"* **Why there is something to replay.** {_pct(zv)} of Headroom-Drift's fresh groups were "
                   "zero-variance (all answers right or all wrong: no GRPO gradient); they never enter the buffer.")
    return out


def _intervals(summary: dict) -> list[str]:
    """The zero-variance share of every method and the gate's acceptance and scan depth, per interval of steps."""
    ms = summary["methods"]
    per = {k: e.get("regime_intervals") for k, e in ms.items() if e.get("regime_intervals")}
    if not per:
        return []
    gate = next((k for k in ("headroom_drift",) if k in per), None)
    rows = []
    for i, iv in enumerate(next(iter(per.values()))):
        row = [f"{iv['steps'][0]}-{iv['steps'][1]}", *(_pct(per[k][i]["zero_variance_share"]) for k in per)]
        if gate:
            g = per[gate][i]
            row += [_pct(g["acceptance"]) if g["acceptance"] is not None else "-", _f(g["scanned"], ".1f", "-")]
        rows.append(row)
    head = ["Steps", *(f"Zero-var. {ms[k]['label']}" for k in per)]
    if gate:
        head += ["HDR acceptance", "HDR scanned / step"]
    return ["", "## Regime per interval", "",
            "Seed means of each run's interval mean: the share of fresh groups that are zero-variance, per method, and "
            "Headroom-Drift's gate acceptance (passes / groups re-scored) and groups scanned per step.", "",
            table(head, rows)]


def _regime(summary: dict) -> list[str]:
    ms = summary["methods"]
    c = summary["modelled_ms_per_token"]
    out = ["", "## Regime", "",
           "Per-step means over steps 1..T (step 0 has an empty buffer); \"in band\": share of steps with the "
           "zero-variance share in 40-60 % / the acceptance in 30-50 %. Generation share: seconds in TRL's "
           f"`_generate` / step seconds, natively and with the modelled rollout cost of {c:g} ms per generated "
           "token added" + (f" (the smallest round cost making generation >= 2/3 of "
                             f"{ms[summary['modelled_from']]['label']}'s step here)"
                             if summary.get("modelled_from") else "")
           + ".", "",
           ]
    rows = []
    for k, e in ms.items():
        r = e["regime"]
        if r.get("acceptance") is None:
            acc = "-"
        elif not e.get("gated", True):  # no Drift gate: everything scanned is replayed
            acc = "ungated"
        else:
            acc = f"{_pct(r['acceptance'])} ({_pct(r.get('acceptance_in_band'))})"
        rows.append([e["label"], f"{_pct(r.get('zero_variance_share'))} ({_pct(r.get('zero_variance_in_band'))})", acc,
                     _pct(r.get("budget_fill")) if r.get("budget_fill") is not None else "-",
                     _f(r.get("scanned"), ".1f", "-"), _f(r.get("replay_kl"), ".4f", "-"),
                     f"{_pct(r.get('generation_share_native'))} / {_pct(r.get('generation_share_modelled'))}"])
    return out + [table(["Method", "Zero-variance share (in band)", "Acceptance (in band)", "Budget fill",
                         "Scanned / step", "Replay KL", f"Generation share native / at {c:g} ms/token"], rows)]


def _paired(summary: dict, seeds: int) -> list[str]:
    ref = summary.get("reference")
    rows = [(k, e) for k, e in summary["methods"].items() if "paired" in e]
    if not ref or not rows:
        return []
    if seeds < 2:  # an interval over prompts alone would read as a verdict that seed noise can overturn
        return ["", f"## Paired differences against {summary['methods'][ref]['label']}", "",
                "One seed: no paired intervals (they need several seeds; `hdreplay compare` runs them)."]
    n = summary["n"]
    p0 = rows[0][1]["paired"]
    prompts = sum(p0["prompts"].values())
    po = summary.get("prompt_order") or {}
    order = ("" if not po else " Prompt order checked from the runs' logs: " + (
        f"every method of a seed read the same prompt sequence (each at its own rate) in all {po['seeds']} seed(s)."
        if po["same_order"] else f"MISMATCH in {', '.join(po['mismatches'][:5])}."))
    out = ["", f"## Paired differences against {summary['methods'][ref]['label']}", "",
           f"Macro Mean@{n} of the method minus Headroom-Drift's, mean over {seeds} seed(s); 95 % percentile "
           f"interval of {p0['reps']} bootstrap replicates resampling seeds and the {prompts} held-out prompts "
           "(crossed, paired: same seeds, warm start, prompt order and held-out prompts for both); the Bonferroni "
           "column widens each interval so that all of them hold together at 95 %. Half-width "
           "parts: seeds only / prompts only. Last column: seeds a half-width of 0.01 would need at this "
           "step count, extrapolated from these variances (the seed part as 1/sqrt(seeds); below the seeds run "
           "when the target is already met; n/a: the prompt part alone exceeds it)." + order, "",
           ]
    fam = p0.get("corrected")  # summaries written before the correction existed have none
    corr_head = [] if fam is None else [f"Bonferroni ({fam['comparisons']}) interval, excludes 0"]

    def corr(p: dict) -> list[str]:
        c = p.get("corrected")
        return [] if fam is None else [f"[{c['lo']:+.4f}, {c['hi']:+.4f}] {'yes' if c['excludes_zero'] else 'no'}"]

    out.append(table(["Method", "Difference", "95 % interval", "Excludes 0", *corr_head,
                      "Half-width (seeds / prompts)", "Seeds for ±0.01"],
                     [[e["label"], f"{p['diff']:+.4f}", f"[{p['lo']:+.4f}, {p['hi']:+.4f}]",
                       "yes" if p["excludes_zero"] else "no", *corr(p),
                       f"{p['half_width']:.4f} ({p['seed_half_width']:.4f} / {p['prompt_half_width']:.4f})",
                       _f(p["seeds_for_target"], "d")] for p, e in ((e["paired"], e) for _, e in rows)]))
    better = [e["label"] for _, e in rows if e["paired"]["excludes_zero"] and e["paired"]["diff"] > 0]
    worse = [e["label"] for _, e in rows if e["paired"]["excludes_zero"] and e["paired"]["diff"] < 0]
    hw = max(e["paired"]["half_width"] for _, e in rows)
    parts = (([f"better than {', '.join(worse)}"] if worse else [])
             + ([f"worse than {', '.join(better)}"] if better else []))
    said = (f"Headroom-Drift is {' and '.join(parts)} at 95 % (intervals excluding 0); the rest are not separated"
            if parts else "no interval excludes 0: Headroom-Drift is not separated from any method")
    if fam is not None and fam["comparisons"] > 1 and (better or worse):
        held = [e["label"] for _, e in rows if e["paired"]["corrected"]["excludes_zero"]]
        said += (f"; corrected for the {fam['comparisons']} comparisons (Bonferroni, "
                 f"{100 * fam['level']:.1f} % intervals) " + (f"these hold: {', '.join(held)}" if held else
                                                               "none holds: treat them as suggestive"))
    out += ["", f"Verdict: {said}. Largest half-width {hw:.4f}"
                + (" (<= 0.01)." if hw <= 0.01 else " (> 0.01: see the last column).")]
    best = [(k, e) for k, e in rows if "paired_best" in e]
    if best:  # the search tasks (0/1 rewards): Best@n per prompt = any of its n samples right
        out += ["", f"Macro Best@{n} of the method minus Headroom-Drift's, the same bootstrap (0/1 rewards: a prompt's "
                    f"Best@{n} is whether any of its {n} samples was right):", "",
                table(["Method", "Best difference", "95 % interval", "Excludes 0", *corr_head],
                      [[e["label"], f"{p['diff']:+.4f}", f"[{p['lo']:+.4f}, {p['hi']:+.4f}]",
                        "yes" if p["excludes_zero"] else "no", *corr(p)]
                       for p, e in ((e["paired_best"], e) for _, e in best)])]
    return out


def _efficiency(summary: dict) -> list[str]:
    ms = summary["methods"]
    if "target" not in summary:
        return []
    c = summary["config"]
    src = summary.get("target_from")
    out = ["", "## Efficiency curves", "",
           f"Held-out macro Mean@{c['curve_n']} on the first {c['curve_prompts']} prompts of each benchmark, every "
           f"{c['eval_every']} steps (seed mean). Target {summary['target']:.3f}"
           + (f" = the final value of {ms[src]['label']}" if src else "")
           + ". AUC: mean of the curve over training (trapezoid). Cost to reach the target, linearly interpolated "
           f"between evaluation points; wall-clock natively and with {summary['modelled_ms_per_token']:g} ms per "
           "generated token of modelled rollout cost.", "",
           ]
    rows = []
    for k, e in ms.items():
        cv = e.get("curve")
        if not cv:
            continue
        t, ap, nr = cv["to_target"], cv.get("auc_paired"), "not reached"
        rows.append([e["label"], _f(cv["auc"]["mean"], ".4f"),
                     "-" if not ap else f"{ap['diff']:+.4f} [{ap['lo']:+.4f}, {ap['hi']:+.4f}]",
                     _f(t["step"], ".0f", nr), _f(t["fresh_responses"], ",.0f", nr), _f(t["wall_s"], ".0f", nr),
                     _f(t["wall_s_modelled"], ".0f", nr)])
    return out + [table(["Method", "AUC", "AUC - HDR [95 %]", "Steps", "Fresh responses", "Wall-clock (s)",
                         "Wall-clock modelled (s)"], rows)]


def _environment(summary: dict) -> list[str]:
    env = summary.get("environment") or {}
    if not env:
        return []
    la0, la1 = env.get("loadavg_start") or [None] * 3, env.get("loadavg_end") or [None] * 3
    return ["", "## Environment", "",
            f"Wall-clock {env['wall_s'] / 60:.1f} min for {env['runs_trained']} run(s) trained "
            f"({env['runs_reused']} reused), {env['workers']} worker(s) of one torch thread each on "
            f"{env['cpus']} CPU(s); load average (1/5/15 min) at start {', '.join(_f(x, '.2f') for x in la0)}, "
            f"at end {', '.join(_f(x, '.2f') for x in la1)}. Step times and wall-clock depend on that load; "
            "held-out accuracies do not."]


def _tool_table(summary: dict) -> list[str]:
    """The environment-cost section of a task with tools (summary["env_cost"], envcost.py)."""
    ms, ec = summary["methods"], summary.get("env_cost")
    if not ec:
        return []
    names = list(ms)
    cnt, lats = ec["counts"], [f"{x:g}" for x in ec["latencies_ms"]]
    out = ["", "## Environment cost and wall-clock", "",
           "Per step (seed mean over steps 2..T): tool calls that reached the environment, tool turns (rounds of the "
           "tool loop with at least one call), tokens the policy generated (tool results excluded), process CPU "
           "seconds (one torch thread per run: compute without sleeps or waits for a core, though other jobs on the "
           "machine still inflate it) "
           f"and the wall-clock actually measured (slept latency {ec['slept_latency_ms']:g} ms per call, "
           f"{ec['concurrency'].replace('_', ' ')}).", "",
           table(["Method", "Tool calls", "Tool turns", "Policy tokens", "CPU s", "Wall s (measured)",
                  f"Macro Mean@{summary['n']}", f"Macro Best@{summary['n']}"],
                 [[ms[k]["label"], _pm(cnt[k]["tool_calls"], ".1f"), _pm(cnt[k]["tool_turns"], ".2f"),
                   _pm(cnt[k]["policy_tokens"], ",.0f"), _pm(cnt[k]["cpu_s"], ".3f"), _f(cnt[k]["step_s"]["mean"]),
                   _f(ms[k]["macro_mean_at_n"]["mean"], ".4f"), _f(ms[k]["macro_best_at_n"]["mean"], ".4f")]
                  for k in names])]
    paper, base = ec["paper"]["step_s"], ec.get("base")
    for conc, what in (("per_turn", "the calls of one turn in flight together across the batch, turns one after "
                                    "another (Search-R1's batched retrieval)"),
                       ("sequential", "every call after the previous one (TRL 1.16's sync tools)")):
        st = ec["step_time"][conc]
        top = lats[-1]
        order = sorted(names, key=lambda k: st[top][k]["mean"])
        ratio = (lambda k, lat: f" ({st[lat][k]['ratio_to_base']:.2f}x)") if base else (lambda k, lat: "")
        pb = paper.get(base) if base else None
        out += ["", f"Modelled mean step time (s) at each per-call latency, {conc.replace('_', ' ')}: {what}; "
                    "CPU seconds + latency x " + ("turns" if conc == "per_turn" else "calls")
                    + (f"; in brackets the ratio to {ms[base]['label']}" if base else "")
                    + ". Fastest first at the largest latency; the paper's Search-R1 step time (Qwen2.5-3B, s) beside "
                    "it, like the paper's Table (search_timing).", "",
                table(["Method", *(f"{x} ms" for x in lats), "Paper (s)"],
                      [[ms[k]["label"], *(f"{st[lat][k]['mean']:.3f}{ratio(k, lat)}" for lat in lats),
                        "-" if k not in paper else f"{paper[k]:.1f}" + (f" ({paper[k] / pb:.2f}x)" if pb else "")]
                       for k in order])]
    return out + _paired_step_time(summary) + _wallclock(summary)


def _paired_step_time(summary: dict) -> list[str]:
    """The reference's modelled step time minus each method's, paired by seed, with its 95 % seed-bootstrap interval
    (summary["env_cost"]["step_time"][...]["ref_minus"], computed by envcost.step_time_table)."""
    ms, ec = summary["methods"], summary["env_cost"]
    ref, lats = ec.get("reference"), [f"{x:g}" for x in ec["latencies_ms"]]
    rows = []
    for conc in ("per_turn", "sequential"):
        st = ec["step_time"][conc]
        for k in ms:
            cells = [st[lat][k].get("ref_minus") for lat in lats]
            if k == ref or not all(cells):
                continue
            rows.append([conc.replace("_", " "), ms[k]["label"],
                         *(f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]" for c in cells)])
    if not rows:
        return []
    return ["", f"{ms[ref]['label']}'s modelled step time minus each method's (s), paired by seed, with the 95 % "
                "percentile interval of the seed bootstrap (negative: Headroom-Drift's step is shorter):", "",
            table(["Concurrency", "Against", *(f"{x} ms" for x in lats)], rows)]


def _pm(s: dict, spec: str) -> str:
    return ("n/a" if s["mean"] is None
            else format(s["mean"], spec) + (f" ± {format(s['std'], spec)}" if s["n"] > 1 else ""))


def _lat(x: float) -> str:
    return "neither reaches" if x != x else "never" if x == float("inf") else f"{x:,.0f} ms"


def _wallclock(summary: dict) -> list[str]:
    ms, ec = summary["methods"], summary["env_cost"]
    wc = ec.get("wallclock")
    if not wc:
        return []
    ref = ec["reference"]
    lats = [f"{x:g}" for x in ec["latencies_ms"]]
    out = ["", f"Wall-clock to the target (held-out macro Mean@{summary['config']['curve_n']} {wc['target']:.3f} "
               "on the curve's prompts, seed-mean curve), modelled from the cumulative CPU seconds and counts at each "
               "evaluation point, per turn / sequential:", "",
           table(["Method", *(f"{x} ms" for x in lats)],
                 [[ms[k]["label"], *(" / ".join(_f(wc[c]["to_target_s"][k][lat], ",.0f", "not reached")
                                                for c in ("per_turn", "sequential")) for lat in lats)]
                  for k in ms])]
    rows = []
    for c in ("per_turn", "sequential"):
        for o, x in wc[c]["crossover"].items():
            rows.append([c.replace("_", " "), ms[o]["label"], _lat(x["latency_ms"]),
                         f"[{_lat(x['lo'])}, {_lat(x['hi'])}]", f"{100 * x['never_share']:.0f}%",
                         f"{100 * x['always_share']:.0f}%", f"{100 * x.get('neither_share', 0.0):.0f}%"])
    out += ["", f"Latency above which {ms[ref]['label']} reaches the target sooner than each method (0 ms: at every "
                "latency; never: at no latency above some value; neither reaches: neither method reaches the target, "
                "so there is no answer), with the 95 % percentile interval over the paired seed resamples that have "
                "an answer and the share of resamples where it never does / always does / neither reaches:", "",
            table(["Concurrency", "Against", "Sooner above", "95 % interval", "Never", "Always", "Neither"], rows)]
    rows = []
    for c in ("per_turn", "sequential"):
        for row in wc[c].get("crossover_by_target", []):
            for o, x in row.items():
                if o != "target":
                    rows.append([c.replace("_", " "), f"{row['target']:.3f}", ms[o]["label"], _lat(x["latency_ms"]),
                                 f"[{_lat(x['lo'])}, {_lat(x['hi'])}]", f"{100 * x['never_share']:.0f}%",
                                 f"{100 * x['always_share']:.0f}%", f"{100 * x.get('neither_share', 0.0):.0f}%"])
    if rows:
        out += ["", f"The same against the on-policy baselines at lower targets (half, three quarters and all of the "
                    f"way from the warm start's curve value {wc['start']:.3f} to the target): one target is one point "
                    "of a noisy curve.", "",
                table(["Concurrency", "Target", "Against", "Sooner above", "95 % interval", "Never", "Always",
                       "Neither"], rows)]
    return out
