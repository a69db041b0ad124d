"""Deprecated alias of :mod:`hdreplay.integrations.layout` (the verl recipe's mini-batch layout; see the README's
changelog).  Importing it warns; the functions are the same objects."""

import importlib
import sys
import warnings

warnings.warn("hdreplay.layout moved to hdreplay.integrations.layout (used by the verl recipe only); the old path "
              "will be removed in the release after next", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("hdreplay.integrations.layout")
