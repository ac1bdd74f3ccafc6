"""accelgen as a stage of a Ray Data pipeline: :class:`Completions`, a callable class for
``ray.data.Dataset.map_batches`` holding one engine, and :func:`complete_dataset`, the stage of ``replicas`` of them.

A batch in is Ray's: columns of equal length. The prompt column holds texts or conversations (lists of
``{"role", "content"}`` messages); the columns accelgen reads per row, where named, are a JSON Schema its completion is
held to (``schema_column``), a LoRA adapter by name (``adapter_column``), its number (``number_column``: what its
sampling draws depend on, as a dataset row's place does for ``accelgen run``), and with ``settings_columns`` its own
``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` and ``num_samples`` (null: the run's). A batch
out holds every input column and the fields of ``accelgen run``'s output lines (``index``, ``prompt``, ``completion``,
``finish_reason``...; null where a row has none): a row that cannot be completed is an error row (``finish_reason``
"error", why in ``error``), and the batch goes on. The output's ordering and checkpoints are Ray Data's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from accelgen.common.errors import UsageError
from accelgen.common.prompts import BadPrompt, PromptRequest, as_conversation, prompt_problem
from accelgen.common.settings import RowSettings
from accelgen.jobs.dataset_rows import with_adapter, with_schema
from accelgen.ray.cluster import ReplicaResources, cluster_device, import_ray
from accelgen.ray.replica import Failed, Replica, ReplicaRecipe

#: The row settings a batch may hold per row with ``settings_columns``.
SETTINGS_COLUMNS = ("max_new_tokens", "temperature", "top_p", "seed", "stop", "num_samples")


class Completions:
    """Completes a Ray Data batch's prompts with one engine, loaded once when Ray makes the instance (in the actor of an
    ``ActorPoolStrategy``). ``model`` and ``options`` are those of ``accelgen.load``; the columns as the module says."""

    def __init__(self, model: str | None = None, *, column: str = "text", schema_column: str | None = None,
                 adapter_column: str | None = None, number_column: str | None = None, settings_columns: bool = False,
                 device: str = "auto", trust_remote_code: bool = False, random_weights: bool = False, world_size: int = 1,
                 **options):
        self.column, self.schema_column, self.adapter_column = column, schema_column, adapter_column
        self.number_column, self.settings_columns = number_column, settings_columns
        settings = {**options, "skip_bad_rows": True}  # a bad row is an error row: the batch goes on
        self.replica = Replica(ReplicaRecipe(model, device, random_weights, trust_remote_code, settings,
                                             constrained=schema_column is not None, rows_choose=settings_columns,
                                             world_size=world_size))
        loaded = self.replica.load()
        if isinstance(loaded, Failed):
            raise loaded.error
        self.numbers = itertools.count()

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        columns = {name: _plain(values) for name, values in batch.items()}
        if self.column not in columns:
            raise UsageError(f"the batch has no column {self.column!r} (its columns: {', '.join(columns) or 'none'}): "
                             f"pass column= the one holding the prompts.")
        count = len(columns[self.column])
        rows = [(self._number(columns, place), self._prompt(columns, place)) for place in range(count)]
        completions = self.replica.complete(rows)
        if isinstance(completions, Failed):  # a setting of the run, not of a row: every batch would fail alike
            raise completions.error
        lines = [completion.as_row() for completion in completions]
        fields = list(dict.fromkeys(name for line in lines for name in line))
        out = {name: values for name, values in columns.items() if name not in fields}
        out.update({name: [line.get(name) for line in lines] for name in fields})
        return out

    def _number(self, columns: dict[str, list], place: int) -> int:
        if self.number_column is None:
            return next(self.numbers)
        number = columns[self.number_column][place]
        if isinstance(number, bool) or not isinstance(number, int):
            raise UsageError(f"number_column {self.number_column!r} holds {number!r}, not a whole row number.")
        return number

    def _prompt(self, columns: dict[str, list], place: int) -> object:
        """The row's prompt, with its own settings where columns give them; a BadPrompt saying what is wrong."""
        value = columns[self.column][place]
        if isinstance(value, list):
            prompt, problem = as_conversation(value)
        else:
            prompt, problem = value, prompt_problem(value)
        if problem:
            return BadPrompt(problem.split(": ")[0])
        if self.schema_column:  # as a dataset row's schema is read (its fix left out of the error row)
            prompt, problem = with_schema(prompt, columns[self.schema_column][place])
            if problem:
                return BadPrompt(f"its schema (column {self.schema_column!r}) {problem.rsplit(': ', 1)[0]}")
        if self.adapter_column:
            prompt, problem = with_adapter(prompt, columns[self.adapter_column][place], self.replica.request.run.lora)
            if problem:
                return BadPrompt(f"its adapter (column {self.adapter_column!r}) {problem.split(': ')[0]}")
        if self.settings_columns:
            own = {name: value for name in SETTINGS_COLUMNS if name in columns
                   and (value := _setting(name, columns[name][place])) is not None}
            if "stop" in own:
                own["stop"] = (own["stop"],) if isinstance(own["stop"], str) else tuple(own["stop"])
            if isinstance(prompt, PromptRequest):
                prompt = dataclasses.replace(prompt, settings=dataclasses.replace(prompt.settings, **own))
            elif own:
                prompt = PromptRequest(prompt, RowSettings(**own), None)
        return prompt


