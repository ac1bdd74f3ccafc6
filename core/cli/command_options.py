"""The options of each ``accelgen`` command, declared once: the run's settings (``accelgen.common.run_options``) and
the command line's own (what to read and write, where the ranks run, what bench measures), each command's in the
order its ``--help`` shows them. ``accelgen.cli.parser`` makes the parsers of these tables, and
``accelgen.cli.option_tables`` the docs' tables.
"""

from __future__ import annotations

import argparse

from accelgen.bench.compare import METRICS
from accelgen.bench.protocol import BENCH_BATCHING, PUBLISHED_PROMPT, BenchProtocol
from accelgen.common.options import Option, json_object_text
from accelgen.common.run_options import DATASET, RUN_SETTINGS
from accelgen.common.settings import DEFAULT_MAX_RESTARTS, DEFAULT_MODEL, DEFAULT_NODE_WAIT, DTYPES
from accelgen.plugin.registry import AUTO_DEVICE

#: Largest file a rank of ``accelgen shard`` writes, by default (the size Hugging Face shards checkpoints to).
DEFAULT_FILE_MIB = 4096

PARALLEL = "parallelism (started with the device's launcher, torchrun by default)"
CLUSTER = 'replicas on a Ray cluster (pip install "accelgen[ray]")'
SCORED = "dataset scoring (instead of --prompt)"

S = RUN_SETTINGS  # the run's settings, which the commands below take by name

DEVICE = Option("device", default=AUTO_DEVICE, help="accelerator name (see 'accelgen devices'); default: best available")
MODEL = Option("model", help=f"Hub id or local folder (default: the built-in demo model, the folder {DEFAULT_MODEL})")
TRUST_REMOTE_CODE = Option("trust_remote_code", kind="switch", help="allow model code from the Hub to run")
#: What every command that loads a model takes first.
MODEL_OPTIONS = (DEVICE, S["lora"], S["max_loras"], S["max_lora_rank"], MODEL, S["dtype"], S["quantize"], S["graphs"],
                 TRUST_REMOTE_CODE)

OUTPUT = Option("output", help="write one JSON line per prompt to this file")
OVERWRITE = Option("overwrite", kind="switch", help="replace an --output file of another run instead of refusing")
QUIET = Option("quiet", kind="switch", help="print no completions, only the summary")
SOURCE = Option("dataset", group=DATASET,
                help="Hub dataset id, local JSON/JSONL/CSV/Parquet file or folder, or a save_to_disk folder; an OpenAI "
                     "Batch requests file (JSONL) is completed request by request, into batch output lines")
DATASET_CONFIG = Option("dataset_config", group=DATASET, help="the dataset's configuration (Hub datasets with several)")
SPLIT = Option("split", group=DATASET, default="train", help="split to complete (default: {default})")
COLUMN = Option("column", group=DATASET, default="text",
                help="column holding the prompts: text, or conversations (lists of {role, content} or ShareGPT {from, "
                     "value} messages) (default: {default})")
LIMIT = Option("limit", group=DATASET, help="complete only the first N rows")
STREAMING = Option("streaming", group=DATASET, kind="switch", help="read rows as needed (datasets larger than memory)")
CHAT_OPTIONS = (S["chat"], S["system_prompt"], S["chat_template"], S["chat_template_kwargs"])
OFFLOAD_OPTIONS = (S["offload"], S["max_device_memory"], S["offload_folder"])
PARALLEL_OPTIONS = (
    Option("world_size", group=PARALLEL,
           help="ranks in the whole job, all nodes together (default 1); with --ray, each replica's, on its node"),
    Option("nnodes", group=PARALLEL, default=1, help="machines taking part (run accelgen on each)"),
    Option("node_rank", group=PARALLEL, default=0, help="this machine's index, 0 to nnodes-1"),
    Option("master_addr", group=PARALLEL, default="127.0.0.1", help="address of node 0, reachable from every node"),
    Option("master_port", group=PARALLEL,
           help="free port on node 0 (default: any free port on one node, 29500 on several)"),
    Option("node_wait", group=PARALLEL, default=DEFAULT_NODE_WAIT,
           help="seconds a node of several waits for the others, saying which it waits for, before it gives up "
                "(default {default})"),
)
DATA_PARALLEL = Option("data_parallel", group=PARALLEL, default=1, metavar="R",
                       help="model replicas sharing the rows, each tensor-parallel over world-size / R ranks of one node "
                            "(default 1: one copy over all the ranks)")
