"""A completion job whose replicas run on a Ray cluster (``accelgen run --ray``): this process (the driver) reads the
rows, hands them to the replicas as they free up, and writes every completion in dataset order into the job's one
output, as ``accelgen.jobs.completion_job.complete`` does on one machine.

Each replica is a Ray actor holding one engine (``accelgen.ray.replica.Replica``), placed by Ray on a node that has
the resources it asks for. Rows go out in calls of ``rows_per_call`` consecutive rows, at most ``CALLS_PER_REPLICA``
to a replica at once (one running, one waiting in its queue, so it never idles between them). Only the driver writes:
a call's rows are written once, when every earlier row is, so the output is the one a single process would write and a
stopped driver resumes from it (``--output`` is read again by the same command, as on one machine).

A replica lost with its process or its node (``RayActorError``, ``NodeDiedError``...) is started again by the driver
(``max_restarts`` times for each replica; Ray places it where the resources are), and the rows of its unfinished calls
go out again first, to whichever replica is ready: every row is written exactly once. A replica out of restarts is
dropped and the others go on. What the rows or the settings cannot do (the user's error) ends the job the way it ends
it on one machine, every earlier row written; a replica that cannot load its model ends it with that line, once.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
import time
from typing import Callable, Iterator

from accelgen.common.errors import UsageError
from accelgen.common.prompts import PromptError
from accelgen.generation.text import Completion
from accelgen.jobs.completion_job import CompletionJob, PromptFigures, RowCount, RunReport, job_request
from accelgen.jobs.progress import Progress
from accelgen.jobs.row_exchange import ReplicaReport
from accelgen.ray.cluster import ReplicaResources, check_fits, cluster_line, connect
from accelgen.ray.replica import Failed, Replica, ReplicaRecipe
from accelgen.session.request import Request

#: Calls a replica holds at once: the one it runs and the next, queued, so it starts the next at once.
CALLS_PER_REPLICA = 2
#: Seconds between two lines saying the job waits for the cluster to place a replica.
WAITING_LINE_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """Where and how a job's replicas run: the cluster's ``address`` (see :func:`accelgen.ray.cluster.connect`), how
    many ``replicas``, what each asks of a node, how often each is started again when lost."""

    replicas: int
    resources: ReplicaResources
    address: str | None = None
    max_restarts: int = 3
    rows_per_call: int | None = None  # None: four batches' worth


@dataclasses.dataclass
class Slot:
    """One of the job's replicas: its actor (the one now, after restarts), whether its model is loaded, where it runs,
    the calls it holds (by reference: their rows)."""

    number: int
    actor: object = None
    loading: object = None  # the reference to the answer of its ``load`` while it loads
    where: dict | None = None  # node, pid, device once loaded
    calls: dict = dataclasses.field(default_factory=dict)
    restarts: int = 0
    dropped: bool = False
    asked_at: float = 0.0

    @property
    def ready(self) -> bool:
        return self.where is not None and not self.dropped


class RowFeed:
    """The job's rows not yet written, as calls of consecutive numbered rows; the rows of a lost replica's calls first."""

    def __init__(self, texts: Iterator[object], first_row: int, rows_per_call: int):
        self.rows = enumerate(itertools.islice(texts, first_row, None), start=first_row)
        self.rows_per_call = rows_per_call
        self.again: collections.deque[list[tuple[int, object]]] = collections.deque()
        self.read_all = False
        self.next_number = first_row  # the number of the next row read

    def next_call(self) -> list[tuple[int, object]] | None:
        """The rows of the next call: a lost call's, else the next rows read; None when every row is out."""
        if self.again:
            return self.again.popleft()
        if self.read_all:
            return None
        rows = list(itertools.islice(self.rows, self.rows_per_call))
        if len(rows) < self.rows_per_call:
            self.read_all = True
        if rows:
            self.next_number = rows[-1][0] + 1
        return rows or None

    @property
    def finished(self) -> bool:
        return self.read_all and not self.again


