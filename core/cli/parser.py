"""The ``accelgen`` command line: every subcommand's arguments (the commands themselves are in ``accelgen.cli``)."""

from __future__ import annotations

import argparse
import json
import textwrap

from accelgen.bench.compare import METRICS
from accelgen.bench.protocol import BENCH_BATCHING, PUBLISHED_PROMPT, BenchProtocol
from accelgen.common.errors import UsageError
from accelgen.common.settings import (
    BATCHING_MODES,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_MODEL,
    DEFAULT_MOST_LORAS,
    DEFAULT_NODE_WAIT,
    DTYPES,
    OFFLOAD_MODES,
    QUANTIZATION_SCHEMES,
    RunSettings,
    SamplingSettings,
)
from accelgen.common.value_ranges import RANGES
from accelgen.plugin.registry import AUTO_DEVICE

#: Largest file a rank of ``accelgen shard`` writes, by default (the size Hugging Face shards checkpoints to).
DEFAULT_FILE_MIB = 4096


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, wrapped at spaces only: a folder's path in it (``/home/me/my-venv/...``) is never cut at a
    hyphen, so that it can be copied whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line (and exit status 2) instead of usage text."""

    def __init__(self, *arguments, **options):
        options.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*arguments, **options)

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


class _VersionAction(argparse.Action):
    """``accelgen --version``: accelgen's release and those of the libraries that decide what it runs, in one line
    (read from the installed distributions: nothing is imported)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **options):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print accelgen's version and those of torch, transformers and DeepSpeed, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def version_line() -> str:
    """``accelgen 0.1.0 (torch 2.13.0+cpu, transformers 5.24.0, deepspeed not installed, Python 3.11.9)``."""
    import platform
    from importlib import metadata

    def version(distribution: str) -> str:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return "not installed"

    libraries = ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "deepspeed"))
    return f"accelgen {version('accelgen')} ({libraries}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accelgen", description="Static-shape LLM text generation on any accelerator.")
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="generate completions for prompts")
    _add_model_arguments(run)
    run.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for several")
    data = run.add_argument_group("dataset completion (instead of --prompt)")
    data.add_argument("--dataset", help="Hub dataset id, local JSON/JSONL/CSV/Parquet file or folder, or a save_to_disk folder; "
                      "an OpenAI Batch requests file (JSONL) is completed request by request, into batch output lines")
    data.add_argument("--dataset-config", help="the dataset's configuration (Hub datasets with several)")
    data.add_argument("--split", default="train", help="split to complete (default: train)")
    data.add_argument("--column", default="text", help="column holding the prompts: text, or conversations (lists of "
                                                       "{role, content} or ShareGPT {from, value} messages) (default: text)")
    data.add_argument("--limit", type=_number("limit"), help=_with_range("complete only the first N rows", "limit"))
    data.add_argument("--streaming", action="store_true", help="read rows as needed (datasets larger than memory)")
    data.add_argument("--schema-column", metavar="COLUMN",
                      help="column holding each row's own JSON Schema (an object, or its JSON text): the row's "
                           "completion is held to it (as --json-schema holds every row's)")
    data.add_argument("--lora-column", metavar="COLUMN",
                      help="column naming each row's LoRA adapter (a NAME of --lora NAME=PATH; empty or null: the base "
                           "model); an OpenAI batch file names it by each request's body.model instead")
    data.add_argument("--skip-bad-rows", action="store_true",
                      help="write a row that cannot be completed (empty, not a prompt, too long, refused by the chat "
                           "template) as an error row (finish_reason error, error: why) and go on, instead of stopping")
    data.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                      help="with an OpenAI batch file: a name its requests' model may give to be served by this run's "
                           "model, as vLLM's run-batch takes it (e.g. gpt-4o-mini); the first is written into the "
                           "responses; repeat for several (default: the --model as given)")
    run.add_argument("--overwrite", action="store_true", help="replace an --output file of another run instead of refusing")
    _add_chat_arguments(run)
    _add_structure_arguments(run, json_flag=True)
    run.add_argument("--max-new-tokens", type=_number("max_new_tokens"), default=RunSettings.max_new_tokens,
                     help=_with_range(f"default {RunSettings.max_new_tokens}", "max_new_tokens"))
    run.add_argument("--max-input-tokens", type=_number("max_input_tokens"), help=_with_range("keep only the first N tokens of each prompt", "max_input_tokens"))
    run.add_argument("--batch-size", type=_number("batch_size"), default=RunSettings.batch_size, help=_with_range("rows decoded together: the batch shape", "batch_size"))
    run.add_argument("--batching", choices=BATCHING_MODES, default=RunSettings.batching,
                     help=f"continuous: a finished row's slot takes the next prompt at once; static: fixed batches, "
                          f"each decoded until its longest row ends (default {RunSettings.batching})")
    run.add_argument("--buckets", type=RANGES["buckets"].parse_list, default=RunSettings.buckets, help="prompt length buckets, e.g. 32,64,128")
    run.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    _add_number(run, "--num-samples", RunSettings.num_samples,
                "completions drawn for each prompt, with --do-sample; its prefill is computed once (default {default})")
    run.add_argument("--prefix-cache", metavar="SIZE",
                     help="device memory for the keys and values of prompt beginnings that rows share (a system prompt, "
                          "few-shot examples), e.g. 2GiB: a row finding its beginning there prefills only the rest; "
                          "0 turns reuse off (default: an eighth of the free memory, at most 2GiB)")
    _add_number(run, "--prefill-chunk", RunSettings.prefill_chunk,
                "prompt tokens one prefill pass runs at most: a longer prompt is prefilled in passes of this many, the "
                "running rows taking a decode step between two, so none waits for a whole long prompt; 0: each prompt "
                "in one pass (default {default})")
    run.add_argument("--logprobs", action="store_true",
                     help="write each new token's log-probability (logprobs) under the model's own distribution: "
                          "log_softmax of its logits, before --temperature, --top-k and --top-p")
    run.add_argument("--prompt-logprobs", type=_number("prompt_logprobs"), nargs="?", const=0, metavar="K",
                     help="write each prompt token's log-probability given those before it (prompt_logprobs, the first "
                          "null), computed in the prefill, with K most likely tokens at each (prompt_top_logprobs; "
                          "default 0: none)")
    run.add_argument("--stop", action="append", default=[], metavar="TEXT", type=stop_text,
                     help="end a completion at the first occurrence of TEXT (not kept; finish_reason stop), on top of "
                          "the model's end tokens; repeat for several. In TEXT, \\n is a new line, \\t a tab and "
                          "\\\\ a backslash: --stop '\\n\\n' stops at a blank line")
    run.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    sampling = SamplingSettings()
    _add_number(run, "--temperature", sampling.temperature, "default {default}")
    _add_number(run, "--top-k", sampling.top_k, "0: off (default {default})")
    _add_number(run, "--top-p", sampling.top_p, "1.0: off (default {default})")
    _add_number(run, "--seed", sampling.seed, "decides the sampled draws of every row (default {default})")
    run.add_argument("--output", help="write one JSON line per prompt to this file")
    run.add_argument("--quiet", action="store_true", help="print no completions, only the summary")
    run.add_argument("--details", action="store_true",
                     help="after the summary, print what the run ran on and how: device and threads, dtype, world size, "
                          "decode ms/step, graph captures, batching and slot occupancy, prompt tokens prefilled and "
                          "reused, offloaded weights, each replica's rows, each rank's parameter bytes and peak memory "
                          "(the run record beside --output keeps them too, as last_run)")
    _add_offload_arguments(run)
    parallel = _add_parallel_arguments(run)
    parallel.add_argument("--data-parallel", type=_number("data_parallel"), default=1, metavar="R",
                          help=_with_range("model replicas sharing the rows, each tensor-parallel over world-size / R "
                                           "ranks of one node (default 1: one copy over all the ranks)", "data_parallel"))
    _add_number(parallel, "--max-restarts", DEFAULT_MAX_RESTARTS,
                "times a job of several ranks starts its workers again after one is killed or crashes: they resume "
                "from --output, so no finished row is lost or written twice (a mistake of the command is not tried "
                "again); 0: the job ends at the first failure (default {default}); with --ray, times each replica is "
                "started again after its process or node is lost")
    cluster = run.add_argument_group("replicas on a Ray cluster (pip install \"accelgen[ray]\")")
    cluster.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                         help="run the job's replicas on the Ray cluster at ADDRESS (host:port of its head, or ray://...); "
                              "without one, RAY_ADDRESS's or the one `ray start` began on this machine, else a new one "
                              "here; 'local': a new one here. This process reads the rows and writes --output")
    _add_number(cluster, "--replicas", 1, "with --ray: copies of the model sharing the rows, each on one node of the "
                "cluster, tensor-parallel over --world-size ranks there (default {default})")
    cluster.add_argument("--replica-resources", type=_json_object("--replica-resources", "Ray's resources", '{"num_cpus": 8}'), metavar="JSON",
                         help="with --ray: what each replica asks of a node, as Ray says it, e.g. '{\"num_cpus\": 8}', "
                              "'{\"num_gpus\": 1}', '{\"resources\": {\"NAME\": 1}}' (default: what the device's "
                              "plugin asks for each of the replica's --world-size ranks)")

    _add_score_parser(commands, run)
    _add_eval_parser(commands)

    bench = commands.add_parser("bench", help="measure latency and throughput (the published BLOOM protocol)")
    _add_model_arguments(bench)
    bench.add_argument("--model-config", help="with --random-weights: a built-in config (bloom, bloomz, bloomz-7b1, bloom-560m), "
                                              "a config.json or model folder, or a Hub id")
    bench.add_argument("--random-weights", action="store_true", help="build the model from its config, no weights read")
    bench.add_argument("--batch-sizes", type=RANGES["batch_sizes"].parse_list, default=BenchProtocol.batch_sizes,
                       help=f"batch sizes to sweep, e.g. 1,8,32 (default {','.join(map(str, BenchProtocol.batch_sizes))})")
    bench.add_argument("--batching", choices=BATCHING_MODES, default=BENCH_BATCHING,
                       help=f"static: fixed batches, as the published protocol measures; or continuous (default {BENCH_BATCHING})")
    _add_number(bench, "--max-new-tokens", BenchProtocol.max_new_tokens, "new tokens per run, always generated (default {default})")
    _add_number(bench, "--runs", BenchProtocol.runs, "timed runs per batch size (default {default})")
    _add_number(bench, "--warmup-runs", BenchProtocol.warmup_runs, "untimed runs first, graph capture included (default {default})")
    bench.add_argument("--prompt", default=PUBLISHED_PROMPT, help=f"default: {PUBLISHED_PROMPT!r}, as published")
    bench.add_argument("--prefix-cache", metavar="SIZE", default="0",
                       help="store for prompt beginnings, as for 'run' (default 0: every run prefills its whole prompt, "
                            "as published; the result counts the prompt tokens prefilled and reused)")
    bench.add_argument("--label", help="column name in 'accelgen compare' (default: the device's name)")
    bench.add_argument("--output", help="write the result file (JSON) here")
    bench.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    bench.add_argument("--json", action="store_true", help="print the result document to stdout")
    bench.add_argument("--quiet", action="store_true",
                       help="say nothing while measuring (loading, each run), only each batch size's figures")
    _add_structure_arguments(bench, json_flag=False)  # its --json prints the result document
    _add_offload_arguments(bench)
    _add_parallel_arguments(bench)

    compare = commands.add_parser("compare", help="tables and a chart from result files of any machines")
    compare.add_argument("files", nargs="+", help="result files written by 'accelgen bench' (or published ones), or output "
                         "files of 'accelgen run' / 'accelgen score' of the same rows: do the answers agree "
                         "(docs/agreement.md)")
    compare.add_argument("--metric", choices=sorted(METRICS), default="end-to-end", help="figure in the cells (default: end-to-end)")
    compare.add_argument("--baseline", help="hardware label (or output file) to compare the others with (default: the first)")
    compare.add_argument("--tolerance", type=float, default=None,
                         help="output files: how far a plain score's prompt_logprob may drift and still agree, relative "
                              "(default 1e-3)")
    compare.add_argument("--markdown", help="also write the table as Markdown to this file")
    compare.add_argument("--plot", help="also draw a PNG chart to this file (needs matplotlib)")

    shard = commands.add_parser("shard", help="split a model once for a world size and dtype; runs then read only their own files")
    shard.add_argument("--model", required=True, help=f"Hub id or local folder of the model to split (the built-in demo "
                                                      f"model is the folder {DEFAULT_MODEL})")
    shard.add_argument("--dtype", required=True, choices=DTYPES, help="the dtype runs of the sharded model will use")
    shard.add_argument("--output", required=True, help="folder to write (written as OUTPUT.partial, renamed when complete)")
    shard.add_argument("--overwrite", action="store_true", help="replace an existing --output folder")
    shard.add_argument("--quantize", type=_shard_scheme, metavar="{int8}",
                       help="write the linear layers' weights in this scheme (each rank quantizes its slices): runs then "
                            "read no full-precision weights and pass the same --quantize")
    shard.add_argument("--max-file-mib", type=_number("max_file_mib"), default=DEFAULT_FILE_MIB,
                       help=_with_range(f"largest file each rank writes, in MiB (default {DEFAULT_FILE_MIB})", "max_file_mib"))
    shard.add_argument("--device", default=AUTO_DEVICE, help="accelerator the ranks load on (see 'accelgen devices'); the split does not depend on it")
    shard.add_argument("--trust-remote-code", action="store_true", help="allow model code from the Hub to run")
    _add_parallel_arguments(shard)

    devices = commands.add_parser("devices", help="list every registered accelerator and whether it can run here")
    devices.add_argument("--prepare", action="store_true",
                         help="do each available device's once-per-machine work now (the CPU: build its C++ kernels), "
                              "ahead of the first job: for images, cluster nodes and CI")
    return parser


