"""A third-party accelgen plugin, as small as one can be: the ``fake`` device.

It computes on the CPU but goes through every hook a real accelerator implements, and says so on
stderr, so a test can see the whole pipeline run on a device the core has never heard of. Install
it with ``pip install ./examples/accelgen-fake-device`` and run ``accelgen run --device fake ...``.
"""

import sys

import torch

import accelgen


def _report(event: str) -> None:
    print(f"fake-device: {event}", file=sys.stderr, flush=True)


class FakeAccelerator:
    name = "fake"
    dist_backend = "gloo"
    supported_dtypes = ("float32",)
    default_dtype = "float32"
    captures_by_default = True
    priority = -1  # never chosen by --device auto
    one_process_per_device = False

    def is_available(self):
        return True

    def unavailable_reason(self):
        return "never: the fake device is always there"

    def device_count(self):
        return 1

    def setup(self, world):
        _report(f"setup rank {world.rank} of {world.size}")
        return torch.device("cpu")

    def prepare_model(self, model, run):
        _report(f"prepare_model {type(model).__name__} as {run.dtype}")
        return model.to("cpu")

    def shard(self, model, world, run):
        raise accelgen.UsageError("the fake device has no tensor parallelism: use --world-size 1")

    def capture(self, step, example_inputs, run):
        shapes = " ".join("x".join(map(str, tensor.shape)) for tensor in example_inputs)
        _report(f"capture decode step for shapes {shapes}")
        return step  # replaying the plain step stands in for a graph

    def mark_step(self):
        pass

    def synchronize(self):
        pass

    def is_out_of_memory(self, error):
        return isinstance(error, MemoryError)

    def launch_command(self, worker_argv, plan):
        return None  # torch's elastic launcher

    def memory_stats(self):
        return {}

    def describe(self):
        return {"device_name": "fake device", "device_count": 1, "driver": None,
                "peak_memory_bandwidth_gbps": None, "peak_bf16_tflops": None}


@accelgen.hookimpl
def accelgen_register_accelerators(register):
    register(FakeAccelerator())
