"""Argument types shared by the command-line subcommands (``python -m pergrad_viz bench|scan|scan-bench``)."""

from __future__ import annotations

import argparse


def positive_ints(text: str) -> list[int]:
    """``"2,32,128"`` -> ``[2, 32, 128]``; anything else is an ``argparse`` error naming what was expected."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
