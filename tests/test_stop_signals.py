"""A SIGTERM that lands inside a library which catches it and raises an error of its own (a compiler wrapping
what interrupted it) still stops the command as a stop: exit status 143, one line, no traceback, the step not
run on as if capture had merely failed. Run in the test's own process, through ``main``, with test accelerators
that send the signal from inside the engine's calls into them."""

import os
import signal
import time

import pytest
from accelerators import CapturingCpu, plugin_manager_with

from accelgen.cli import main


def _stopped_inside_a_library():
    """Send this process SIGTERM and wrap what it raises here in an error of the library's own, as torch's
    compiler does with what interrupts it."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises before this ends
    except BaseException as error:
        raise RuntimeError("the library's own error") from error
    raise AssertionError("SIGTERM was not delivered")


class CaptureStoppedCpu(CapturingCpu):
    def capture(self, step, example_inputs, run):
        _stopped_inside_a_library()


class SynchronizeStoppedCpu(CapturingCpu):
    def synchronize(self):
        _stopped_inside_a_library()


class SignalsAsItIsCollected:
    """An object whose finalizer sends this process a signal: the handler runs inside ``__del__``, where Python
    prints an exception raised and drops it."""

    def __init__(self, signal_number: int):
        self.signal_number = signal_number

    def __del__(self):
        os.kill(os.getpid(), self.signal_number)
        sum(range(100_000))  # the handler runs here, inside the finalizer


class SignalledInAFinalizerCpu(CapturingCpu):
    """Its first synchronize drops an object whose finalizer signals the process, then works on (a second)."""

    def __init__(self, signal_number: int):
        super().__init__()
        self.signal_number, self.sent = signal_number, False

    def synchronize(self):
        if not self.sent:
            self.sent = True
            SignalsAsItIsCollected(self.signal_number)  # collected at once, here
            time.sleep(5)  # the signal, sent again once the finalizer has returned, lands here


def run_with(accelerator, capsys, tiny_model_folder) -> tuple[int, str]:
    status = main(["run", "--device", "cpu", "--model", str(tiny_model_folder("llama")), "--prompt", "Hello",
                   "--max-new-tokens", "4", "--graphs"], plugin_manager=plugin_manager_with(accelerator))
    return status, capsys.readouterr().err


def test_a_stop_wrapped_by_the_capturing_compiler_stops_the_run(capsys, tiny_model_folder):
    status, stderr = run_with(CaptureStoppedCpu(), capsys, tiny_model_folder)
    assert status == 143, stderr
    assert stderr.strip().splitlines()[-1] == "accelgen: stopped (SIGTERM)"
    assert "cannot capture" not in stderr and "Traceback" not in stderr


def test_a_stop_wrapped_anywhere_in_the_run_is_a_stop_not_a_traceback(capsys, tiny_model_folder):
    status, stderr = run_with(SynchronizeStoppedCpu(), capsys, tiny_model_folder)
    assert status == 143, stderr
    assert stderr.strip().splitlines()[-1] == "accelgen: stopped (SIGTERM)"
    assert "Traceback" not in stderr


@pytest.mark.parametrize(("sent", "status", "line"), [(signal.SIGTERM, 143, "accelgen: stopped (SIGTERM)"),
                                                     (signal.SIGINT, 130, "accelgen: interrupted")])
def test_a_signal_that_lands_inside_a_finalizer_still_stops_the_run(capsys, tiny_model_folder, sent, status, line):
    """Before: "Exception ignored in: <function Group.__del__ ...>", and a run sent SIGTERM went on to the end."""
    status_seen, stderr = run_with(SignalledInAFinalizerCpu(sent), capsys, tiny_model_folder)
    assert status_seen == status, stderr
    assert stderr.strip().splitlines()[-1] == line
    assert "Exception ignored" not in stderr and "Traceback" not in stderr


def test_a_stopped_dataset_run_says_where_its_rows_are_and_how_to_go_on(tiny_model_folder, tmp_path, cli_environment):
    """Ctrl-C or SIGTERM to a run writing an output: one line naming the output and the command that resumes."""
    import json
    import subprocess
    import sys

    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": f"Row {number}"}) + "\n" for number in range(400)))
    for sent, status, said in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped (SIGTERM)")):
        output = tmp_path / f"out-{sent.name}.jsonl"
        run = subprocess.Popen([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model",
                                str(tiny_model_folder("llama")), "--dataset", str(dataset), "--max-new-tokens", "16",
                                "--output", str(output), "--quiet"], env=cli_environment, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not output.exists() or output.read_text().count("\n") < 2):
            time.sleep(0.01)
        run.send_signal(sent)
        _, stderr = run.communicate(timeout=60)
        assert run.returncode == status, stderr
        assert stderr.splitlines()[-1] == (f"accelgen: {said}: the rows finished are kept in {output}, and the same "
                                           f"command resumes")


def test_a_dataset_run_stopped_before_any_row_finished_does_not_claim_rows_kept(capsys, tiny_model_folder, tmp_path):
    """SIGTERM while the first insertion's step is captured: no row has finished, so none is said to be kept."""
    dataset, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    dataset.write_text('{"text": "Hello"}\n{"text": "World"}\n')
    status = main(["run", "--device", "cpu", "--model", str(tiny_model_folder("llama")), "--dataset", str(dataset),
                   "--output", str(output), "--max-new-tokens", "4", "--graphs"],
                  plugin_manager=plugin_manager_with(CaptureStoppedCpu()))
    stderr = capsys.readouterr().err
    assert status == 143, stderr
    assert stderr.strip().splitlines()[-1] == "accelgen: stopped (SIGTERM): no row had finished yet"