class InOrder:
    """Calls' completions handed in as they come, given out in row order from ``first_row``: each row once."""

    def __init__(self, first_row: int):
        self.next_row = first_row
        self.waiting: dict[int, list[Completion]] = {}

    def hand_in(self, first_row: int, completions: list[Completion]) -> list[Completion]:
        """The rows that are now next in order (none while an earlier one is missing)."""
        if first_row >= self.next_row and first_row not in self.waiting:
            self.waiting[first_row] = completions
        ready: list[Completion] = []
        while self.next_row in self.waiting:
            completions = self.waiting.pop(self.next_row)
            ready.extend(completions)
            self.next_row += max(len(completions), 1)
        return ready


def complete_on_cluster(request: Request, job: CompletionJob, recipe: ReplicaRecipe, plan: ClusterPlan,
                        on_batch: Callable[[int, list[Completion]], None] | None = None,
                        show_progress: bool = False, say: Callable[[str], None] | None = None) -> RunReport | None:
    """Complete every row of ``job`` not yet written on ``plan``'s cluster, writing them into its output in order;
    ``recipe`` builds each replica's request (its settings decided here for the job). ``on_batch`` and
    ``show_progress`` as in ``accelgen.jobs.completion_job.complete``; ``say`` prints a line of the job's own."""
    say = say or (lambda line: print(f"accelgen: {line}", file=sys.stderr, flush=True))
    ranks = recipe.world_size  # each replica's, on its node
    deciding = dataclasses.replace(request, world=dataclasses.replace(request.world, replicas=plan.replicas, size=ranks,
                                                                      local_size=ranks))
    decided = job_request(deciding, job)  # the batch shape and the capture of each replica's share of the rows
    recipe = dataclasses.replace(recipe, run=decided.run, capture_later=decided.capture_later,
                                 constrained=job.rows.constrained)
    ray = connect(plan.address)
    try:
        return _drive(ray, job, recipe, plan, decided, on_batch, show_progress, say)
    finally:
        ray.shutdown()  # every replica ends with the driver (a cluster started for this job too)


