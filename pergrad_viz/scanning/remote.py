"""Errors raised in another process, carried back as themselves: rank 0's failure to prepare a scan reaches the
other ranks, and a ``DataLoader`` worker's failure (``num_workers > 0``) reaches the scan, as the same exception
type with the same arguments and attributes, its original traceback chained as the cause
(:class:`RemoteTraceback`).

``torch.utils.data`` alone re-raises a worker's error as ``type(message)``: an exception class whose constructor
takes other arguments then arrives as a ``RuntimeError``, and the traceback only as text. Here the exception is
rebuilt without calling its constructor (as :mod:`pickle` restores an object: the class, then ``args`` and the
instance's attributes); only a class the receiving process cannot import (e.g. one defined inside a function)
falls back to ``type(message)`` or a ``RuntimeError`` naming it.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from dataclasses import dataclass

import torch


class RemoteTraceback(Exception):
    """The cause chained to an exception carried from another process: its traceback there, as text."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.text.rstrip()}\n\"\"\""


def _same(a: BaseException, b: BaseException) -> bool:
    return type(a) is type(b) and a.args == b.args and str(a) == str(b)


def _pickled(exc: BaseException) -> bytes | None:
    """``exc`` as bytes that unpickle to an equal exception, or None: by pickle's own rules where they rebuild it,
    else as (class, args, attributes), which :func:`_unpickle` restores without calling the constructor."""
    try:
        data = pickle.dumps(exc)
        if _same(pickle.loads(data), exc):
            return data
    except Exception:  # a constructor that wants other arguments, an attribute that does not pickle, ...
        pass
    try:
        return pickle.dumps((type(exc), exc.args, dict(getattr(exc, "__dict__", {}))))
    except Exception:  # a class defined inside a function, an attribute that does not pickle
        return None


def _unpickle(data: bytes) -> BaseException:
    value = pickle.loads(data)
    if isinstance(value, BaseException):
        return value
    kind, args, state = value
    error = kind.__new__(kind, *args)
    error.args = args
    error.__dict__.update(state)
    return error


def error_report(exc: BaseException) -> dict:
    """What another process needs to raise ``exc`` again: its type's name, message and traceback (plain strings,
    which always pickle) and, where it pickles, the exception itself (``pickled``)."""
    kind = type(exc)
    return {"module": kind.__module__, "qualname": kind.__qualname__, "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)), "pickled": _pickled(exc)}


def rebuild_error(report: dict, where: str = "rank 0 failed to prepare the scan") -> Exception:
    """The exception to raise for another process's ``report``: the same exception where it could be carried (same
    type, ``args`` and attributes), else the same type built from the message alone, else a RuntimeError naming it
    (``where`` says what failed). Its ``__cause__`` is the original traceback (:class:`RemoteTraceback`)."""
    error = None
    if report.get("pickled") is not None:
        try:
            error = _unpickle(report["pickled"])
        except Exception:  # the class cannot be imported here
            error = None
    if not isinstance(error, Exception):
        error = _from_message(report, where)
    if report.get("traceback"):
        error.__cause__ = RemoteTraceback(report["traceback"])
    return error


def _from_message(report: dict, where: str) -> Exception:
    kind = sys.modules.get(report["module"])
    for part in report["qualname"].split("."):
        kind = getattr(kind, part, None)
    name = f"{report['module']}.{report['qualname']}"
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            error = kind(report["message"])
        except Exception:  # a constructor that wants other arguments
            error = None
        if isinstance(error, kind) and str(error) == report["message"]:
            return error
    return RuntimeError(f"{where} with {name}: {report['message']}")


@dataclass
class WorkerFailure:
    """What a ``DataLoader`` worker hands back instead of a batch when loading it failed: :func:`error_report`."""

    report: dict

    def reraise(self) -> None:
        raise rebuild_error(self.report, where="a DataLoader worker failed to load a batch")


class GuardedBatches(torch.utils.data.Dataset):
    """A dataset served a collated batch at a time (``__getitems__``), as a ``DataLoader`` worker would build it
    (``dataset.__getitems__`` or ``dataset[i]`` per index, then ``collate``), with any error caught and handed
    back as a :class:`WorkerFailure` in place of the batch. Use with ``collate_fn=`` :func:`first`."""

    def __init__(self, dataset: torch.utils.data.Dataset, collate):
        self.dataset = dataset
        self.collate = collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> object:
        return self.dataset[i]

    def __getitems__(self, indices: list[int]) -> list:
        try:
            getitems = getattr(self.dataset, "__getitems__", None)
            items = getitems(indices) if getitems else [self.dataset[i] for i in indices]
            return [self.collate(items)]
        except Exception as exc:
            return [WorkerFailure(error_report(exc))]


def first(batch: list) -> object:
    """The collate function of a dataset whose ``__getitems__`` returns ``[the collated batch]``."""
    return batch[0]
