"""A progress bar on standard error for the slow parts of the Python API (model loads, long
generate calls), in the style of tqdm but without the dependency. It appears only once the
work has taken longer than `delay_s`, so quick loads print nothing."""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000.0
    return f"{n:.1f} TB"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60:02d}:{seconds % 60:02d}"


class ProgressBar:
    """`bar(done, total)` as work proceeds; `close()` at the end. On a terminal the bar is
    redrawn in place; elsewhere (logs) a line is written at each tenth of the work."""

    def __init__(
        self,
        description: str,
        unit: str = "B",
        delay_s: float = 1.0,
        stream: Optional[TextIO] = None,
        clock: Callable[[], float] = time.monotonic,
        width: int = 30,
    ) -> None:
        self.description = description
        self.unit = unit
        self.delay_s = delay_s
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.width = width
        self.start = clock()
        self.shown = False
        self.last_draw = -1.0
        self.last_tenth = -1
        self.done = 0
        self.total = 0
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False

    def _amount(self, n: float) -> str:
        return _bytes(n) if self.unit == "B" else f"{int(n)}"

    def line(self) -> str:
        elapsed = self.clock() - self.start
        frac = self.done / self.total if self.total > 0 else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + " " * (self.width - filled)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        rate_text = f"{_bytes(rate)}/s" if self.unit == "B" else f"{rate:.2f} {self.unit}/s"
        return (
            f"{self.description}: {frac * 100:3.0f}%|{bar}| {self._amount(self.done)}/"
            f"{self._amount(self.total)} [{_clock(elapsed)}<{_clock(eta)}, {rate_text}]"
        )

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        now = self.clock()
        if not self.shown and now - self.start < self.delay_s:
            return
        self.shown = True
        if self.tty:
            if done < total and now - self.last_draw < 0.1:
                return
            self.last_draw = now
            self.stream.write("\r" + self.line())
        else:
            tenth = int(10 * done / total) if total > 0 else 10
            if tenth == self.last_tenth:
                return
            self.last_tenth = tenth
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends the bar (with a newline on a terminal) if it was shown."""
        if self.shown and self.tty:
            self.stream.write("\r" + self.line() + "\n")
            self.stream.flush()
