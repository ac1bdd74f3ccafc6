"""The plugin system: built-ins and third-party plugins through one pluggy manager."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import accelgen
from accelgen.cli import main
from accelgen.plugin.manager import DEFAULT_PLUGINS, get_plugin_manager
from accelgen.plugin.registry import registered_accelerators, select_accelerator

REPOSITORY = Path(__file__).resolve().parents[1]


class UnavailableAccelerator(accelgen.Accelerator):
    """A device whose software stack is missing, as hpu is on a laptop."""

    name = "npu"
    supported_dtypes = ("bfloat16",)
    default_dtype = "bfloat16"
    captures_by_default = True
    priority = 50

    def is_available(self):
        return False

    def unavailable_reason(self):
        return "NPU runtime not installed (pip install npu-runtime)"

    def setup(self, world):
        raise AssertionError("an unavailable device is never set up")


class Plugin:
    """Plugins can be objects too; this one registers whatever accelerators it is given."""

    def __init__(self, *accelerators):
        self.accelerators = accelerators

    @accelgen.hookimpl
    def accelgen_register_accelerators(self, register):
        for accelerator in self.accelerators:
            register(accelerator)


def test_built_in_plugins_register_through_the_same_hook():
    plugin_manager = get_plugin_manager(load_entry_points=False)
    # get_plugins() is a set: compare names, not order (the order of calls is pluggy's, tested below)
    assert sorted(plugin_manager.get_name(plugin) for plugin in plugin_manager.get_plugins()) == sorted(DEFAULT_PLUGINS)
    assert list(registered_accelerators(plugin_manager)) == ["hpu", "cuda", "cpu"]  # by priority


def test_entry_point_of_a_built_in_is_not_registered_twice():
    plugin_manager = get_plugin_manager()
    names = [plugin_manager.get_name(plugin) for plugin in plugin_manager.get_plugins()]
    assert names.count("accelgen_cpu") == 1


def test_unknown_device_lists_the_known_ones(capsys):
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(Plugin(UnavailableAccelerator()))
    assert main(["run", "--device", "xpu", "--prompt", "hi"], plugin_manager) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "No plugin provides --device 'xpu'" in error
    assert "cpu" in error and "npu (unavailable: NPU runtime not installed" in error


def test_known_but_unavailable_device_says_why(capsys):
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(Plugin(UnavailableAccelerator()))
    assert main(["run", "--device", "npu", "--prompt", "hi"], plugin_manager) == 2
    assert capsys.readouterr().err == (
        "accelgen: error: --device npu is not available here: NPU runtime not installed (pip install npu-runtime)\n"
    )


def test_devices_lists_every_accelerator_and_why_not(capsys):
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(Plugin(UnavailableAccelerator()))
    assert main(["devices"], plugin_manager) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("npu") and "unavailable: NPU runtime not installed" in lines[0]
    [cpu_line] = [line for line in lines if line.startswith("cpu")]
    assert "available, 1 device(s)" in cpu_line and "accelgen_cpu" in cpu_line


def test_auto_device_skips_unavailable_accelerators():
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(Plugin(UnavailableAccelerator()))
    assert select_accelerator(plugin_manager, "auto").name == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_later_plugin_replaces_a_built_in_accelerator_of_the_same_name(tiny_model_folder):
    captured = []

    class RecordingCpu(accelgen.Accelerator):
        name = "cpu"
        captures_by_default = True

        def is_available(self):
            return True

        def setup(self, world):
            return torch.device("cpu")

        def capture(self, step, example_inputs, run):
            captured.append(tuple(tensor.shape for tensor in example_inputs))
            return step

    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(Plugin(RecordingCpu()))
    generator = accelgen.load(
        tiny_model_folder("llama"), device="cpu", batch_size=2, max_new_tokens=4, buckets=(8, 128),
        plugin_manager=plugin_manager,
    )
    generator.generate(["one", "two", "three"])
    generator.generate(["four", "five"])
    generator.generate(["a prompt longer than eight tokens needs the next bucket"])
    # the decode buffers (accelgen.generation.decoding.DecodeState) for batch 2, bucket + 4 cache positions and 4 new tokens:
    # [2, 1] tokens, [2, 1] positions, [1] cache index, [2, bucket + 4] mask, [1] step, [2, 4] new tokens,
    # [2] finished rows, [2] prompt numbers; one capture per bucket, reused by later batches
    def shapes(cache_length):
        return tuple(torch.Size(shape) for shape in ([2, 1], [2, 1], [1], [2, cache_length], [1], [2, 4], [2], [2]))

    assert captured == [shapes(8 + 4), shapes(128 + 4)]
    assert generator.stats.graph_captures == 2


def test_hook_tracing_switch_prints_hook_calls(monkeypatch, capsys):
    monkeypatch.setenv("ACCELGEN_TRACE_HOOKS", "1")
    registered_accelerators(get_plugin_manager(load_entry_points=False))
    assert "accelgen_register_accelerators" in capsys.readouterr().err


@pytest.mark.slow
def test_third_party_plugin_package_runs_the_whole_pipeline(tmp_path, tiny_model_folder, cli_environment):
    """pip-install the example plugin package (into a private folder) and run on its 'fake' device."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(REPOSITORY / "examples" / "accelgen-fake-device")],
        check=True,
    )
    environment = dict(cli_environment, PYTHONPATH=str(target))
    devices = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "devices"], env=environment, capture_output=True, text=True, check=True
    )
    assert "fake" in devices.stdout and "accelgen-fake-device 0.1.0" in devices.stdout

    output = tmp_path / "out.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "fake", "--model", str(tiny_model_folder("gpt2")),
         "--prompt", "Hello", "--prompt", "DeepSpeed is", "--batch-size", "2", "--max-new-tokens", "6",
         "--output", str(output)],
        env=environment, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "fake-device: setup rank 0 of 1" in result.stderr
    assert "fake-device: prepare_model GPT2LMHeadModel as float32" in result.stderr
    assert result.stderr.count("fake-device: capture decode step") == 1
    assert "graph captures: 1" in result.stderr
    expected = accelgen.generate(["Hello", "DeepSpeed is"], model=tiny_model_folder("gpt2"), device="cpu",
                                 batch_size=2, max_new_tokens=6)
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["completion_token_ids"] for row in written] == [c.completion_token_ids for c in expected]
    assert all(row["completion_token_ids"] for row in written)


