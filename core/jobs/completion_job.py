"""Completing prompts or a dataset's rows into a resumable JSON-lines output: what ``accelgen run`` does
once its request is built, callable from Python the same way.

:func:`open_job` checks the inputs and the output (and finds where a stopped run left off) before any
model loads; :func:`complete` loads the model and generates every row not yet written, appending each
batch as it completes. Running out of device memory becomes one line saying what would fit.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import time
import warnings
from typing import Callable, Iterator, Sequence

from accelgen.adapters.figures import AdapterFigures
from accelgen.common.errors import AccelgenWarning, UsageError
from accelgen.common.prompts import PromptError, ScoreRequest, check_prompts
from accelgen.common.settings import World
from accelgen.generation.generator import Generator
from accelgen.generation.text import Completion, PromptSamples, SampleCompletion
from accelgen.jobs.chat_template import chat_template_hash
from accelgen.jobs.completion_file import CompletionFile, CompletionLines, run_record_path
from accelgen.jobs.dataset_pin import dataset_pin, resumable_pin
from accelgen.jobs.dataset_rows import DatasetRequest, TextRows, open_rows
from accelgen.jobs.kept_samples import row_digest
from accelgen.jobs.openai_batch import BatchOutputLines, ServedNames, is_batch_file, open_requests
from accelgen.jobs.progress import Progress
from accelgen.jobs.row_exchange import ReplicaReport, ReplicaResults, RowTaking
from accelgen.jobs.row_structures import check_job_structure, check_with_tokenizer, checked_rows
from accelgen.jobs.score_lines import ScoreLines
from accelgen.loading.model_files import BUILT_IN_NAME
from accelgen.model.memory import parameter_bytes
from accelgen.parallel.job_store import job_store
from accelgen.parallel.process_groups import gather_from_ranks
from accelgen.session.api import load_request
from accelgen.session.out_of_memory import out_of_memory_line
from accelgen.session.request import Request


@dataclasses.dataclass
class CompletionJob:
    """The texts to complete, where the completions go, and how many were already written there."""

    rows: TextRows
    writer: CompletionFile | None
    done: int
    dataset: DatasetRequest | None = None  # where the rows come from, when they are a dataset's
    lines: CompletionLines | BatchOutputLines = CompletionLines()  # what the output's lines hold

    @property
    def noun(self) -> str:
        """What the job's rows are called where a run speaks of them: prompts, a dataset's rows, a batch's requests."""
        return "prompt" if self.dataset is None else self.lines.noun

    @property
    def output(self) -> str | None:
        return self.writer.path if self.writer else None

    def close(self) -> None:
        """Close the output and give up its lock (also done when :func:`complete` ends)."""
        if self.writer:
            self.writer.close()

    @property
    def finished(self) -> bool:
        return self.rows.total is not None and self.done >= self.rows.total

    @property
    def samples_kept(self) -> int:
        """The finished samples of the next row that a stopped run kept (``--num-samples``)."""
        return len(self.writer.kept.samples) if self.writer else 0

    def error_rows(self, report: RunReport) -> tuple[int, int]:
        """The error rows (``--skip-bad-rows``) of the job once ``report``'s run has ended, and its rows: its output's
        (rows kept from a stopped run included), or this run's without an output. On the writer."""
        if self.writer:
            return self.writer.error_rows, self.writer.completed_rows
        return report.error_rows, report.rows

    def record_last_run(self, report: RunReport) -> None:
        """Keep ``report``'s figures in the output's run record (``last_run``), where there is an output. On the writer."""
        if self.writer:
            self.writer.record_last_run(report.figures())


@dataclasses.dataclass(frozen=True)
class PromptFigures:
    """The prompt tokens of a run's prefills, those run through the model, and those taken from the store of
    prompt prefixes (``prefix_store_bytes`` of it, None when prefixes were not reused) by ``prefix_hits`` prompts."""

    tokens: int
    prefilled: int
    reused: int
    prefix_hits: int
    prefix_store_bytes: int | None

    @classmethod
    def of(cls, generator: Generator, replicas: list[ReplicaReport] | None) -> "PromptFigures":
        """The figures of ``generator``'s run, or the job's: the sums of its ``replicas``' (each replica its own store)."""
        return cls.summed(replicas or [generator.stats], generator.stats.prefix_store_bytes)

    @classmethod
    def summed(cls, counts: list, prefix_store_bytes: int | None) -> "PromptFigures":
        """The sums of ``counts``' figures (replicas' reports, or generators' stats)."""
        return cls(*(sum(getattr(count, field) for count in counts)
                     for field in ("prompt_tokens", "prefilled_tokens", "reused_tokens", "prefix_hits")),
                   prefix_store_bytes)


