"""The import arrows docs/architecture.md draws: config/ imports nothing above it, and no
product module imports the Hub emulator of speedtronic/testing/ (lazy imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "speedtronic"


def _imports(path: Path) -> set[str]:
    """Every ``speedtronic...`` module ``path`` imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name == "speedtronic" or name.startswith("speedtronic.")}


def _modules(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def test_config_imports_nothing_above_it():
    climbing = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in _modules(PACKAGE / "config")
        for name in _imports(path)
        if not name.startswith("speedtronic.config")
    }
    assert climbing == set()


def test_metrics_imports_nothing_from_train():
    """The metrics layer sits beside the trainer: it names no trainer type, even for the
    checker (the start-up lines take the values they print)."""
    climbing = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in _modules(PACKAGE / "metrics")
        for name in _imports(path)
        if name == "speedtronic.train" or name.startswith("speedtronic.train.")
    }
    assert climbing == set()


def test_no_product_module_imports_the_testing_package():
    testing = PACKAGE / "testing"
    offenders = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in _modules(PACKAGE)
        if testing not in path.parents
        for name in _imports(path)
        if name == "speedtronic.testing" or name.startswith("speedtronic.testing.")
    }
    assert offenders == set()


def test_the_checks_see_lazy_imports(tmp_path):
    """The walker finds an import inside a function, so the two tests above can fail."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from speedtronic.data.tokenizer import load_tokenizer\n")
    assert "speedtronic.data.tokenizer" in _imports(module)
