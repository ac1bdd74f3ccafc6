"""Progress of a long run: a bar on a terminal, a plain line every few seconds otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Rows done of ``total`` (None when unknown), their rate and the time left."""

    def __init__(self, total: int | None, done: int = 0, stream: TextIO | None = None, every_seconds: float = 10.0):
        stream = stream or sys.stderr
        self.total, self.done, self.stream, self.every_seconds = total, done, stream, every_seconds
        self._started = self._last_line = time.monotonic()
        self._resumed_at = done
        self._printed: int | None = None  # rows done when the last line was printed
        self._bar = None
        if stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, unit="row", file=stream, dynamic_ncols=True)

    def update(self, rows: int) -> None:
        self.done += rows
        if self._bar is not None:
            self._bar.update(rows)
        elif time.monotonic() - self._last_line >= self.every_seconds:
            self._print_line()

    def close(self, final_line: bool = True) -> None:
        """End the bar, or print the last progress line when ``final_line`` (unless the last line printed says it)."""
        if self._bar is not None:
            self._bar.close()
        elif final_line and self._printed != self.done:
            self._print_line()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = (self.done - self._resumed_at) / elapsed
        of_total = f"/{self.total}" if self.total is not None else ""
        text = f"accelgen: {self.done}{of_total} rows, {rate:.2f} rows/s"
        if self.total is not None and rate > 0:
            text += f", ETA {(self.total - self.done) / rate:.0f} s"
        return text

    def _print_line(self) -> None:
        self._last_line, self._printed = time.monotonic(), self.done
        print(self.line(), file=self.stream, flush=True)
