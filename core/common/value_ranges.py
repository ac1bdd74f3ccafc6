"""The valid range of every numeric option, declared once: the command line parses each option with its
range (and shows it in ``--help``), and the Python API checks the same settings with the same ranges.

Whole numbers stop at 2**31 - 1 unless they mean more (a 64-bit seed, a port): a count beyond that is a
typo, and torch would overflow on it. NaN and infinities are refused everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

from accelgen.common.errors import UsageError

INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Range:
    """Numbers of ``kind`` (int or float) from ``low`` to ``high``; ``above_low`` excludes ``low`` itself."""

    kind: type
    low: float
    high: float
    above_low: bool = False

    def describe(self) -> str:
        if self.kind is int:
            return f"a whole number from {self.low} to {self.high}"
        lower = f"above {self.low:g}" if self.above_low else f"at least {self.low:g}"
        return f"a number {lower}" + ("" if math.isinf(self.high) else f" and at most {self.high:g}")

    def holds(self, value: float) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or math.isinf(value):
            return False
        above = value > self.low if self.above_low else value >= self.low
        return above and value <= self.high and (self.kind is float or float(value).is_integer())

    def check(self, option: str, value: float) -> None:
        """Raise UsageError when ``value`` of ``option`` (e.g. "--seed") is out of range."""
        if not self.holds(value):
            raise UsageError(f"{option} must be {self.describe()} (got {value!r}).")

    def check_each(self, option: str, value: float | tuple | list | None) -> None:
        """:meth:`check` ``value``, or each item of a sequence (``--buckets``); None: not set."""
        for item in value if isinstance(value, (tuple, list)) else () if value is None else (value,):
            self.check(option, item)

    def parse(self, text: str) -> int | float:
        """``text`` as a number in range, for argparse's ``type=``."""
        try:
            value = self.kind(text)
        except ValueError:
            value = None
        if value is None or not self.holds(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}")
        return value

    def parse_list(self, text: str) -> tuple[int | float, ...]:
        """Comma-separated numbers in range (``--buckets 32,64,128``), for argparse's ``type=``."""
        try:
            return tuple(self.parse(part.strip()) for part in text.split(","))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must list numbers each {self.describe()}, e.g. 32,64,128; got {text!r}") from None


COUNT = Range(int, 1, INT32_MAX)

#: Each numeric setting or option by name (the Python API's keyword, the command line's option with dashes).
RANGES: dict[str, Range] = {
    "batch_size": COUNT,
    "max_new_tokens": COUNT,
    "max_input_tokens": COUNT,
    "buckets": COUNT,
    "temperature": Range(float, 0, math.inf, above_low=True),
    "top_k": Range(int, 0, INT32_MAX),
    "top_p": Range(float, 0, 1, above_low=True),
    "seed": Range(int, 0, 2**64 - 1),  # a nanosecond timestamp fits; so does any seed torch takes
    "limit": COUNT,
    "num_samples": Range(int, 1, 1 << 16),
    "prompt_logprobs": Range(int, 0, 1 << 10),
    "num_fewshot": Range(int, 0, 1 << 16),
    "max_length": Range(int, 2, INT32_MAX),  # alternatives per token: OpenAI's API gives at most 5, vLLM's 20
    "prefill_chunk": Range(int, 0, INT32_MAX),
    "max_restarts": Range(int, 0, 1000),
    "world_size": Range(int, 1, 65536),
    "data_parallel": Range(int, 1, 65536),
    "replicas": Range(int, 1, 65536),
    "nnodes": Range(int, 1, 65536),
    "max_file_mib": Range(int, 1, 1 << 20),
    "node_rank": Range(int, 0, 65535),
    "master_port": Range(int, 1, 65535),
    "node_wait": Range(int, 1, INT32_MAX),
    "batch_sizes": COUNT,
    "runs": COUNT,
    "warmup_runs": Range(int, 0, INT32_MAX),
    "max_loras": Range(int, 1, 1024),
    "max_lora_rank": Range(int, 1, 65536),
}


def option_name(setting: str) -> str:
    """The command line's option for a setting: ``max_new_tokens`` -> ``--max-new-tokens``."""
    return "--" + setting.replace("_", "-")


def check_settings(**settings: float | None) -> None:
    """Raise UsageError for the first setting out of its range (None: not set; a sequence: each item)."""
    for name, value in settings.items():
        RANGES[name].check_each(option_name(name), value)


#: Units of memory sizes (``--max-device-memory 8GiB``): powers of 1024 with an "i", of 1000 without.
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15, "eb": 10**18,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "eib": 2**60}


def parse_memory_size(value: str | int, option: str) -> int:
    """``value`` (``"8GiB"``, ``"1500MB"``, ``"0.5 TiB"``, or a number of bytes) in bytes; UsageError naming
    ``option`` when it is not a size, or not more than zero."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(value))
        if match is None or match[2].lower() not in SIZE_UNITS:
            raise UsageError(f"{option} {value!r} is not a memory size: write it like 8GiB, 1500MiB or 20GB.")
        size = int(float(match[1]) * SIZE_UNITS[match[2].lower()])
    if not 0 < size < 2**63:
        raise UsageError(f"{option} must be more than 0 bytes and less than 8 EiB (got {value!r}).")
    return size