@dataclasses.dataclass(frozen=True)
class StructureFigures:
    """Rows held to a structure (each sample a row; the job's), the seconds their grammars took to compile, and the
    host's work of following their tokens (``mask_share``: over the decode steps' time; both this replica's)."""

    rows: int
    compile_seconds: float
    mask_share: float | None

    @classmethod
    def of(cls, generator: Generator, replicas: list[ReplicaReport] | None) -> "StructureFigures | None":
        stats = generator.stats
        rows = sum(replica.constrained_rows for replica in replicas) if replicas else stats.constrained_rows
        return cls(rows, stats.grammar_compile_seconds, stats.mask_share) if rows else None


@dataclasses.dataclass(frozen=True)
class RunReport:
    """What a finished run did, for its summary: the same on every rank of a replica (figures of its ranks
    gathered); the job's rows and tokens, and each replica's, on the writer of a data-parallel job."""

    rows: int  # completed by this run (the job's, on the writer of a data-parallel job)
    new_tokens: int  # kept: each row's tokens up to its end
    load_seconds: float
    generate_seconds: float
    decode_seconds: float  # in decode steps (after each batch's first token)
    decode_steps: int
    device: str
    device_settings: str | None  # what the accelerator chose for the run (its summary_phrase)
    dtype: str
    quantize: str | None  # the weights' scheme, None when they are in dtype
    world_size: int
    graph_captures: int
    capture_seconds: float
    capture_failure: str | None  # why the decode step ran eagerly, when it could not be captured
    batching: str  # "continuous" or "static"
    slot_occupancy: float | None  # kept tokens / token places computed
    offload: str | None  # where an offloaded model's weights sat, as a sentence
    unsharded_parameter_bytes: int
    rank_memory: list[dict]  # per rank: parameter_bytes, host memory while loading, the device's memory_stats()
    replicas: list[ReplicaReport] | None = None  # with --data-parallel, on the writer: what each replica did
    error_rows: int = 0  # rows written as error rows (--skip-bad-rows), on the writer
    prompts: PromptFigures | None = None  # what the prompts cost to prefill (the job's)
    structure: StructureFigures | None = None  # what holding rows to structures cost (this replica's), when some were
    first_error: str | None = None  # which row was this run's first error row, and why (on the writer)
    adapters: AdapterFigures | None = None  # what the LoRA adapters did (the job's), None without adapters
    step_traces: int = 0  # decode steps traced instead of captured (``Accelerator.trace_step``)
    trace_failure: str | None = None  # why the decode step could not be traced (then it ran as it is)
    prompt_logprobs: int | None = None  # the prompts' tokens were scored (with that many alternatives each)
    kept_weights: str | None = None  # where int8 weights kept between loads came from or went, as a phrase

    @property
    def rows_per_second(self) -> float:
        return self.rows / max(self.generate_seconds, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.generate_seconds, 1e-9)

    @property
    def ms_per_decode_step(self) -> float:
        return 1000 * self.decode_seconds / max(self.decode_steps, 1)

    def figures(self) -> dict:
        """Every figure of the report, as JSON values (what the run record keeps as ``last_run``)."""
        return {**dataclasses.asdict(self), "tokens_per_second": self.tokens_per_second,
                "rows_per_second": self.rows_per_second, "ms_per_decode_step": self.ms_per_decode_step}


