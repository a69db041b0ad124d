"""Deprecated alias of :mod:`hdreplay.baselines.exgrpo` (see the README's changelog): importing it warns; every name is
the same object."""

import sys
import warnings

from ..baselines import exgrpo as _moved

warnings.warn("hdreplay.strategies.exgrpo moved to hdreplay.baselines.exgrpo; the old path will be removed in the release "
              "after next", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
