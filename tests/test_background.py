"""The one wait helper and the one worker-thread helper (speedtronic.background)."""

from __future__ import annotations

import threading
import time

from speedtronic.background import Loop, wait_for


def test_wait_for_returns_the_first_truthy_answer() -> None:
    answers = iter([None, 0, "", "ready"])
    assert wait_for(lambda: next(answers), timeout=5.0, interval=0.0) == "ready"


def test_wait_for_gives_up_at_the_deadline_without_overshooting() -> None:
    start = time.monotonic()
    assert wait_for(lambda: False, timeout=0.3, interval=10.0) is None
    assert 0.25 <= time.monotonic() - start < 2.0


def test_wait_for_stops_when_the_event_is_set() -> None:
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    start = time.monotonic()
    assert wait_for(lambda: None, timeout=None, interval=10.0, stop=stop) is None
    assert time.monotonic() - start < 2.0


def test_wait_for_grows_its_pause_with_the_attempt() -> None:
    pauses: list[int] = []

    def interval(attempt: int) -> float:
        pauses.append(attempt)
        return 0.0

    calls = iter(range(4))
    assert wait_for(lambda: next(calls) == 3, timeout=5.0, interval=interval)
    assert pauses == [1, 2, 3]


def test_loop_ticks_until_done_and_wakes_early() -> None:
    ticks: list[float] = []
    loop = Loop("test-loop", lambda: ticks.append(time.monotonic()) or len(ticks) >= 3, 10.0)
    loop.start()
    assert wait_for(lambda: len(ticks) == 1, timeout=2.0, interval=0.01)
    loop.wake()
    assert wait_for(lambda: len(ticks) == 2, timeout=2.0, interval=0.01)
    loop.wake()
    assert wait_for(lambda: not loop.running, timeout=2.0, interval=0.01)
    assert len(ticks) == 3
    loop.stop()


def test_loop_waits_first_and_stops_promptly() -> None:
    ticks: list[int] = []
    loop = Loop("test-wait-first", lambda: ticks.append(1) and False, 10.0, wait_first=True)
    loop.start()
    time.sleep(0.1)
    assert ticks == []  # the first tick comes after one interval
    start = time.monotonic()
    loop.stop(timeout=2.0)
    assert time.monotonic() - start < 2.0 and not loop.running and loop.stopping
    assert ticks == []


def test_loop_can_be_stopped_from_its_own_tick() -> None:
    holder: list[Loop] = []
    done = threading.Event()

    def tick() -> None:
        holder[0].stop()
        done.set()

    holder.append(Loop("test-self-stop", tick, 0.01))
    holder[0].start()
    assert done.wait(2.0)
    assert wait_for(lambda: not holder[0].running, timeout=2.0, interval=0.01)
