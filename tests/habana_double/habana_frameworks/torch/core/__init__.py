"""Test double of ``habana_frameworks.torch.core``: not Habana's software.

In lazy mode the real ``mark_step`` compiles and launches the operations queued so far; here every
operation already ran on the CPU, so it only counts the call."""

from habana_frameworks.torch import double_record


def mark_step() -> None:
    double_record["mark_step"] += 1
