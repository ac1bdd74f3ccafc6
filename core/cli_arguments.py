"""The ``accelgen`` command line: every subcommand's arguments (the commands themselves are in ``accelgen.cli``)."""

from __future__ import annotations

import argparse

from accelgen.accelerators import AUTO_DEVICE
from accelgen.bench import PUBLISHED_PROMPT
from accelgen.compare import METRICS
from accelgen.errors import UsageError
from accelgen.settings import DEFAULT_BUCKETS, DTYPES


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line (and exit status 2) instead of usage text."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accelgen", description="Static-shape LLM text generation on any accelerator.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="generate completions for prompts")
    _add_model_arguments(run)
    run.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for several")
    data = run.add_argument_group("dataset completion (instead of --prompt)")
    data.add_argument("--dataset", help="Hub dataset id, local JSON/JSONL/CSV/Parquet file or folder, or a save_to_disk folder")
    data.add_argument("--dataset-config", help="the dataset's configuration (Hub datasets with several)")
    data.add_argument("--split", default="train", help="split to complete (default: train)")
    data.add_argument("--column", default="text", help="column holding the prompts (default: text)")
    data.add_argument("--limit", type=int, help="complete only the first N rows")
    data.add_argument("--streaming", action="store_true", help="read rows as needed (datasets larger than memory)")
    run.add_argument("--overwrite", action="store_true", help="replace an --output file of another run instead of refusing")
    run.add_argument("--max-new-tokens", type=int, default=100)
    run.add_argument("--max-input-tokens", type=int, help="keep only the first N tokens of each prompt")
    run.add_argument("--batch-size", type=int, default=1, help="fixed batch shape; the last batch is padded")
    run.add_argument("--buckets", type=_int_list, default=DEFAULT_BUCKETS, help="prompt length buckets, e.g. 32,64,128")
    run.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    run.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    run.add_argument("--temperature", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--output", help="write one JSON line per prompt to this file")
    run.add_argument("--quiet", action="store_true", help="print no completions, only the summary")
    _add_parallel_arguments(run)

    bench = commands.add_parser("bench", help="measure latency and throughput (the published BLOOM protocol)")
    _add_model_arguments(bench)
    bench.add_argument("--model-config", help="with --random-weights: a built-in config (bloom, bloomz, bloomz-7b1, bloom-560m), "
                                              "a config.json or model folder, or a Hub id")
    bench.add_argument("--random-weights", action="store_true", help="build the model from its config, no weights read")
    bench.add_argument("--batch-sizes", type=_int_list, default=(1,), help="batch sizes to sweep, e.g. 1,8,32 (default 1)")
    bench.add_argument("--max-new-tokens", type=int, default=100, help="new tokens per run, always generated (default 100)")
    bench.add_argument("--runs", type=int, default=5, help="timed runs per batch size (default 5)")
    bench.add_argument("--warmup-runs", type=int, default=1, help="untimed runs first, graph capture included (default 1)")
    bench.add_argument("--prompt", default=PUBLISHED_PROMPT, help=f"default: {PUBLISHED_PROMPT!r}, as published")
    bench.add_argument("--label", help="column name in 'accelgen compare' (default: the device's name)")
    bench.add_argument("--output", help="write the result file (JSON) here")
    bench.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    bench.add_argument("--json", action="store_true", help="print the result document to stdout")
    _add_parallel_arguments(bench)

    compare = commands.add_parser("compare", help="tables and a chart from result files of any machines")
    compare.add_argument("files", nargs="+", help="result files written by 'accelgen bench' (or published ones)")
    compare.add_argument("--metric", choices=sorted(METRICS), default="end-to-end", help="figure in the cells (default: end-to-end)")
    compare.add_argument("--baseline", help="hardware label to compare the others with (default: the first column)")
    compare.add_argument("--markdown", help="also write the table as Markdown to this file")
    compare.add_argument("--plot", help="also draw a PNG chart to this file (needs matplotlib)")

    commands.add_parser("devices", help="list every registered accelerator and whether it can run here")
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=AUTO_DEVICE, help="accelerator name (see 'accelgen devices'); default: best available")
    parser.add_argument("--model", help="Hub id or local folder (default: the built-in demo model)")
    parser.add_argument("--dtype", choices=DTYPES, help="default: the device's (float32 on cpu)")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="capture the decode step as a graph (default: the device decides)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model code from the Hub to run")


def _add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parallel = parser.add_argument_group("tensor parallelism (started with the device's launcher, torchrun by default)")
    parallel.add_argument("--world-size", type=int, help="ranks in the whole job, all nodes together (default 1)")
    parallel.add_argument("--nnodes", type=int, default=1, help="machines taking part (run accelgen on each)")
    parallel.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 to nnodes-1")
    parallel.add_argument("--master-addr", default="127.0.0.1", help="address of node 0, reachable from every node")
    parallel.add_argument("--master-port", type=int, help="free port on node 0 (default: any free port on one node, 29500 on several)")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
