"""A plugin written for an older form of the contract keeps working for a stated time: its tuning knobs set on the
accelerator itself (the contract before ``accelgen.Tuning``) are read as its ``tuning``, with one deprecation line
naming the plugin, the old attributes, the new form and the date after which the old form is refused."""

from __future__ import annotations

import json
import re

import pytest
import torch
from accelerators import RegisteringPlugin
from conftest import one_error_line

import accelgen
from accelgen.cli import main
from accelgen.plugin.manager import get_plugin_manager
from accelgen.plugin.old_forms import OLD_TUNING_ACCEPTED_UNTIL
from accelgen.plugin.registry import registered_accelerators

captured_steps: list[str] = []


class LastMonthsNpu(accelgen.Accelerator):
    """A third-party device written before the knobs moved into ``accelgen.Tuning``: it computes on the CPU and
    captures its decode step by default (its capture records the call and returns the step)."""

    name = "oldnpu"
    captures_by_default = True
    capture_pays_after_steps = 0

    def is_available(self):
        return True

    def setup(self, world):
        return torch.device("cpu")

    def capture(self, step, example_inputs, run):
        captured_steps.append(" ".join("x".join(map(str, tensor.shape)) for tensor in example_inputs))
        return step


def plugin_manager_with(accelerator) -> accelgen.plugin.manager.PluginManager:
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RegisteringPlugin(accelerator), name="npu_plugin")
    return plugin_manager


def deprecation_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr and "accelgen: error" not in stderr, stderr
    return [line for line in stderr.splitlines() if "captures_by_default" in line]


def test_a_plugin_setting_its_knobs_on_itself_runs_to_the_end_with_one_deprecation_line(tmp_path, capsys):
    captured_steps.clear()
    output_file = tmp_path / "out.jsonl"
    command = ["run", "--device", "oldnpu", "--prompt", "DeepSpeed is", "--max-new-tokens", "3", "--quiet",
               "--output", str(output_file)]
    assert main(command, plugin_manager_with(LastMonthsNpu())) == 0
    output = capsys.readouterr()
    [row] = [json.loads(line) for line in output_file.read_text().splitlines()]
    assert row["prompt"] == "DeepSpeed is" and row["completion"]
    [line] = deprecation_lines(output.err)
    assert line.startswith("accelgen: warning: plugin npu_plugin (")
    assert "sets captures_by_default, capture_pays_after_steps on LastMonthsNpu itself" in line
    assert "tuning = accelgen.Tuning(captures_by_default=True, capture_pays_after_steps=0)" in line
    assert f"until {OLD_TUNING_ACCEPTED_UNTIL}" in line and re.search(r"\d{4}-\d\d-\d\d", OLD_TUNING_ACCEPTED_UNTIL)
    assert captured_steps  # its captures_by_default was read: the decode step was captured by default


def test_the_old_knobs_are_read_over_the_tuning_a_subclass_inherits():
    """A subclass of a built-in accelerator that sets one knob the old way keeps its parent's other knobs."""
    from accelgen_cpu import CpuAccelerator

    class OldStyleCpu(CpuAccelerator):
        name = "oldcpu"
        prefill_pass_steps = 0

    accelerator = registered_accelerators(plugin_manager_with(OldStyleCpu()))["oldcpu"]
    assert accelerator.tuning == accelgen.Tuning(**{**vars(CpuAccelerator.tuning), "prefill_pass_steps": 0})


def test_devices_lists_a_plugin_of_the_old_form_as_available_with_its_deprecation(capsys):
    assert main(["devices"], plugin_manager_with(LastMonthsNpu())) == 0
    output = capsys.readouterr()
    assert any(line.startswith("oldnpu ") and "available" in line for line in output.out.splitlines())
    assert len(deprecation_lines(output.err)) == 1


class KnobThatCannotBeRead(LastMonthsNpu):
    """An old knob given as a property that raises: the plugin is set aside, as any member that raises."""

    name = "badnpu"

    @property
    def captures_prefill(self):
        raise RuntimeError("not ready")


def test_an_old_knob_that_cannot_be_read_is_refused_in_one_line(capsys):
    assert main(["run", "--device", "badnpu", "--prompt", "hi"], plugin_manager_with(KnobThatCannotBeRead())) == 2
    error = one_error_line(capsys)
    assert error.startswith("accelgen: error: --device badnpu cannot be used: plugin npu_plugin") and "not ready" in error


@pytest.mark.parametrize("value", ["yes", None])
def test_an_old_knob_of_the_wrong_kind_is_refused_in_one_line(value, capsys):
    class WrongKind(LastMonthsNpu):
        name = "wrongnpu"
        captures_by_default = value

    assert main(["run", "--device", "wrongnpu", "--prompt", "hi"], plugin_manager_with(WrongKind())) == 2
    error = one_error_line(capsys)
    assert "captures_by_default" in error and "must be" in error
