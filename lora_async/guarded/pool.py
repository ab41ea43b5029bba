"""`GuardedPool`: a user function (`module:qualname`) called concurrently in child processes.

A user function (a reward, a tool) may raise, return junk, print, hang or crash its process;
none of that may take the training run down, and none of it may hold back the other calls.
A pool owns the children (`worker.py`) and one thread that feeds them:

- a plain function runs in up to `size` processes, one call each at a time, started on demand
  (so a fast function keeps one process, a slow one as many as calls wait);
- an `async def` function runs in one process, up to `size` calls at once on its event loop.

Every failure becomes a `CallResult` with an error text. A call past `timeout_s` (counted from
when a worker takes it, not from a wait in the queue) is cut off alone: a plain call's process
is killed (the next call starts another), an async call's coroutine is cancelled. An async
function that ignores cancellation (it blocks its event loop) loses its process after a grace
period, and with it the calls it was holding back anyway.

Callers are threads or event loops: `submit` returns a `concurrent.futures.Future`, `call`
blocks, `acall` awaits; the pool belongs to no event loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import os
import selectors
import threading
import time
from typing import Any, Iterable, Mapping

from .process import Call, Worker, request_line
from .result import CallResult, GuardedError

HELLO_TIMEOUT_S = 60.0  # importing a user module may pull in sympy, numpy, ...; only a hang is this slow
GROW_AFTER_S = 0.05  # a queued call that waited this long starts another worker (up to the size)
CANCEL_GRACE_S = 2.0  # an async call that does not end this long after its cancel costs its process
WAKE_CHUNK = 4096


class GuardedPool:
    """One user function in child processes; see the module docstring.

    `extra_paths` go on the children's sys.path after their working directory (the parent's,
    as at construction), so a function in the user's project or next to a test imports; `env`
    is added to their environment."""

    def __init__(self, spec: str, timeout_s: float, size: int = 1, extra_paths: Iterable[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.spec, self.timeout_s, self.size = spec, timeout_s, max(1, size)
        self.extra_paths = list(extra_paths)
        self.env = dict(env or {})
        self._cwd = os.getcwd()  # a restart after a chdir must import the same module
        self._ids = itertools.count()
        self._workers: list[Worker] = []
        self._queue: collections.deque[Call] = collections.deque()
        self._incoming: collections.deque[Call] = collections.deque()  # from callers' threads
        self._lock = threading.Lock()
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        first = Worker.spawn(spec, self.extra_paths, self._cwd, self.env)  # on this thread: import errors surface now
        hello = first.read_hello(HELLO_TIMEOUT_S)
        if hello is None or not hello.get("ready"):
            error = (hello or {}).get("error") or first.stderr_tail() or "the worker exited without a word"
            first.kill(gently=False)
            raise GuardedError(f"{spec} could not be loaded: {error}")
        first.ready = True
        self.params: tuple[str, ...] = tuple(hello["params"])
        self.required: tuple[str, ...] = tuple(hello["required"])
        self.var_kw: bool = bool(hello["var_kw"])
        self.is_async: bool = bool(hello.get("is_async"))
        self._adopt(first)
        self._thread = threading.Thread(target=self._serve, name=f"guarded {spec}", daemon=True)
        self._thread.start()

    # ---- what callers use
    def accepted(self, names: Iterable[str]) -> list[str]:
        """Which of `names` the function receives (all of them if it takes **kwargs)."""
        return [n for n in names if self.var_kw or n in self.params]

    def submit(self, arguments: Mapping[str, Any] | None = None, /, *, strict: bool = False,
               **kwargs: Any) -> concurrent.futures.Future:
        """Queue a call with keywords: `submit(completion=...)`, or `submit({...})` for names that
        could clash with `strict` (a tool's arguments, a record's fields). Not strict: keywords
        the function does not take are dropped (the reward rule). Strict: they are an error, as
        are missing ones (the tool rule: the model's mistake, told back to it). The future's
        result is a `CallResult`; it never raises."""
        merged = {**(arguments or {}), **kwargs}
        if not strict:
            merged = {k: v for k, v in merged.items() if self.var_kw or k in self.params}
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        try:
            request = request_line(call_id, merged)
        except ValueError as exc:  # a circular structure
            future.set_result(CallResult(message=f"arguments are not JSON: {exc}"))
            return future
        with self._lock:
            if self._closed:
                future.set_result(CallResult(message="the pool is closed"))
                return future
            self._incoming.append(Call(call_id, request, future))
        self._wake()
        return future

    def call(self, arguments: Mapping[str, Any] | None = None, /, *, strict: bool = False,
             **kwargs: Any) -> CallResult:
        """`submit` and wait for the result (from a thread)."""
        result: CallResult = self.submit(arguments, strict=strict, **kwargs).result()
        return result

    async def acall(self, arguments: Mapping[str, Any] | None = None, /, *, strict: bool = False,
                    **kwargs: Any) -> CallResult:
        """`submit` and await the result (from any event loop)."""
        result: CallResult = await asyncio.wrap_future(self.submit(arguments, strict=strict, **kwargs))
        return result

    @property
    def processes(self) -> int:
        """Worker processes alive now (started on demand, at most `size`)."""
        return len(self._workers)

    def close(self) -> None:
        """Stop the thread, end every process; calls not answered yet get an error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(timeout=10)
        for worker in list(self._workers):
            self._end(worker, "the pool is closed", gently=True)
        for call in [*self._queue, *self._incoming]:
            self._settle(call, CallResult(message="the pool is closed"))
        self._queue.clear()
        self._incoming.clear()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- the pool's thread
    def _serve(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a bug here must not leave callers waiting forever
            with self._lock:
                self._closed = True
            message = f"the guarded pool of {self.spec} failed: {type(exc).__name__}: {exc}"
            for worker in list(self._workers):
                self._end(worker, message)
            self._queue.extend(self._incoming)
            self._fail_queue(message)

    def _loop(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select(self._next_timeout()):
                if key.data is None:
                    self._drain_wake()
                else:
                    self._read(key.data)
            with self._lock:
                self._queue.extend(self._incoming)
                self._incoming.clear()
            self._expire(time.monotonic())
            self._dispatch()

    def _next_timeout(self) -> float | None:
        deadlines = [c.deadline for w in self._workers for c in w.calls.values()]
        deadlines += [d for w in self._workers for d in w.cancelling.values()]
        deadlines += [w.hello_deadline for w in self._workers if not w.ready]
        if self._queue and len(self._workers) < self._limit:  # when queued calls will have waited long enough to grow
            deadlines += [c.submitted + GROW_AFTER_S for c in self._queue if not self._overdue(c)][:1]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _dispatch(self) -> None:
        """Hand queued calls to workers, starting workers where the size allows."""
        while self._queue:
            call = self._queue[0]
            if call.future.cancelled():  # its caller went away before a worker took it
                self._queue.popleft()
                continue
            worker = self._free_worker()
            if worker is None:
                self._grow()  # their hello arrives later; dispatch goes on then
                return
            self._queue.popleft()
            self._send(worker, call)

    def _free_worker(self) -> Worker | None:
        # A worker with a cancellation pending may be blocked: new calls wait for its answer (or its end).
        per_worker = self.size if self.is_async else 1
        return next((w for w in self._workers if w.ready and not w.cancelling and len(w.calls) < per_worker), None)

    @property
    def _limit(self) -> int:
        return 1 if self.is_async else self.size

    @staticmethod
    def _overdue(call: Call) -> bool:
        return time.monotonic() - call.submitted >= GROW_AFTER_S

    def _grow(self) -> None:
        """Start the workers the queue needs, as far as the size allows (an async function: one).
        A queued call asks for a worker once it has waited GROW_AFTER_S (none alive: at once), so
        a fast function keeps one process however many calls arrive together."""
        starting = sum(not w.ready for w in self._workers)
        waiting = len(self._queue) if not self._workers else sum(self._overdue(c) for c in self._queue)
        while len(self._workers) < self._limit and starting < waiting:
            try:
                worker = Worker.spawn(self.spec, self.extra_paths, self._cwd, self.env)
            except OSError as exc:
                self._fail_queue(f"could not start a worker: {exc}")
                return
            worker.hello_deadline = time.monotonic() + HELLO_TIMEOUT_S
            self._adopt(worker)
            starting += 1

    def _send(self, worker: Worker, call: Call) -> None:
        call.deadline = time.monotonic() + self.timeout_s
        call.started = time.time()
        worker.calls[call.id] = call
        if not worker.write(call.request):
            self._died(worker)

    def _read(self, worker: Worker) -> None:
        if not worker.read():
            self._died(worker)
            return
        while b"\n" in worker.buffer:
            message = worker.take_line()
            if message is None:  # a garbled line: the worker cannot be trusted any more
                self._died(worker)
                return
            if worker.ready:
                self._answer(worker, message)
            else:
                self._hello(worker, message)

    def _hello(self, worker: Worker, hello: dict[str, Any]) -> None:
        if hello.get("ready"):
            worker.ready = True
            return
        error = hello.get("error") or worker.stderr_tail() or "the worker exited without a word"
        self._end(worker, f"could not restart: {self.spec} could not be loaded: {error}")
        if not any(w.ready for w in self._workers):
            self._fail_queue(f"could not restart: {self.spec} could not be loaded: {error}")

    def _answer(self, worker: Worker, reply: dict[str, Any]) -> None:
        call_id = int(reply.get("id", -1))
        if reply.get("cancelled"):
            worker.cancelling.pop(call_id, None)
            return
        call = worker.calls.pop(call_id, None)
        if call is None:  # answered after it was cut off
            worker.cancelling.pop(call_id, None)
            return
        started, ended, wait_s = reply.get("started"), reply.get("ended"), time.monotonic() - call.submitted
        if "error" in reply:
            self._settle(call, CallResult(message=str(reply["error"]), location=reply.get("where"), started=started,
                                          ended=ended, wait_s=wait_s))
        else:
            self._settle(call, CallResult(value=reply.get("value"), started=started, ended=ended, wait_s=wait_s))

    def _expire(self, now: float) -> None:
        """Cut off calls past their deadline, and workers that never said hello or never let go."""
        for worker in list(self._workers):
            if not worker.ready and now >= worker.hello_deadline:
                self._end(worker, f"the worker did not start within {HELLO_TIMEOUT_S:g}s")
                continue
            if any(now >= d for d in worker.cancelling.values()):
                self._end(worker, f"worker killed: a call of {self.spec} ignored its cancellation "
                                  "(it blocks the event loop), so its process was restarted")
                continue
            for call in [c for c in worker.calls.values() if now >= c.deadline]:
                del worker.calls[call.id]
                self._settle(call, CallResult(message=f"timed out after {self.timeout_s:g}s", timed_out=True,
                                              started=call.started, ended=time.time(),
                                              wait_s=now - call.submitted))
                if self.is_async:
                    worker.cancelling[call.id] = now + CANCEL_GRACE_S
                    worker.cancel(call.id)
                else:
                    self._end(worker, "")  # it held only this call

    # ---- processes
    def _adopt(self, worker: Worker) -> None:
        self._workers.append(worker)
        self._selector.register(worker.fd, selectors.EVENT_READ, worker)

    def _died(self, worker: Worker) -> None:
        """The child ended (os._exit, a crash, out of memory): say how to each of its calls."""
        code = worker.exit_code(wait_s=1.0)
        if not worker.ready:
            self._hello(worker, {"ready": False})
            return
        self._end(worker, f"worker died (exit code {code}): {worker.stderr_tail() or 'no output'}")

    def _end(self, worker: Worker, message: str, gently: bool = False) -> None:
        """Kill a worker; its unanswered calls get `message`."""
        if worker in self._workers:
            self._workers.remove(worker)
            try:
                self._selector.unregister(worker.fd)
            except (KeyError, ValueError):
                pass
        worker.kill(gently)
        for call in worker.calls.values():
            self._settle(call, CallResult(message=message, started=call.started, ended=time.time(),
                                          wait_s=time.monotonic() - call.submitted))
        worker.calls.clear()

    # ---- small helpers
    def _fail_queue(self, message: str) -> None:
        """No worker can take the queued calls: each gets `message`, as unavailable."""
        while self._queue:
            self._settle(self._queue.popleft(), CallResult(message=message, unavailable=True))

    @staticmethod
    def _settle(call: Call, result: CallResult) -> None:
        if not call.future.done():
            try:
                call.future.set_result(result)
            except concurrent.futures.InvalidStateError:  # cancelled by its caller meanwhile
                pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # the pipe is full (a wake is pending) or closed
            pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, WAKE_CHUNK):
                pass
        except (BlockingIOError, OSError):
            pass
