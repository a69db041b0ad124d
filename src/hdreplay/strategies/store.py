"""Deprecated alias of :mod:`hdreplay.baselines.store` (see the README's changelog): importing it warns; every name is
the same object."""

import sys
import warnings

from ..baselines import store as _moved

warnings.warn("hdreplay.strategies.store moved to hdreplay.baselines.store; the old path will be removed in the release "
              "after next", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
