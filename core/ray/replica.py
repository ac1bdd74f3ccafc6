"""One replica of a Ray job: a process of the cluster holding one engine (``accelgen.session.api.load_request``) that
completes the numbered rows it is handed, as a rank of ``accelgen run`` does.

The driver cannot hand a :class:`~accelgen.session.request.Request` across processes (it holds the plugin manager and
its accelerator): it hands what builds one (:class:`ReplicaRecipe`) and the run settings it decided for the job (the
batch shape the rows take, whether the decode step is captured), and the replica builds its own request from them.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Sequence

from accelgen.common.errors import UsageError
from accelgen.common.settings import RunSettings, World
from accelgen.generation.capture_decision import CaptureWhenItPays
from accelgen.generation.text import Completion
from accelgen.jobs.completion_job import RunReport, run_report
from accelgen.jobs.row_exchange import ReplicaReport
from accelgen.jobs.row_structures import checked_rows
from accelgen.plugin.manager import get_plugin_manager
from accelgen.plugin.registry import select_accelerator
from accelgen.ray.replica_ranks import RANK_END_SECONDS, REPORT, ReplicaRanks
from accelgen.session.api import load_request
from accelgen.session.out_of_memory import out_of_memory_line
from accelgen.session.request import Request, build_request


@dataclasses.dataclass(frozen=True)
class ReplicaRecipe:
    """What builds a replica's request: :func:`accelgen.session.request.build_request`'s arguments, and the job's
    decided run settings (None: those the ``settings`` make)."""

    model: str | None
    device: str
    random_weights: bool = False
    trust_remote_code: bool = False
    settings: dict = dataclasses.field(default_factory=dict)
    run: RunSettings | None = None
    capture_later: CaptureWhenItPays | None = None
    constrained: bool = False  # rows bring their own structures, checked against the tokenizer as they come
    rows_choose: bool = False  # rows bring their own sampling settings (``RowSettings``)
    world_size: int = 1  # the replica's ranks (tensor parallelism on its node: ``accelgen.ray.replica_ranks``)

    def request(self, world: World | None = None) -> Request:
        """The request of one rank of the replica (``world``: its place among the replica's ranks)."""
        request = build_request(self.model, device=self.device, random_weights=self.random_weights,
                                trust_remote_code=self.trust_remote_code, world=world or World(), **self.settings)
        if self.run is not None:
            return dataclasses.replace(request, run=self.run, capture_later=self.capture_later)
        changes = {"structured_rows": True} if self.constrained else {}
        if self.rows_choose:
            changes.update(rows_choose=True, skip_bad_rows=True)
        return dataclasses.replace(request, run=dataclasses.replace(request.run, **changes)) if changes else request


@dataclasses.dataclass(frozen=True)
class Failed:
    """A replica's answer for rows it could not complete because of the rows or the settings, not the cluster: the
    user's error (its one line), which ends the job the way it ends ``accelgen run`` on one machine."""

    error: UsageError


class Replica:
    """An engine on one process of the cluster. Made a Ray actor by the driver (``accelgen.ray.cluster_job``) or by
    Ray Data (``accelgen.ray.batch_columns.Completions``); the model loads in :meth:`load`."""

    def __init__(self, recipe: ReplicaRecipe, number: int = 0, world: World | None = None):
        self.recipe, self.number = recipe, number
        self.world = world  # given to ranks 1 and up of a tensor-parallel replica; rank 0 (the actor) makes its own
        self.ranks: ReplicaRanks | None = None  # on rank 0 of a tensor-parallel replica: the others
        self.request: Request | None = None
        self.generator = None
        self.load_seconds = 0.0
        self.loaded_at = 0.0
        self.rows = 0

    def load(self) -> dict | Failed:
        """Load the model; where this replica runs (node, process, device), or why it cannot load as a :class:`Failed`."""
        started = time.perf_counter()
        try:
            if self.recipe.world_size > 1 and self.world is None:
                accelerator = select_accelerator(get_plugin_manager(), self.recipe.device)
                self.ranks = ReplicaRanks(self.recipe, accelerator, self.recipe.world_size)
                self.world = self.ranks.world
            self.request = self.recipe.request(self.world)
            self.generator = load_request(self.request)
        except UsageError as error:
            return Failed(error)
        except Exception as error:  # noqa: BLE001 - out of memory becomes advice, anything else goes on up
            if self.request is not None and self.request.accelerator.is_out_of_memory(error):
                return Failed(UsageError(out_of_memory_line(self.request, None, None)))
            raise
        self.loaded_at = time.perf_counter()
        self.load_seconds = self.loaded_at - started
        return {"node": node_address(), "pid": os.getpid(), "device": self.generator.accelerator.name,
                "settings": self.generator.accelerator.summary_phrase()}

    def complete(self, numbered_rows: Sequence[tuple[int, object]]) -> list[Completion] | Failed:
        """The completions of ``numbered_rows`` (row number, prompt), in their order; a row or setting that cannot be
        completed (without ``--skip-bad-rows``) as a :class:`Failed`."""
        if self.ranks is not None:
            self.ranks.hand(list(numbered_rows))
        rows = iter(numbered_rows)
        if self.recipe.constrained:
            numbers = [number for number, _ in numbered_rows]
            texts = checked_rows((text for _, text in numbered_rows), self.generator.constraints.compiler, self.request.run)
            rows = zip(numbers, texts)
        try:
            completions = [completion for batch in self.generator.generate_numbered(rows) for completion in batch]
        except UsageError as error:
            return Failed(error)
        except Exception as error:  # noqa: BLE001 - out of memory becomes advice, anything else goes on up
            if self.ranks is not None:  # a collective broken by a rank gone: the replica is lost, not the job
                self.ranks.end_if_a_rank_ended(within=RANK_END_SECONDS)
            if self.request.accelerator.is_out_of_memory(error):
                return Failed(UsageError(out_of_memory_line(self.request, self.generator, None)))
            raise
        self.rows += len(completions)
        return completions

    def report(self) -> tuple[RunReport, ReplicaReport]:
        """What this replica did so far: its run's report, and its figures as one of the job's replicas."""
        if self.ranks is not None:
            self.ranks.hand(REPORT)  # the ranks' memory figures are gathered: every rank takes part
        seconds = time.perf_counter() - self.loaded_at
        figures = ReplicaReport.of_stats(self.number, self.rows, self.generator.stats, seconds)
        return run_report(self.generator, self.load_seconds, seconds, self.rows), figures


def node_address() -> str:
    """The address this node is known by in the cluster (Ray's), or its host name outside one."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside a Ray worker: any name will do
        return socket.gethostname()

