"""Progress of the lab's long loops: a tqdm bar on a terminal, a short line every few percent elsewhere.

A bar redrawn into a file (``make demo > log 2>&1``, CI) is hundreds of carriage-return updates; off a terminal
:func:`progress` prints one plain line (tqdm's own meter text) each time another 1/``lines`` of the total is done, and
at the end.  ``tqdm(disable=None)`` only switches the bar off; the line every N steps is what :class:`LineProgress`
adds (tqdm has no mode that ends its updates with a newline at a chosen step interval).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Iterable, Iterator

from tqdm.auto import tqdm


def on_terminal() -> bool:
    """True when both stdout and stderr (where a bar is drawn) are terminals."""
    return all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


class LineProgress:
    """The part of tqdm's interface the lab uses (update, n, set_description, refresh, close, iteration, ``with``),
    printing a line to stdout whenever ``n`` reaches the next multiple of ``every`` (and once more at close)."""

    def __init__(self, iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, every: int = 1) -> None:
        self.iterable, self.total, self.desc, self.unit, self.n = iterable, total, desc, unit, initial
        self.every, self._t0, self._shown = max(1, every), time.monotonic(), initial
        self._next = (initial // self.every + 1) * self.every

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable:
            yield item
            self.update()

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def refresh(self) -> None:
        if self.n >= self._next:
            self._print()
            self._next = (self.n // self.every + 1) * self.every

    def close(self) -> None:
        if self.n != self._shown:
            self._print()

    def _print(self) -> None:
        self._shown = self.n
        meter = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}]"
        print(tqdm.format_meter(self.n, self.total, time.monotonic() - self._t0, prefix=self.desc, unit=self.unit,
                                bar_format=meter), flush=True)


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             initial: int = 0, enabled: bool = True, lines: int = 20, leave: bool = True):
    """A tqdm bar on a terminal; elsewhere a :class:`LineProgress` printing about ``lines`` lines (``lines=0``:
    none); nothing when not ``enabled``."""
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if not enabled or (not on_terminal() and lines == 0):
        return tqdm(iterable, total=total, disable=True)
    if on_terminal():
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave, dynamic_ncols=True)
    return LineProgress(iterable, total=total, desc=desc, unit=unit, initial=initial,
                        every=math.ceil((total or lines) / lines))