def _add_score_parser(commands, run: argparse.ArgumentParser) -> None:
    """``accelgen score``: the rows' log-likelihoods, through the same job as ``run`` (every option of run that
    decides nothing of a score takes run's default)."""
    score = commands.add_parser("score", help="log-likelihoods of texts, continuations and choices, and perplexity")
    _add_model_arguments(score)
    score.add_argument("--prompt", action="append", default=[], help="a text to score; repeat for several")
    data = score.add_argument_group("dataset scoring (instead of --prompt)")
    data.add_argument("--dataset", help="Hub dataset id, local JSON/JSONL/CSV/Parquet file or folder, or a save_to_disk folder")
    data.add_argument("--dataset-config", help="the dataset's configuration (Hub datasets with several)")
    data.add_argument("--split", default="train", help="split to score (default: train)")
    data.add_argument("--column", default="text", help="column holding the texts: text, or conversations (rendered by "
                                                       "the chat template) (default: text)")
    scored = data.add_mutually_exclusive_group()
    scored.add_argument("--continuation-column", metavar="COLUMN",
                        help="column holding each row's continuation: its log-likelihood after the row's text, and "
                             "whether it is the model's greedy continuation")
    scored.add_argument("--choices-column", metavar="COLUMN",
                        help="column holding each row's choices (a list of texts, or its JSON text): each one's "
                             "log-likelihood after the row's text, the best named (by the sum, per token, per byte)")
    data.add_argument("--limit", type=_number("limit"), help=_with_range("score only the first N rows", "limit"))
    data.add_argument("--streaming", action="store_true", help="read rows as needed (datasets larger than memory)")
    data.add_argument("--skip-bad-rows", action="store_true",
                      help="write a row that cannot be scored (empty, too long, without its continuation or choices) "
                           "as an error row (finish_reason error, error: why) and go on, instead of stopping")
    score.add_argument("--token-logprobs", type=_number("prompt_logprobs"), nargs="?", const=0, metavar="K",
                       help="also write each token (tokens), its log-probability (token_logprobs, the first null) and "
                            "its K most likely alternatives (top_logprobs; default 0: none)")
    score.add_argument("--overwrite", action="store_true", help="replace an --output file of another run instead of refusing")
    _add_chat_arguments(score)
    score.add_argument("--max-input-tokens", type=_number("max_input_tokens"),
                       help=_with_range("keep only the first N tokens of each text", "max_input_tokens"))
    score.add_argument("--batch-size", type=_number("batch_size"), default=RunSettings.batch_size,
                       help=_with_range("rows prefilled together", "batch_size"))
    score.add_argument("--buckets", type=RANGES["buckets"].parse_list, default=RunSettings.buckets,
                       help="prompt length buckets, e.g. 32,64,128 (a row longer than the largest is refused)")
    _add_number(score, "--prefill-chunk", RunSettings.prefill_chunk,
                "tokens one prefill pass runs at most: a longer row is scored in passes of this many (default {default})")
    score.add_argument("--output", help="write one JSON line of scores per row to this file")
    score.add_argument("--quiet", action="store_true", help="print no rows, only the summary")
    score.add_argument("--details", action="store_true", help="after the summary, print what the run ran on and how")
    _add_offload_arguments(score)
    parallel = _add_parallel_arguments(score)
    parallel.add_argument("--data-parallel", type=_number("data_parallel"), default=1, metavar="R",
                          help=_with_range("model replicas sharing the rows (default 1)", "data_parallel"))
    _add_number(parallel, "--max-restarts", DEFAULT_MAX_RESTARTS,
                "times a job of several ranks starts its workers again after one fails (default {default})")
    own = {action.dest for action in score._actions}
    score.set_defaults(**{**{action.dest: action.default for action in run._actions
                             if action.dest not in own and action.dest != "help"}, "max_new_tokens": 1})


