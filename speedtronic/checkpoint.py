"""Checkpoint files: atomic writes, the ``latest.json`` pointer, pruning, safe loading.

Layout of a checkpoint directory::

    latest.json              {"step": 4, "file": "step_000000000004.pt"}
    step_000000000002.pt
    step_000000000004.pt

Every file is written atomically (:mod:`speedtronic.atomic_files`: temp file, fsync, rename,
directory fsync): a process killed mid-write leaves at worst a stale temp file, the previous
checkpoint stays loadable, and a full disk is one ``CheckpointError`` naming the file and "no
space left on device". Checkpoints hold only tensors and primitive containers and are read
with ``torch.load(weights_only=True)`` (no pickled objects).

One run per directory (:meth:`CheckpointManager.claim`): a run that finds another run's
checkpoints resumes them, deletes them (``overwrite``: only once every file can be deleted,
and only when the new run starts, :meth:`CheckpointManager.start`) or is refused.
``keep_last`` never deletes the file just written, so ``latest.json`` always names a file that
exists.

Which checkpoint resumes: the one whose *recorded* ``step`` (read from the file, tensors
memory-mapped, not the file name) is highest; the pointer's file wins a tie. ``load_latest``
skips, with a warning each, files it cannot read, files that record no valid step, and files
its ``use`` callback rejects (another model shape, other optimizer groups), and falls back to
the next; only when files exist and none is usable is it a :class:`CheckpointError`.

What goes into a file is registered, not hand-assembled (:mod:`speedtronic.checkpoint_parts`,
re-exported here). :func:`checkpoint_config` gives the commands that read a checkpoint
(``eval``, ``sample``, ``export``) the run config it carries, with its travelling tokenizer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from speedtronic.atomic_files import (
    TEMP_MARK,
    atomic_json_dump,
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_with,
    fsync_dir,
    os_reason,
)
from speedtronic.checkpoint_parts import (
    CheckpointParts,
    RNGState,
    Stateful,
    capture_rng_state,
    restore_rng_state,
)

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointParts",
    "RNGState",
    "Stateful",
    "atomic_json_dump",
    "atomic_torch_save",
    "atomic_write_bytes",
    "atomic_write_with",
    "capture_rng_state",
    "check_finite",
    "checkpoint_config",
    "non_finite",
    "os_reason",
    "read_step",
    "restore_rng_state",
]

_STEP_FILE = re.compile(r"step_(\d+)\.pt")
#: Linux ``FS_IOC_GETFLAGS`` (``_IOR('f', 1, long)``) and the inode flags no one deletes past.
_GETFLAGS = (2 << 30) | (struct.calcsize("l") << 16) | (ord("f") << 8) | 1
_IMMUTABLE_OR_APPEND = 0x10 | 0x20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or read."""


# ----------------------------------------------------------------------------- manager


def read_step(path: str | os.PathLike[str]) -> int:
    """The optimizer step recorded inside checkpoint ``path``.

    The file is opened with ``mmap=True`` so its tensors are not read (a legacy, non-zip file
    is loaded whole). ``CheckpointError`` when it is unreadable or records no valid step (an
    integer in ``[0, 10**12)``).
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        state = CheckpointManager.load(path)  # not memory-mappable: read it whole (or fail)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} does not contain a state dictionary")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**12:
        shown = repr(step) if len(repr(step)) <= 40 else repr(step)[:37] + "..."
        raise CheckpointError(f"checkpoint {path} records no valid step (step: {shown})")
    return step


def non_finite(state: dict[str, Any], chunk: int = 1 << 14) -> str | None:
    """The first floating tensor of ``state`` holding NaN or inf, else None; checked ``chunk``
    values at a time, so the check adds a few kB, not a mask the size of a tensor."""
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        flat = value.reshape(-1)
        parts = (flat[start : start + chunk] for start in range(0, flat.numel(), chunk))
        if not all(bool(torch.isfinite(part).all()) for part in parts):
            return key
    return None


def check_finite(state: dict[str, Any], source: str) -> None:
    """Refuse a model state that holds NaN or inf: a ``CheckpointError`` naming ``source`` and
    the first such tensor (a resume would train on from it as ``loss=nan``)."""
    bad = non_finite(state)
    if bad is not None:
        raise CheckpointError(f"{source}: {bad} holds NaN or inf values; its weights are refused")


def _short(exc: BaseException) -> str:
    """One informative line of a (possibly multi-paragraph) load error."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    chosen = next((line for line in lines if "Unpickler error" in line), lines[0] if lines else "")
    return f"{type(exc).__name__}: {chosen[:300]}"


