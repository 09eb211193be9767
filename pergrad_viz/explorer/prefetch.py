"""Importing ahead, while no explorer works, the libraries a network of the menu needs (the ViT with LoRA: transformers
and peft, seconds of imports), and what torch imports lazily at a Jacobian's first call, so that a first visit does not
wait for them.

The imports run in a thread of their own, started once an explorer has shown its first setting (:func:`start`).
They give way to every explorer's work: at the start of each module it imports, the thread pauses while an explorer
runs a job (holds :data:`~.worker.TURN`), so a job never shares the interpreter with it, and its timings are not
disturbed. A pause gives way itself where it would block someone: while another thread waits for a module lock (a
module this thread is importing), the imports go on, so nobody waits on a paused thread; a job for the ViT that
finds them not done imports what is left as any import would. A module that fails to import is
left alone (the network's first visit says why).

A pause point is the moment a module is looked for (a finder on ``sys.meta_path`` that finds nothing); while paused,
the thread lets go of the interpreter's import lock, so that other threads import freely.
"""

from __future__ import annotations

import _imp
import importlib
import sys
import threading
import time
from collections.abc import Callable, Iterable

import torch

from pergrad_viz.core.memory import empty_result
from pergrad_viz.explorer.worker import TURN

__all__ = ["POLL_S", "TORCH_LAZY", "Prefetch", "start", "warm_results"]

POLL_S = 0.05  # a paused import checks this often whether it may go on
# What torch imports at its first autograd.grad given grad_outputs (sympy with it: 0.3 s here): a Jacobian's first
# call (320 ms of MLP(784, 20, 10)'s first Jacobian at B=32, 1 thread, against 23-34 ms with it imported), unless
# an explorer timing batched_grad or autograd_stack (the default) has imported it with its first view already.
TORCH_LAZY = ("torch.fx.experimental.symbolic_shapes",)
BOOTSTRAP = "<frozen importlib._bootstrap"  # the import system's frames (a module lock's acquire among them)


class Prefetch:
    """The thread importing ``modules`` in order (see the module's docstring); :attr:`done` is set at the end."""

    def __init__(self, modules: Iterable[str]):
        self.modules = tuple(dict.fromkeys(modules))
        self.failed: dict[str, BaseException] = {}
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pergrad-explorer-imports", daemon=True)
        self._thread.start()

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        """The pause point: called (under the import lock) before each module this process imports; finds nothing."""
        if threading.get_ident() == self._thread.ident and TURN.locked():
            self._pause()
        return None

    def _pause(self) -> None:
        _imp.release_lock()  # held by the import system around find_spec: others may import meanwhile
        try:
            if _imp.lock_held():  # still (taken twice: a finder importing, or another thread now): no pause here
                return
            while TURN.locked() and not self._waited_on():
                time.sleep(POLL_S)
        finally:
            _imp.acquire_lock()

    def _waited_on(self) -> bool:
        """Whether another thread waits for a module lock (one this thread may hold: a module it is importing): then
        this thread goes on, so that nobody waits on a pause. (Merely passing through the import system, as a
        ``from package import name`` in a function does, is no reason: the pause holds while a job runs.)"""
        me = threading.get_ident()
        return any(tid != me and frame.f_code.co_name == "acquire" and frame.f_code.co_filename.startswith(BOOTSTRAP)
                   for tid, frame in sys._current_frames().items())

    def _run(self) -> None:
        sys.meta_path.insert(0, self)
        try:
            for name in self.modules:
                if name in sys.modules:
                    continue
                try:
                    importlib.import_module(name)
                except Exception as exc:  # an optimisation: the network's own import says what is wrong
                    self.failed[name] = exc
        finally:
            sys.meta_path.remove(self)
            self.done.set()


STARTED: list[Prefetch] = []  # the process's Prefetch, the latest started
STARTING = threading.Lock()


def start(modules: Iterable[str]) -> Prefetch | None:
    """Start importing ``modules`` ahead, unless a start came first and is still importing (one at a time per process:
    the explorers of a process share it; an explorer that wanted only torch's own module does not keep the menu's
    libraries from a later one); returns the process's :class:`Prefetch`, None while there was nothing to import."""
    with STARTING:
        failed = STARTED[0].failed if STARTED else {}  # not tried again: a broken library once, not at every view
        wanted = [m for m in modules if m not in sys.modules and m not in failed]
        if wanted and (not STARTED or STARTED[0].done.is_set()):
            previous = dict(failed)
            STARTED[:] = [Prefetch(wanted)]
            STARTED[0].failed.update(previous)
        return STARTED[0] if STARTED else None


WARM_STEP_BYTES = 32 << 20  # written between two calls of ``check``: a few ms each, tens when the kernel faults


def warm_results(shape: tuple[int, ...], dtype: torch.dtype, count: int = 2,
                 check: Callable[[], None] | None = None) -> None:
    """Write ``count`` CPU results of ``shape`` (B, P) once, now, and let them go: ``core.memory`` keeps their memory
    for the next results of that size, which are then written without page faults (the largest setting's: the
    heatmap's result and ``auto``'s first timed one). Measured here, in-process, for the MLP at B=256, hidden 512
    (two of (256, 407,050) float32): its first view 1.3-1.9 s after the change, about 0.6 s warmed.

    ``check()`` is called after every :data:`WARM_STEP_BYTES` written and may raise to stop (a learner's input comes
    first: writing 834 MB took 1-1.5 s on fragmented memory); what was written stays warm."""
    results = [empty_result(shape, dtype, "cpu") for _ in range(count)]
    for r in results:
        flat = r.view(-1)
        step = max(1, WARM_STEP_BYTES // r.element_size())
        for start in range(0, flat.numel(), step):
            flat[start:start + step].fill_(0)
            if check is not None:
                check()
