"""Replay strategies that need state of their own beyond the (order, gate) selectors of :mod:`hdreplay.selection`.

:mod:`.repo`: RePO's per-prompt stores, retrieval rules and :class:`~.repo.RepoController` (a prompt-conditioned
controller the TRL integration uses for ``replay_repo``); :mod:`.bapo`: BAPO's uid store with score histories,
eligibility ranges, category eviction and :class:`~.bapo.BapoController` (``replay_bapo``); :mod:`.store`: the per-prompt records' checkpoint format.
The selector-level strategies (uniform FIFO, FreshPER, rollout-level |A| priority) are selectors; the strategy
registry of the sandbox is ``hdreplay_lab/sandbox/methods.py``; docs/strategies.md documents all of them.
"""
