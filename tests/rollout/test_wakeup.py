"""The wake-up the local engine's waiting calls rely on: a change made in another thread wakes every waiter on every
event loop at once, a change that lands between a waiter's check and its wait is not lost, and a waiter whose loop
has closed does not break the others."""
from __future__ import annotations

import asyncio
import threading
import time

from rollout_sglang.engines.wakeup import Wakeup


def test_a_change_in_another_thread_wakes_waiters_on_two_loops_at_once():
    wake, state, woken = Wakeup(), {"ready": False}, []

    async def waiter(name: str) -> None:
        while True:
            armed = wake.arm()
            if state["ready"]:
                wake.disarm(armed)
                woken.append((name, time.monotonic()))
                return
            await wake.wait(armed, 30.0)

    threads = [threading.Thread(target=lambda n=n: asyncio.run(waiter(n))) for n in ("a", "b")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while wake.armed() < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert wake.armed() == 2
    state["ready"] = True
    changed = time.monotonic()
    wake.notify()
    for t in threads:
        t.join(10)
    assert sorted(n for n, _ in woken) == ["a", "b"]
    assert all(at - changed < 5.0 for _, at in woken)  # woken by the notify, not by the 30 s re-check
    assert wake.armed() == 0


def test_a_notify_between_the_check_and_the_wait_is_not_lost():
    async def main() -> bool:
        wake = Wakeup()
        armed = wake.arm()  # armed first, then the condition checked (false), then the change lands
        wake.notify()
        return await wake.wait(armed, 5.0)

    assert asyncio.run(main()) is True


def test_a_waiter_whose_loop_closed_does_not_break_the_notify():
    wake = Wakeup()

    async def arm_and_leave() -> None:
        wake.arm()  # never waited on: its loop closes with it armed

    asyncio.run(arm_and_leave())

    async def main() -> bool:
        armed = wake.arm()
        threading.Thread(target=wake.notify).start()
        return await wake.wait(armed, 5.0)

    assert asyncio.run(main()) is True
    assert wake.armed() == 0


def test_a_wait_times_out_and_forgets_its_future():
    async def main() -> tuple[bool, int]:
        wake = Wakeup()
        came = await wake.wait(wake.arm(), 0.05)
        return came, wake.armed()

    assert asyncio.run(main()) == (False, 0)