def _drive(ray, job: CompletionJob, recipe: ReplicaRecipe, plan: ClusterPlan, decided: Request, on_batch,
           show_progress: bool, say: Callable[[str], None]) -> RunReport | None:
    nodes = check_fits(ray, plan.resources)
    split = f" of {recipe.world_size} ranks" if recipe.world_size > 1 else ""
    say(f"Ray cluster of {cluster_line(nodes)}: {plan.replicas} replica{'s' if plan.replicas > 1 else ''}{split} on "
        f"{recipe.device}, each asking {plan.resources.describe()}")
    samples_per_row = 1 if decided.run.rows_choose else decided.run.num_samples
    rows_per_call = plan.rows_per_call or max(4, 4 * max(1, decided.run.batch_size // samples_per_row))
    driver = _Driver(ray, job, recipe, plan, say, rows_per_call)
    # from the first replica ready: the rate is the cluster's, its start said apart
    progress = (lambda: Progress(job.rows.total, job.done, samples_per_row=samples_per_row)) if show_progress else None
    completed = False
    try:
        driver.run(on_batch, progress)
        completed = True
        return driver.report()
    except PromptError as error:
        if job.dataset:  # its prompts are the dataset's rows: name the row
            raise error.in_dataset(job.dataset.source, job.dataset.column) from None
        raise
    finally:
        if job.writer:
            job.writer.close()
        if driver.progress:
            driver.progress.close(final_line=completed)
        driver.stop()


class _Driver:
    """The loop of :func:`complete_on_cluster`: replicas started and started again, rows handed out, completions
    written in order."""

    def __init__(self, ray, job: CompletionJob, recipe: ReplicaRecipe, plan: ClusterPlan, say: Callable[[str], None],
                 rows_per_call: int):
        self.ray, self.job, self.recipe, self.plan, self.say = ray, job, recipe, plan, say
        self.actor_class = ray.remote(Replica).options(**plan.resources.options(), max_restarts=0, max_concurrency=1)
        self.feed = RowFeed(job.rows.texts, job.done, rows_per_call)
        self.order = InOrder(job.done)
        self.rows_ahead = rows_per_call * CALLS_PER_REPLICA * plan.replicas * 2
        self.slots = [Slot(number) for number in range(plan.replicas)]
        self.count = RowCount()
        self.failure: tuple[int, UsageError] | None = None  # the first row of the call the user's error came from
        self.started = time.perf_counter()
        self.first_loaded: float | None = None
        self.waiting_said = time.monotonic()
        self.progress: Progress | None = None
        self.new_tokens = 0  # of the rows written: a lost replica's own count goes with it

    def run(self, on_batch, progress: Callable[[], Progress] | None) -> None:
        """Complete the rows: ``progress`` makes the job's progress once its first replica is ready."""
        for slot in self.slots:
            self._start(slot)
        batch_number = self.job.done // max(self.feed.rows_per_call, 1) + 1
        while True:
            self._hand_out()
            if self.failure is not None and self.order.next_row >= self.failure[0]:
                raise self.failure[1]
            if self.feed.finished and not any(slot.calls for slot in self.slots):
                return
            if not any(slot.ready or slot.loading is not None for slot in self.slots):
                raise UsageError("every replica was lost more times than --max-restarts allows: the rows finished are "
                                 "kept, and the same command resumes once the cluster is whole again.")
            waited_on = {slot.loading: (slot, None) for slot in self.slots if slot.loading is not None}
            for slot in self.slots:
                waited_on.update({reference: (slot, rows) for reference, rows in slot.calls.items()})
            ready, _ = self.ray.wait(list(waited_on), num_returns=1, timeout=1.0)
            self._say_waiting()
            for reference in ready:
                slot, rows = waited_on[reference]
                completions = self._answer(slot, reference, rows)
                if progress and self.progress is None and self.first_loaded is not None:
                    self.progress = progress()
                if not completions:
                    continue
                self.count.add(completions)
                self.count.count_errors(completions, self.job.lines)
                self.new_tokens += sum(_kept_tokens(completion) for completion in completions)
                if self.job.writer:
                    self.job.writer.write(completions)
                if on_batch:
                    on_batch(batch_number, completions)
                    batch_number += 1
                if self.progress:
                    self.progress.update(len(completions), sum(len(completion.completions or [completion])
                                                          for completion in completions))

    def _start(self, slot: Slot) -> None:
        slot.actor = self.actor_class.remote(self.recipe, slot.number)
        slot.loading = slot.actor.load.remote()
        slot.where, slot.asked_at = None, time.monotonic()

    def _hand_out(self) -> None:
        for slot in self.slots:
            while slot.ready and len(slot.calls) < CALLS_PER_REPLICA and self.failure is None:
                if not self.feed.again and self.feed.next_number >= self.order.next_row + self.rows_ahead:
                    return  # an earlier row is still out: the rows held for order stay bounded
                rows = self.feed.next_call()
                if rows is None:
                    return
                slot.calls[slot.actor.complete.remote(rows)] = rows

    def _answer(self, slot: Slot, reference, rows: list | None) -> list[Completion]:
        """Take the answer of ``reference`` (``slot``'s load, or its call of ``rows``): the rows now next in order."""
        if rows is None:
            slot.loading = None
        else:
            del slot.calls[reference]
        try:
            answer = self.ray.get(reference)
        except self.ray.exceptions.RayTaskError as error:  # our own code failed in the replica: shown as it is
            raise error.as_instanceof_cause() from None
        except self.ray.exceptions.RayError as error:
            self._lost(slot, error, rows)
            return []
        if isinstance(answer, Failed):
            if rows is None:
                raise UsageError(f"replica {slot.number} could not load the model: {answer.error}") from None
            if self.failure is None or rows[0][0] < self.failure[0]:
                self.failure = (rows[0][0], answer.error)  # raised once every earlier row is written
            return []
        if rows is None:
            slot.where = answer
            self.first_loaded = self.first_loaded or time.perf_counter()
            restarted = f" (restart {slot.restarts})" if slot.restarts else ""
            self.say(f"replica {slot.number} ready on node {answer['node']} ({answer['device']}, pid {answer['pid']}) "
                     f"{time.monotonic() - slot.asked_at:.1f} s after it was asked for{restarted}")
            return []
        return self.order.hand_in(rows[0][0], answer)

    def _lost(self, slot: Slot, error: BaseException, rows: list | None) -> None:
        """``slot``'s replica is gone with its process or node: its calls' rows go out again, and it starts again."""
        lost_rows = ([rows] if rows is not None else []) + list(slot.calls.values())
        slot.calls.clear()
        self.feed.again.extendleft(reversed(sorted(lost_rows, key=lambda call: call[0][0])))
        self._kill(slot)
        node = f" on node {slot.where['node']}" if slot.where else ""
        said = str(error).lower()  # Ray names a node's death where it knows it; a process gone first may be the node's
        why = ("its node is gone" if isinstance(error, self.ray.exceptions.NodeDiedError) or "node" in said and
               ("died" in said or "dead" in said) else "its process ended, or its node is gone")
        again = sum(len(call) for call in lost_rows)
        redone = f": its {again} rows in flight are done again" if again else ""
        if slot.restarts >= self.plan.max_restarts:
            slot.dropped = True
            left = sum(not other.dropped for other in self.slots)
            self.say(f"replica {slot.number}{node} was lost ({why}) after {slot.restarts} restarts (--max-restarts "
                     f"{self.plan.max_restarts}); going on with {left} replica{'s' if left != 1 else ''}{redone}")
            return
        slot.restarts += 1
        self.say(f"replica {slot.number}{node} was lost ({why}); starting it again (restart {slot.restarts} of "
                 f"{self.plan.max_restarts}){redone}")
        self._start(slot)

    def _say_waiting(self) -> None:
        """Every ``WAITING_LINE_SECONDS`` while no replica is ready: which replicas the cluster has not placed yet."""
        if any(slot.ready for slot in self.slots) or time.monotonic() - self.waiting_said < WAITING_LINE_SECONDS:
            return
        self.waiting_said = time.monotonic()
        waiting = [slot.number for slot in self.slots if slot.loading is not None]
        self.say(f"waiting for the cluster to place and load replica{'s' if len(waiting) > 1 else ''} "
                 f"{', '.join(map(str, waiting))} ({self.plan.resources.describe()} each)")

    def report(self) -> RunReport | None:
        """The job's report: the replicas' own reports, their rows and tokens summed (None when no replica is left to
        say what it did)."""
        answers = []
        for slot in self.slots:
            if slot.ready:
                try:
                    answers.append(self.ray.get(slot.actor.report.remote()))
                except self.ray.exceptions.RayError:
                    continue  # lost at the very end: its rows are written already
        if not answers:
            return None
        first = answers[0][0]
        replicas: list[ReplicaReport] = [replica for _, replica in answers]
        prompts = PromptFigures.summed(replicas, None)
        loaded = self.first_loaded or self.started
        return dataclasses.replace(
            first, rows=self.count.rows, new_tokens=self.new_tokens,
            load_seconds=loaded - self.started, generate_seconds=time.perf_counter() - loaded,
            rank_memory=[memory for report, _ in answers for memory in report.rank_memory],
            replicas=replicas if len(replicas) > 1 else None, error_rows=self.count.errors,
            first_error=self.count.first_error, prompts=prompts)

    def _kill(self, slot: Slot) -> None:
        try:
            self.ray.kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone with its node
            pass
        slot.where, slot.loading = None, None

    def stop(self) -> None:
        """End every replica (the cluster stays)."""
        for slot in self.slots:
            if slot.actor is not None:
                self._kill(slot)


def _kept_tokens(completion: Completion) -> int:
    """The new tokens a written row kept: each of its samples'."""
    if completion.completions:
        return sum(len(sample.get("completion_token_ids") or ()) for sample in completion.completions)
    return len(completion.completion_token_ids)