def run_report(generator: Generator, load_seconds: float, generate_seconds: float, rows: int,
               replicas: list[ReplicaReport] | None = None, error_rows: int = 0, first_error: str | None = None) -> RunReport:
    """The report of a run by ``generator`` that completed ``rows`` (every rank of a replica must call this:
    the ranks' memory figures are gathered). ``replicas``: each replica's figures, which then make the job's."""
    stats = generator.stats
    rank_memory = gather_from_ranks(
        {"parameter_bytes": parameter_bytes(generator.model), **generator.loaded.loading_host_memory,
         **generator.accelerator.memory_stats()}, generator.world
    )
    return RunReport(
        rows=sum(replica.rows for replica in replicas) if replicas else rows,
        new_tokens=sum(replica.new_tokens for replica in replicas) if replicas else stats.new_tokens, load_seconds=load_seconds, generate_seconds=generate_seconds,
        decode_seconds=sum(timing.decode_seconds for timing in stats.timings),
        decode_steps=sum(timing.decode_steps for timing in stats.timings),
        device=generator.accelerator.name, device_settings=generator.accelerator.summary_phrase(),
        dtype=generator.run.dtype, quantize=generator.run.quantize, world_size=generator.world.size,
        graph_captures=stats.graph_captures, capture_seconds=stats.capture_seconds,
        capture_failure=generator.capture_failure, batching=generator.batching, slot_occupancy=stats.slot_occupancy,
        offload=None if generator.loaded.placement is None else generator.loaded.placement.describe(),
        unsharded_parameter_bytes=generator.loaded.unsharded_parameter_bytes,
        rank_memory=rank_memory, replicas=replicas, error_rows=error_rows, prompts=PromptFigures.of(generator, replicas),
        structure=StructureFigures.of(generator, replicas), first_error=first_error,
        step_traces=stats.step_traces, trace_failure=stats.trace_failure, prompt_logprobs=generator.run.prompt_logprobs,
        kept_weights=generator.loaded.kept_weights,
        adapters=AdapterFigures.of(generator.run.lora, generator.loaded.adapters.buffer_bytes if generator.loaded.adapters
                                   else 0, replicas or [stats]),
    )


def open_job(
    request: Request, *, prompts: Sequence[str] = (), dataset: DatasetRequest | None = None, output: str | None = None,
    overwrite: bool = False, lock_output: bool | None = None, served_model_names: Sequence[str] = (),
    scores: ScoreLines | None = None,
) -> CompletionJob:
    """The job of completing ``prompts`` or the ``dataset``'s rows into ``output``: inputs and output checked,
    a stopped run's completed rows found; nothing loaded or written yet. The output is locked against other
    writers until the job closes when ``lock_output`` (default: on rank 0, the writer). ``served_model_names``: the
    names an OpenAI batch file's requests may give as their ``model`` to be served by this run (the first is written
    into the responses); by default the model's own name. ``scores``: the rows are scored into these lines
    (``accelgen score``; a dataset's rows as its ``scores`` say), not completed."""
    lines = scores or CompletionLines()
    batch = dataset is not None and is_batch_file(dataset.source)
    if batch and scores is not None:
        raise UsageError(f"{dataset.source!r} is an OpenAI batch file: accelgen run serves its requests (echo and "
                         f"logprobs give prompt log-probabilities); accelgen score reads rows of text.")
    if served_model_names and not batch:
        raise UsageError("--served-model-name names the model an OpenAI batch file's requests ask for: it goes with "
                         "--dataset requests.jsonl (a file of batch requests); drop it for other prompts.")
    if dataset is not None:
        if output:
            check_not_dataset(output, dataset.source)
        if batch:
            names = _served_names(request, served_model_names)
            lines, open_dataset = _batch_lines(request, names), functools.partial(open_requests, model_names=names)
        else:
            open_dataset = open_rows
        if dataset.schema_column is not None and request.run.structure is not None:
            raise UsageError(f"--schema-column and {request.run.structure.flag} both say what a row's completion is held "
                             f"to: pass one of them.")
        check_job_structure(request.run, dataset.schema_column)
        rows = open_dataset(dataset)
        source = dict(dataset=dataset.source, dataset_config=dataset.config, split=dataset.split, column=dataset.column)
        if served_model_names:  # written into every response: a resume must write the same
            source["served_model_names"] = list(served_model_names)
        if dataset.schema_column is not None:
            source["schema_column"] = dataset.schema_column

        def dataset_keys() -> Iterator[object]:  # the rows read again, where a resume compares them with the output's
            return map(lines.request_key, open_dataset(dataset).texts)

        if output:
            pin = dataset_pin(dataset, rows.revision)
            earlier = _resumed_run_record(output, overwrite)
            source.update(resumable_pin(dataset, pin, earlier, output, row_key=lines.row_key, reread=dataset_keys))
    else:
        check_job_structure(request.run)
        if not request.run.skip_bad_rows:  # else a prompt that cannot be one becomes an error row
            check_prompts(prompts)
        texts = iter(prompts) if scores is None else (ScoreRequest(prompt) for prompt in prompts)
        rows, dataset_keys = TextRows(texts, len(prompts)), None
        source = dict(prompts_sha256=hashlib.sha256(json.dumps(list(prompts)).encode()).hexdigest())
    if request.run.chat.text_as_user or rows.conversational:
        source["chat_template_sha256"] = chat_template_hash(request)
    lock_output = request.world.is_main if lock_output is None else lock_output
    writer = CompletionFile(output, run_record(request, source), overwrite, lock=lock_output, lines=lines,
                            dataset_keys=dataset_keys) if output else None
    if writer and writer.kept.samples:  # taken only by the row they complete, which may have been edited since
        rows_again = open_dataset(dataset).texts if dataset is not None else iter(prompts)
        writer.kept.of_row(row_digest(next(itertools.islice(rows_again, writer.completed_rows, None), None)))
    return CompletionJob(rows, writer, writer.completed_rows if writer else 0, dataset, lines)


