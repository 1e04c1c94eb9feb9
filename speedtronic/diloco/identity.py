"""Node identity: the ``node_id`` fallback chain and the ``nodes/<id>/owner.json`` claim.

A node claims its id at startup and re-writes the claim with every delta upload (same
commit); the claim also carries the node's round status (``training``, ``done``), which the
master reads to know whom to wait for. Before each upload it reads the claim back: a
different instance token there means another *live* process wrote it after us, which is a
collision. A claim left by a dead incarnation (a restart) is taken over: on this host when
its pid is gone; from another host (a pid says nothing there) when that node's files did not
change while this node watched them (``held_elsewhere``). The instance token is kept in
``<state_dir>/identity.json``, so a restart with the same state directory keeps its token.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from speedtronic.config.errors import ConfigError
from speedtronic.config.limits import check_node_id

__all__ = ["ExchangeAccessError", "NodeClaim", "NodeIdCollisionError", "resolve_node_id"]

_NODE_ENV = ("SPEEDTRONIC_NODE_ID", "HOSTNAME", "HF_USERNAME", "USER")


def resolve_node_id(configured: str | None, environ: Mapping[str, str]) -> str:
    """``node_id`` -> SPEEDTRONIC_NODE_ID -> HOSTNAME -> HF_USERNAME -> USER -> ``local``.

    The result must pass the config layer's one node-id rule (letters, digits, ``._@+-``, at
    most 128 characters), else ``ConfigError``.
    """
    candidates = [configured, *(environ.get(name) for name in _NODE_ENV), "local"]
    value = next(str(c).strip() for c in candidates if c is not None and str(c).strip())
    return check_node_id(value)


class NodeIdCollisionError(ConfigError):
    """Another live node already uses this node's id, found when the node claims it at
    startup (before it trains or writes anything) or, for the later of two nodes, when the
    earlier one writes again: a configuration error, exit code 2. ``detail`` says how it
    was found."""

    def __init__(self, node_id: str, detail: str = "") -> None:
        found = f" ({detail})" if detail else ""
        super().__init__(
            f"distributed.node_id: another live node already uses node id {node_id!r}{found}; "
            "give each worker a unique id (SPEEDTRONIC_NODE_ID, distributed.node_id, or a "
            "unique hostname)"
        )
        self.node_id = node_id


class ExchangeAccessError(ConfigError):
    """The exchange refused this node's credentials (HTTP 401/403, or 404 for its own
    repository): exit code 2. The message names the repository; the entrypoint, which knows
    where the token came from, adds that (:meth:`with_token_source`). Never the token."""

    def __init__(self, message: str, *, repo_id: str, status: int | None = None) -> None:
        super().__init__(message)
        self.repo_id, self.status = repo_id, status

    def with_token_source(self, source: str | None) -> ExchangeAccessError:
        """The same error, naming where ``distributed.token`` came from (``env:HF_TOKEN``,
        ``secret:hf_token``, ``file``, ``cli``; None: no token was configured)."""
        where = source or "nowhere: no token is set (distributed.token, HF_TOKEN, hf_token secret)"
        return ExchangeAccessError(
            f"{self}; the token came from {where}", repo_id=self.repo_id, status=self.status
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


class NodeClaim:
    """This process's claim on ``node_id`` in the repository."""

    def __init__(self, node_id: str, role: str, state_dir: Path, host: str | None = None):
        self.node_id, self.role = node_id, role
        self.instance = self._instance_token(state_dir / "identity.json")
        self.host = host or socket.gethostname()
        self.claimed = False
        self.reported: set[str] = set()

    @staticmethod
    def _instance_token(path: Path) -> str:
        try:
            return str(json.loads(path.read_text(encoding="utf-8"))["instance"])
        except (OSError, ValueError, KeyError, TypeError):
            token = secrets.token_hex(8)
            with contextlib.suppress(OSError):
                path.write_text(json.dumps({"instance": token}) + "\n", encoding="utf-8")
            return token

    def record(self, **status: Any) -> dict[str, Any]:
        """The claim written to ``nodes/<id>/owner.json``, with the node's round status
        (``state``: ``training``, ``done`` or ``aggregator``; ``final_round`` when done)."""
        return {
            "node_id": self.node_id,
            "instance": self.instance,
            "role": self.role,
            "host": self.host,
            "pid": os.getpid(),
            **status,  # no timestamp: an unchanged record keeps its blob id (the master skips it)
        }

    def check(self, owner: Mapping[str, Any] | None) -> str | None:
        """The instance token of a live colliding node (reported once), else None."""
        other = owner.get("instance") if owner else None
        if not other or other == self.instance or other in self.reported:
            return None
        if self.claimed:
            live = True  # somebody overwrote our claim after we made it
        else:  # before our first claim: only a running process on this host is provably live
            pid = owner.get("pid")
            live = (
                owner.get("host") == self.host
                and isinstance(pid, int)
                and pid != os.getpid()
                and _pid_alive(pid)
            )
        if live:
            self.reported.add(str(other))
            return str(other)
        return None

    def held_elsewhere(self, owner: Mapping[str, Any] | None) -> bool:
        """Whether ``owner`` is another instance's record, written on another host by a node
        that has not finished: it may be live, and only its files can tell (a live node
        writes at every round), see :meth:`~speedtronic.diloco.link.NodeLink.claim_id`."""
        other = owner.get("instance") if owner else None
        if not other or other == self.instance or owner.get("host") == self.host:
            return False
        return owner.get("state") in ("training", "aggregator")
