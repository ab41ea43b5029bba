"""Guarded calls: user functions in worker processes (GuardedPool), and objects of this process
on threads of their own (call_guarded); concurrent, each call with its own limit."""

import asyncio
import threading

import pytest

from lora_async.guarded import GuardedError, GuardedPool, call_guarded

MODULE = '''
import asyncio, os, sys, time
def nap(seconds):
    print("chatter on stdout must not corrupt a reply")
    time.sleep(seconds)
    return os.getpid()
async def anap(seconds):
    await asyncio.sleep(seconds)
    return os.getpid()
async def blocks(seconds):
    time.sleep(seconds)  # blocks the worker's event loop: cancelling cannot stop it
    return os.getpid()
def crash(code):
    os._exit(code)
def returns_coroutine():
    return anap(0)
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "guarded_fns.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    return "guarded_fns"


def test_plain_calls_overlap_in_their_own_processes(module):
    pool = GuardedPool(f"{module}:nap", timeout_s=30, size=4)
    try:
        assert not pool.is_async and pool.processes == 1  # more start on demand
        outs = [f.result() for f in [pool.submit(seconds=1.0) for _ in range(4)]]
        assert all(o.ok for o in outs) and len({o.value for o in outs}) == 4 and pool.processes == 4
        assert max(o.started for o in outs) < min(o.ended for o in outs)
        more = [f.result() for f in [pool.submit(seconds=0.1) for _ in range(6)]]  # at most `size` processes
        assert all(o.ok for o in more) and pool.processes == 4 and {o.value for o in more} <= {o.value for o in outs}
    finally:
        pool.close()


def test_a_timed_out_plain_call_loses_only_its_process(module):
    pool = GuardedPool(f"{module}:nap", timeout_s=1.0, size=2)
    try:
        # both workers started first: the quick call then waits for no process to start, only
        # for one beside the slow call's (or, wrongly, behind it)
        assert all(f.result().ok for f in [pool.submit(seconds=0.5), pool.submit(seconds=0.5)])
        assert pool.processes == 2
        slow, quick = pool.submit(seconds=60), pool.submit(seconds=0)
        quick_out = quick.result()
        assert quick_out.ok and not slow.done()  # the quick call did not wait behind the slow one
        slow_out = slow.result()
        assert slow_out.timed_out and slow_out.message == "timed out after 1s"
        assert pool.call(seconds=0).value == quick_out.value  # the survivor serves on
    finally:
        pool.close()


def test_async_calls_share_one_process_and_a_hung_one_is_cancelled(module):
    pool = GuardedPool(f"{module}:anap", timeout_s=2.0, size=16)

    async def run():
        return await asyncio.gather(*(pool.acall(seconds=s) for s in (0.5, 0.5, 60, 0.5)))

    try:
        assert pool.is_async
        outs = asyncio.run(run())
        assert [o.ok for o in outs] == [True, True, False, True] and outs[2].timed_out
        assert len({o.value for o in outs if o.ok}) == 1 and pool.processes == 1
        assert pool.call(seconds=0).value == outs[0].value  # the same process: only the coroutine went
    finally:
        pool.close()


def test_an_async_function_that_blocks_its_loop_loses_its_process(module):
    pool = GuardedPool(f"{module}:blocks", timeout_s=0.5)
    try:
        first = pool.call(seconds=60)
        assert first.timed_out
        after = pool.call(seconds=0)  # waits for the cancellation, which never comes: a new process
        assert after.ok and pool.processes == 1
    finally:
        pool.close()


def test_a_crash_is_reported_and_the_next_call_gets_a_new_worker(module):
    pool = GuardedPool(f"{module}:crash", timeout_s=5.0)
    try:
        out = pool.call(code=3)
        assert out.message.startswith("worker died (exit code 3)") and not out.unavailable
        assert pool.call(code=4).message.startswith("worker died (exit code 4)")
    finally:
        pool.close()


def test_a_module_broken_after_startup_makes_calls_unavailable(module, tmp_path):
    pool = GuardedPool(f"{module}:crash", timeout_s=5.0)
    try:
        (tmp_path / "guarded_fns.py").write_text("raise ImportError('broken meanwhile')\n")
        pool.call(code=1)
        out = pool.call(code=1)
        assert out.unavailable and "broken meanwhile" in out.message
    finally:
        pool.close()


def test_strict_and_loose_keywords_and_odd_returns(module):
    pool = GuardedPool(f"{module}:nap", timeout_s=5.0)
    try:
        assert pool.call(seconds=0, extra=1).ok  # loose: keywords it does not take are dropped
        strict = pool.call({"seconds": 0, "extra": 1}, strict=True)
        assert strict.message.startswith("TypeError: nap() got an unexpected keyword argument 'extra'")
        assert pool.call({"seconds": {1, 2}}).message.startswith("TypeError")  # a set arrives as a list
    finally:
        pool.close()
    coro = GuardedPool(f"{module}:returns_coroutine", timeout_s=5.0)
    try:
        assert isinstance(coro.call().value, int)  # a plain function returning a coroutine is awaited
    finally:
        coro.close()


def test_close_answers_every_call_and_later_submits(module):
    pool = GuardedPool(f"{module}:nap", timeout_s=60, size=1)
    pending = [pool.submit(seconds=60), pool.submit(seconds=60)]
    pool.close()
    assert [f.result(timeout=10).message for f in pending] == ["the pool is closed"] * 2
    assert pool.call(seconds=0).message == "the pool is closed"
    pool.close()  # idempotent


def test_unloadable_functions_fail_at_construction(module):
    with pytest.raises(GuardedError, match="guarded_fns:missing could not be loaded: AttributeError"):
        GuardedPool(f"{module}:missing", timeout_s=1.0)
    with pytest.raises(GuardedError, match="not of the form module:function"):
        GuardedPool("no_colon", timeout_s=1.0)


# ---- call_guarded: objects of this process


def test_plain_calls_here_run_at_once():
    """Four calls that each wait for all four: one at a time (a lock, a busy executor), none would return."""
    meet = threading.Barrier(4, timeout=60)

    async def run():
        return await asyncio.gather(*(call_guarded(meet.wait, timeout_s=60, what="meet") for _ in range(4)))

    results = asyncio.run(run())
    assert all(r.ok for r in results) and sorted(r.value for r in results) == [0, 1, 2, 3]


def test_a_hung_plain_call_here_is_left_behind_and_holds_nothing_back():
    release = threading.Event()

    async def run():
        return await asyncio.gather(call_guarded(release.wait, timeout_s=0.2, what="hangs"),
                                    call_guarded(lambda: 7, timeout_s=60, what="quick"))

    try:
        hung, quick = asyncio.run(run())
        assert hung.timed_out and hung.message == "timed out after 0.2s" and not hung.ok
        assert quick.ok and quick.value == 7
        assert any(t.name == "lora-async-guarded-hangs" and t.daemon for t in threading.enumerate())  # still waiting
    finally:
        release.set()


def test_faults_here_become_results():
    def raises(text):
        raise ValueError(text)

    def exits():
        raise SystemExit(3)  # user code must not end the run

    async def araises():
        raise KeyError("gone")

    class Awaitable:
        def __await__(self):
            yield

    def hands_back_an_awaitable():
        return Awaitable()

    async def run():
        return await asyncio.gather(call_guarded(raises, "bad input", timeout_s=5, what="raises"),
                                    call_guarded(exits, timeout_s=5, what="exits"),
                                    call_guarded(araises, timeout_s=5, what="araises"),
                                    call_guarded(hands_back_an_awaitable, timeout_s=5, what="step"))

    raised, exited, araised, awaitable = asyncio.run(run())
    assert raised.message == "ValueError: bad input" and isinstance(raised.exception, ValueError)
    assert raised.location is not None and raised.location.split(":")[0].endswith("test_guarded.py")
    assert exited.message == "SystemExit: 3" and araised.message == "KeyError: 'gone'"
    assert awaitable.message == "TypeError: step returned an awaitable from a plain method"


def test_an_async_call_here_runs_on_the_callers_loop_and_is_cancelled_at_its_deadline():
    seen = {}

    async def hangs():
        seen["loop"] = asyncio.get_running_loop()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    async def run():
        result = await call_guarded(hangs, timeout_s=0.2, what="hangs")
        return result, asyncio.get_running_loop()

    result, loop = asyncio.run(run())
    assert result.timed_out and seen == {"loop": loop, "cancelled": True}