def _served_names(request: Request, given: Sequence[str]) -> ServedNames:
    """What a batch request's ``model`` may say to be served by this run: one of the ``given`` names, or without
    any, the model as named or its last part."""
    for name in given:
        if not name.strip():
            raise UsageError("--served-model-name needs a name (the model the batch file's requests ask for), "
                             "not an empty text.")
    return ServedNames(request.model.names, tuple(dict.fromkeys(given)), request.run.lora.names)


def _batch_lines(request: Request, names: ServedNames) -> BatchOutputLines:
    """The output lines of a batch file's run (refusing what they cannot hold)."""
    for flag, asked in (("--logprobs", request.run.logprobs), ("--prompt-logprobs", request.run.prompt_logprobs is not None)):
        if asked:
            raise UsageError(f"{flag} is not written into OpenAI batch output lines: each request asks for its own "
                             f"(body.logprobs K, with echo for its prompt's); drop {flag} for a batch file.")
    return BatchOutputLines(names.written, request.model.tokenizer)


def _resumed_run_record(output: str, overwrite: bool) -> dict | None:
    """The run record of the rows already in ``output`` that this run would resume after; None when it starts
    afresh, or when the record cannot be read (``CompletionFile`` refuses that one, in its own words)."""
    if overwrite or not os.path.isfile(output) or os.path.getsize(output) == 0:
        return None
    try:
        with open(run_record_path(output), encoding="utf-8") as run_file:
            record = json.load(run_file)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def check_not_dataset(output: str, dataset_source: str) -> None:
    """Raise UsageError when ``output`` (or the run record beside it) is the local dataset being read, or
    lies in the dataset's folder (whose files are all read): the input is never an output, whatever the flags."""
    source = os.path.realpath(os.path.expanduser(dataset_source))
    if not os.path.exists(source):
        return  # a Hub dataset
    for written in (output, output + ".run.json", run_record_path(output)):
        path = os.path.realpath(written)
        inside = os.path.isdir(source) and os.path.commonpath([source, path]) == source
        if path == source or inside or (os.path.exists(path) and os.path.samefile(path, source)):
            raise UsageError(f"--output {output!r} would overwrite the dataset being read ({dataset_source!r}): "
                             f"write the completions to a file outside it.")


def run_record(request: Request, source: dict) -> dict:
    """What decides an output file's rows, written beside it: a resumed run must match it."""
    return dict(model=request.model.name or BUILT_IN_NAME, model_identity=request.model.identity(), **source,
                **request.run.output_deciding(), **request.adapters.record())


def _slots_for_the_rows(request: Request, job: CompletionJob) -> Request:
    """The request with no more slots than the rows left to complete take (each of its samples a slot), said in one
    line: a batch shape larger than that would compute empty slots at every step. Rows that choose their own number
    of samples (an OpenAI batch file) or a count not known beforehand (a streamed dataset) keep the asked size."""
    run = request.run
    if job.rows.total is None or run.rows_choose or (job.dataset is not None and job.dataset.choices):
        return request  # (a row of choices takes a slot per choice)
    slots = max(1, _row_samples_left(request, job))
    if slots >= run.batch_size:
        return request
    warnings.warn(AccelgenWarning(
        f"--batch-size {run.batch_size:,} is more than the {slots:,} slots the rows left to complete "
        f"{'(with their samples) ' if run.num_samples > 1 else ''}need: running {slots}"), stacklevel=3)
    return dataclasses.replace(request, run=dataclasses.replace(run, batch_size=slots))


