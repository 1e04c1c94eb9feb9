"""Cold config-load time (``speedtronic config show``): this tree against a baseline tree.

Each sample is a fresh interpreter (``python -m speedtronic config show --config C``), so it
measures what a user waits for: interpreter start, imports (yaml, pydantic, the config
package), model schema build, loading, validating and printing the file. (Until issue 29,
``validate`` did exactly this; it is now the dry run of ``train`` and imports torch, so the
config layer is timed through ``config show``, which both trees have.) The baseline is the
package as committed at ``--baseline`` (default: 2f1b716, the config before pydantic), exported with
``git archive`` into a temporary folder. Samples alternate between the trees; medians.
The lines of ``speedtronic/config/`` are counted in both trees too (issue 21's two figures).

Byte-code caches are written by the warm-up runs (as ``pip install`` does for a user), also
when the caller's environment sets ``PYTHONDONTWRITEBYTECODE``. A third column, the *pydantic
floor*, runs the baseline tree after importing ``pydantic.dataclasses`` and building one
one-field pydantic dataclass (which discovers pydantic plugins): what any pydantic-based config
costs before its own schemas are built.

    python bench/config_validate.py                      # 15 samples each (~10 s)
    python bench/config_validate.py --samples 21 --out bench/results/config_validate.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The hand-written config package, before it moved onto pydantic (issue 21's "today").
PRE_PYDANTIC = "2f1b716"


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True).stdout


def _export(ref: str, into: Path) -> Path:
    """The ``speedtronic`` package at ``ref`` under ``into`` (returns ``into``)."""
    archive = _git("archive", "--format=tar", ref, "speedtronic")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _check_imported_from(tree: Path) -> None:
    """The package must come from ``tree`` (PYTHONPATH beats an editable install)."""
    code = "import speedtronic; print(speedtronic.__file__)"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    where = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True
    )
    if not where.stdout.strip().startswith(str(tree)):
        raise SystemExit(f"speedtronic was imported from {where.stdout.strip()}, not {tree}")


#: The pydantic floor: pydantic imported and one model built before the CLI runs.
FLOOR = (
    "import sys, runpy, dataclasses, pydantic.dataclasses as p\n"
    "p.dataclass(dataclasses.make_dataclass('One', [('x', int)]))\n"
    "sys.argv[0] = 'speedtronic'\n"
    "runpy.run_module('speedtronic', run_name='__main__', alter_sys=True)\n"
)


def _once(tree: Path, config: str, *, floor: bool = False) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # warm-up runs write both .pyc caches
    env = {k: v for k, v in env.items() if not k.startswith("SPEEDTRONIC_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["SPEEDTRONIC_SECRETS_DIR"] = "/nonexistent-speedtronic-bench"
    start = time.perf_counter()
    entry = ["-c", FLOOR] if floor else ["-m", "speedtronic"]
    entry += ["config", "show"]
    done = subprocess.run(
        [sys.executable, *entry, "--config", config],
        cwd=tree,  # `-m` puts the working directory first on sys.path
        env=env,
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"config show failed under {tree}: {done.stderr.strip()}")
    return elapsed


def config_lines(tree: Path) -> int:
    """Lines of every module in ``tree/speedtronic/config``."""
    files = sorted((tree / "speedtronic" / "config").glob("*.py"))
    return sum(len(path.read_text(encoding="utf-8").splitlines()) for path in files)


def main() -> None:
    """Time both trees, print the medians and the ratio, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=PRE_PYDANTIC, help="git ref of the baseline")
    parser.add_argument("--config", default="configs/smoke.yaml")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    ref = args.baseline
    config = str((REPO / args.config).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        baseline = _export(ref, Path(tmp))
        for tree in (REPO, baseline):  # .pyc files and the OS file cache, not the interpreter
            _check_imported_from(tree)
            _once(tree, config)
        times: dict[str, list[float]] = {"this tree": [], "baseline": [], "pydantic floor": []}
        for _ in range(args.samples):
            times["this tree"].append(_once(REPO, config))
            times["baseline"].append(_once(baseline, config))
            times["pydantic floor"].append(_once(baseline, config, floor=True))
        lines = {"this tree": config_lines(REPO), "baseline": config_lines(baseline)}
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["this tree"] / medians["baseline"]
    floor = medians["pydantic floor"] / medians["baseline"]
    for name, value in medians.items():
        print(f"{name:14s} median {value * 1000:7.1f} ms over {args.samples} cold runs")
    print(f"ratio this tree / baseline ({ref[:12]}): {ratio:.2f}x (pydantic floor {floor:.2f}x)")
    print(f"config/ lines: this tree {lines['this tree']}, baseline {lines['baseline']}")
    if args.out:
        result = {"baseline": ref, "config": args.config, "medians_s": medians, "ratio": ratio}
        result["floor_ratio"] = floor
        result["config_lines"] = lines
        result["samples_s"] = times
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
