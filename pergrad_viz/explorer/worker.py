"""The explorer's background worker: one thread running the latest submitted job, so that a control's callback
only hands the new setting over and returns (the controls and the kernel stay free).

The worker's thread is the only one that computes, times (it alone reads and writes the timing cache) and draws
(it alone writes the output panes' traits); the kernel's thread only writes the controls. :meth:`Worker.stop`
ends the thread and joins it, so that a closed explorer holds nothing alive.

Several explorers in one process (a notebook with two, shown at once as a Voila dashboard) take turns: a job runs
only while it holds :data:`TURN`, one lock for the process. Otherwise their workers would compute and time at the same
time, each measuring the other (the threads share the cores and the interpreter), and every timing would be noisy.
The newest job goes first: a running job gives way (at its next check, :meth:`Worker.outranked`) to one submitted
after it to another explorer, and runs again once that one is done (the learner moved a control of the other).

While it has nothing to do, a worker may do work of its own ahead of need (``idle``: the explorer computes the
menu's other networks before they are chosen). Idle work runs last: only while no job of any explorer waits, it holds
:data:`TURN` like a job (so nothing else times meanwhile), and it gives way to any job at its next check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pergrad_viz.explorer.state import Setting, Stale

__all__ = ["TURN", "Job", "Worker"]

TURN = threading.Lock()  # held by the one worker of the process running a job (see the module's docstring)
TURN_POLL_S = 0.05  # a worker waiting for its turn checks this often whether it was stopped
IDLE_POLL_S = 0.25  # a worker with idle work waits this long (or until a job comes) before each piece of it
WAITING: dict[int, float] = {}  # worker id -> when the job it waits to run was submitted (under WAITING_LOCK)
WAITING_LOCK = threading.Lock()


@dataclass(frozen=True)
class Job:
    """One piece of work: show ``setting``; ``rerun``: forget its timings first and time it again."""

    setting: Setting
    rerun: bool = False
    submitted: float = field(default_factory=time.monotonic, compare=False)


class Worker:
    """One daemon thread running the latest submitted :class:`Job` with ``run(job)``; a newer submission is what
    :meth:`peek` returns meanwhile (the running job checks it and gives way). :meth:`stop` ends the thread: the
    running job sees :attr:`stopping` at its next check, and the thread is joined."""

    def __init__(self, run: Callable[[Job], None], name: str = "pergrad-explorer",
                 idle: Callable[[Callable[[], None]], bool] | None = None):
        self._run = run
        self._idle = idle  # idle(check) -> whether there may be more: one piece of idle work (see the module)
        self._cond = threading.Condition()
        self._pending: Job | None = None
        self._busy = False
        self._stopping = False
        self._running: Job | None = None
        self._gave_way = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` in place of any pending one (a pending rerun of the same computation stays a rerun).
        Ignored once stopped."""
        with self._cond:
            if self._stopping:
                return
            pending = self._pending
            if pending is not None and pending.rerun and pending.setting.key == job.setting.key and not job.rerun:
                job = Job(job.setting, rerun=True)
            self._pending = job
            self._cond.notify_all()

    def peek(self) -> Job | None:
        with self._cond:
            return self._pending

    def take(self, job: Job) -> bool:
        """Take ``job`` off the queue if it is still the pending one (handled in place)."""
        with self._cond:
            if self._pending is job:
                self._pending = None
                return True
            return False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or running; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._busy or self._pending is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._busy or self._pending is not None

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called: the running job should give up at its next check."""
        with self._cond:
            return self._stopping

    def outranked(self) -> bool:
        """Whether another explorer's worker waits to run a job submitted after the running one: the running job
        should give way at its next check (raise :class:`~.state.Stale`); it is run again next."""
        running = self._running
        self._gave_way = self._gave_way or (running is not None and self._newer_waiting(running.submitted))
        return self._gave_way

    def _newer_waiting(self, submitted: float) -> bool:
        with WAITING_LOCK:
            return any(t > submitted for w, t in WAITING.items() if w != id(self))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> bool:
        """Drop the pending job, let the running one end (it gives up at its next check) and join the thread;
        True when it ended within ``timeout`` seconds (it ends later otherwise, by itself)."""
        with self._cond:
            self._stopping = True
            self._pending = None
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    if self._idle is None:
                        self._cond.wait()
                    elif not self._cond.wait(IDLE_POLL_S):
                        break  # nothing came meanwhile: a piece of idle work
                if self._stopping:
                    return
                job = self._pending
                if job is not None:
                    self._pending, self._busy = None, True
            if job is None:
                self._idle_turn()
                continue
            try:
                if self._take_turn(job):
                    self._running, self._gave_way = job, False
                    try:
                        self._run(job)
                    finally:
                        self._running = None
                        TURN.release()
            finally:
                with self._cond:
                    if self._gave_way and self._pending is None and not self._stopping:
                        self._pending = job  # it gave way to another explorer's newer job: run it again next
                    self._gave_way = False
                    self._busy = False
                    self._cond.notify_all()
                del job

    def _idle_turn(self) -> None:
        """One piece of idle work, while no job of any explorer waits or runs (:data:`TURN` held meanwhile);
        ``idle`` is called no more once it says there is nothing left."""
        with WAITING_LOCK:
            if WAITING or not TURN.acquire(blocking=False):
                return
        try:
            more = self._idle(self._idle_check)
        except Stale:
            more = True
        except Exception:  # an optimisation only: the work it was doing is done again when asked for
            more = False
        finally:
            TURN.release()
        if not more:
            self._idle = None

    def _idle_check(self) -> None:
        """Idle work gives way to any job: this worker's, another explorer's (or a stop)."""
        with self._cond:
            wanted = self._pending is not None or self._stopping
        with WAITING_LOCK:
            wanted = wanted or bool(WAITING)
        if wanted:
            raise Stale

    def _take_turn(self, job: Job) -> bool:
        """Wait until no other worker of the process runs a job, then hold :data:`TURN`; False when stopped
        meanwhile (the job is dropped). While waiting, ``job`` is in :data:`WAITING` (an older running job gives way
        to it)."""
        with WAITING_LOCK:
            WAITING[id(self)] = job.submitted
        try:
            while True:
                if self._newer_waiting(job.submitted):  # the newer job first (it may wait for this one's turn)
                    time.sleep(TURN_POLL_S)
                elif TURN.acquire(timeout=TURN_POLL_S):
                    return True
                if self.stopping:
                    return False
        finally:
            with WAITING_LOCK:
                WAITING.pop(id(self), None)