def _row_samples_left(request: Request, job: CompletionJob) -> int:
    """The completions the rows left take: each of their samples, but those kept by a stopped run (a job whose rows
    number is known)."""
    return (job.rows.total - job.done) * request.run.num_samples - job.samples_kept


def _rows_left(request: Request, job: CompletionJob) -> int | None:
    """The completions the rows left to complete take; None when their number is not known (a streamed dataset)."""
    return None if job.rows.total is None else _row_samples_left(request, job)


def job_request(request: Request, job: CompletionJob) -> Request:
    """The request as ``job``'s rows decide it, checked against the tokenizer: rows that choose their own settings or
    bring their own structures, no more slots than the rows left take, the decode step's capture decided for them."""
    if job.rows.rows_choose:  # each row's settings are its own; a request that cannot be served is its own error
        request = dataclasses.replace(request, run=dataclasses.replace(request.run, rows_choose=True, skip_bad_rows=True))
    if job.rows.constrained:  # rows bring their own structures: the steps take each slot's mask
        request = dataclasses.replace(request, run=dataclasses.replace(request.run, structured_rows=True))
    if job.rows.prompt_logprobs is not None:  # rows ask for their prompts' log-probabilities: every prefill scores
        alternatives = max(job.rows.prompt_logprobs, request.run.prompt_logprobs or 0)
        request = dataclasses.replace(request, run=dataclasses.replace(request.run, prompt_logprobs=alternatives))
    if job.rows.logprobs:  # rows ask for their new tokens' log-probabilities: every row's are recorded
        request = dataclasses.replace(request, run=dataclasses.replace(request.run, logprobs=True))
    request = _slots_for_the_rows(request, job)
    request = request.capture_decided(_rows_left(request, job))
    check_with_tokenizer(request)
    return request


def complete(
    request: Request, job: CompletionJob, on_batch: Callable[[int, list[Completion]], None] | None = None,
    show_progress: bool = False,
) -> RunReport:
    """Load the request's model and complete every row of ``job`` not yet written. Rank 0 writes each batch
    as it completes and calls ``on_batch(batch number, completions)``; ``show_progress`` draws progress.
    Every rank of a job calls this, and gets the run's report."""
    generator = None
    is_main = request.world.is_main
    request = job_request(request, job)
    try:
        started = time.perf_counter()
        generator = load_request(request)
        loaded = time.perf_counter()
        if job.rows.constrained:  # each row's own structure checked for this model's tokenizer as it is read
            job.rows = dataclasses.replace(job.rows, texts=checked_rows(job.rows.texts, generator.constraints.compiler,
                                                                        request.run))
        samples_per_row = 1 if request.run.rows_choose else request.run.num_samples  # a batch file's rows choose theirs
        progress = (Progress(job.rows.total, job.done, samples_per_row=samples_per_row,
                             samples_done=job.done * samples_per_row + job.samples_kept) if show_progress and is_main else None)
        if progress and request.run.use_graphs and request.accelerator.tuning.capture_pays_after_steps:
            progress.announce("compiling the decode step before the first rows (seconds to minutes the first time, "
                              "less once the compiler's cache holds it)")
        if progress and request.capture_later is not None:
            generator.on_capture = lambda: progress.announce(
                "compiling the decode step: the rows so far say the rows left will pay for it")
        number = job.done // request.run.batch_size + 1
        completed = False
        written = RowCount()
        looks = (_replicas_looks(request.world, job, generator, written, loaded) if request.world.replicas > 1
                 else _looks(job, generator, written))
        try:
            for look in looks:
                written.count_errors(look.completions, job.lines)
                if is_main and job.writer:
                    job.writer.write(look.completions)
                    job.writer.keep_samples(look.open_samples, look.open_row_digest)
                if is_main and on_batch and look.completions:
                    on_batch(number, look.completions)
                    number += 1
                if progress:
                    progress.update(len(look.completions), look.samples, paused_seconds=generator.stats.capture_seconds)
            completed = True
        finally:
            if job.writer:
                job.writer.close()
            if progress:
                progress.close(final_line=completed)  # a failure's own line is the last word
    except PromptError as error:
        if job.dataset:  # its prompts are the dataset's rows: name the row
            raise error.in_dataset(job.dataset.source, job.dataset.column) from None
        raise
    except Exception as error:  # noqa: BLE001 - out of memory becomes advice, anything else goes on up
        if request.accelerator.is_out_of_memory(error):
            raise UsageError(out_of_memory_line(request, generator, job.output)) from None
        raise
    return run_report(generator, loaded - started, time.perf_counter() - loaded, written.rows, written.replicas,
                      written.errors, written.first_error)


