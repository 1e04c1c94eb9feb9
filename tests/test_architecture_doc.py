"""docs/architecture.md's module table stays true: every module of the package has its row, and
the size it gives is the module's size (within 15% or 25 lines: the table is a map, not a
ledger; regenerate the sizes with ``python tests/test_architecture_doc.py``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "speedtronic"
ROW = re.compile(r"^\| `([^`]+)` \| (\d[\d,]*) \| (.+) \|$")
#: The 2.0.0 import paths: same-shaped seven-line modules, one row for all of them.
SHIM_ROW = "2.0.0 paths"


def _modules() -> dict[str, int]:
    sizes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        text = path.read_text()
        if "speedtronic.compat.ALIASES" in text and len(text.splitlines()) <= 10:
            continue  # a 2.0.0 path module (covered by SHIM_ROW)
        sizes[path.relative_to(PACKAGE).as_posix()] = len(text.splitlines())
    return sizes


def _table() -> dict[str, int]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = int(match.group(2).replace(",", ""))
    return rows


def test_every_module_has_a_row_with_its_size() -> None:
    actual, table = _modules(), _table()
    assert sorted(set(actual) - set(table)) == [], "modules missing from docs/architecture.md"
    assert sorted(set(table) - set(actual)) == [], "rows for modules that do not exist"
    off = {
        name: (table[name], lines)
        for name, lines in actual.items()
        if abs(table[name] - lines) > max(25, 0.15 * lines)
    }
    assert off == {}, "sizes in docs/architecture.md drifted (doc, actual)"


def test_the_2_0_0_paths_have_their_row() -> None:
    assert f"| {SHIM_ROW} |" in DOC.read_text()


if __name__ == "__main__":  # rewrite the size column in place
    sizes = _modules()
    out = []
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match and match.group(1) in sizes:
            line = f"| `{match.group(1)}` | {sizes[match.group(1)]:,} | {match.group(3)} |"
        out.append(line)
    DOC.write_text("\n".join(out) + "\n")
    sys.exit(0)
