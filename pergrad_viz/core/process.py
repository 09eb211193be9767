"""What PyTorch's lazy imports under a public call would leave in the user's process, put back when the call ends:
sympy's warnings filter (``('once', SymPyDeprecationWarning)``, added by its import, which torch._dynamo's import
under torch.func's first grad or a first batched backward brings) and ``TORCHINDUCTOR_CACHE_DIR`` (set by
torch._dynamo's import to its cache directory, made absolute). Only PyTorch's own settings are taken back: a value
the user sets meanwhile (another thread) is kept. And the warnings the package's checks keep quiet (:func:`quiet`)
without touching the process's filters, whose change makes Python forget which warnings it has shown."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator

from pergrad_viz.core.users import FILTERS

INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
# the start of torch.func's note that an operation runs without a batching rule (slower, not wrong: "please file us
# an issue"), kept out of what the package shows
NO_BATCHING_RULE = "There is a performance drop because we have not yet"


@contextlib.contextmanager
def leaving_process_as_found() -> Iterator[None]:
    """Run the body; afterwards, a sympy filter its first import added and the cache variable PyTorch set are gone."""
    cache = os.environ.get(INDUCTOR_CACHE)
    filters = None if "sympy" in sys.modules else list(warnings.filters)
    try:
        yield
    finally:
        _put_back_cache(cache)
        if filters is not None and "sympy" in sys.modules:
            _drop_sympy_filters(filters)


def leaves_process_as_found(fn: Callable) -> Callable:
    """Decorator: ``fn`` runs under :func:`leaving_process_as_found` (a public call not under ``computing_gradients``,
    which does the same: ``pv.scan``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with leaving_process_as_found():
            return fn(*args, **kwargs)

    return wrapper


def _put_back_cache(saved: str | None) -> None:
    now = os.environ.get(INDUCTOR_CACHE)
    if now == saved:
        return
    if saved is not None and now == os.path.abspath(saved):  # torch wrote the user's relative path back absolute
        os.environ[INDUCTOR_CACHE] = saved
    elif saved is None and now is not None and now == _torch_default_cache():
        os.environ.pop(INDUCTOR_CACHE, None)


def _torch_default_cache() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another PyTorch: nothing known to take back
        return None
    return os.path.abspath(default_cache_dir())


def _drop_sympy_filters(before: list) -> None:
    """Remove the filters for sympy's warnings that appeared since ``before`` was taken (its import's)."""
    with FILTERS:
        added = [f for f in warnings.filters
                 if f not in before and getattr(f[2], "__module__", "").startswith("sympy")]
        for f in added:
            warnings.filters.remove(f)
        if added:
            getattr(warnings, "_filters_mutated", lambda: None)()  # the module's caches read the list anew


@contextlib.contextmanager
def quiet(*messages: str) -> Iterator[None]:
    """Warnings whose text matches one of ``messages`` (regexes; none given: every warning) are not shown while the
    body runs, the process's filters untouched: ``warnings.catch_warnings`` puts the filter list back on exit, and
    any change to it makes Python forget which warnings it has shown, so that the user's own (a loss's note on
    broadcast shapes) would show again after every checked call. A warning the filters make an error still is."""
    with FILTERS:
        show, here = warnings.showwarning, threading.get_ident()

        def shown(message, category, filename, lineno, file=None, line=None):
            if threading.get_ident() != here or (messages and not any(re.search(m, str(message)) for m in messages)):
                show(message, category, filename, lineno, file, line)  # another thread's, or not one to keep quiet

        warnings.showwarning = shown
        try:
            yield
        finally:
            warnings.showwarning = show
