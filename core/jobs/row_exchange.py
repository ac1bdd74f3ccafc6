"""Rows handed to a data-parallel job's replicas as they free up, and their completions brought back, in
dataset order, to the one writer: through the job's store (``accelgen.parallel.job_store``).

Why the store and not collectives among the replicas' leaders: a replica wants its next row when one of its
slots frees, at a moment no other replica shares, and a collective would hold every replica at each
exchange until the slowest came. The store's atomic counter gives each row number to exactly one replica
whatever the timing; a completion waits in the store until the writer (the leader of replica 0, which
decodes too) looks, between two of its own batches, and finally until every replica has finished.

The store's keys (under the job's prefix):

- ``rows taken``: how many row numbers the replicas have taken (the counter);
- ``replica{r}/take{k}``: the number replica r's leader took k-th, read once by each of the replica's
  other ranks, which take the same rows in the same order (then the key goes);
- ``row{n}``: row n's completion, from the time its replica finishes it until the writer writes it;
- ``replica{r}/report``: what replica r did, set once it has handed in all its rows;
- ``finished``: how many replicas have.

- ``rows written``: the first row the writer has not written yet (set as it advances).

A row's text is read by every rank from its own view of the dataset (the ranks skip the rows they do not
take), so only numbers and finished rows cross the store.

Finished rows wait for the writer while an earlier row is still being completed, so a slow replica holding
one row would let the others fill the store and the writer's memory without end. So a replica's leader does
not take a row while ``rows_ahead`` rows past the first unwritten one are taken already, and waits (counted
in its report) until the writer moves on, except in two cases that would otherwise never end: the replica
holds the first unwritten row itself (its decoding must go on, and its own rows ahead are bounded by its
scheduler's read-ahead), or, on the writer, that row is finished and only waits to be written.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from typing import Iterator

import torch

from accelgen.common.settings import World
from accelgen.generation.stats import GenerationStats
from accelgen.generation.text import Completion

_PAST_THE_END = object()
#: Seconds between the writer's looks for the rows of other replicas, once its own replica has finished, and
#: between a held leader's looks at the rows written.
POLL_SECONDS = 0.01
#: How many rows past the first unwritten one the replicas may take: what bounds the rows held for order.
ROWS_AHEAD = 1024


@dataclasses.dataclass(frozen=True)
class ReplicaReport:
    """What one replica did: the rows it completed, the tokens it kept, its seconds from loaded to finished."""

    replica: int
    rows: int
    new_tokens: int
    seconds: float
    waited_seconds: float = 0.0  # held before taking a row, while a slower replica held the first unwritten one
    prompt_tokens: int = 0  # of the prompts it prefilled; run through the model; from its prefix store; prompts
    prefilled_tokens: int = 0  # that found a beginning there (accelgen.generation.stats.GenerationStats)
    reused_tokens: int = 0
    prefix_hits: int = 0
    constrained_rows: int = 0  # rows it held to a structure
    adapter_loads: int = 0  # LoRA adapters copied into its buffer slots, and the prompts it completed per adapter
    adapter_rows: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_stats(cls, replica: int, rows: int, stats: GenerationStats, seconds: float,
                 waited_seconds: float = 0.0) -> "ReplicaReport":
        """Replica ``replica``'s report from its generator's ``stats``, once it completed ``rows`` in ``seconds``."""
        return cls(replica, rows, stats.new_tokens, seconds, waited_seconds, stats.prompt_tokens, stats.prefilled_tokens,
                   stats.reused_tokens, stats.prefix_hits, stats.constrained_rows, stats.adapter_loads,
                   dict(stats.adapter_rows))


class RowTaking:
    """The rows one replica completes: numbers from the job's counter, each taken as the replica's generator
    asks for its next prompt, the same on every rank of the replica. ``results``: the replica's results, which
    know the rows in flight and the first unwritten one (see the module docstring on ``rows_ahead``)."""

    def __init__(self, store: torch.distributed.Store, world: World, first_row: int, results: "ReplicaResults",
                 rows_ahead: int = ROWS_AHEAD):
        self.store, self.world, self.first_row = store, world, first_row
        self.results, self.rows_ahead = results, rows_ahead
        self.waited_seconds = 0.0

    def numbered_texts(self, texts: Iterator[str]) -> Iterator[tuple[int, str]]:
        """(row number, text) of each row this replica takes, in the order taken (increasing). ``texts`` are the
        dataset's texts from its row 0; the rows other replicas take are skipped."""
        passed = 0  # rows of ``texts`` read so far
        for turn in itertools.count():
            number = self._take(turn)
            text = next(itertools.islice(texts, number - passed, None), _PAST_THE_END)
            if text is _PAST_THE_END:
                return  # the other ranks of the replica find the same
            passed = number + 1
            yield number, text

    def _take(self, turn: int) -> int:
        """The replica's ``turn``-th row number: taken by its leader, read by its other ranks."""
        key = f"replica{self.world.replica}/take{turn}"
        if self.world.leads_replica:
            self._wait_for_room()
            number = self.first_row + self.store.add("rows taken", 1) - 1
            self.results.in_flight.add(number)
            if self.world.size > 1:
                self.store.set(key, str(number))
            return number
        number = int(self.store.get(key))
        if self.store.add(key + "/read", 1) == self.world.size - 1:  # the replica's last rank to read it
            self.store.delete_key(key)
            self.store.delete_key(key + "/read")
        return number


    def _wait_for_room(self) -> None:
        """Hold the leader while ``rows_ahead`` rows past the first unwritten one are taken, unless it may not
        wait (see the module docstring)."""
        held_since = None
        while True:
            taken = self.first_row + self.store.add("rows taken", 0)
            first_unwritten = self.results.first_unwritten()
            if (taken - first_unwritten < self.rows_ahead or first_unwritten in self.results.in_flight
                    or self.results.waits_to_be_written(first_unwritten)):
                break
            held_since = held_since or time.perf_counter()
            time.sleep(POLL_SECONDS)
        if held_since is not None:
            self.waited_seconds += time.perf_counter() - held_since


