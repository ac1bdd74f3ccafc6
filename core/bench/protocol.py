"""What ``accelgen bench`` measures, the same on every machine: the protocol of the published BLOOM / BLOOMZ
benchmarks (greedy decoding, ``max_new_tokens`` forced, the published prompt over the batch, warm-up runs not
counted, then timed runs, for each batch size of a sweep)."""

from __future__ import annotations

import dataclasses
from typing import Any

from accelgen.common.errors import UsageError
from accelgen.common.prompts import prompt_problem
from accelgen.common.value_ranges import check_settings

PUBLISHED_PROMPT = "DeepSpeed is a machine learning framework"
#: How ``accelgen bench`` batches by default: fixed batches, as the published protocol measures.
BENCH_BATCHING = "static"


@dataclasses.dataclass(frozen=True)
class BenchProtocol:
    """What is measured: the same on every machine for figures to compare."""

    batch_sizes: tuple[int, ...] = (1,)
    max_new_tokens: int = 100
    prompt: str = PUBLISHED_PROMPT
    warmup_runs: int = 1
    runs: int = 5

    def check(self) -> None:
        if not self.batch_sizes:
            raise UsageError("--batch-sizes must list batch sizes, e.g. 1,8,32.")
        check_settings(batch_sizes=self.batch_sizes, max_new_tokens=self.max_new_tokens, runs=self.runs,
                       warmup_runs=self.warmup_runs)
        problem = prompt_problem(self.prompt)
        if problem:
            raise UsageError(f"--prompt {problem} (the default is the published prompt).")

    def as_record(self, prompt_tokens: int) -> dict[str, Any]:
        return dict(prompt=self.prompt, prompt_tokens=prompt_tokens, max_new_tokens=self.max_new_tokens,
                    decoding="greedy", ignore_eos=True, warmup_runs=self.warmup_runs, runs=self.runs)
