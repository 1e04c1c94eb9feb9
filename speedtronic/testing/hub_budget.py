"""Hub quotas for the emulator: commits per hour and API requests per window, time-scaled.

The Hugging Face Hub limits how often an account may act: its docs plan for about 128 commits
per hour (whether a repository or an account is counted is not published, so both can be
chosen here) and, for a free account, 1,000 API requests per 5 minutes. The emulator enforces
such budgets with sliding windows and answers 429 with ``Retry-After`` and the IETF
``RateLimit-*`` headers past them. ``time_scale`` compresses time: with 360, an hour of budget
passes in 10 s, so an hour of a K-node run can be tested in seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable

__all__ = ["Budget", "BudgetKeeper"]


@dataclasses.dataclass
class Budget:
    """Quotas (0 = unlimited). ``commit_scope`` is ``repo`` or ``token``; windows are in
    real Hub seconds, divided by ``time_scale`` on the emulator's clock."""

    commits_per_hour: int = 0
    commit_scope: str = "repo"
    requests_per_window: int = 0
    window_seconds: float = 300.0
    time_scale: float = 1.0


class BudgetKeeper:
    """Sliding-window counters per key; thread-safe."""

    def __init__(self, budget: Budget, clock: Callable[[], float] = time.monotonic):
        self.budget = budget
        self._clock = clock
        self._lock = threading.Lock()
        self._events: dict[tuple[str, str], collections.deque[float]] = {}
        self.refused = {"commit": 0, "request": 0}

    def _admit(self, kind: str, key: str, limit: int, window: float) -> dict[str, str] | None:
        """Record one event unless ``key`` used up ``limit`` in the last ``window`` seconds
        of real Hub time; return the 429 headers when it did."""
        if limit <= 0:
            return None
        span = window / self.budget.time_scale
        now = self._clock()
        with self._lock:
            events = self._events.setdefault((kind, key), collections.deque())
            while events and events[0] <= now - span:
                events.popleft()
            if len(events) < limit:
                events.append(now)
                return None
            self.refused[kind] += 1
            wait = max(0.0, events[0] + span - now)
        reset = math.ceil(wait * self.budget.time_scale)  # in Hub seconds, as the Hub says it
        return {
            "Retry-After": f"{max(wait, 0.01):.3f}",
            "RateLimit-Limit": str(limit),
            "RateLimit-Remaining": "0",
            "RateLimit-Reset": str(reset),
            "RateLimit-Policy": f'{limit};w={int(window)};name="{kind}"',
        }

    def request(self, token: str) -> dict[str, str] | None:
        """One API request by ``token``: None, or the headers of a 429."""
        budget = self.budget
        return self._admit("request", token, budget.requests_per_window, budget.window_seconds)

    def commit(self, repo_id: str, token: str) -> dict[str, str] | None:
        """One commit to ``repo_id`` by ``token``, counted per repository or per token."""
        key = repo_id if self.budget.commit_scope == "repo" else token
        return self._admit("commit", key, self.budget.commits_per_hour, 3600.0)

    def configure(self, **knobs: object) -> None:
        """Change the budget at runtime."""
        with self._lock:
            for name, value in knobs.items():
                if not hasattr(self.budget, name):
                    raise ValueError(f"unknown budget knob {name}")
                setattr(self.budget, name, type(getattr(self.budget, name))(value))
