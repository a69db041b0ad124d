"""The policy-lag sandbox (``hdreplay compare-async``): asynchronous GRPO on the CPU sandbox with a modelled pipeline.

pipeline.py   the modelled generation pipeline: slots, group durations (long-tailed, longer for longer
              completions), arrivals, AReaL-style throttling; the modelled wall-clock
methods.py    what each compared method does with a group that arrives k policy versions behind
learner.py    sampling with a perturbed (bf16) sampler, the losses (PPO-clip against the sampler, decoupled
              PPO with truncated importance weights), the re-scorer
run.py        one run of one method and seed at a fixed number of generated groups
compare.py    every method x seed, resumable, progress in a log; summary.py / plots.py: tables, intervals, PNGs
"""