MAX_RESTARTS = Option("max_restarts", group=PARALLEL, default=DEFAULT_MAX_RESTARTS,
                      help="times a job of several ranks starts its workers again after one is killed or crashes: they "
                           "resume from --output, so no finished row is lost or written twice (a mistake of the command "
                           "is not tried again); 0: the job ends at the first failure (default {default}); with --ray, "
                           "times each replica is started again after its process or node is lost")

RUN = (
    *MODEL_OPTIONS,
    Option("prompt", kind="repeated", default=(), help="a prompt; repeat for several"),
    SOURCE, DATASET_CONFIG, SPLIT, COLUMN, LIMIT, STREAMING,
    Option("schema_column", group=DATASET, metavar="COLUMN",
           help="column holding each row's own JSON Schema (an object, or its JSON text): the row's completion is held "
                "to it (as --json-schema holds every row's)"),
    Option("lora_column", group=DATASET, metavar="COLUMN",
           help="column naming each row's LoRA adapter (a NAME of --lora NAME=PATH; empty or null: the base model); an "
                "OpenAI batch file names it by each request's body.model instead"),
    S["skip_bad_rows"],
    Option("served_model_name", group=DATASET, kind="repeated", default=(), metavar="NAME",
           help="with an OpenAI batch file: a name its requests' model may give to be served by this run's model, as "
                "vLLM's run-batch takes it (e.g. gpt-4o-mini); the first is written into the responses; repeat for "
                "several (default: the --model as given)"),
    OVERWRITE,
    *CHAT_OPTIONS,
    S["json_schema"], S["json_object"], S["regex"], S["choices"],
    *(S[name] for name in ("max_new_tokens", "max_input_tokens", "batch_size", "batching", "buckets", "ignore_eos",
                           "num_samples", "prefix_cache", "prefill_chunk", "logprobs", "prompt_logprobs", "stop",
                           "do_sample", "temperature", "top_k", "top_p", "seed")),
    OUTPUT,
    QUIET,
    Option("details", kind="switch",
           help="after the summary, print what the run ran on and how: device and threads, dtype, world size, decode "
                "ms/step, graph captures, batching and slot occupancy, prompt tokens prefilled and reused, offloaded "
                "weights, each replica's rows, each rank's parameter bytes and peak memory (the run record beside "
                "--output keeps them too, as last_run)"),
    *OFFLOAD_OPTIONS,
    *PARALLEL_OPTIONS,
    DATA_PARALLEL,
    MAX_RESTARTS,
    Option("ray", group=CLUSTER, bare=True, bare_value="", metavar="ADDRESS",
           help="run the job's replicas on the Ray cluster at ADDRESS (host:port of its head, or ray://...); without "
                "one, RAY_ADDRESS's or the one `ray start` began on this machine, else a new one here; 'local': a new "
                "one here. This process reads the rows and writes --output"),
    Option("replicas", group=CLUSTER, default=1,
           help="with --ray: copies of the model sharing the rows, each on one node of the cluster, tensor-parallel "
                "over --world-size ranks there (default {default})"),
    Option("replica_resources", group=CLUSTER, metavar="JSON",
           parse=json_object_text("--replica-resources", "Ray's resources", '{"num_cpus": 8}'),
           help="with --ray: what each replica asks of a node, as Ray says it, e.g. '{\"num_cpus\": 8}', "
                "'{\"num_gpus\": 1}', '{\"resources\": {\"NAME\": 1}}' (default: what the device's plugin asks for each "
                "of the replica's --world-size ranks)"),
)

