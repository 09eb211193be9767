"""Argument types and the help format shared by the command-line subcommands
(``python -m pergrad_viz bench|scan|scan-bench``)."""

from __future__ import annotations

import argparse
import textwrap


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs keep their line breaks (column tables, examples; written within 88 columns);
    option help is wrapped to the terminal, each option stating its default in its own words."""

    def __init__(self, prog: str, **kwargs) -> None:
        kwargs.setdefault("max_help_position", 30)
        super().__init__(prog, **kwargs)

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):  # argparse measures the commands one indent short
            for command in action._get_subactions():
                width = len(command.dest) + self._current_indent + 2 * self._indent_increment
                self._action_max_length = max(self._action_max_length, width)

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Never break an option name such as --batch-sizes at its hyphen.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def positive_ints(text: str) -> list[int]:
    """``"2,32,128"`` -> ``[2, 32, 128]``; anything else is an ``argparse`` error naming what was expected."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def non_negative_int(text: str) -> int:
    """``"0"`` -> 0; a negative number or anything else is an ``argparse`` error (a seed, a count of workers)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        _refuse(f"expected an integer >= 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """``"32"`` -> 32; zero, a negative number or anything else is an ``argparse`` error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        _refuse(f"expected a positive integer, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """``"0.5"`` -> 0.5; zero, a negative number, inf or nan is an ``argparse`` error."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        _refuse(f"expected a positive number, got {text!r}")
    return value


def device(text: str) -> str:
    """A device torch knows (``cpu``, ``cuda``, ``cuda:1``) that this machine has; else an ``argparse`` error."""
    import torch

    try:
        kind = torch.device(text).type
    except RuntimeError:
        _refuse(f"expected a device such as cpu or cuda, got {text!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        _refuse(f"{text!r}: this machine has no CUDA device torch can use (torch.cuda.is_available() is False); use "
                "--device cpu")
    return text


def _refuse(message: str):
    raise argparse.ArgumentTypeError(message)
