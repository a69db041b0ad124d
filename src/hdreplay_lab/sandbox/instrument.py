"""Per-step instrumentation of a sandbox run: what the comparison's evidence is computed from.

:class:`StepStats` is the one per-step state object; two things fill it:

* the sandbox trainer (:func:`sandbox_trainer_class`, a subclass of ``HDRGRPOTrainer``) at TRL's two
  seams that see a step's fresh rollouts: ``_generate`` (generated tokens, generation seconds, the
  modelled rollout cost) and ``_calculate_rewards`` (the prompts in order and the per-group reward
  variance).  Both post-process TRL's own result; nothing of TRL is copied.
* :class:`Instrument`, a ``TrainerCallback``: adds them to each step's log entry (which hdreplay's
  ``HDRLogCallback`` writes to ``train_log.jsonl``), measures each step's process CPU time, and runs the held-out
  curve every ``eval_every`` steps.

Environment cost (multi-turn tasks)
-----------------------------------
With ``tool_calls`` (a counter of the calls that reached the environment), ``_generate`` counts per step the tool
calls and the tool *turns*: rounds of TRL's tool loop in which at least one row called a tool (TRL regenerates
after each round, so a round closes when the next ``_generate_single_turn`` starts or ``_generate`` returns).
``turn_latency_s`` sleeps once per such turn: every call of a turn in flight at once, turns one after another, as
Search-R1 sends each turn's queries to its retriever in one batch (envcost.py; TRL 1.16 itself runs sync tools one
by one, which the environment's own per-call sleep models instead).

Modelled rollout cost
---------------------
A tiny model sampling on CPU is overhead-bound: 1.5x more fresh rollouts cost almost nothing, unlike
an LLM serving engine whose decode is throughput-bound.  ``rollout_ms_per_token`` adds a sleep of that
many milliseconds per generated token after TRL's ``_generate`` (the idea of benchmarks/trl_step.py).
A sleep uses no CPU, so the cost is exact and independent of machine load; it is recorded in
``run.json`` and every ``train_log.jsonl`` line carries the step's generated tokens and its cumulative
count, so the wall-clock of the same run under any other per-token cost is
``train_s + (c' - c) * cum_gen_tokens`` (:func:`hdreplay_lab.sandbox.curves.wall_at_cost`).

train_log.jsonl keys added here (besides TRL's log entries and HDRLogCallback's wall_s / step_s)
    train_s         seconds since training began, held-out evaluation time excluded
    gen_s           seconds inside ``_generate`` this step (including the modelled cost)
    gen_tokens      completion tokens generated this step; cum_gen_tokens: since step 1 (tool result tokens
                    included: the rollout cost is charged on them too)
    policy_tokens   completion tokens the policy generated (tool mask 1; tool results excluded)
    tool_calls      tool calls that reached the environment this step; tool_turns: rounds of the tool loop with
                    at least one call (see above)
    cpu_s           process CPU seconds of the step (on_step_begin .. on_step_end: the same interval as step_s;
                    no sleep, little contention: one torch thread per process)
    groups          fresh groups this step; zero_var_groups: those whose rewards are all equal
    zero_variance_share   zero_var_groups / groups (for every method, replay or not)
prompts.jsonl: {"step", "prompts"}: the prompts the dataloader handed each step, in the sampler's order (one per
                group; before dynamic sampling's extra rounds, BAPO's re-evaluations or ExGRPO's substitutions)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np


@dataclass
class StepStats:
    """What the trainer's seams saw during the current step (reset when the step is logged)."""

    gen_s: float = 0.0
    gen_tokens: int = 0
    groups: int = 0
    zero_var_groups: int = 0
    prompts: list = field(default_factory=list)
    cum_gen_tokens: int = 0
    #: fresh groups generated so far, over every generation round (DAPO dynamic sampling's discarded ones included)
    cum_groups: int = 0
    policy_tokens: int = 0
    tool_calls: int = 0
    tool_turns: int = 0
    cpu_s: float = 0.0
    #: totals since step 1 of the per-step counts above (the held-out curve's points carry them)
    cum: dict = field(default_factory=lambda: {"policy_tokens": 0, "tool_calls": 0, "tool_turns": 0, "cpu_s": 0.0})
    #: set by the trainer when it counts tool calls (a step without any then logs 0 of them, not nothing)
    counts_tools: bool = False

    def take(self) -> dict:
        """This step's fields for train_log.jsonl; resets the per-step counters."""
        self.cum_gen_tokens += self.gen_tokens
        self.cum_groups += self.groups
        for k in self.cum:
            self.cum[k] += getattr(self, k)
        out = {"gen_s": self.gen_s, "gen_tokens": self.gen_tokens, "cum_gen_tokens": self.cum_gen_tokens,
               "groups": self.groups, "zero_var_groups": self.zero_var_groups,
               "zero_variance_share": self.zero_var_groups / self.groups if self.groups else None,
               "policy_tokens": self.policy_tokens, "cpu_s": self.cpu_s, "prompts": self.prompts}
        if self.counts_tools:
            out.update(tool_calls=self.tool_calls, tool_turns=self.tool_turns)
        self.gen_s, self.gen_tokens, self.groups, self.zero_var_groups, self.prompts = 0.0, 0, 0, 0, []
        self.policy_tokens, self.tool_calls, self.tool_turns, self.cpu_s = 0, 0, 0, 0.0
        return out