def _add_eval_parser(commands) -> None:
    """``accelgen eval``: lm-evaluation-harness's tasks on the engine (``accelgen[eval]``)."""
    evaluate = commands.add_parser("eval", help="score lm-evaluation-harness tasks (pip install \"accelgen[eval]\")")
    _add_model_arguments(evaluate)
    evaluate.add_argument("--tasks", required=True, type=lambda text: [task for task in text.split(",") if task],
                          help="lm-eval task, group or tag names or globs, comma-separated (hellaswag,arc_easy)")
    evaluate.add_argument("--include-path", metavar="FOLDER", help="a folder of task YAML files of your own")
    evaluate.add_argument("--num-fewshot", type=_number("num_fewshot"), metavar="N",
                          help=_with_range("examples before each question (default: each task's)", "num_fewshot"))
    evaluate.add_argument("--limit", type=float, metavar="N",
                          help="only the first N documents of each task (below 1: that share of them)")
    evaluate.add_argument("--output", metavar="FILE", help="write lm-eval's results as JSON")
    evaluate.add_argument("--log-samples", action="store_true",
                          help="keep every document's requests and answers in --output")
    evaluate.add_argument("--max-length", type=_number("max_length"), metavar="N",
                          help=_with_range("the window a request is cut to (default: the model's context less 2)",
                                           "max_length"))
    evaluate.add_argument("--batch-size", type=_number("batch_size"), default=RunSettings.batch_size,
                          help=_with_range("requests prefilled and decoded together", "batch_size"))
    evaluate.add_argument("--buckets", type=RANGES["buckets"].parse_list, default=RunSettings.buckets,
                          help="prompt length buckets, e.g. 128,512,2048 (the largest bounds --max-length)")
    _add_parallel_arguments(evaluate)


