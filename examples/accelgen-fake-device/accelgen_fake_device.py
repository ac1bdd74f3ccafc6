"""A third-party accelgen plugin, as small as one can be: the ``fake`` device.

It computes on the CPU and writes what differs from ``accelgen.Accelerator``'s defaults, saying on stderr
when the core calls it, so a test can see the whole pipeline run on a device the core has never heard of.
Install it with ``pip install ./examples/accelgen-fake-device`` and run ``accelgen run --device fake ...``.
"""

import sys

import torch

import accelgen


def _report(event: str) -> None:
    print(f"fake-device: {event}", file=sys.stderr, flush=True)


class FakeAccelerator(accelgen.Accelerator):
    name = "fake"
    tuning = accelgen.Tuning(captures_by_default=True)
    priority = -1  # never chosen by --device auto

    def is_available(self):
        return True

    def setup(self, world):
        _report(f"setup rank {world.rank} of {world.size}")
        return torch.device("cpu")

    def prepare_model(self, model, device, run, world):
        _report(f"prepare_model {type(model).__name__} as {run.dtype}")
        return model  # it arrives in run.dtype on the device setup() returned: nothing to move

    def capture(self, step, example_inputs, run):
        shapes = " ".join("x".join(map(str, tensor.shape)) for tensor in example_inputs)
        _report(f"capture decode step for shapes {shapes}")
        return step  # replaying the plain step stands in for a graph


@accelgen.hookimpl
def accelgen_register_accelerators(register):
    register(FakeAccelerator())
