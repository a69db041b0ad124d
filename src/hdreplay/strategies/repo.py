"""Deprecated alias of :mod:`hdreplay.baselines.repo` (see the README's changelog): importing it warns; every name is
the same object."""

import sys
import warnings

from ..baselines import repo as _moved

warnings.warn("hdreplay.strategies.repo moved to hdreplay.baselines.repo; the old path will be removed in the release "
              "after next", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