SCORE = (
    *MODEL_OPTIONS,
    Option("prompt", kind="repeated", default=(), help="a text to score; repeat for several"),
    SOURCE.but(group=SCORED, help="Hub dataset id, local JSON/JSONL/CSV/Parquet file or folder, or a save_to_disk "
                                  "folder"),
    DATASET_CONFIG.but(group=SCORED),
    SPLIT.but(group=SCORED, help="split to score (default: {default})"),
    COLUMN.but(group=SCORED, help="column holding the texts: text, or conversations (rendered by the chat template) "
                                  "(default: {default})"),
    Option("continuation_column", group=SCORED, exclusive=True, metavar="COLUMN",
           help="column holding each row's continuation: its log-likelihood after the row's text, and whether it is "
                "the model's greedy continuation"),
    Option("choices_column", group=SCORED, exclusive=True, metavar="COLUMN",
           help="column holding each row's choices (a list of texts, or its JSON text): each one's log-likelihood after "
                "the row's text, the best named (by the sum, per token, per byte)"),
    LIMIT.but(group=SCORED, help="score only the first N rows"),
    STREAMING.but(group=SCORED),
    S["skip_bad_rows"].but(group=SCORED, help="write a row that cannot be scored (empty, too long, without its "
                                              "continuation or choices) as an error row (finish_reason error, error: "
                                              "why) and go on, instead of stopping"),
    S["prompt_logprobs"].but(name="token_logprobs", flag="--token-logprobs", numbers=S["prompt_logprobs"].value_range,
                             help="also write each token (tokens), its log-probability (token_logprobs, the first null) "
                                  "and its K most likely alternatives (top_logprobs; default 0: none)"),
    OVERWRITE,
    *CHAT_OPTIONS,
    S["max_input_tokens"].but(help="keep only the first N tokens of each text"),
    S["batch_size"].but(help="rows prefilled together"),
    S["buckets"].but(help="prompt length buckets, e.g. 32,64,128 (a row longer than the largest is refused)"),
    S["prefill_chunk"].but(help="tokens one prefill pass runs at most: a longer row is scored in passes of this many "
                                "(default {default})"),
    OUTPUT.but(help="write one JSON line of scores per row to this file"),
    QUIET.but(help="print no rows, only the summary"),
    Option("details", kind="switch", help="after the summary, print what the run ran on and how"),
    *OFFLOAD_OPTIONS,
    *PARALLEL_OPTIONS,
    DATA_PARALLEL.but(help="model replicas sharing the rows (default 1)"),
    MAX_RESTARTS.but(help="times a job of several ranks starts its workers again after one fails (default {default})"),
)

EVAL = (
    *MODEL_OPTIONS,
    Option("tasks", required=True, parse=lambda text: [task for task in text.split(",") if task],
           help="lm-eval task, group or tag names or globs, comma-separated (hellaswag,arc_easy)"),
    Option("include_path", metavar="FOLDER", help="a folder of task YAML files of your own"),
    Option("num_fewshot", metavar="N", help="examples before each question (default: each task's)"),
    Option("limit", parse=float, metavar="N", help="only the first N documents of each task (below 1: that share of them)"),
    Option("output", metavar="FILE", help="write lm-eval's results as JSON"),
    Option("log_samples", kind="switch", help="keep every document's requests and answers in --output"),
    Option("max_length", metavar="N", help="the window a request is cut to (default: the model's context less 2)"),
    S["batch_size"].but(help="requests prefilled and decoded together"),
    S["buckets"].but(help="prompt length buckets, e.g. 128,512,2048 (the largest bounds --max-length)"),
    *PARALLEL_OPTIONS,
)

