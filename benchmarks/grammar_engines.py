"""llguidance against xgrammar on the four extraction schemas of ``dataset_throughput.py --workload structured``: what
compiling each schema costs, and what following 16 rows costs per decode step (each row's token consumed and its next
mask filled, on the host), the two things structured output adds to a dataset job.

The rows walk their grammars at random: at each step each row takes a token drawn uniformly (seeded) among those its
mask allows, until its grammar is complete or 128 steps have passed; row r follows schema r % 4, as the workload's rows
do. Both engines use the workload's tokenizer (the built-in model's, 4,096 tokens) and write JSON compact (llguidance:
``whitespace_flexible`` false; xgrammar: ``any_whitespace`` false). Each engine compiles each schema afresh (a new
matcher of a new grammar for llguidance, whose compiled grammars are not cached between matchers; a compiler without
its cache for xgrammar). Medians over ``--rounds`` rounds, one thread each.

    pip install llguidance xgrammar    # xgrammar is optional here: without it only llguidance is measured
    python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import time

import torch
from dataset_throughput import EXTRACTION_SCHEMAS

from accelgen.loading.model_files import DEFAULT_MODEL, load_tokenizer

ROWS, MOST_STEPS = 16, 128


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf

        self.engine = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        self.version = importlib.metadata.version("llguidance")

    def compile(self, schema: dict):
        grammar = self.engine.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        return lambda: self.engine.LLMatcher(self.tokenizer, grammar)

    @staticmethod
    def fill(matcher, mask: torch.Tensor, row: int) -> None:
        matcher.unsafe_compute_mask_ptr(mask[row].data_ptr(), mask.shape[1] * 4)

    @staticmethod
    def consume(matcher, token: int) -> None:
        assert matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar

        self.engine = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.version = importlib.metadata.version("xgrammar")

    def compile(self, schema: dict):
        compiler = self.engine.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return lambda: self.engine.GrammarMatcher(compiled)

    @staticmethod
    def fill(matcher, mask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(mask, row)

    @staticmethod
    def consume(matcher, token: int) -> None:
        assert matcher.accept_token(token)


def allowed_of(mask: torch.Tensor, width: int) -> torch.Tensor:
    bit_values = torch.ones(32, dtype=torch.int32).bitwise_left_shift_(torch.arange(32, dtype=torch.int32))
    return ((mask.unsqueeze(-1) & bit_values) != 0).view(mask.shape[0], -1)[:, :width]


def measure(engine, width: int, seed: int) -> dict:
    """One round: each schema compiled afresh (seconds each), then 16 rows walked to their ends."""
    compile_seconds, makers = [], []
    for schema in EXTRACTION_SCHEMAS:
        started = time.perf_counter()
        make = engine.compile(schema)
        make()  # the first matcher: what a row waits for before its first token
        compile_seconds.append(time.perf_counter() - started)
        makers.append(make)
    draw = random.Random(seed)
    matchers = [makers[row % 4]() for row in range(ROWS)]
    mask = torch.full((ROWS, -(-width // 32)), -1, dtype=torch.int32)
    live, step_seconds, tokens = list(range(ROWS)), [], 0
    for row in live:
        engine.fill(matchers[row], mask, row)
    for _ in range(MOST_STEPS):
        allowed = allowed_of(mask, width)
        chosen = {row: draw.choice(allowed[row].nonzero().flatten().tolist()) for row in live}
        started = time.perf_counter()
        for row in live:
            engine.consume(matchers[row], chosen[row])
            engine.fill(matchers[row], mask, row)
        step_seconds.append(time.perf_counter() - started)
        tokens += len(live)
        live = [row for row in live if not only_the_end_allowed(allowed_of(mask[row: row + 1], width)[0])]
        if not live:
            break
    return {"compile_ms": [1000 * seconds for seconds in compile_seconds],
            "step_ms": 1000 * statistics.mean(step_seconds), "row_token_us": 1e6 * sum(step_seconds) / tokens}


def only_the_end_allowed(allowed: torch.Tensor) -> bool:
    """The row's grammar is complete: only its end token is left (the built-in tokenizer's end is token 2)."""
    return allowed.sum().item() == 1 and bool(allowed[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(str(DEFAULT_MODEL))
    engines = []
    for engine_class in (Llguidance, Xgrammar):
        try:
            started = time.perf_counter()
            engine = engine_class(tokenizer)
            engine.tokenizer_seconds = time.perf_counter() - started
            engines.append(engine)
        except ImportError:
            print(f"{engine_class.name}: not installed; left out")
    print(f"four extraction schemas, {ROWS} rows (row r: schema r % 4), tokenizer of {len(tokenizer)} tokens, one "
          f"thread, medians of {arguments.rounds} rounds")
    print("| engine | version | tokenizer set-up ms | compile ms per schema (1-4) | host ms per decode step (16 rows) "
          "| us per row and token |")
    print("|---|---|---:|---|---:|---:|")
    for engine in engines:
        rounds = [measure(engine, len(tokenizer), seed) for seed in range(arguments.rounds)]
        compile_ms = [statistics.median(one["compile_ms"][schema] for one in rounds) for schema in range(4)]
        print(f"| {engine.name} | {engine.version} | {1000 * engine.tokenizer_seconds:.1f} | "
              f"{' / '.join(f'{ms:.2f}' for ms in compile_ms)} | {statistics.median(one['step_ms'] for one in rounds):.3f} | "
              f"{statistics.median(one['row_token_us'] for one in rounds):.1f} |")


if __name__ == "__main__":
    main()
