"""The replay methods compared with Headroom-Drift Replay, at the TRL seam: ExGRPO, BAPO, POPO, DAPO's dynamic sampling,
and the table that builds a run's strategy.  Open ``strategies.py`` first (one row per strategy, its hooks)."""
