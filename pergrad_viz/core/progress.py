"""Progress bars: tqdm's where tqdm is installed (it is optional), else a plain bar printing a line to stderr at
every tenth of the way."""

from __future__ import annotations

import sys


class PlainBar:
    """The part of tqdm's interface the package uses (``update``, ``set_postfix_str``, ``close``), without tqdm."""

    def __init__(self, total: int, desc: str, unit: str, disable: bool = False):
        self.total, self.desc, self.unit, self.disable = total, desc, unit, disable
        self.n, self.postfix, self._shown = 0, "", 0

    def update(self, n: int = 1) -> None:
        self.n += n
        tenth = 10 * self.n // max(self.total, 1)
        if tenth > self._shown:
            self._shown = tenth
            self._show()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        self.disable = True

    def _show(self) -> None:
        if not self.disable:
            extra = f" ({self.postfix})" if self.postfix else ""
            print(f"{self.desc}: {self.n}/{self.total} {self.unit}{extra}", file=sys.stderr, flush=True)


def progress_bar(*, total: int, desc: str, unit: str, disable: bool = False, **tqdm_options):
    """``tqdm.auto.tqdm(total=..., desc=..., unit=..., disable=..., **tqdm_options)``, or a :class:`PlainBar` where
    tqdm is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return PlainBar(total, desc, unit, disable)
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, **tqdm_options)
