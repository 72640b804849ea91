"""``WorkerThreadEngine._deliver_many``: finished generations reach their futures with one
event-loop wake-up per loop (not one per row), on every loop the rows came from; a closed
loop, a cancelled future or an error result does not stop the others being delivered."""

import asyncio
from types import SimpleNamespace

from molt_core.engines.base import WorkerThreadEngine


def _counting(loop):
    calls = []
    orig = loop.call_soon_threadsafe

    def wrapped(cb, *args):
        calls.append(len(args[0]) if args else None)
        return orig(cb, *args)

    loop.call_soon_threadsafe = wrapped
    return calls


def test_deliver_many_wakes_each_loop_once_and_skips_closed_loops_and_cancelled_futures():
    gone, a, b = asyncio.new_event_loop(), asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        rows = {name: SimpleNamespace(loop=lp, future=lp.create_future())
                for name, lp in (("gone", gone), ("a1", a), ("b1", b), ("a2", a), ("a3", a), ("b2", b))}
        gone.close()  # the caller's loop is gone: its row is dropped, the rest still delivered
        rows["a3"].future.cancel()
        calls = {"a": _counting(a), "b": _counting(b)}
        err = RuntimeError("boom")
        WorkerThreadEngine._deliver_many([(rows["gone"], "x"), (rows["a1"], 1), (rows["b1"], 2), (rows["a2"], err),
                                          (rows["a3"], 3), (rows["b2"], 4)])
        assert calls == {"a": [3], "b": [2]}  # one wake-up per loop, carrying all of its rows
        for lp in (a, b):
            lp.run_until_complete(asyncio.sleep(0))
        assert rows["a1"].future.result() == 1 and rows["b1"].future.result() == 2 and rows["b2"].future.result() == 4
        assert rows["a2"].future.exception() is err
        assert rows["a3"].future.cancelled()  # not overwritten (no InvalidStateError either)
        assert not rows["gone"].future.done()
        # the single-row form goes the same way
        f = a.create_future()
        WorkerThreadEngine._deliver(SimpleNamespace(loop=a, future=f), 7)
        a.run_until_complete(asyncio.sleep(0))
        assert f.result() == 7 and calls["a"] == [3, 1]
    finally:
        a.close()
        b.close()
