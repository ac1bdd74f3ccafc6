"""Progress of a long run: a bar on a terminal, a plain line every few seconds otherwise (logs, CI). With several
samples per row (``--num-samples``) it counts samples, so that a row of thousands of samples is seen to move: a line
at once says how many there are to make (a prompt's samples start only once its prefill is given to each of them,
which takes a while for thousands), and the rate is measured from the first samples made."""

from __future__ import annotations

import sys
import time
from typing import TextIO

#: Seconds between two plain progress lines (off a terminal).
LINE_EVERY_SECONDS = 10.0


class Progress:
    """Rows done of ``total`` (None when unknown), their rate and the time left; with ``samples_per_row`` > 1, the
    samples done too (``samples_done`` of them already), their rate and the time left by them."""

    def __init__(self, total: int | None, done: int = 0, stream: TextIO | None = None,
                 every_seconds: float | None = None, samples_per_row: int = 1, samples_done: int | None = None):
        stream = stream or sys.stderr
        self.total, self.done, self.stream = total, done, stream
        self.every_seconds = LINE_EVERY_SECONDS if every_seconds is None else every_seconds
        self.samples_per_row = samples_per_row
        self.samples_done = done * samples_per_row if samples_done is None else samples_done
        self._started = self._last_line = time.monotonic()
        self._resumed_at = self._counted()
        self._printed: int | None = None  # what was counted when the last line was printed
        self._paused = 0.0  # seconds left out of the rate so far
        self._bar = None
        if stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self._total_counted(), initial=self._counted(), unit=self._unit(), file=stream,
                             dynamic_ncols=True)
        elif samples_per_row > 1:
            self._print_line()
        self._first_samples = samples_per_row == 1  # whether samples have been made (rows alone count from the start)

    def _unit(self) -> str:
        return "sample" if self.samples_per_row > 1 else "row"

    def _counted(self) -> int:
        """What the rate and the time left are of: samples, with several per row, else rows."""
        return self.samples_done if self.samples_per_row > 1 else self.done

    def _total_counted(self) -> int | None:
        return None if self.total is None else self.total * (self.samples_per_row if self.samples_per_row > 1 else 1)

    def announce(self, doing: str) -> None:
        """Say that ``doing`` (compiling the decode step) holds the rows up: on the bar, as its description until
        rows come; else as a line. Its time is left out of the rate (``update``'s ``paused_seconds``)."""
        if self._bar is not None:
            self._bar.set_description_str(doing)
        else:
            print(f"accelgen: {doing}", file=self.stream, flush=True)

    def update(self, rows: int, samples: int | None = None, paused_seconds: float = 0.0) -> None:
        """``rows`` more rows done, and ``samples`` more samples (default: those of the rows). ``paused_seconds``: the
        time spent so far on what is no row's work (compiling the decode step), left out of the rate and the time
        left, which would otherwise promise a job as slow as its compile."""
        self._leave_out(paused_seconds - self._paused)
        before = self._counted()
        self.done += rows
        self.samples_done += rows * self.samples_per_row if samples is None else samples
        if not self._first_samples and self._counted() > before:  # the rate from the first samples made: the time
            self._first_samples = True                            # before them was their prompt's
            self._started, self._resumed_at = time.monotonic(), self._counted()
        if self._bar is not None:
            if rows:
                self._bar.set_description_str("", refresh=False)
            self._bar.update(self._counted() - before)
        elif time.monotonic() - self._last_line >= self.every_seconds:
            self._print_line()

    def _leave_out(self, seconds: float) -> None:
        """Move the clocks the rate is measured by ``seconds`` later, as if that time had not passed."""
        if seconds <= 0:
            return
        self._paused += seconds
        self._started += seconds
        if self._bar is not None:
            self._bar.start_t += seconds
            self._bar.last_print_t += seconds

    def close(self, final_line: bool = True) -> None:
        """End the bar, or print the last progress line when ``final_line`` (unless the last line printed says it)."""
        if self._bar is not None:
            self._bar.close()
        elif final_line and self._printed != self._counted():
            self._print_line()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = (self._counted() - self._resumed_at) / elapsed
        of_total = f"/{self.total}" if self.total is not None else ""
        text = f"accelgen: {self.done}{of_total} rows"
        if self.samples_per_row > 1:
            of_samples = f"/{self._total_counted():,}" if self.total is not None else ""
            text += f", {self.samples_done:,}{of_samples} samples"
        text += f", {rate:.2f} {self._unit()}s/s"
        if self.total is not None and rate > 0:
            text += f", ETA {(self._total_counted() - self._counted()) / rate:.0f} s"
        return text

    def _print_line(self) -> None:
        self._last_line, self._printed = time.monotonic(), self._counted()
        print(self.line(), file=self.stream, flush=True)
