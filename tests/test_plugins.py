"""The plugin system: built-ins and third-party plugins through one pluggy manager."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerators import CapturingCpu, RegisteringPlugin

import accelgen
from accelgen.cli import main
from accelgen.generation.decoding import DecodeState
from accelgen.plugin.manager import DEFAULT_PLUGINS, ENTRY_POINT_GROUP, get_plugin_manager
from accelgen.plugin.registry import registered_accelerators, select_accelerator

REPOSITORY = Path(__file__).resolve().parents[1]


class UnavailableAccelerator(accelgen.Accelerator):
    """A device whose software stack is missing, as hpu is on a laptop."""

    name = "npu"
    supported_dtypes = ("bfloat16",)
    default_dtype = "bfloat16"
    tuning = accelgen.Tuning(captures_by_default=True)
    priority = 50

    def is_available(self):
        return False

    def unavailable_reason(self):
        return "NPU runtime not installed (pip install npu-runtime)"

    def setup(self, world):
        raise AssertionError("an unavailable device is never set up")


def test_built_in_plugins_register_through_the_same_hook():
    plugin_manager = get_plugin_manager(load_entry_points=False)
    # get_plugins() is a set: compare names, not order (the order of calls is pluggy's, tested below)
    assert sorted(plugin_manager.get_name(plugin) for plugin in plugin_manager.get_plugins()) == sorted(DEFAULT_PLUGINS)
    assert list(registered_accelerators(plugin_manager)) == ["hpu", "cuda", "cpu"]  # by priority


def test_entry_point_of_a_built_in_is_not_registered_twice(capsys):
    """The built-ins are also listed as entry points (pyproject.toml); loading those must neither register a
    module twice nor be refused by pluggy as a duplicate and shown as a broken plugin."""
    entry_points = {entry_point.name for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert set(DEFAULT_PLUGINS) <= entry_points  # else this test checks nothing
    plugin_manager = get_plugin_manager()
    names = [plugin_manager.get_name(plugin) for plugin in plugin_manager.get_plugins()]
    assert all(names.count(built_in) == 1 for built_in in DEFAULT_PLUGINS)
    assert [failure for failure in plugin_manager.load_failures if failure.plugin in DEFAULT_PLUGINS] == []
    assert main(["devices"], plugin_manager) == 0
    assert [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("broken") and any(built_in in line for built_in in DEFAULT_PLUGINS)] == []


def test_unknown_device_lists_the_known_ones(capsys):
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RegisteringPlugin(UnavailableAccelerator()))
    assert main(["run", "--device", "xpu", "--prompt", "hi"], plugin_manager) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "No plugin provides --device 'xpu'" in error
    assert "cpu" in error and "npu (unavailable: NPU runtime not installed" in error


def test_known_but_unavailable_device_says_why(capsys):
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RegisteringPlugin(UnavailableAccelerator()))
    assert main(["run", "--device", "npu", "--prompt", "hi"], plugin_manager) == 2
    assert capsys.readouterr().err == (
        "accelgen: error: --device npu is not available here: NPU runtime not installed (pip install npu-runtime)\n"
    )


def test_devices_lists_every_accelerator_and_why_not(capsys):
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RegisteringPlugin(UnavailableAccelerator()))
    assert main(["devices"], plugin_manager) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("npu") and "unavailable: NPU runtime not installed" in lines[0]
    [cpu_line] = [line for line in lines if line.startswith("cpu")]
    assert "available, 1 device(s), --quantize int8" in cpu_line and "accelgen_cpu" in cpu_line


def test_devices_as_json_holds_the_same_facts(capsys):
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RegisteringPlugin(UnavailableAccelerator()))
    assert main(["devices", "--json"], plugin_manager) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)["accelerators"]}
    assert listed["npu"] == {"name": "npu", "available": False, "plugin": listed["npu"]["plugin"],
                             "unavailable": "NPU runtime not installed (pip install npu-runtime)"}
    assert listed["cpu"]["available"] and listed["cpu"]["devices"] == 1 and listed["cpu"]["quantize"] == ["int8"]


def test_auto_device_skips_unavailable_accelerators():
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RegisteringPlugin(UnavailableAccelerator()))
    assert select_accelerator(plugin_manager, "auto").name == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_later_plugin_replaces_a_built_in_accelerator_of_the_same_name(tiny_model_folder):
    replays_per_capture = []  # one entry per capture: how often its step was replayed since

    class RecordingCpu(CapturingCpu):
        def capture(self, step, example_inputs, run):
            if len(example_inputs) != len(DecodeState._fields):
                return step  # a prefill shape: this test follows the decode step's graphs
            assert example_inputs and all(isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
                                          for tensor in example_inputs)
            captured_addresses = [tensor.data_ptr() for tensor in example_inputs]
            replays_per_capture.append(0)
            capture_number = len(replays_per_capture) - 1

            def replay(*inputs):
                assert [tensor.data_ptr() for tensor in inputs] == captured_addresses  # the buffers captured on
                replays_per_capture[capture_number] += 1
                return step(*inputs)

            return replay

    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RegisteringPlugin(RecordingCpu()))
    settings = dict(device="cpu", batch_size=2, max_new_tokens=4, buckets=(8, 128), batching="static")
    generator = accelgen.load(tiny_model_folder("llama"), plugin_manager=plugin_manager, **settings)
    plain = accelgen.load(tiny_model_folder("llama"), graphs=False, **settings)  # the built-in cpu: no capture
    long_prompt = "a prompt longer than eight tokens needs the next bucket"

    def same_as_plain(prompts):
        completions = generator.generate(prompts)
        expected = plain.generate(prompts)
        return [c.completion_token_ids for c in completions] == [c.completion_token_ids for c in expected]

    assert same_as_plain(["one", "two", "three"])  # two batches of bucket 8: captured once, then replayed
    assert len(replays_per_capture) == 1 and replays_per_capture[0] > 0
    replays_of_the_first_batches = replays_per_capture[0]
    assert same_as_plain(["four", "five"])  # a later batch of the same bucket replays that capture
    assert len(replays_per_capture) == 1 and replays_per_capture[0] > replays_of_the_first_batches
    assert same_as_plain([long_prompt])  # the next bucket: its own capture
    assert len(replays_per_capture) == 2 and replays_per_capture[1] > 0
    assert generator.stats.graph_captures == 2 and plain.stats.graph_captures == 0


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
         "--output", str(output), "--details"],
        env=environment, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "fake-device: setup rank 0 of 1" in result.stderr
    assert "fake-device: prepare_model GPT2LMHeadModel as float32" in result.stderr
    # the slot step once, and the one prefill shape met (two prompts into two slots) once
    assert result.stderr.count("fake-device: capture decode step") == 2
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


class UnknownScheme(UnavailableAccelerator):
    name = "ipu"
    quantization_schemes = ("int8", "int3")


class KnobsOnItself(UnavailableAccelerator):
    """Written before the tuning knobs moved into ``accelgen.Tuning`` (read as its tuning for a stated time,
    tests/test_hostile_plugin_contract.py), with a value the knob cannot take."""

    name = "vpu"
    packs_prompts = "yes"


class TuningOfAnotherKind(UnavailableAccelerator):
    name = "dpu"
    tuning = {"captures_by_default": True}


@pytest.mark.parametrize("accelerator, device, problem", [
    (OldStyleAccelerator(), "tpu", "registers OldStyleAccelerator, which lacks dist_backend, supported_dtypes, "),
    (WrongDtypes(), "xpu", "registers 'xpu' with supported_dtypes ('bfloat16', 'float8') and default_dtype 'float16'"),
    (UnknownScheme(), "ipu", "registers 'ipu' with quantization_schemes ('int8', 'int3'): each must be one of int8, fp8"),
    (KnobsOnItself(), "vpu", "registers KnobsOnItself setting packs_prompts='yes': it must be True or False"),
    (TuningOfAnotherKind(), "dpu", "registers TuningOfAnotherKind with tuning {'captures_by_default': True}: it must "
                                   "be an accelgen.Tuning"),
])
def test_a_broken_accelerator_is_refused_at_registration_with_one_line(accelerator, device, problem, capsys):
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RegisteringPlugin(accelerator), name="my_plugin")

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
