"""Deprecated alias of :mod:`hdreplay.baselines.bapo` (see the README's changelog): importing it warns; every name is
the same object."""

import sys
import warnings

from ..baselines import bapo as _moved

warnings.warn("hdreplay.strategies.bapo moved to hdreplay.baselines.bapo; the old path will be removed in the release "
              "after next", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
