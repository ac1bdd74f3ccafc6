"""The scheduler: which rows run in which slots, decided on the host without touching the device.

Rows come in as :class:`Row` objects (their number, prompt ids, prompt bucket, settings, budget of decode steps) and
wait; :meth:`Scheduler.plan` puts waiting rows into free slots and says, in a plain :class:`Plan`, which
cache length the slots need, which rows a prefill inserts into which slots, and how many decode steps run
before the host looks again. After each look, :meth:`Scheduler.collect` names the slots whose rows can be
read back and :meth:`Scheduler.finish` frees them and gives out, in the order the rows came in, every row
whose predecessors are all done. The runner (``accelgen.generation.runner``) carries the plan out.

Two policies of the same scheduler:

A row that cannot end early (``--ignore-eos``) ends when its budget does: the host then looks only when the
next row ends.

- ``continuous``: a finished row's slot takes the next waiting row at the next look (on a device whose prefill
  passes cost much beyond their prompts' work, once the free slots have idled as long as a pass costs, so that one
  pass starts several rows). A prompt's samples that
  do not all fit the free slots start as they fit: those left wait, their first tokens drawn from the one
  prefill, and each starts from its prompt's cache row as a slot frees. Rows are read only as
  slots free up (for a data-parallel replica, reading a row is taking it from the others), and a row starts
  only while it is fewer than ``READ_AHEAD_SLOTS`` times B rows ahead of the oldest row not yet given out,
  which bounds the finished rows held back for order. The cache holds the largest bucket met so far; a row
  that needs more waits until the slots are empty, and the slots are then made anew for it.
- ``static``: fixed batches. B rows are inserted together into empty slots, in one prefill, with a cache
  sized for that batch's bucket; no slot is refilled until every row of the batch has ended.

Under either policy a row of a LoRA adapter starts once its adapter holds a buffer slot of the device
(``adapter_slots``): the insertion says which adapters the runner copies in first.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from accelgen.common.errors import UsageError
from accelgen.common.prompts import PromptError
from accelgen.common.settings import RowSettings, RunSettings
from accelgen.generation.adapter_slots import AdapterSlots
from accelgen.generation.decoding import choose_bucket
from accelgen.generation.prompt_scores import PromptScores

#: Decode steps between two looks at which rows have finished (each look waits for the device), per policy:
#: a finished row's slot idles until the next look; a fixed batch only stops early at one.
LOOK_INTERVAL = {"continuous": 4, "static": 8}
#: How many rows ahead of the oldest row not yet given out a row may start, in multiples of the slot count.
READ_AHEAD_SLOTS = 4


@dataclasses.dataclass(eq=False)
class Row:
    """One prompt on its way through the slots."""

    place: int  # its place among the rows given to one run: results come out in this order
    number: int  # its prompt number: keys its sampling draws (with ``sample``), names it in errors
    prompt_ids: list[int]
    bucket: int  # the prompt bucket it is padded to (once parked: the one its prompt was prefilled at)
    budget: int  # decode steps it may still take (its first token comes from the prefill)
    state: str = "waiting"  # -> "running" -> "finished"
    slot: int | None = None
    new_tokens: list[int] | None = None  # read back once finished: its new tokens, padding after its end
    error: str | None = None  # why it could not be completed (an error row, given out in its place)
    logprobs: list[float] | None = None  # read back with its tokens, with --logprobs
    sample: int = 0  # which of its prompt's samples it is (--num-samples)
    first_sample: int = 0  # the first of its prompt's samples made by this run (those before it were kept by an earlier)
    settings: RowSettings = RowSettings()  # what it is completed with, every field set (but an error row's)
    #: a sample parked while its prompt was prefilled: its first token drawn then (and its log-probability), and
    #: the slot whose cache row holds its prompt's keys and values, from which it starts (set by the runner)
    first_token: int | None = None
    first_logprob: float = 0.0
    prompt_slot: int | None = None
    adapter_slot: int = 0  # the buffer slot its LoRA adapter is in while it runs (0: the base model's), set as it starts
    prompt_scores: PromptScores | None = None  # its prompt's tokens scored in its prefill (--prompt-logprobs)

    @property
    def samples(self) -> int:
        """How many samples its prompt has (an error row is alone)."""
        return 1 if self.error is not None else self.settings.num_samples

    @property
    def prompt_rows(self) -> int:
        """How many rows its prompt has in this run: one per sample not kept from an earlier run."""
        return self.samples - self.first_sample

    @property
    def opens_prompt(self) -> bool:
        """Whether it is the first of its prompt's rows in this run (the one whose prefill its samples share)."""
        return self.sample == self.first_sample

    @property
    def draw_key(self) -> int:
        """What keys its sampling draws: its prompt number, and its sample above bit 40 (sample 0 draws as a
        prompt without --num-samples does)."""
        return self.number | (self.sample << 40)