class CheckpointManager:
    """Owns one checkpoint directory: naming, interval, atomic save, pruning, fallback load.

    ``every_steps`` is the save interval in optimizer steps, ``keep_last`` how many step files
    to keep (``None`` keeps all), ``warn`` a ``callable(message)`` for fallback warnings (the
    runtime passes ``MetricLogger.warning``).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_steps: int = 500,
        keep_last: int | None = 3,
        enabled: bool = True,
        save_final: bool = True,
        warn: Callable[[str], Any] | None = None,
    ) -> None:
        if int(every_steps) <= 0:
            raise ValueError("checkpoint.every_steps must be positive")
        if keep_last is not None and int(keep_last) <= 0:
            raise ValueError("checkpoint.keep_last must be positive or null")
        self.directory = Path(directory)
        self.every_steps = int(every_steps)
        self.keep_last = None if keep_last is None else int(keep_last)
        self.enabled = bool(enabled)
        self.save_final = bool(save_final)
        self.warn = warn
        self.pending_clear = False  # claim(overwrite=True): delete the old run at start()

    @property
    def pointer_path(self) -> Path:
        """``<dir>/latest.json``."""
        return self.directory / "latest.json"

    def should_save(self, step: int) -> bool:
        """True when ``step`` is a positive multiple of the interval and saving is on."""
        return self.enabled and step > 0 and step % self.every_steps == 0

    def path_for(self, step: int) -> Path:
        """``<dir>/step_<12-digit step>.pt``."""
        return self.directory / f"step_{int(step):012d}.pt"

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint for ``step``, move the pointer, prune old files.

        ``state`` gets ``"step": step`` when it records none (resume orders by it)."""
        path = self.path_for(step)
        if "step" not in state:
            state = {**state, "step": int(step)}
        try:
            atomic_torch_save(state, path)
            atomic_json_dump({"step": int(step), "file": path.name}, self.pointer_path)
        except OSError as exc:
            raise CheckpointError(f"could not write checkpoint {path}: {os_reason(exc)}") from exc
        self.prune(keep=path)
        return path

    def claim(self, *, resume: bool, overwrite: bool, clear: bool = True) -> None:
        """One run per directory: decide what a run starting here does with what it finds.

        An empty directory (no step file, no pointer) is this run's. One that holds
        checkpoints is continued with ``resume``, emptied for a new run with ``overwrite``
        (``clear``: this process deletes them when the run starts, :meth:`start`; other
        ranks of a node and a dry run pass False), and otherwise refused with a
        ``ConfigError`` naming both flags: two runs' checkpoints never make one series. A
        pointer that is not a file, or (``overwrite``) a file this process cannot delete, is
        a ``ConfigError`` too: decided here, before anything is deleted or trained.
        """
        from speedtronic.config import ConfigError

        if resume and overwrite:
            raise ConfigError(
                "checkpoint.resume and checkpoint.overwrite are both set (--resume, "
                "--overwrite): continue the run in the folder or start a new one, not both"
            )
        pointer = self.pointer_path
        if pointer.exists() and not pointer.is_file():
            raise ConfigError(
                f"checkpoint.directory: {pointer} is not a file (the run writes its pointer "
                "there); remove it"
            )
        files = self.step_files()
        if resume or not (files or pointer.exists()):
            return
        if overwrite:
            problem = self._undeletable([pointer, *(path for _, path in files)])
            if problem:
                raise ConfigError(
                    f"checkpoint.overwrite: cannot delete the old run's checkpoints: {problem}; "
                    "nothing was deleted"
                )
            self.pending_clear = clear
            return
        newest = files[-1][1].name if files else self.pointer_path.name
        raise ConfigError(
            f"checkpoint.directory {self.directory} holds another run's checkpoints (newest: "
            f"{newest}); pass --resume (checkpoint.resume) to continue it, or --overwrite "
            "(checkpoint.overwrite) to delete them and start a new run there"
        )

    def _undeletable(self, paths: list[Path]) -> str | None:
        """Why this process could not delete every one of ``paths`` (None: it can): a
        directory it cannot write, or a file marked immutable or append-only (``chattr``),
        which not even root deletes."""
        if not os.access(self.directory, os.W_OK | os.X_OK):
            return f"{self.directory} is not writable"
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue  # gone, or a link (deleting a link is always allowed here)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return f"{path} is not a regular file"
                flags = struct.unpack_from("i", fcntl.ioctl(fd, _GETFLAGS, bytes(8)))[0]
            except OSError:
                flags = 0  # a filesystem without inode flags
            finally:
                os.close(fd)
            if flags & _IMMUTABLE_OR_APPEND:
                return f"{path} is immutable or append-only (lsattr shows it; chattr -i -a)"
        return None

    def start(self) -> None:
        """A run begins: delete what a claim with ``overwrite`` left to delete (once)."""
        if self.pending_clear:
            self.pending_clear = False
            self.clear()

    def clear(self) -> None:
        """Delete the pointer, every step file and stale temp files (a new run starts here).
        The pointer goes first, so it never names a file that is gone."""
        with contextlib.suppress(FileNotFoundError):
            self.pointer_path.unlink()
        for _, path in self.step_files():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._remove_stale_temps(own=False)
        if self.directory.is_dir():
            fsync_dir(self.directory)

    def step_files(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every step file, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for child in self.directory.iterdir():
            match = _STEP_FILE.fullmatch(child.name)
            if match and child.is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def _pointer_file(self) -> Path | None:
        try:
            pointer = json.loads(self.pointer_path.read_text(encoding="utf-8"))
            name = str(pointer["file"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not _STEP_FILE.fullmatch(name):  # never follow a pointer out of the directory
            return None
        path = self.directory / name
        return path if path.is_file() else None

    def survey(self) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
        """``(usable, broken)``: step files with the step each records, newest first (the
        pointer's file first among equal steps, then the file name), and the files that
        cannot be read or record no valid step, with the reason."""
        pointed = self._pointer_file()
        usable: list[tuple[int, int, int, Path]] = []
        broken: list[tuple[Path, str]] = []
        for named, path in self.step_files():
            try:
                recorded = read_step(path)
            except CheckpointError as exc:
                broken.append((path, str(exc)))
                continue
            usable.append((recorded, int(path == pointed), named, path))
        usable.sort(reverse=True)
        return [(recorded, path) for recorded, _, _, path in usable], broken

    def candidates(self) -> list[Path]:
        """Checkpoint files to try, newest recorded step first; unreadable ones last."""
        usable, broken = self.survey()
        return [path for _, path in usable] + [path for path, _ in broken]

    def latest_path(self) -> Path | None:
        """The file with the highest recorded step (else any step file), or ``None``."""
        candidates = self.candidates()
        return candidates[0] if candidates else None

    @staticmethod
    def load(path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read one checkpoint with ``weights_only=True``; ``CheckpointError`` when unusable."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path} is unreadable: {_short(exc)}") from exc
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {path} does not contain a state dictionary")
        return state

    def load_latest(
        self, use: Callable[[dict[str, Any]], Any] | None = None
    ) -> dict[str, Any] | None:
        """The newest usable checkpoint state, or ``None`` when there is none.

        Candidates go newest recorded step first. ``use(state)``, when given, is called on each
        loaded candidate (the trainer's ``resume``: it checks model shapes, step and optimizer
        groups before it changes anything) and a candidate it rejects by raising is skipped
        like an unreadable one: each skip is reported through ``warn`` with the next file
        tried. ``CheckpointError`` only when files exist but none is usable.
        """
        usable, broken = self.survey()
        order = [path for _, path in usable]
        errors = []
        for _broken, reason in broken:
            errors.append(reason)
            self._skip(reason, order[0] if order else None)
        for index, path in enumerate(order):
            following = order[index + 1] if index + 1 < len(order) else None
            try:
                state = self.load(path)
                state.setdefault("path", str(path))
                if use is not None:
                    use(state)
            except Exception as exc:
                reason = str(exc) if isinstance(exc, CheckpointError) else _short(exc)
                if not isinstance(exc, CheckpointError):
                    reason = f"checkpoint {path} cannot be used: {reason}"
                errors.append(reason)
                self._skip(reason, following)
                continue
            return state
        if errors:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory} that this run can use: "
                + "; ".join(errors)
            )
        return None

    def _skip(self, reason: str, following: Path | None) -> None:
        if following is not None:
            self._warn(f"{reason}; falling back to {following.name}")
        else:
            self._warn(f"{reason}; no older checkpoint to fall back to")

    def _warn(self, message: str) -> None:
        if self.warn is not None:
            self.warn(message)
        else:
            import warnings

            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _remove_stale_temps(self, *, own: bool) -> None:
        if not self.directory.is_dir():
            return
        mine = f"{TEMP_MARK}{os.getpid()}-"
        for child in self.directory.iterdir():
            stale = child.name.startswith(".") and TEMP_MARK in child.name
            if stale and (own or mine not in child.name):
                with contextlib.suppress(OSError):
                    child.unlink()

    def prune(self, keep: Path | None = None) -> None:
        """Delete all but the newest ``keep_last`` step files, and stale temp files.

        ``keep`` is the file just written (what the pointer names): it is never deleted and
        counts as the newest; step files numbered after it belong to a branch this run left
        when it resumed from an older checkpoint, and are deleted (with a warning) so a later
        resume cannot pick them."""
        self._remove_stale_temps(own=False)
        files = self.step_files()
        doomed: list[Path] = []
        if keep is not None:
            written = next((step for step, path in files if path == keep), None)
            if written is not None:
                later = [path for step, path in files if step > written]
                for path in later:
                    self._warn(
                        f"deleting {path.name}: it is newer than {keep.name}, which this run "
                        "just wrote after resuming from an older checkpoint"
                    )
                doomed += later
                files = [(step, path) for step, path in files if step < written]
                files.append((written, keep))
        if self.keep_last is not None:
            doomed += [path for _, path in files[: max(0, len(files) - self.keep_last)]]
        for path in doomed:
            if path != keep:
                with contextlib.suppress(OSError):
                    path.unlink()

    def copy_to(self, destination: str | os.PathLike[str]) -> Path:
        """Copy the newest checkpoint file to ``destination``."""
        source = self.latest_path()
        if source is None:
            raise CheckpointError("no checkpoint is available to copy")
        destination = Path(destination)
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, destination)
        return destination


