"""docs/diloco.md's failure table names real tests: every ``file::test`` it cites exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "diloco.md"
SHORT = {
    "node": "test_diloco_node.py",
    "master": "test_diloco_master.py",
    "lifecycle": "test_diloco_lifecycle.py",
    "master_lifecycle": "test_diloco_master_lifecycle.py",
    "store_safety": "test_diloco_store_safety.py",
    "link_bytes": "test_diloco_link_bytes.py",
}


def _table() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## What goes wrong, and what the protocol does", 1)[1]
    section = section.split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "`" in line]


def test_the_failure_table_opens_the_page_and_every_test_it_names_exists():
    text = DOC.read_text(encoding="utf-8")
    assert text.index("## The round, in fifteen lines") < text.index("## Running it")
    rows = _table()
    assert len(rows) >= 20
    cited = 0
    for row in rows:
        tests_cell = row.rstrip(" |").rsplit("|", 1)[1]
        for ref in re.findall(r"`([^`]+)`", tests_cell):
            name, _, test = ref.partition("::")
            path = ROOT / "tests" / SHORT.get(name, name)
            assert path.exists(), f"{ref}: no file {path}"
            if test:
                assert re.search(rf"^def {re.escape(test)}\(", path.read_text(), re.M), (
                    f"{ref}: no such test"
                )
            cited += 1
    assert cited >= len(rows)
