"""Replay analytics and tau calibration built from run logs (issue 5).

Layers (each usable alone):
    load            run directories and JSONL with a bad-line policy  -> RunData
    gate, age, lifetime, counterfactual, entropy, training
                    pure section functions: step / group / log records -> dicts of numbers
    calibration     pure tau-calibration diagnostics, flags and recommendation -> dataclasses
    report, calibrate   orchestration + writing (markdown via ``markdown``, PNG via ``figures``)

Entry points for the CLI: :func:`main_report` (``hdreplay report``) and
:func:`main_calibrate_summary` (``hdreplay calibrate``).  matplotlib / tqdm are imported only when
figures / progress bars are produced.
"""

from .age import age_gate, mixing, phase_mixture, pool_ages, staleness
from .calibrate import run_calibration, summarize_calibration, main_calibrate_summary
from .calibration import (
    CalibrationCriteria, CalibrationSummary, Recommendation, RunDiagnostics, compare_adaptive, diagnose, recommend,
)
from .counterfactual import counterfactual
from .entropy import EntropyThresholds, collapse_timing, first_held
from .gate import acceptance, prefix_share, replay_kl, scan
from .lifetime import headroom_deciles, multiplicity
from .load import AnalysisInputError, BadLineWarning, RunData, load_run, read_jsonl
from .report import ReportSettings, analyze_run, build_report, main_report, write_report
from .training import log_series, training

__all__ = [
    "AnalysisInputError", "BadLineWarning", "CalibrationCriteria", "CalibrationSummary", "EntropyThresholds",
    "Recommendation", "ReportSettings", "RunData", "RunDiagnostics", "acceptance", "age_gate", "analyze_run",
    "build_report", "collapse_timing", "compare_adaptive", "counterfactual", "diagnose", "first_held",
    "headroom_deciles", "load_run", "log_series", "main_calibrate_summary", "main_report", "mixing",
    "multiplicity", "phase_mixture", "pool_ages", "prefix_share", "read_jsonl", "recommend", "replay_kl",
    "run_calibration", "scan", "staleness", "summarize_calibration", "training", "write_report",
]