@dataclasses.dataclass(frozen=True)
class Insertion:
    """Start ``rows`` in ``slots``. Rows parked before (``first_token`` set) start from their prompt's cache row;
    the others' distinct prompts (``prefilled``: the first row of each) are prefilled once, as one shape of
    ``shape_rows`` prompts of ``bucket_length`` tokens, and first tokens are drawn for ``draws`` (those rows, then
    the samples parked now) from their prompts' (``sources[j]``: the place in ``prefilled`` of draw j's prompt),
    ``draw_rows`` draws in the shape. A prefill run in passes (``--prefill-chunk``) gives the rows already running
    a decode step between two passes, ``decode_between`` at most (the most decode steps any of them has left)."""

    rows: list[Row]
    slots: list[int]
    shape_rows: int
    bucket_length: int
    prefilled: list[Row]
    draws: list[Row]
    sources: list[int]
    draw_rows: int
    decode_between: int = 0
    adapter_loads: tuple[tuple[str, int], ...] = ()  # (adapter, buffer slot) to copy in before the rows start

    @property
    def resumed(self) -> list[tuple[Row, int]]:
        """The parked rows started now, with their slots."""
        return [(row, slot) for row, slot in zip(self.rows, self.slots) if row.first_token is not None]

    def of_prompts(self, numbers: set[int]) -> "Insertion":
        """The part of this insertion that prefills only the prompts numbered ``numbers``: their rows and draws, in
        shapes no larger than this one's, at the largest of their buckets."""
        rows = [(row, slot) for row, slot in zip(self.rows, self.slots) if row.number in numbers]
        prefilled = [row for row in self.prefilled if row.number in numbers]
        draws = [row for row in self.draws if row.number in numbers]
        places = {row.number: place for place, row in enumerate(prefilled)}
        return Insertion([row for row, _ in rows], [slot for _, slot in rows], _prefill_rows(len(prefilled), self.shape_rows),
                         max(row.bucket for row in prefilled), prefilled, draws, [places[row.number] for row in draws],
                         _prefill_rows(len(draws), self.draw_rows), self.decode_between)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the runner does before the host looks again, in this order."""

    cache_bucket: int  # the slots must hold prompts of this bucket (made anew when they hold another)
    insertion: Insertion | None
    steps: int  # decode steps


class Scheduler:
    """Rows into slots, by a policy ("continuous" or "static")."""

    def __init__(self, run: RunSettings, policy: str, context_limit: int | None, prefill_pass_steps: float = 0,
                 adapter_slots: AdapterSlots | None = None):
        """Rows of ``run`` (its batch size is the slot count; its settings each row's, but for a row's own) by
        ``policy``, for a model of ``context_limit`` positions (None: no limit), on a device where a prefill pass
        costs ``prefill_pass_steps`` decode steps beyond its prompts' work (``Accelerator.tuning.prefill_pass_steps``),
        with the LoRA adapters rows choose in ``adapter_slots`` (None: rows of the base model only)."""
        self.run, self.policy, self.slots, self.max_new_tokens = run, policy, run.batch_size, run.max_new_tokens
        self.adapter_slots = adapter_slots
        #: the idle slot-steps free slots wait for before a pass starts rows in them (continuous batching)
        self.pass_slot_steps = prefill_pass_steps * run.batch_size if policy == "continuous" else 0
        self._idle_slot_steps = 0  # the free slots' since the last insertion
        #: whether a row that cannot be completed ends as an error row (else it stops the run)
        self.bad_rows_end = run.skip_bad_rows
        #: whether a row may end before its budget (at end-of-sequence, a stop text, a row's own budget); if not,
        #: the host knows every row's end and looks only then
        self.rows_end_early = run.rows_end_early
        self.buckets, self.context_limit = tuple(sorted(run.buckets)), context_limit
        self.waiting: collections.deque[Row] = collections.deque()
        self.running: dict[int, Row] = {}  # by slot
        self.finished: dict[int, Row] = {}  # by place: ended, held until every row before it is given out
        self.cache_bucket: int | None = None
        self._places = 0  # rows added so far
        self._next_out = 0  # the place of the next row to give out
        #: the rows that have ended in their slots so far, and the decode steps they took in all (a row's steps end
        #: at the look that saw it end; a fixed batch's rows take the batch's)
        self.rows_ended = self.steps_of_ended_rows = 0

    # -- rows in ----------------------------------------------------------------------------------------

    def room(self) -> int:
        """How many more rows to read now: what the free slots can start, less the rows already waiting."""
        return max(0, self.slots - len(self.running) - len(self.waiting))

    def add(self, number: int, prompt_ids: list[int], own: RowSettings | None = None, conversation: bool = False,
            first_sample: int = 0) -> Row:
        """A prompt's new waiting rows, with its ``own`` settings over the run's (one row per sample from
        ``first_sample`` on, those before it kept by a stopped run; consecutive, each with its own draws; the first is
        returned). A prompt too long for every bucket or the model's context (said with the fixes of a
        ``conversation`` when it is one), or whose own settings the run cannot take, is refused by number (or ends at
        once as an error row, with ``bad_rows_end``)."""
        try:
            settings = self.run.row_settings(own)
            bucket = choose_bucket(len(prompt_ids), self.buckets, self.context_limit, self.max_new_tokens, conversation)
        except UsageError as error:
            if not self.bad_rows_end:
                raise PromptError(number, f": {error}") from None
            return self.add_error(number, str(error).removesuffix("."))
        first_sample = min(first_sample, settings.num_samples - 1)
        rows = [Row(self._places + place, number, prompt_ids, bucket, budget=settings.max_new_tokens - 1,
                    sample=sample, first_sample=first_sample, settings=settings)
                for place, sample in enumerate(range(first_sample, settings.num_samples))]
        self._places += len(rows)
        self.waiting.extend(rows)
        return rows[0]

    def add_error(self, number: int, error: str) -> Row:
        """A prompt that cannot be completed, ended at once: one error row, given out in its place."""
        row = Row(self._places, number, [], 0, 0, state="finished", new_tokens=[], error=error)
        self._places += 1
        self.finished[row.place] = row
        return row

    @property
    def idle(self) -> bool:
        """No row waits or runs."""
        return not self.waiting and not self.running

    # -- the plan ---------------------------------------------------------------------------------------

    def plan(self) -> Plan | None:
        """What to run next; None when no row waits or runs. Commits the plan's steps to the rows' budgets."""
        if self.idle:
            return None
        insertion = None if self._gathering() else self._insertion()
        if insertion is None and not self.running:  # the next row needs larger slots: the slots are empty
            self.cache_bucket = self._bucket_for_next_rows()
            insertion = self._insertion()
        budgets = [row.budget for row in self.running.values()]
        if self.rows_end_early:
            steps = min(LOOK_INTERVAL[self.policy], max(budgets, default=0))
        else:  # until the next row ends (with fixed batches, until the batch ends)
            ends = [budget for budget in budgets if budget > 0] or [0]
            steps = max(ends) if self.policy == "static" else min(ends)
        for row in self.running.values():
            row.budget = max(0, row.budget - steps)
        self._idle_slot_steps = 0 if insertion is not None else self._idle_slot_steps + (self.slots - len(self.running)) * steps
        return Plan(self.cache_bucket, insertion, steps)

    def _gathering(self) -> bool:
        """Whether the free slots wait for more to free before a pass starts rows in them: while rows run and enough
        rows wait to fill them (none left to come otherwise), until they have idled as many slot-steps as a pass
        costs (a ski-rental rule: at most twice the cost of the better choice, whatever the rows' lengths). It
        depends on the rows' tokens alone, never on timings: a job runs the same passes every time."""
        free = self.slots - len(self.running)
        return (bool(self.running) and 0 < free <= len(self.waiting)
                and self._idle_slot_steps < self.pass_slot_steps)

    def _insertion(self) -> Insertion | None:
        """Waiting rows into free slots, as the policy allows; None when none goes in."""
        if self.policy == "static":
            if self.running or not self.waiting:
                return None
            self.cache_bucket = self._bucket_for_next_rows()
        elif self.cache_bucket is None:
            self.cache_bucket = self._bucket_for_next_rows()
        free = [slot for slot in range(self.slots) if slot not in self.running]
        limit = self._next_out + READ_AHEAD_SLOTS * self.slots
        rows, parked, loads = [], [], []
        while self.waiting and len(rows) < len(free) and self.waiting[0].place < limit:
            head = self.waiting[0]
            if head.bucket > self.cache_bucket:
                break  # wait for the slots to empty, then grow
            room = len(free) - len(rows)
            if head.opens_prompt and room < head.prompt_rows and self.policy == "static":
                if room < min(head.prompt_rows, self.slots):
                    break  # a batch's samples of a prompt start together (one prefill) when the slots can hold them
            if not self._place_adapter(head, rows, loads):
                break  # its adapter waits for a buffer slot that no running row's adapter holds
            if head.opens_prompt and room < head.prompt_rows and self.policy != "static":
                # the samples that do not fit draw their first token from this prefill and wait at the head of the
                # queue: the next slots to free are theirs, and their prompt's cache row is not reused before
                parked = list(itertools.islice(self.waiting, room, head.prompt_rows))
            rows.append(self.waiting.popleft())
        if not rows:
            return None
        slots = free[: len(rows)]
        for slot, row in zip(slots, rows):
            row.state, row.slot = "running", slot
            self.running[slot] = row
        draws = [row for row in rows if row.first_token is None] + parked
        firsts: dict[int, int] = {}  # prompt number -> its place among the prompts prefilled
        sources = [firsts.setdefault(row.number, len(firsts)) for row in draws]
        prefilled = list({row.number: row for row in reversed(draws)}.values())[::-1]
        drawn = {id(row) for row in draws}
        between = max((row.budget for row in self.running.values() if id(row) not in drawn), default=0)
        return Insertion(rows, slots, _prefill_rows(len(prefilled), self.slots), max(row.bucket for row in draws or rows),
                         prefilled, draws, sources, _prefill_rows(len(draws), max(self.slots, len(draws))), between,
                         tuple(loads))

    def _place_adapter(self, row: Row, starting: list[Row], loads: list[tuple[str, int]]) -> bool:
        """Give ``row`` the buffer slot of its adapter (adding (adapter, slot) to ``loads`` when it must be copied in),
        its samples too; False when the adapter has none free of the adapters of running rows and of those
        ``starting`` with it."""
        adapter = row.settings.adapter
        if self.adapter_slots is None or adapter is None:
            return True
        in_use = {other.settings.adapter for other in (*self.running.values(), *starting)}
        placed = self.adapter_slots.place(adapter, in_use)
        if placed is None:
            return False
        slot, load = placed
        if load:
            loads.append((adapter, slot))
        for sample in itertools.takewhile(lambda waiting: waiting.number == row.number, self.waiting):
            sample.adapter_slot = slot
        return True

    def decoded_between(self, steps: int, insertion: Insertion) -> None:
        """The runner gave the rows running besides the insertion's new ones ``steps`` decode steps between the passes
        of its prefill: their budgets count them."""
        drawn = {id(row) for row in insertion.draws}
        for row in self.running.values():
            if id(row) not in drawn:
                row.budget = max(0, row.budget - steps)

    def _bucket_for_next_rows(self) -> int:
        """The bucket slots made now hold: the largest among the rows that can fill them."""
        return max(row.bucket for row in list(self.waiting)[: self.slots])

    # -- rows out ---------------------------------------------------------------------------------------

    def collect(self, finished_slots: list[bool]) -> list[int]:
        """Given which slots' rows have ended (read from the device at a look), the slots to read back now:
        every ended row's, or with fixed batches only once the whole batch has ended."""
        ended = [slot for slot in self.running if finished_slots[slot]]
        if self.policy == "static" and len(ended) < len(self.running):
            return []
        return sorted(ended)

    def finish(self, new_tokens: dict[int, list[int]] | None = None,
               logprobs: dict[int, list[float]] | None = None) -> list[Row]:
        """Free the slots of ``new_tokens`` (slot -> the row's tokens read back, and their ``logprobs`` when
        recorded) and return the rows now ready to give out, in the order they came in."""
        for slot, tokens in (new_tokens or {}).items():
            row = self.running.pop(slot)
            row.state, row.slot, row.new_tokens = "finished", None, tokens
            self.rows_ended += 1
            self.steps_of_ended_rows += row.settings.max_new_tokens - 1 - row.budget
            row.logprobs = None if logprobs is None else logprobs[slot]
            self.finished[row.place] = row
        ready = []
        while self._next_out in self.finished:
            ready.append(self.finished.pop(self._next_out))
            self._next_out += 1
        return ready


def _prefill_rows(rows: int, slots: int) -> int:
    """The row count of the prefill shape for ``rows`` prompts: the next power of two, at most ``slots``."""
    shape_rows = 1
    while shape_rows < rows:
        shape_rows *= 2
    return min(shape_rows, slots)
