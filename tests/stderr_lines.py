"""The standard error of a started process, read line by line in a thread as it comes: a test can wait for a line
while the process runs, and read every line once it has ended (to the end of the stream, not after a pause)."""

from __future__ import annotations

import queue
import subprocess
import threading
import time

#: How long the last lines of an ended process may take to arrive: its stream closes when the last process holding
#: it (a rank, too) has gone, so this bounds a hang, it times nothing.
END_OF_STREAM_SECONDS = 60


class StderrLines:
    """Lines of ``process.stderr`` (opened with ``text=True``): :meth:`wait_for` one, :meth:`text` of all so far."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self.seen: list[str] = []
        self._arrived: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self._arrived.put(line)

    def _take_arrived(self) -> None:
        while not self._arrived.empty():
            self.seen.append(self._arrived.get())

    def wait_for(self, text: str, seconds: float, while_running: bool = False) -> str:
        """The first line holding ``text`` not yet waited for, within ``seconds``; with ``while_running``, fail at
        once if the process ends first."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                line = self._arrived.get(timeout=0.5)
            except queue.Empty:
                assert not (while_running and self.process.poll() is not None), "".join(self.seen)
                continue
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} in {''.join(self.seen)}")

    def text(self) -> str:
        """Every line so far; once the process has ended, every line it wrote."""
        if self.process.poll() is not None:
            self._reader.join(END_OF_STREAM_SECONDS)
        self._take_arrived()
        return "".join(self.seen)