@dataclasses.dataclass
class RowCount:
    """The rows this process's replica completed (its kept tokens are its generator's ``stats.new_tokens``); the
    replicas' reports on the writer."""

    rows: int = 0
    replicas: list[ReplicaReport] | None = None
    errors: int = 0  # error rows among those the writer wrote
    first_error: str | None = None  # the first of them, and why (``lines.error_of``)

    def add(self, completions: list[Completion]) -> None:
        self.rows += len(completions)

    def count_errors(self, completions: list[Completion], lines: CompletionLines | BatchOutputLines) -> None:
        for completion in completions:
            if completion.finish_reason == "error":
                self.errors += 1
                self.first_error = self.first_error or lines.error_of(completion)


@dataclasses.dataclass(frozen=True)
class Look:
    """What one look at the slots gave out: the rows completed, in order; the finished samples of the next row, whose
    line is not written yet (kept beside the output: ``accelgen.jobs.kept_samples``), and that row's digest; how many
    samples finished."""

    completions: list[Completion]
    open_samples: list[SampleCompletion]
    open_row_digest: str | None
    samples: int


def _looks(job: CompletionJob, generator: Generator, count: RowCount) -> Iterator[Look]:
    """The job's rows not yet written, completed by this process's model (split over the job's ranks), sample by
    sample: the next row's samples kept by a stopped run are not made again."""
    kept = job.writer.kept.samples if job.writer else []
    prompts = PromptSamples(kept)
    in_flight: dict[int, object] = {}  # by number: the rows read and not yet complete

    def numbered() -> Iterator[tuple[int, object]]:
        for number, text in enumerate(itertools.islice(job.rows.texts, job.done, None), start=job.done):
            in_flight[number] = text
            yield number, text

    for samples in generator.generate_samples(numbered(), {job.done: len(kept)}):
        completions = [completion for sample in samples if (completion := prompts.add(sample)) is not None]
        count.add(completions)
        ends = [place for place, sample in enumerate(samples) if sample.ends_prompt]
        for sample in samples[: ends[-1] + 1 if ends else 0]:
            in_flight.pop(sample.completion.index, None)
        open_samples = samples[ends[-1] + 1 if ends else 0:]
        digest = row_digest(in_flight[open_samples[0].completion.index]) if open_samples else None
        yield Look(completions, open_samples, digest, len(samples))


def _replicas_looks(world: World, job: CompletionJob, generator: Generator, count: RowCount,
                    started: float) -> Iterator[Look]:
    """:func:`_replicas_batches`' rows, each look's: a replica's rows are handed in whole (their samples are not kept
    before their line is written: a stopped run makes them again, identical)."""
    for completions in _replicas_batches(world, job, generator, count, started):
        yield Look(completions, [], None, sum(len(completion.completions or [completion]) for completion in completions))


def _replicas_batches(world: World, job: CompletionJob, generator: Generator, count: RowCount,
                      started: float) -> Iterator[list[Completion]]:
    """The job's rows not yet written, completed by the job's replicas (``accelgen.jobs.row_exchange``): this
    replica completes the rows it takes; on the writer, every replica's rows in order, the last ones once all
    have finished (then ``count.replicas`` holds their reports). Other ranks yield nothing."""
    store = job_store()
    results = ReplicaResults(store, world, job.done)
    taking = RowTaking(store, world, job.done, results)
    for completions in generator.generate_numbered(taking.numbered_texts(job.rows.texts)):
        count.add(completions)
        if world.leads_replica and (ready := results.hand_in(completions)):
            yield ready
    if world.leads_replica:
        results.finish(ReplicaReport.of_stats(world.replica, count.rows, generator.stats, time.perf_counter() - started,
                                              taking.waited_seconds))
    if world.is_main:
        yield from results.rest()
        count.replicas = results.reports()
