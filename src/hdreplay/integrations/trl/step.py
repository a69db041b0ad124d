"""Where :class:`ReplayStep` and :class:`Generation` lived before they joined :mod:`.batch` (the rows of a
generation, held until commit, sit in the same file that reads them into groups).  Kept as an alias."""

from .batch import Generation, ReplayStep  # noqa: F401

__all__ = ["Generation", "ReplayStep"]
