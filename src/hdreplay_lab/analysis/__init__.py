"""Replay analytics and tau calibration built from run logs, on pandas.

Layers (each usable alone):
    load            run directories -> RunData of DataFrames (JSONL with a bad-line policy, TRL log_history,
                    TensorBoard scalars)
    gate, age, lifetime, training
                    pure section functions: step / group / log frames -> dicts of numbers
    calibration     pure tau-calibration diagnostics, flags and recommendation -> dataclasses
    report, calibrate   orchestration + writing (markdown via ``markdown``, PNG via ``figures``)

The ``hdreplay report`` / ``hdreplay calibrate`` commands (``hdreplay_lab.cli``) call :func:`build_report` /
:func:`write_report` and :func:`summarize_calibration` / :func:`run_calibration`.
"""

from .age import age_gate, mixing, phase_mixture, pool_ages, staleness
from .calibration import (
    CalibrationCriteria,
    CalibrationSummary,
    Recommendation,
    RunDiagnostics,
    compare_adaptive,
    diagnose,
    recommend,
    run_calibration,
    summarize_calibration,
)
from .gate import acceptance, prefix_share, replay_kl, scan
from .lifetime import counterfactual, headroom_deciles, multiplicity
from .load import AnalysisInputError, BadLineWarning, RunData, load_run, read_jsonl, step_frame
from .report import ReportSettings, analyze_run, build_report, write_report
from .training import EntropyThresholds, collapse_timing, log_series, training

__all__ = [
    "AnalysisInputError", "BadLineWarning", "CalibrationCriteria", "CalibrationSummary", "EntropyThresholds",
    "Recommendation", "ReportSettings", "RunData", "RunDiagnostics", "acceptance", "age_gate", "analyze_run",
    "build_report", "collapse_timing", "compare_adaptive", "counterfactual", "diagnose", "headroom_deciles",
    "load_run", "log_series", "mixing", "multiplicity", "phase_mixture", "pool_ages", "prefix_share", "read_jsonl",
    "recommend", "replay_kl", "run_calibration", "scan", "staleness", "step_frame", "summarize_calibration",
    "training", "write_report",
]
