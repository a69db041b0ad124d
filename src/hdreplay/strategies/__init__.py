"""Deprecated: the peer strategies moved to :mod:`hdreplay.baselines` (RePO, ExGRPO, BAPO, their store; see the
README's changelog).  ``hdreplay.strategies.<name>`` still imports, as an alias of ``hdreplay.baselines.<name>``."""