class ReplicaResults:
    """Completions going back to the writer: handed in by a replica's leader, collected in dataset order by the
    writer (the job's main rank, itself the leader of replica 0)."""

    def __init__(self, store: torch.distributed.Store, world: World, first_row: int):
        self.store, self.world, self.first_row = store, world, first_row
        self.next_row = first_row  # the writer's: the first row not yet written
        self._own: dict[int, Completion] = {}  # the writer's replica's rows not yet written
        self.in_flight: set[int] = set()  # on a leader: the rows its replica took and has not handed in

    def first_unwritten(self) -> int:
        """The first row the writer has not written (on the writer, its own count; elsewhere, as published)."""
        if self.world.is_main:
            return self.next_row
        return int(self.store.get("rows written")) if self.store.check(["rows written"]) else self.first_row

    def waits_to_be_written(self, number: int) -> bool:
        """On the writer: row ``number`` is finished and waits only for the writer's next look."""
        return self.world.is_main and (number in self._own or self.store.check([f"row{number}"]))

    def hand_in(self, completions: list[Completion]) -> list[Completion]:
        """Hand in a replica's finished rows (on its leader); on the writer, return the rows that can be written
        now, in order: its own and those other replicas have handed in."""
        self.in_flight.difference_update(completion.index for completion in completions)
        if self.world.is_main:
            self._own.update((completion.index, completion) for completion in completions)
            return self._in_order()
        for completion in completions:
            self.store.set(f"row{completion.index}", json.dumps(dataclasses.asdict(completion)))
        return []

    def finish(self, report: ReplicaReport) -> None:
        """Say (on a replica's leader, after its last rows were handed in) that the replica is done."""
        self.store.set(f"replica{report.replica}/report", json.dumps(dataclasses.asdict(report)))
        self.store.add("finished", 1)

    def rest(self) -> Iterator[list[Completion]]:
        """On the writer, once its own replica has finished: the other replicas' rows, in order, as they come,
        until every replica has finished."""
        while True:
            every_replica_finished = self.store.add("finished", 0) == self.world.replicas
            rows = self._in_order()
            if rows:
                yield rows
            elif every_replica_finished:
                return
            else:
                time.sleep(POLL_SECONDS)

    def reports(self) -> list[ReplicaReport]:
        """Every replica's report (on the writer, after :meth:`rest`)."""
        return [ReplicaReport(**json.loads(self.store.get(f"replica{replica}/report")))
                for replica in range(self.world.replicas)]

    def _in_order(self) -> list[Completion]:
        """The rows from ``next_row`` on that are finished, up to the first that is not."""
        rows = []
        while True:
            key = f"row{self.next_row}"
            if self.next_row in self._own:
                rows.append(self._own.pop(self.next_row))
            elif self.store.check([key]):
                rows.append(Completion.from_fields(json.loads(self.store.get(key))))
                self.store.delete_key(key)
            else:
                if rows:
                    self.store.set("rows written", str(self.next_row))
                return rows
            self.next_row += 1