def complete_dataset(dataset, model: str | None = None, *, replicas: int = 1, world_size: int = 1,
                     num_cpus: float | None = None, num_gpus: float | None = None, resources: dict | None = None,
                     rows_per_batch: int = 64, **options):
    """``dataset`` (a ``ray.data.Dataset``) with every row completed by ``replicas`` engines, each an actor of a pool
    split over ``world_size`` ranks of its node (``accelgen.ray.replica_ranks``) and asking Ray for ``num_cpus``,
    ``num_gpus`` and ``resources`` (default: what the device's plugin asks for each rank), handed ``rows_per_batch``
    rows at a time: a lazy ``ray.data.Dataset`` (write it, or iterate it). ``options``: those of :class:`Completions`."""
    ray = import_ray()
    asked = {name: value for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus), ("resources", resources))
             if value is not None}
    replica = (ReplicaResources.of(asked) if asked
               else ReplicaResources.of(_device_resources(ray, options.get("device", "auto")), world_size))
    return dataset.map_batches(Completions, fn_constructor_args=(model,),
                               fn_constructor_kwargs={**options, "world_size": world_size},
                               compute=ray.data.ActorPoolStrategy(size=replicas), batch_size=rows_per_batch,
                               **replica.options())


def _device_resources(ray, device: str) -> dict:
    """What one rank of ``device`` asks of a node (its plugin's answer); for ``auto``, of the best device the cluster's
    nodes hold (``accelgen.ray.cluster.cluster_device``) once Ray is joined, else of one CPU."""
    from accelgen.plugin.manager import get_plugin_manager
    from accelgen.plugin.registry import AUTO_DEVICE, registered_accelerators

    plugin_manager = get_plugin_manager()
    if device == AUTO_DEVICE and ray.is_initialized():
        device = cluster_device(ray, plugin_manager, device)
    accelerator = registered_accelerators(plugin_manager).get(device)
    return accelerator.cluster_resources() if accelerator is not None else {"num_cpus": 1}


#: The settings that are whole numbers: a column of them with a null in it reaches a batch as floats (Arrow to NumPy).
WHOLE_SETTINGS = ("max_new_tokens", "seed", "num_samples")


def _setting(name: str, value: object) -> object:
    """A row's value of the settings column ``name`` as the setting: None (the run's) for a null, which a numeric column
    holding one reaches the batch as (NaN), and a whole number where the setting is one."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if name in WHOLE_SETTINGS and value.is_integer():
            return int(value)
    return value


def _plain(values) -> list:
    """A column of Ray's batch (a NumPy array, or a list) as Python values: arrays inside it as lists."""
    listed = values.tolist() if hasattr(values, "tolist") else list(values)
    return [_plain_value(value) for value in listed]


def _plain_value(value):
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain_value(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain_value(item) for key, item in value.items()}
    return value
