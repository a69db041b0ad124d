"""Replay strategies beyond the (order, gate) selectors that need state of their own (per-prompt stores).

Only :mod:`.repo` (RePO's per-prompt stores and retrieval rules) lives here so far; it is not wired into a trainer
yet (see docs/strategies.md).  The selector-level strategies (uniform FIFO, FreshPER, rollout-level |A| priority)
are selectors of :mod:`hdreplay.selection`.
"""
