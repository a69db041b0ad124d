"""The evidence page (README section and docs/results/README.md): every claim row has a verdict, and every figure and
result it links is committed."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERDICTS = ("reproduced", "same direction, not separated", "not reproduced", "partly")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _rows(path: Path, heading: str) -> list[str]:
    text = path.read_text()
    if heading not in text:
        pytest.fail(f"{path.relative_to(ROOT)} has no section {heading!r}")
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return [x for x in section.splitlines() if x.startswith("|") and not x.startswith("|---")][1:]


@pytest.mark.parametrize("doc, heading, base", [
    ("docs/results/README.md", "## Evidence: which of the paper's claims the sandbox reproduces", "docs/results"),
    ("README.md", "## Where replay pays: the evidence", "."),
])
def test_every_evidence_row_has_a_verdict_and_committed_links(doc, heading, base):
    rows = _rows(ROOT / doc, heading)
    assert len(rows) >= 8, rows
    claims = " ".join(rows).lower()
    for topic in ("math", "multimodal", "search", "tau", "strateg", "gate cost", "asynchronous"):
        assert topic in claims, f"{doc}: no row about {topic}"
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        assert any(f"**{v}" in cells[1] for v in VERDICTS), f"{doc}: no verdict in {row[:120]}"
        links = LINK.findall(row)
        assert len(links) >= 2, f"{doc}: a row needs a figure and a result link: {row[:120]}"
        for link in links:
            target = (ROOT / base / link.split("#", 1)[0]).resolve()
            assert target.exists() and ROOT in target.parents, f"{doc}: {link} does not exist"
        assert any(x.endswith(".png") for x in links), f"{doc}: no figure in {row[:120]}"