# -- broken plugins: refused with one line, never silent, the other devices still work ------------------


class HalfWrittenAccelerator(accelgen.Accelerator):
    """A plugin author's first draft: a name and availability, but no setup()."""

    name = "npu"

    def is_available(self):
        return True


class OldStyleAccelerator:
    """Written against a protocol, not the base class, and missing most of it."""

    name = "tpu"

    def is_available(self):
        return True


class WrongDtypes(UnavailableAccelerator):
    name = "xpu"
    supported_dtypes = ("bfloat16", "float8")
    default_dtype = "float16"


@pytest.mark.parametrize("accelerator, device, problem", [
    (OldStyleAccelerator(), "tpu", "registers OldStyleAccelerator, which lacks dist_backend, supported_dtypes, "),
    (WrongDtypes(), "xpu", "registers 'xpu' with supported_dtypes ('bfloat16', 'float8') and default_dtype 'float16'"),
])
def test_a_broken_accelerator_is_refused_at_registration_with_one_line(accelerator, device, problem, capsys):
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(Plugin(accelerator), name="my_plugin")

    assert main(["devices"], plugin_manager) == 0
    lines = capsys.readouterr().out.splitlines()
    [broken] = [line for line in lines if line.startswith("broken")]
    assert broken.startswith("broken   plugin my_plugin (") and problem in broken  # its package: this test's
    assert any(line.startswith("cpu ") and "available" in line for line in lines)  # the others still work

    assert main(["run", "--device", device, "--prompt", "hi"], plugin_manager) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"accelgen: error: --device {device} cannot be used: plugin my_plugin")
    assert problem in error


def test_an_accelerator_without_setup_cannot_be_made_and_its_plugin_is_named(capsys):
    """Python itself refuses the half-written accelerator (abstract methods); the registry names its plugin."""

    class HalfWrittenPlugin:
        @accelgen.hookimpl
        def accelgen_register_accelerators(self, register):
            register(HalfWrittenAccelerator())

    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(HalfWrittenPlugin(), name="my_plugin")
    assert main(["devices"], plugin_manager) == 0
    [broken] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("broken")]
    assert broken.startswith("broken   plugin my_plugin (") and "HalfWrittenAccelerator" in broken
    assert "abstract method" in broken and "setup" in broken
    assert main(["run", "--device", "npu", "--prompt", "hi"], plugin_manager) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "my_plugin" in error and "abstract method" in error


def test_a_plugin_whose_hook_raises_is_set_aside_and_the_others_work(tiny_model_folder, capsys):
    class RaisingPlugin:
        @accelgen.hookimpl
        def accelgen_register_accelerators(self, register):
            raise RuntimeError("driver library libnpu.so not found")

    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RaisingPlugin(), name="raising_plugin")
    assert list(registered_accelerators(plugin_manager)) == ["hpu", "cuda", "cpu"]
    assert main(["run", "--device", "cpu", "--model", str(tiny_model_folder("gpt2")), "--prompt", "hi",
                 "--max-new-tokens", "2"], plugin_manager) == 0
    assert main(["devices"], plugin_manager) == 0
    assert ("broken   plugin raising_plugin (package unknown): accelgen_register_accelerators raised RuntimeError: "
            "driver library libnpu.so not found") in capsys.readouterr().out


@pytest.mark.slow
def test_an_installed_plugin_that_fails_to_import_is_shown_with_its_error(tmp_path, tiny_model_folder, cli_environment):
    """The most reported plugin problem elsewhere: an entry point whose import fails, skipped without a word."""
    package = tmp_path / "accelgen-broken-device"
    package.mkdir()
    (package / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "accelgen-broken-device"\nversion = "0.3.0"\n\n'
        '[project.entry-points.accelgen]\nbroken_device = "accelgen_broken_device"\n'
    )
    (package / "accelgen_broken_device.py").write_text("import vendor_runtime_that_is_not_installed\n")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(package)], check=True)
    environment = dict(cli_environment, PYTHONPATH=str(target))

    devices = subprocess.run([sys.executable, "-m", "accelgen.cli", "devices"], env=environment,
                             capture_output=True, text=True)
    assert devices.returncode == 0, devices.stderr
    assert ("broken   plugin broken_device (accelgen-broken-device 0.3.0): cannot be loaded: ModuleNotFoundError: "
            "No module named 'vendor_runtime_that_is_not_installed'") in devices.stdout
    assert any(line.startswith("cpu ") for line in devices.stdout.splitlines())

    unknown = subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--device", "broken", "--prompt", "hi"],
                             env=environment, capture_output=True, text=True)
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1 and "Traceback" not in unknown.stderr
    assert "Plugins that could not be used: broken_device (accelgen-broken-device 0.3.0): cannot be loaded" in unknown.stderr

    works = subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model",
                            str(tiny_model_folder("gpt2")), "--prompt", "hi", "--max-new-tokens", "2"],
                           env=environment, capture_output=True, text=True)
    assert works.returncode == 0, works.stderr
