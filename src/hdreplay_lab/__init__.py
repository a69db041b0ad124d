"""hdreplay_lab: the lab beside the core library.

    sandbox/    tiny models, tasks, warm start, evaluation, methods, one run, comparisons (CPU)
    analysis/   replay analytics and tau calibration from run logs (pandas, matplotlib)
    synthetic   a model-free policy and group generator (tests, ``hdreplay explain``)
    cli         the ``hdreplay`` command

The core library (``hdreplay``) never imports this package.
"""
