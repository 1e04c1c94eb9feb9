"""Reading the secrets directory: one file per secret (``hf_token``, ``<section>__<field>``).

An entry whose name is one of ours must be a regular file inside the directory (links inside
it are followed: Kubernetes' ``hf_token -> ..data/hf_token``); anything else, or a file that
cannot be read, is a ``ConfigError`` naming it, so a value meant is never dropped silently. A
FIFO or device is never read (checked before opening, opened without blocking, checked again).
Other entries are not ours and are left alone.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from speedtronic.config.limits import ConfigError

__all__ = ["MAX_SECRETS_BYTES", "read_secret_file", "read_secret_files"]

logger = logging.getLogger("speedtronic.config")
MAX_SECRETS_BYTES = 16 * 2**20  # all secret files together (a token is ~40 bytes)
_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_regular(mode: int) -> str | None:
    """What a non-regular file is (``a FIFO``...), or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _FILE_KINDS if test(mode)), "not a regular file")


def read_secret_file(path: Path, root: str, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path``, a regular file inside the directory ``root`` (a real
    path), else a ``ConfigError`` naming it."""
    expected = "expected a regular file in the secrets directory holding the value"
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"secret {path} is a directory; expected a file holding the value")
        real = os.path.realpath(path)
        if not real.startswith(root + os.sep):
            raise ConfigError(
                f"secret file {path} is a link that leads out of the secrets directory (to "
                f"{real}); {expected} (copy the file in, or mount the secret there)"
            )
        kind = _not_regular(mode)
        if kind is not None:
            raise ConfigError(f"secret file {path} is {kind}; {expected}")
        if mode & 0o077:
            logger.warning(
                "secret file %s is readable by group/others (mode %s); make it readable "
                "by its owner only (chmod 600, or defaultMode: 0400 in Kubernetes)",
                path,
                oct(stat.S_IMODE(mode)),
            )
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
        with open(fd, "rb") as handle:
            kind = _not_regular(os.fstat(handle.fileno()).st_mode)  # replaced since the stat
            if kind is not None:
                raise ConfigError(f"secret file {path} is {kind}; {expected}")
            return handle.read(limit)
    except OSError as exc:
        raise ConfigError(f"cannot read secret file {path}: {exc.strerror}") from None


def read_secret_files(secrets_dir: Path, wanted: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Dotted field -> (file name, stripped text) of the files ``wanted`` names (lower-case
    file name -> dotted field; any case matches, the later in name order wins)."""
    try:
        entries = sorted(os.scandir(secrets_dir), key=lambda entry: entry.name)
    except OSError as exc:
        raise ConfigError(f"cannot list secrets directory {secrets_dir}: {exc.strerror}") from None
    root = os.path.realpath(secrets_dir)
    found: dict[str, tuple[str, str]] = {}
    total = 0
    for entry in entries:
        dotted = wanted.get(entry.name.lower())
        if dotted is None:
            continue
        path = secrets_dir / entry.name
        data = read_secret_file(path, root, MAX_SECRETS_BYTES + 1 - total)
        total += len(data)
        if total > MAX_SECRETS_BYTES:
            raise ConfigError(
                f"cannot read secrets directory {secrets_dir}: its secret files hold more than "
                f"{MAX_SECRETS_BYTES} bytes"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"secret file {path} is not UTF-8 text") from None
        found[dotted] = (entry.name, text.strip())
    return found