BENCH = (
    *MODEL_OPTIONS,
    Option("model_config",
           help="with --random-weights: a built-in config (bloom, bloomz, bloomz-7b1, bloom-560m), a config.json or "
                "model folder, or a Hub id"),
    Option("random_weights", kind="switch", help="build the model from its config, no weights read"),
    Option("batch_sizes", kind="numbers", default=BenchProtocol.batch_sizes,
           help="batch sizes to sweep, e.g. 1,8,32 (default {default})"),
    S["batching"].but(default=BENCH_BATCHING, help="static: fixed batches, as the published protocol measures; or "
                                                   "continuous (default {default})"),
    S["max_new_tokens"].but(default=BenchProtocol.max_new_tokens,
                            help="new tokens per run, always generated (default {default})"),
    Option("runs", default=BenchProtocol.runs, help="timed runs per batch size (default {default})"),
    Option("warmup_runs", default=BenchProtocol.warmup_runs,
           help="untimed runs first, graph capture included (default {default})"),
    Option("prompt", default=PUBLISHED_PROMPT, help=f"default: {PUBLISHED_PROMPT!r}, as published"),
    S["prefix_cache"].but(default="0", help="store for prompt beginnings, as for 'run' (default 0: every run prefills "
                                            "its whole prompt, as published; the result counts the prompt tokens "
                                            "prefilled and reused)"),
    Option("label", help="column name in 'accelgen compare' (default: the device's name)"),
    Option("output", help="write the result file (JSON) here"),
    OVERWRITE.but(help="replace an existing --output file"),
    Option("json", kind="switch", help="print the result document to stdout"),
    QUIET.but(help="say nothing while measuring (loading, each run), only each batch size's figures"),
    S["json_schema"], S["regex"], S["choices"],  # its --json prints the result document
    *OFFLOAD_OPTIONS,
    *PARALLEL_OPTIONS,
)

COMPARE = (
    Option("files", kind="arguments",
           help="result files written by 'accelgen bench' (or published ones), or output files of 'accelgen run' / "
                "'accelgen score' of the same rows: do the answers agree (docs/agreement.md)"),
    Option("metric", choices=tuple(sorted(METRICS)), default="end-to-end",
           help="figure in the cells (default: {default})"),
    Option("baseline", help="hardware label (or output file) to compare the others with (default: the first)"),
    Option("tolerance", parse=float,
           help="output files: how far a plain score's prompt_logprob may drift and still agree, relative (default "
                "1e-3)"),
    Option("markdown", help="also write the table as Markdown to this file"),
    Option("plot", help="also draw a PNG chart to this file (needs matplotlib)"),
)


def shard_scheme(value: str) -> str:
    """The ``parse`` of ``accelgen shard --quantize``: weight-only schemes, which a checkpoint can hold."""
    if value == "int8":
        return value
    if value in S["quantize"].choices:  # fp8 scales come from activations measured on the device at each load
        raise argparse.ArgumentTypeError(f"{value} is measured on the device when a run loads the model: shard without "
                                         f"--quantize and pass --quantize {value} to the runs")
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose int8)")


SHARD = (
    MODEL.but(required=True, help=f"Hub id or local folder of the model to split (the built-in demo model is the "
                                  f"folder {DEFAULT_MODEL})"),
    S["dtype"].but(required=True, choices=DTYPES, help="the dtype runs of the sharded model will use"),
    Option("output", required=True, help="folder to write (written as OUTPUT.partial, renamed when complete)"),
    OVERWRITE.but(help="replace an existing --output folder"),
    S["quantize"].but(choices=None, parse=shard_scheme, metavar="{int8}",
                      help="write the linear layers' weights in this scheme (each rank quantizes its slices): runs then "
                           "read no full-precision weights and pass the same --quantize"),
    Option("max_file_mib", default=DEFAULT_FILE_MIB, help="largest file each rank writes, in MiB (default {default})"),
    DEVICE.but(help="accelerator the ranks load on (see 'accelgen devices'); the split does not depend on it"),
    TRUST_REMOTE_CODE,
    *PARALLEL_OPTIONS,
)

DEVICES = (
    Option("prepare", kind="switch",
           help="do each available device's once-per-machine work now (the CPU: build its C++ kernels), ahead of the "
                "first job: for images, cluster nodes and CI"),
    Option("json", kind="switch", help="print the list as one JSON document, for scripts (the same facts)"),
)

#: Each command: its one-line help and its options.
COMMANDS = {
    "run": ("generate completions for prompts", RUN),
    "score": ("log-likelihoods of texts, continuations and choices, and perplexity", SCORE),
    "eval": ('score lm-evaluation-harness tasks (pip install "accelgen[eval]")', EVAL),
    "bench": ("measure latency and throughput (the published BLOOM protocol)", BENCH),
    "compare": ("tables and a chart from result files of any machines", COMPARE),
    "shard": ("split a model once for a world size and dtype; runs then read only their own files", SHARD),
    "devices": ("list every registered accelerator and whether it can run here", DEVICES),
}
