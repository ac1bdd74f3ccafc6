"""A SIGTERM that lands inside a library which catches it and raises an error of its own (a compiler wrapping
what interrupted it) still stops the command as a stop: exit status 143, one line, no traceback, the step not
run on as if capture had merely failed. Run in the test's own process, through ``main``, with test accelerators
that send the signal from inside the engine's calls into them."""

import os
import signal
import time

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
