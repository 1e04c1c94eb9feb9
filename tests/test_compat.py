"""The 2.0.0 import paths: one alias table (speedtronic.compat), a DeprecationWarning, and
the very objects of the real modules."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from speedtronic.compat import ALIASES

REPO = Path(__file__).resolve().parents[1]


def _file_of(old: str) -> Path:
    """Where the module of the 2.0.0 path ``old`` is written."""
    path = REPO.joinpath(*old.split("."))
    return path / "__init__.py" if ALIASES[old].package else path.with_suffix(".py")


def _fresh_import(name: str) -> tuple[object, list[warnings.WarningMessage]]:
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    parent = name.rpartition(".")[0]
    if parent in ALIASES and parent in sys.modules:
        del sys.modules[parent]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, caught


def test_each_old_path_is_a_thin_module_of_the_table():
    """The 2.0.0 paths are files, so no finder is needed; each only calls deprecated_module,
    and the table (not the file) says what it holds. No old-path file outside the table."""
    bodies = {}
    for old in ALIASES:
        tree = ast.parse(_file_of(old).read_text())
        code = [node for node in tree.body if not isinstance(node, ast.Expr)]  # the docstring
        bodies[old] = [ast.dump(node) for node in code]
    assert len({tuple(body) for body in bodies.values()}) == 1, "the files differ"
    assert all(len(body) == 3 for body in bodies.values())  # import, one call, del
    package = REPO / "speedtronic" / "distributed"
    assert sorted(package.rglob("*.py")) == sorted(
        _file_of(old) for old in ALIASES if old.startswith("speedtronic.distributed")
    )


IMPORT_MACHINERY = (
    "import sys; state = lambda: (list(sys.meta_path), list(sys.path_hooks)); before = state(); "
)


def test_importing_the_package_changes_no_import_machinery():
    """``import speedtronic`` adds no finder or hook (and imports no compat code); importing a
    2.0.0 path adds none either."""
    code = IMPORT_MACHINERY + (
        "import speedtronic; assert state() == before, state(); "
        "assert 'speedtronic.compat' not in sys.modules; "
        "import warnings; warnings.simplefilter('ignore', DeprecationWarning); "
        "import speedtronic.distributed.hub, speedtronic.runtime; "
        "assert state() == before, state()"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_old_path_warns_and_resolves_to_the_real_objects(old):
    module, caught = _fresh_import(old)
    ours = [
        w for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)
    ]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "deprecated 2.0.0 import path" in str(ours[0].message)
    assert ours[0].filename == __file__  # points at the importing line, not at importlib
    alias = ALIASES[old]
    assert sorted(module.__all__) == sorted(alias.exports)
    for name in sorted(alias.names):
        value = getattr(module, name)
        owners = [importlib.import_module(t) for t in alias.targets]
        assert any(getattr(owner, name, None) is value for owner in owners), (old, name)


def test_star_import_and_non_exported_helper():
    namespace: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec("from speedtronic.precision import *", namespace)
        from speedtronic.precision import parameter_count  # 2.0.0's non-exported helper
    from speedtronic.train.precision import resolve_precision

    assert namespace["resolve_precision"] is resolve_precision
    assert callable(parameter_count)


def test_unknown_names_still_fail():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import speedtronic.distributed as dist
        import speedtronic.runtime as runtime

    with pytest.raises(AttributeError):
        _ = runtime.no_such_name
    with pytest.raises(ImportError):
        from speedtronic.distributed import no_such_name  # noqa: F401
    assert "tensors" not in dist.__all__
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("speedtronic.no_such_module")


def test_package_code_imports_only_real_paths():
    """speedtronic/, bench/ and docs never name an old path (tests of compat do)."""
    import re

    pattern = re.compile(
        r"\bspeedtronic\.(runtime|precision|trainer|shapes|scheduling|optimizers|registry|"
        r"profiling|hooks|integrations|distributed)\b"
    )
    offenders = []
    for folder, suffix in (("speedtronic", "*.py"), ("bench", "*.py")):
        for path in (REPO / folder).rglob(suffix):
            if path.name == "compat.py" or (
                path.name == "__init__.py" and path.parent.name == "speedtronic"
            ):
                continue
            offenders += [
                f"{path.relative_to(REPO)}:{m.group(0)}" for m in pattern.finditer(path.read_text())
            ]
    assert offenders == []


def test_importing_the_package_imports_no_old_path_and_no_torch():
    code = (
        "import sys, speedtronic; from speedtronic.compat import ALIASES; "
        "assert not [m for m in ALIASES if m in sys.modules]; assert 'torch' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