def zero_variance_groups(rewards, n: int) -> int:
    """Groups whose ``n`` rewards are all equal (up to 1e-8), rewards in group order.

    rewards: (G * n,) -- TRL's sampler repeats each prompt ``n`` times consecutively.
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if n < 1 or r.size % n:
        raise ValueError(f"{r.size} rewards do not split into groups of n={n}")
    g = r.reshape(-1, n)
    return int((np.abs(g - g[:, :1]).max(axis=1) <= 1e-8).sum())


def sandbox_trainer_class():
    """``HDRGRPOTrainer`` with the two measuring seams (built lazily: importing this module stays light)."""
    from hdreplay.integrations.trl import HDRGRPOTrainer

    class SandboxTrainer(HDRGRPOTrainer):
        def __init__(self, *args, stats: StepStats, rollout_ms_per_token: float = 0.0,
                     tool_calls: Callable[[], int] | None = None, turn_latency_s: float = 0.0, **kwargs):
            super().__init__(*args, **kwargs)
            self.step_stats, self.rollout_s_per_token = stats, rollout_ms_per_token / 1000.0
            self.tool_calls, self.turn_latency_s = tool_calls, turn_latency_s
            self._calls_mark = tool_calls() if tool_calls else 0
            stats.counts_tools = tool_calls is not None

        def _close_turn(self) -> None:
            """Count the tool calls made since the last mark as one turn (if any), sleeping the turn latency."""
            if self.tool_calls is None:
                return
            now = self.tool_calls()
            if now > self._calls_mark:
                self.step_stats.tool_calls += now - self._calls_mark
                self.step_stats.tool_turns += 1
                if self.turn_latency_s:
                    time.sleep(self.turn_latency_s)
            self._calls_mark = now

        def _generate_single_turn(self, *args, **kwargs):
            if self.model.training:  # TRL regenerates after each round of tool calls: that round is a turn
                self._close_turn()
            return super()._generate_single_turn(*args, **kwargs)

        def _generate(self, prompts):
            t0 = time.perf_counter()
            training = self.model.training
            if training and self.tool_calls is not None:
                self._calls_mark = self.tool_calls()  # calls outside training rollouts (evaluation) do not count
            out = super()._generate(prompts)
            if training:
                self._close_turn()  # a last round whose results were all dropped as overlong still ran its calls
                tokens = sum(len(c) for c in out[1])  # out[1]: completion_ids, one list per row
                if self.rollout_s_per_token:
                    time.sleep(self.rollout_s_per_token * tokens)
                self.step_stats.gen_tokens += tokens
                mask = out[2]  # tool_mask: 1 on tokens the policy generated, None without tools
                self.step_stats.policy_tokens += tokens if mask is None else int(sum(sum(m) for m in mask))
                self.step_stats.gen_s += time.perf_counter() - t0
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            if self.model.training:
                n = self.num_generations
                w = self.reward_weights.to(per_func.device)
                rewards = (per_func * w.unsqueeze(0)).nansum(dim=1).cpu().numpy()
                self.step_stats.groups += len(rewards) // n
                self.step_stats.zero_var_groups += zero_variance_groups(rewards, n)
            return per_func

        def _generate_and_score_completions(self, inputs):
            if self.model.training:  # the dataloader's batch, before a strategy adds or substitutes prompts
                self.step_stats.prompts += [_prompt_key(x) for x in inputs[::self.num_generations]]
            return super()._generate_and_score_completions(inputs)

    return SandboxTrainer


def _prompt_key(row: dict) -> str:
    p = row.get("question", row.get("prompt"))
    return p if isinstance(p, str) else json.dumps(p)


class Instrument:
    """A ``TrainerCallback`` placed before hdreplay's ``HDRLogCallback``: adds this step's measurements (StepStats)
    to the step's log entry, so train_log.jsonl (and TensorBoard) carry them; writes ``prompts.jsonl``; runs the
    held-out curve.

    ``curve_fn()`` evaluates the current model (returns a dict) every ``eval_every`` steps, at the last step and at
    step 0; its time is excluded from ``train_s`` (and from the curve's ``wall_s``).  Built lazily so importing
    this module does not import transformers.
    """

    def __new__(cls, *a, **k):
        from transformers import TrainerCallback

        class _Instrument(TrainerCallback):
            def __init__(self, run_dir: Path, stats: StepStats, *, curve_fn: Callable[[], dict] | None = None,
                         eval_every: int = 0, generations: int = 1):
                self.stats, self.curve_fn, self.eval_every = stats, curve_fn, eval_every
                self.generations = generations
                self.t0 = None
                self.cpu0 = None
                self.eval_s = 0.0
                self.prompts = open(run_dir / "prompts.jsonl", "w")
                self.curve = open(run_dir / "curve.jsonl", "w") if curve_fn else None

            def _train_s(self) -> float:
                return time.perf_counter() - self.t0 - self.eval_s

            def _evaluate(self, step: int) -> None:
                wall = self._train_s() if step else 0.0
                t = time.perf_counter()
                res = self.curve_fn()
                self.eval_s += time.perf_counter() - t
                # responses generated so far: every generation round counted (steps x b x n unless dynamic sampling)
                rec = {"step": step, "fresh_responses": self.stats.cum_groups * self.generations, "wall_s": wall,
                       "cum_gen_tokens": self.stats.cum_gen_tokens,
                       **{f"cum_{k}": v for k, v in self.stats.cum.items()}, **res}
                self.curve.write(json.dumps(rec) + "\n")
                self.curve.flush()

            def on_train_begin(self, args, state, control, **kw):
                self.t0 = time.perf_counter()
                if self.curve_fn:
                    self._evaluate(0)

            def on_step_begin(self, args, state, control, **kw):
                self.cpu0 = time.process_time()

            def on_step_end(self, args, state, control, **kw):
                if self.cpu0 is not None:
                    self.stats.cpu_s += time.process_time() - self.cpu0
                    self.cpu0 = None

            def on_log(self, args, state, control, logs=None, **kw):
                if logs is None or "loss" not in logs:
                    return
                step = state.global_step
                took = self.stats.take()
                self.prompts.write(json.dumps({"step": step, "prompts": took.pop("prompts")}) + "\n")
                self.prompts.flush()
                logs.update({k: v for k, v in took.items() if v is not None}, train_s=self._train_s())
                # the curve point after this step's bookkeeping (cum_gen_tokens now includes the step)
                if self.curve_fn and self.eval_every and (step % self.eval_every == 0 or step == args.max_steps):
                    self._evaluate(step)

            def close(self):
                self.prompts.close()
                if self.curve:
                    self.curve.close()

        return _Instrument(*a, **k)