def checkpoint_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The (redacted) run config a checkpoint carries, so it can be used without ``--config``,
    less what only the user may set (:func:`speedtronic.config.layering.travelling`: pickle
    loading, ``init_from``, a push, trackers; one warning names what was set).

    ``path`` is a trainer checkpoint (``step_*.pt``: its ``config`` entry), a checkpoint
    directory (its newest usable checkpoint), a ``final/`` folder or a ``.safetensors`` file
    beside a ``config.yaml`` (what the DiLoCo master writes). ``CheckpointError`` naming the
    path when it carries none.
    """
    target = Path(path)
    folder = target if target.is_dir() else target.parent
    if (folder / "config.yaml").is_file() and (
        target.suffix == ".safetensors" or (folder / "model.safetensors").is_file()
    ):
        import yaml

        try:
            config = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise CheckpointError(f"{folder / 'config.yaml'} is unreadable: {exc}") from None
        if isinstance(config, dict):
            _final_tokenizer(folder, config)
    elif target.is_dir():
        state = CheckpointManager(target, warn=lambda message: None).load_latest() or {}
        config = _with_tokenizer(state.get("config"), state.get("tokenizer"))
    elif target.is_file() and target.suffix != ".safetensors":
        state = CheckpointManager.load(target)
        config = _with_tokenizer(state.get("config"), state.get("tokenizer"))
    else:
        config = None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{target} carries no run config (a trainer checkpoint, a checkpoint directory or a "
            "final/ folder does); pass --config"
        )
    from speedtronic.config.layering import travelling

    return travelling(config, f"the config in {target}")  # never what runs code or reaches out


def _with_tokenizer(config: Any, record: Any) -> Any:
    """``config`` whose ``data.tokenizer`` names the tokenizer the checkpoint carries."""
    from speedtronic.data.tokenizer import materialize_tokenizer

    folder = materialize_tokenizer(record)
    if folder is not None and isinstance(config, dict) and isinstance(config.get("data"), dict):
        config["data"]["tokenizer"] = str(folder)
    return config


def _final_tokenizer(folder: Path, config: dict[str, Any]) -> None:
    """A ``final/`` folder's tokenizer: a ``tokenizer.json`` inside it, else (when the recorded
    path is gone, e.g. the run folder was moved) the one the run's newest checkpoint carries
    (``final/../<checkpoint.directory>``)."""
    data = config.get("data")
    if not isinstance(data, dict):
        return
    spec = data.get("tokenizer")
    if not isinstance(spec, str) or spec.strip().lower() in ("", "bytes"):
        return
    if (folder / "tokenizer.json").is_file():
        data["tokenizer"] = str(folder)
        return
    if Path(spec).expanduser().exists():
        return
    section = config.get("checkpoint")
    directory = Path(str((section or {}).get("directory") or "checkpoints"))
    if not directory.is_absolute():
        directory = folder.parent / directory  # final/ sits in run.output_dir
    for path in CheckpointManager(directory, warn=lambda message: None).candidates():
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:
            continue
        if isinstance(state, dict) and isinstance(state.get("tokenizer"), dict):
            _with_tokenizer(config, state["tokenizer"])
            return
