"""The explorer's background worker: one thread running the latest submitted job, so that a control's callback
only hands the new setting over and returns (the controls and the kernel stay free)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pergrad_viz.explorer.state import Setting

__all__ = ["Worker"]


class Worker:
    """One daemon thread running the latest submitted job; a newer submission makes ``stale()`` true."""

    def __init__(self, run: Callable[[Setting], None]):
        self._run = run
        self._cond = threading.Condition()
        self._pending: Setting | None = None
        self._busy = False
        self._generation = 0
        self._thread = threading.Thread(target=self._loop, name="pergrad-explorer", daemon=True)
        self._thread.start()

    def submit(self, setting: Setting) -> None:
        with self._cond:
            self._pending = setting
            self._generation += 1
            self._cond.notify_all()

    def peek(self) -> Setting | None:
        with self._cond:
            return self._pending

    def take(self, setting: Setting) -> bool:
        """Take ``setting`` off the queue if it is still the pending one (handled in place)."""
        with self._cond:
            if self._pending is setting:
                self._pending = None
                self._generation += 1
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

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                setting, self._pending, self._busy = self._pending, None, True
            try:
                self._run(setting)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

