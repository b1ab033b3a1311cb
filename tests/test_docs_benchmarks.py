"""BENCHMARKS.md stays a reference a user reads: speed, memory and bytes tables within its first
60 lines, under 500 lines in all, every headline table followed by its sections, and headed places
for the tables still to come (GPU, mixture of experts, low-bit optimizer state)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")


def _sections() -> dict[str, tuple[int, str]]:
    """``{heading: (first line number, body)}`` of the ``##`` sections."""
    lines = TEXT.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("## ")]
    return {
        lines[s][3:]: (s + 1, "\n".join(lines[s + 1 : e]))
        for s, e in zip(starts, starts[1:] + [len(lines)])
    }


def test_short_with_speed_memory_and_bytes_tables_first():
    assert len(TEXT.splitlines()) < 500
    sections = _sections()
    for heading in ("Speed", "Memory", "Bytes on the wire"):
        line, body = sections[heading]
        table_rows = [row for row in body.splitlines() if row.startswith("| ")]
        last_row = line + body.splitlines().index(table_rows[-1]) + 1
        assert len(table_rows) >= 3 and last_row <= 60, (heading, last_row)


def test_every_headline_table_names_its_machine_and_date():
    for heading in ("Speed", "Memory", "Bytes on the wire"):
        rows = [r for r in _sections()[heading][1].splitlines() if r.startswith("| ")][2:]
        for row in rows:
            assert re.search(r"CPU-2, 20\d\d-\d\d-\d\d", row), (heading, row)


def test_sections_in_reading_order_and_places_for_the_tables_to_come():
    order = [
        "The bench: Muon vs AdamW on the tiny GPT",
        "Optimizer step time on CPU",
        "Optimizer-step peak memory on CPU",
        "Bytes across hosts (measured on the interfaces)",
        "Time on a shaped link",
        "FSDP2 / tensor parallel",
        "Megatron-Core",
        "GPU",
        "Mixture of experts",
        "Low-bit optimizer state",
    ]
    sections = _sections()
    lines = [sections[h][0] for h in order]
    assert lines == sorted(lines)
    for heading in ("Mixture of experts", "Low-bit optimizer state"):
        assert "go here" in sections[heading][1], heading  # where the next tables go
    assert "| figure | target |" in sections["GPU"][1]  # measured on a card, with targets
