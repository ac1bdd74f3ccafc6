"""Test double of ``habana_frameworks.torch``, Habana's PyTorch bridge: not Habana's software.

The real package registers the ``hpu`` device with torch when imported; this one cannot, and keeps
tensors on the CPU (see the end of ``hpu``). It counts the calls the plugin makes in
``double_record``, and writes them to ``$HABANA_DOUBLE_RECORD_DIR/<pid>.json`` at exit when that is set.
"""

import atexit
import collections
import json
import os

__version__ = "0.0.0+test-double"

#: Calls made in this process, by name ("mark_step", "graph_capture", "graph_replay", ...).
double_record: collections.Counter = collections.Counter()


def _write_record() -> None:
    folder = os.environ.get("HABANA_DOUBLE_RECORD_DIR")
    if folder:
        record = dict(double_record, rank=int(os.environ.get("RANK", 0)), lazy_mode=os.environ.get("PT_HPU_LAZY_MODE"),
                      lazy_collectives=os.environ.get("PT_HPU_ENABLE_LAZY_COLLECTIVES"))
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w", encoding="utf-8") as record_file:
            json.dump(record, record_file)


atexit.register(_write_record)

from habana_frameworks.torch import core, hpu  # noqa: E402  (the real package exposes both)
