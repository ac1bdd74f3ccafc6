"""Plain data handed from the user's request to the core and the plugins."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from accelgen.common.errors import UsageError
from accelgen.common.structure import Structure

#: The small BLOOM-architecture model shipped with accelgen, used when no --model is given (rebuilt by
#: examples/build_default_model.py); named in ``--help`` so that it can be sharded or benched by its path.
DEFAULT_MODEL = Path(__file__).parent.parent / "default_model"

#: Dtype names users pass (``--dtype``) and the torch attribute each one names.
DTYPES = ("float32", "bfloat16", "float16")
#: Bytes per value of each dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def torch_dtype(name: str):
    """The ``torch.dtype`` a dtype name of :data:`DTYPES` names (torch is imported here, not by this module)."""
    import torch

    return getattr(torch, name)

#: Weight quantization schemes (``--quantize``): weight-only int8 with one scale per output channel, and the
#: device's 8-bit float. Which ones a device runs is its plugin's answer (``Accelerator.quantization_schemes``).
QUANTIZATION_SCHEMES = ("int8", "fp8")
#: Where ``--offload`` keeps the weights that do not fit the device: host memory, or files.
OFFLOAD_MODES = ("cpu", "disk")
#: How rows share the batch: "continuous" (a finished row's slot takes the next prompt at once) or "static"
#: (fixed batches, each decoded until its longest row ends).
BATCHING_MODES = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How the next token is chosen. Greedy unless ``do_sample``."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    top_p: float = 1.0  # 1.0: no nucleus filtering
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class RowSettings:
    """The settings one row is completed with: the run's, or a row's own (an OpenAI batch request's fields);
    None in a row's own settings keeps the run's (:meth:`RunSettings.row_settings`)."""

    max_new_tokens: int | None = None
    temperature: float | None = None  # 0: greedy
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    num_samples: int | None = None
    structure: Structure | None = None  # what its completion is held to (a JSON schema, a regex, choices)
    adapter: str | None = None  # the name of the LoRA adapter it is completed with (``AdapterSettings``); None: the base


#: LoRA adapters held in the device's buffers at once when the run does not say (``--max-loras``): one per named
#: adapter, at most this many.
DEFAULT_MOST_LORAS = 8


@dataclasses.dataclass(frozen=True)
class AdapterSettings:
    """Fine-tuned LoRA adapters over the model (``--lora``): ``named`` ones, (name, PEFT folder or Hub id) pairs, that
    rows choose by name, computed in the same steps as the rows of the base model from device buffers that hold
    ``max_loras`` of them at once at ranks up to ``max_lora_rank`` (None: the largest rank among them); or one, ``merged``,
    added into the weights at load for every row (``accelgen.adapters``)."""

    named: tuple[tuple[str, str], ...] = ()
    merged: str | None = None
    max_loras: int = 0  # 0 without named adapters
    max_lora_rank: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.named)

    def problem(self, name: str) -> str | None:
        """Why a row cannot be completed with the adapter ``name``, as a clause with its fix; None when this run serves
        it."""
        if name in self.names:
            return None
        served = f"it serves {', '.join(map(repr, self.names))}" if self.names else "it serves no adapter"
        return (f"names LoRA adapter {name!r}, which this run does not serve ({served}, and the base model for an empty "
                f"name): add --lora {name}=PATH, or fix the row")


@dataclasses.dataclass(frozen=True)
class ChatSettings:
    """How prompts meet an instruction model's chat template. ``text_as_user`` (``--chat``): each text prompt is
    one user message; ``system_prompt``: a system message put first in every conversation that has none;
    ``template``: a Jinja chat template used instead of the tokenizer's own; ``template_kwargs``: more variables
    the template is rendered with (``{"enable_thinking": false}``)."""

    text_as_user: bool = False
    system_prompt: str | None = None
    template: str | None = None
    template_kwargs: dict | None = None


@dataclasses.dataclass(frozen=True)
class OffloadSettings:
    """Weights beyond ``max_device_bytes`` of device memory kept in host memory (``mode`` "cpu") or in files
    ("disk") and brought to the device layer by layer in every forward pass (``accelgen.loading.offload``).
    ``max_device_bytes`` None: what the device says is free. ``folder``: where "disk" writes the offloaded
    weights, in the run's dtype; None: they are read in place from the checkpoint's safetensors files."""

    mode: str
    max_device_bytes: int | None = None
    folder: str | None = None


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What a generation run asks of the core and of the accelerator (built by ``accelgen.session.request``).
    The defaults here (and :class:`SamplingSettings`') are every setting's one default: the declarations of
    ``accelgen.common.run_options``, and so the Python API and the command line, take theirs from these."""

    dtype: str
    batch_size: int = 1
    max_new_tokens: int = 100
    max_input_tokens: int | None = None  # truncate prompts to their first N tokens
    ignore_eos: bool = False
    use_graphs: bool | None = False  # None: left to the job's length (``Request.capture_decided``); eager until then
    trace_steps: bool = False  # a decode step not captured runs as the device traces it (``Accelerator.trace_step``)
    buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048)  # prompt lengths padded to
    sampling: SamplingSettings = SamplingSettings()
    offload: OffloadSettings | None = None
    batching: str = "continuous"  # accelgen bench measures "static" by default, as published (BENCH_BATCHING)
    quantize: str | None = None  # a scheme of QUANTIZATION_SCHEMES: the linear layers' weights, not the activations
    chat: ChatSettings = ChatSettings()
    stop: tuple[str, ...] = ()  # a completion ends at the first of these texts (not kept), as at an end token
    skip_bad_rows: bool = False  # a row that cannot be completed becomes an error row instead of stopping the run
    logprobs: bool = False  # record each chosen token's log-probability under the model's own distribution
    #: each prompt token's log-probability given those before it, with this many best alternatives (0: none); None: none
    prompt_logprobs: int | None = None
    num_samples: int = 1  # completions drawn for each prompt, its prefill shared
    rows_choose: bool = False  # rows may bring their own RowSettings (an OpenAI batch file's requests)
    prefix_cache: int | None = None  # bytes of prompt-prefix blocks kept on the device; 0: no reuse; None: a default
    prefill_chunk: int = 512  # prompt positions one prefill pass runs at most; 0: each prompt in one pass
    structure: Structure | None = None  # what every row's completion is held to (--json-schema, --json, --regex, --choice)
    structured_rows: bool = False  # rows may bring their own structure (a schema column, batch requests' response_format)
    lora: AdapterSettings = AdapterSettings()  # fine-tuned adapters: chosen row by row, or one merged for every row

    @property
    def constrained(self) -> bool:
        """Whether rows may be held to a structure: the decode step then takes each slot's mask of allowed tokens."""
        return self.structure is not None or self.structured_rows

    @property
    def rows_end_early(self) -> bool:
        """Whether a row may end before its ``max_new_tokens`` (at end-of-sequence, a stop text, the end of its
        structure, its own budget); if not, every row's end is known before it starts."""
        return not self.ignore_eos or bool(self.stop) or self.rows_choose or self.constrained

    def row_settings(self, own: RowSettings | None = None) -> RowSettings:
        """A row's settings, every field set: its ``own`` where it has them, else the run's (a greedy run's
        temperature is 0). Raise UsageError, in the request's words, for own settings this run cannot take."""
        sampling = self.sampling
        run = RowSettings(self.max_new_tokens, sampling.temperature if sampling.do_sample else 0.0, sampling.top_p,
                          sampling.seed, self.stop, self.num_samples, self.structure, adapter=None)
        if own is None:
            return run
        settings = RowSettings(**{field.name: getattr(run, field.name) if getattr(own, field.name) is None
                                  else getattr(own, field.name) for field in dataclasses.fields(RowSettings)})
        if own.structure is not None and not self.constrained:  # its steps would take no mask: it would not hold
            raise UsageError("A row brings its own structure, but this run takes none: open the rows as a job's "
                             "(accelgen.jobs.completion_job) so that the run is set for them.")
        if settings.max_new_tokens > self.max_new_tokens:
            raise UsageError(f"max_tokens {settings.max_new_tokens} is over this run's --max-new-tokens "
                             f"{self.max_new_tokens} (the size of its slots): run with --max-new-tokens "
                             f"{settings.max_new_tokens}, or ask for fewer.")
        if settings.num_samples > 1 and settings.temperature == 0:
            raise UsageError(f"n {settings.num_samples} with temperature 0 (greedy) gives {settings.num_samples} equal "
                             f"completions: set a temperature above 0, or n 1.")
        if settings.adapter is not None and (problem := self.lora.problem(settings.adapter)):
            raise UsageError(f"{problem}.")
        return settings

    @property
    def torch_dtype(self):
        """The ``torch.dtype`` of ``dtype``."""
        return torch_dtype(self.dtype)

    def output_deciding(self) -> dict:
        """The settings that decide what a run writes (graph capture, offloading and batching do not), flat, as
        JSON values."""
        settings = dataclasses.asdict(self)
        sampling = settings.pop("sampling")
        del settings["use_graphs"], settings["trace_steps"], settings["offload"], settings["batching"], settings["skip_bad_rows"]
        del settings["rows_choose"], settings["structured_rows"]  # the rows' own settings are the dataset's, which the job pins
        del settings["prefix_cache"], settings["prefill_chunk"]  # what a whole prompt's one prefill writes
        del settings["lora"]  # adapters are pinned by their content (``accelgen.adapters.adapter_set``), not by path
        if self.quantize is None:
            del settings["quantize"]  # so that records written before quantization existed still match
        chat = settings.pop("chat")
        del chat["template"]  # its text decides as its hash, which the job records (``chat_template_sha256``)
        chat = {key: value for key, value in chat.items() if value not in (None, False)}  # older records match
        if self.stop:
            settings["stop"] = list(self.stop)
        else:
            del settings["stop"]
        if not self.logprobs:
            del settings["logprobs"]
        if self.prompt_logprobs is None:
            del settings["prompt_logprobs"]
        if self.num_samples == 1:
            del settings["num_samples"]
        if self.structure is None:
            del settings["structure"]
        return {**settings, "buckets": list(self.buckets), **sampling, **chat}


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process sits among the ranks of its model replica, and among the job's replicas.

    ``rank`` and ``size`` are the replica's: the tensor-parallel ranks that hold one copy of the model. A job
    of N ranks with ``--data-parallel R`` runs R replicas of N / R ranks each (replica ``replica`` holds the
    job's ranks ``replica * size`` to ``replica * size + size - 1``, all on one node); with R = 1 (the
    default) the replica is the whole job. ``local_rank`` and ``local_size`` are the node's: the device this
    process uses and how many ranks the node runs."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1  # ranks on this node
    replica: int = 0
    replicas: int = 1
    master_addr: str | None = None  # where the job's store runs (rank 0's host), when launched
    master_port: int | None = None

    @classmethod
    def from_environment(cls) -> "World":
        """Read the variables set by torch's elastic launcher (``torchrun``) or DeepSpeed's launcher: the only
        place that reads them, once per process (the command line's ``main``, or the Python API when it is not
        handed a world); everything else is handed this object. One replica: see :meth:`in_replicas`."""
        port = os.environ.get("MASTER_PORT")
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            local_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1))),
            master_addr=os.environ.get("MASTER_ADDR"),
            master_port=None if port is None else int(port),
        )

    def in_replicas(self, data_parallel: int) -> "World":
        """This job's world split into ``data_parallel`` replicas (``--data-parallel``), which must divide its
        ranks (``accelgen.parallel.launcher.check_data_parallel``): this process's place in its replica."""
        job_rank, job_size = self.job_rank, self.size * self.replicas
        size = max(job_size // data_parallel, 1)
        return dataclasses.replace(self, rank=job_rank % size, size=size, replica=job_rank // size,
                                   replicas=data_parallel)

    @property
    def job_rank(self) -> int:
        """This process's rank among all the job's ranks."""
        return self.replica * self.size + self.rank

    @property
    def is_main(self) -> bool:
        """The job's first rank: the one that prints and writes."""
        return self.job_rank == 0

    @property
    def leads_replica(self) -> bool:
        """The first rank of its replica: the one that takes rows for the replica and hands in its results."""
        return self.rank == 0


#: How many times a job of several ranks starts its workers again after one fails (``--max-restarts``).
DEFAULT_MAX_RESTARTS = 3
#: Seconds a node of a multi-node job waits for the others before it gives up (``--node-wait``), as torch's own
#: rendezvous: long enough for nodes started by hand one after another.
DEFAULT_NODE_WAIT = 600


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """How the ranks of a job are spread over machines; one launch per node."""

    world_size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    max_restarts: int = 0  # times torch's agent starts the workers again after one fails (they resume the output)
    node_wait: int = DEFAULT_NODE_WAIT  # seconds a node of several waits for the others before it gives up
    port_given: bool = True  # the user named --master-port (else it was picked free here, and may be picked again)

    @property
    def processes_per_node(self) -> int:
        return self.world_size // self.nnodes
