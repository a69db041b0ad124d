"""Progress bars for long work (tqdm when installed and enabled, a plain iterator otherwise).

Use as ``with closing(progress(items, desc=...)) as it: ...`` so that an error inside the loop
clears the bar before the error message is printed.
"""

from __future__ import annotations

from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], *, desc: str, enabled: bool = True, total: int | None = None) -> Iterator[T]:
    """Iterate ``items`` with a tqdm bar on stderr (``desc`` names the work) when ``enabled``."""
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm ships with the [sandbox] extra
            pass
        else:
            bar = tqdm(items, desc=desc, total=total, leave=False)
            try:
                yield from bar
            finally:
                bar.close()
            return
    yield from items
