"""Run a comparison's (method, seed) jobs, ``workers`` at a time, each in its own process.

One process per run: torch's intra-op pool is per process, and each worker runs one thread (env.py), so
two workers use the two cores of a small machine without oversubscribing them.  With one worker the runs
go in this process (no start-up cost, the progress follows every step).  With several, the progress follows
the runs' ``train_log.jsonl`` line counts.  Progress is a bar on a terminal, else a line every 5 % of the steps
(progress.py).  A run that fails stops the comparison with its error; runs finished before it stay finished
(their metrics.json is complete), so the same command continues where it stopped.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from pathlib import Path


def _job(spec, model_dir: str, run_dir: str) -> str:
    """One run (top level, so a spawned worker can import it)."""
    from ..env import configure_threads, offline_env
    from .methods import get_methods
    from .runner import run_one
    from .tasks import get_task

    offline_env()
    configure_threads()
    import warnings

    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
    run_one(spec, get_methods([spec.method])[0], get_task(spec.task), Path(model_dir), Path(run_dir))
    return run_dir


def _logged_steps(run_dir: Path) -> int:
    try:
        with open(run_dir / "train_log.jsonl", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def run_jobs(cfg, jobs: list[tuple], model_dir: Path, *, total_steps: int, done_steps: int = 0,
             progress: bool = True) -> None:
    """Run ``jobs`` [(RunSpec, run_dir)] with ``cfg.workers`` processes (see the module docstring)."""
    from ..progress import progress as progress_bar

    bar = progress_bar(total=total_steps, initial=done_steps, unit="step", enabled=progress)
    try:
        if cfg.workers == 1 or len(jobs) <= 1:
            from .methods import get_methods
            from .runner import run_one
            from .tasks import get_task

            for spec, run_dir in jobs:
                bar.set_description(f"{spec.method} seed {spec.seed}")
                run_one(spec, get_methods([spec.method])[0], get_task(spec.task), model_dir, run_dir,
                        on_step=bar.update)
            return
        ctx = mp.get_context("spawn")  # no forked torch state (thread pools, RNG) in the workers
        ex = ProcessPoolExecutor(max_workers=min(cfg.workers, len(jobs)), mp_context=ctx)
        try:
            futs = {ex.submit(_job, spec, str(model_dir), str(d)): Path(d) for spec, d in jobs}
            pending = set(futs)
            finished_steps = done_steps
            while pending:
                done, pending = wait(pending, timeout=2.0, return_when=FIRST_EXCEPTION)
                for f in done:
                    f.result()  # raises the run's error
                    finished_steps += cfg.steps
                running = sum(min(_logged_steps(futs[f]), cfg.steps) for f in pending if futs[f].exists())
                bar.n = finished_steps + running
                bar.set_description(f"{len(futs) - len(pending)}/{len(futs)} runs")
                bar.refresh()
        except BaseException:
            ex.shutdown(wait=False, cancel_futures=True)  # runs not started never start
            raise
        ex.shutdown(wait=True)
    finally:
        bar.close()

