"""The explorer's background worker: one thread running the latest submitted job, so that a control's callback
only hands the new setting over and returns (the controls and the kernel stay free).

The worker's thread is the only one that computes, times (it alone reads and writes the timing cache) and draws
(it alone writes the output panes' traits); the kernel's thread only writes the controls. :meth:`Worker.stop`
ends the thread and joins it, so that a closed explorer holds nothing alive.

Several explorers in one process (a notebook with two, shown at once as a Voila dashboard) take turns: a job runs
only while it holds :data:`TURN`, one lock for the process. Otherwise their workers would compute and time at the same
time, each measuring the other (the threads share the cores and the interpreter), and every timing would be noisy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pergrad_viz.explorer.state import Setting

__all__ = ["TURN", "Job", "Worker"]

TURN = threading.Lock()  # held by the one worker of the process running a job (see the module's docstring)
TURN_POLL_S = 0.05  # a worker waiting for its turn checks this often whether it was stopped


@dataclass(frozen=True)
class Job:
    """One piece of work: show ``setting``; ``rerun``: forget its timings first and time it again."""

    setting: Setting
    rerun: bool = False


class Worker:
    """One daemon thread running the latest submitted :class:`Job` with ``run(job)``; a newer submission is what
    :meth:`peek` returns meanwhile (the running job checks it and gives way). :meth:`stop` ends the thread: the
    running job sees :attr:`stopping` at its next check, and the thread is joined."""

    def __init__(self, run: Callable[[Job], None], name: str = "pergrad-explorer"):
        self._run = run
        self._cond = threading.Condition()
        self._pending: Job | None = None
        self._busy = False
        self._stopping = False
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
                    self._cond.wait()
                if self._stopping:
                    return
                job, self._pending, self._busy = self._pending, None, True
            try:
                if self._take_turn():
                    try:
                        self._run(job)
                    finally:
                        TURN.release()
            finally:
                del job
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _take_turn(self) -> bool:
        """Wait until no other worker of the process runs a job, then hold :data:`TURN`; False when stopped
        meanwhile (the job is dropped)."""
        while not TURN.acquire(timeout=TURN_POLL_S):
            if self.stopping:
                return False
        return True