def _add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of conversations: text rows as user messages, a system prompt, the chat template and its variables."""
    chat = parser.add_argument_group("instruction models (conversations are rendered by the tokenizer's chat template)")
    chat.add_argument("--chat", action="store_true", help="make each --prompt or text row one user message")
    chat.add_argument("--system-prompt", metavar="TEXT", help="a system message first in every conversation that has none")
    chat.add_argument("--chat-template", metavar="FILE", dest="chat_template_file",
                      help="a Jinja chat template to render conversations with, instead of the tokenizer's")
    chat.add_argument("--chat-template-kwargs", metavar="JSON", type=_json_object("--chat-template-kwargs"),
                      help="more variables for the chat template, as a JSON object, e.g. '{\"enable_thinking\": false}'")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=AUTO_DEVICE, help="accelerator name (see 'accelgen devices'); default: best available")
    adapters = parser.add_argument_group("fine-tuned LoRA adapters (PEFT folders or Hub ids)")
    adapters.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                          help="an adapter rows choose by NAME (--lora-column, or a batch request's model), run beside the "
                               "base model in the same steps; repeat for several. PATH alone: one adapter merged into the "
                               "weights for every row")
    adapters.add_argument("--max-loras", type=_number("max_loras"), metavar="N",
                          help=_with_range(f"named adapters held on the device at once; others are copied in as their "
                                           f"rows come (default: one per adapter, at most {DEFAULT_MOST_LORAS})", "max_loras"))
    adapters.add_argument("--max-lora-rank", type=_number("max_lora_rank"), metavar="R",
                          help=_with_range("the largest rank the device's buffers hold (default: the largest of the "
                                           "adapters')", "max_lora_rank"))
    parser.add_argument("--model", help=f"Hub id or local folder (default: the built-in demo model, the folder {DEFAULT_MODEL})")
    parser.add_argument("--dtype", choices=DTYPES, help="default: the device's (float32 on cpu)")
    parser.add_argument("--quantize", choices=QUANTIZATION_SCHEMES,
                        help="store the linear layers' weights as int8 (one scale per output channel) or the device's "
                             "8-bit float; activations stay in --dtype (see 'accelgen devices' for what a device runs)")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="capture the decode step as a graph (default: the device decides)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model code from the Hub to run")


def _add_structure_arguments(parser: argparse.ArgumentParser, json_flag: bool) -> None:
    """The options that hold every completion to a structure (one of them at most; needs accelgen[structured])."""
    structure = parser.add_argument_group("structured output: every completion held to one structure "
                                          "(pip install \"accelgen[structured]\")")
    structure.add_argument("--json-schema", metavar="FILE", dest="json_schema_file",
                           help="a JSON Schema (a .json file) every completion is a JSON value of")
    if json_flag:
        structure.add_argument("--json", action="store_true", dest="json_object", help="every completion a JSON object")
    structure.add_argument("--regex", metavar="PATTERN", help="a regular expression every whole completion matches")
    structure.add_argument("--choice", action="append", dest="choices", metavar="TEXT",
                           help="a text every completion may be; repeat for each choice")


def _json_object(flag: str, what: str = "template variables", example: str = '{"enable_thinking": false}'):
    """The argparse ``type`` of an option holding a JSON object (of ``what``, such as ``example``)."""

    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except ValueError as error:
            raise UsageError(f"{flag} is not JSON ({error}): give a JSON object, e.g. '{example}'.") from None
        if not isinstance(value, dict):
            raise UsageError(f"{flag} must be a JSON object of {what}, e.g. '{example}'.")
        return value

    return parse


def _add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    offload = parser.add_argument_group("models larger than the device (Hugging Face Accelerate's big-model inference)")
    offload.add_argument("--offload", choices=OFFLOAD_MODES,
                         help="keep the weights that do not fit --max-device-memory in host memory (cpu) or in files (disk); "
                              "they are brought to the device layer by layer in every step")
    offload.add_argument("--max-device-memory", help="device memory the run may use, KV cache included, e.g. 8GiB "
                                                     "(default: what the device has free)")
    offload.add_argument("--offload-folder", help="with --offload disk: write the offloaded weights here in the run's dtype "
                                                  "(default: read them in place from the checkpoint's safetensors files)")


def _add_parallel_arguments(parser: argparse.ArgumentParser):
    """The options of a job of several ranks; returns their group."""
    parallel = parser.add_argument_group("parallelism (started with the device's launcher, torchrun by default)")
    parallel.add_argument("--world-size", type=_number("world_size"), help=_with_range("ranks in the whole job, all nodes together (default 1); with --ray, each replica's, on its node", "world_size"))
    parallel.add_argument("--nnodes", type=_number("nnodes"), default=1, help=_with_range("machines taking part (run accelgen on each)", "nnodes"))
    parallel.add_argument("--node-rank", type=_number("node_rank"), default=0, help=_with_range("this machine's index, 0 to nnodes-1", "node_rank"))
    parallel.add_argument("--master-addr", default="127.0.0.1", help="address of node 0, reachable from every node")
    parallel.add_argument("--master-port", type=_number("master_port"), help=_with_range("free port on node 0 (default: any free port on one node, 29500 on several)", "master_port"))
    _add_number(parallel, "--node-wait", DEFAULT_NODE_WAIT, "seconds a node of several waits for the others, saying "
                "which it waits for, before it gives up (default {default})")
    return parallel


def _add_number(parser, flag: str, default, help_text: str) -> None:
    """A numeric option with its default, and its range in the help (``{default}`` in ``help_text`` says it)."""
    setting = flag.lstrip("-").replace("-", "_")
    parser.add_argument(flag, type=_number(setting), default=default,
                        help=_with_range(help_text.format(default=default), setting))


def _number(setting: str):
    """The argparse ``type`` of a numeric option: parsed and checked against its range."""
    return RANGES[setting].parse


#: The escapes ``--stop`` reads, as a shell cannot type a new line inside quotes.
STOP_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def stop_text(value: str) -> str:
    """The argparse ``type`` of ``--stop``: ``\\n``, ``\\t`` and ``\\\\`` read as a new line, a tab and a backslash; any
    other backslash is itself."""
    text, position = [], 0
    while position < len(value):
        escaped = value[position + 1: position + 2]
        if value[position] == "\\" and escaped in STOP_ESCAPES:
            text.append(STOP_ESCAPES[escaped])
            position += 2
        else:
            text.append(value[position])
            position += 1
    return "".join(text)


def _shard_scheme(value: str) -> str:
    """The argparse ``type`` of ``accelgen shard --quantize``: weight-only schemes, which a checkpoint can hold."""
    if value == "int8":
        return value
    if value in QUANTIZATION_SCHEMES:  # fp8 scales come from activations measured on the device at each load
        raise argparse.ArgumentTypeError(f"{value} is measured on the device when a run loads the model: shard without "
                                         f"--quantize and pass --quantize {value} to the runs")
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose int8)")


def _with_range(help_text: str, setting: str) -> str:
    return f"{help_text}; {RANGES[setting].describe()}"
