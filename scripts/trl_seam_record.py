"""Rewrite tests/trl/data/trl_seam.json: the TRL seam (what hdreplay overrides on TRL / transformers classes and the
private names it uses), found by scanning src/, fingerprinted against the installed trl and transformers; what only
the lab (hdreplay_lab) uses is recorded apart, in the record's "lab" section.

    PYTHONPATH=src .venv/bin/python scripts/trl_seam_record.py

Run it after changing the seam (tests/trl/test_trl_seam_contract.py says when), and after moving the TRL pin once
hdreplay has been adapted to the new release.  Give every new item its line in docs/trl.md ("The seam").
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import trl_seam  # noqa: E402


def main() -> None:
    record = trl_seam.write_record()
    v = record["recorded_with"]
    counts = []
    for section, what in (("items", "seam items"), ("lab", "lab-only items")):
        kinds: dict[str, int] = {}
        for item in record[section].values():
            kinds[item["kind"]] = kinds.get(item["kind"], 0) + 1
        counts.append(f"{len(record[section])} {what} ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))})")
    print(f"{trl_seam.RECORD.relative_to(trl_seam.ROOT)}: {'; '.join(counts)} against trl {v['trl']}, "
          f"transformers {v['transformers']}")


if __name__ == "__main__":
    main()
