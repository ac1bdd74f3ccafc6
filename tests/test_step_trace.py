"""Decode steps traced instead of captured (``Accelerator.trace_step``): the CPU traces a step that it does not compile
into TorchScript, whose replays must write every token the step as it is writes; a step the tracer cannot follow (the
host reads a value from its tensors) runs as it is, saying why in the run record only; turning graphs off, or
offloading weights, traces nothing."""

import json
import warnings

import pytest
import torch
from accelerators import plugin_manager_with
from conftest import PROMPTS

import accelgen
from accelgen.cli import main
from accelgen.common.static_sizes import static_shape
from accelgen_cpu import CpuAccelerator
from accelgen_cpu.step_trace import StepNotTraceable, traced

pytestmark = pytest.mark.transformers_release  # the traced code is transformers' modeling code: CI runs it with each

NEW_TOKENS = 20
FAMILIES = ("llama", "bloom", "gpt2", "opt", "falcon")


def token_ids(completions):
    return [completion.completion_token_ids for completion in completions]


@pytest.mark.parametrize("architecture, quantize, dtype", [(family, None, "float32") for family in FAMILIES]
                         + [(family, "int8", "float32") for family in ("llama", "bloom", "opt")]  # int8's families
                         + [(family, None, "bfloat16") for family in FAMILIES])  # oneDNN's packed products
def test_a_traced_decode_step_writes_every_token_the_step_as_it_is_writes(tiny_model_folder, architecture, quantize,
                                                                           dtype):
    folder = str(tiny_model_folder(architecture))
    settings = dict(device="cpu", max_new_tokens=NEW_TOKENS, batch_size=2, quantize=quantize, do_sample=True, seed=3,
                    top_k=20, logprobs=True, dtype=dtype)
    prompts = PROMPTS + ["a longer prompt " * 6]  # two prompt buckets: two cache lengths, a trace each

    traced_run = accelgen.load(folder, **settings)  # graphs left to the device: a call of the API never compiles
    written = traced_run.generate(prompts)
    as_it_is = accelgen.load(folder, graphs=False, **settings).generate(prompts)

    assert traced_run.stats.trace_failure is None
    assert traced_run.stats.step_traces == 2 and traced_run.stats.graph_captures == 0
    assert token_ids(written) == token_ids(as_it_is)
    assert [completion.logprobs for completion in written] == [completion.logprobs for completion in as_it_is]


SCHEMA = {"type": "object", "properties": {"label": {"enum": ["good", "bad"]}, "score": {"type": "integer"}},
          "required": ["label", "score"]}


@pytest.mark.parametrize("settings", [
    pytest.param(dict(json_schema=SCHEMA, do_sample=True, seed=5, num_samples=2), id="structured-samples"),
    pytest.param(dict(stop=["e"], batching="static"), id="stop-static"),
    pytest.param(dict(lora=True), id="lora"),
])
def test_a_traced_step_holds_rows_to_their_structures_stops_and_adapters_as_the_step_as_it_is(
        tiny_model_folder, tmp_path_factory, settings):
    from lora_adapters import build_adapters  # needs peft, as adapters do

    folder = tiny_model_folder("llama")
    adapters = {}
    if settings.pop("lora", False):
        adapters = build_adapters(folder, tmp_path_factory.mktemp("lora"), "llama")
        settings["lora"] = [f"{name}={path}" for name, path in adapters.items()]
    if "json_schema" in settings:
        pytest.importorskip("llguidance", reason="structured output needs the [structured] extra")
    # the third row's adapter is loaded into its buffers while the others run, after the step was traced
    names = ["a1", None, "a0"] if adapters else None
    runs = [accelgen.load(str(folder), device="cpu", max_new_tokens=NEW_TOKENS, batch_size=2, graphs=graphs, **settings)
            for graphs in (None, False)]
    written = [run.generate(PROMPTS, **({"adapters": names} if names else {})) for run in runs]

    assert runs[0].stats.trace_failure is None and runs[0].stats.step_traces >= 1
    def texts(completions):  # each sample's tokens (a row's own, with one sample)
        return [[sample["completion_token_ids"] for sample in completion.completions or [vars(completion)]]
                for completion in completions]

    assert texts(written[0]) == texts(written[1])
    if names:
        assert texts(written[0]) != texts(runs[1].generate(PROMPTS))  # the adapters changed what rows wrote


class DataReadingCpu(CpuAccelerator):
    """The CPU, its decode step branching on a value the host reads from a buffer (as a model's code might)."""

    def trace_step(self, step, example_inputs, run):
        def reading(*buffers):
            if buffers[0].sum() >= 0:  # always true here; a trace would keep whichever way it went
                return step(*buffers)
            return step(*buffers)

        return super().trace_step(reading, example_inputs, run)


def test_a_step_that_reads_a_value_on_the_host_is_not_traced_and_runs_as_it_is(tiny_model_folder, tmp_path, capsys):
    folder = tiny_model_folder("llama")
    output = tmp_path / "out.jsonl"
    prompts = tmp_path / "rows.jsonl"
    prompts.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in PROMPTS))
    main(["run", "--device", "cpu", "--model", str(folder), "--dataset", str(prompts), "--output", str(output),
          "--max-new-tokens", str(NEW_TOKENS), "--quiet"], plugin_manager=plugin_manager_with(DataReadingCpu()))

    errors = capsys.readouterr().err
    assert "warning" not in errors  # it costs nothing but speed, which the user cannot change: the record says why
    record = json.loads((tmp_path / "out.jsonl.run.json").read_text())["last_run"]
    assert record["step_traces"] == 0
    assert record["trace_failure"].startswith("Converting a tensor to a Python boolean might cause the trace to be "
                                              "incorrect at ")
    written = [json.loads(line)["completion_token_ids"] for line in output.read_text().splitlines()]
    eager = accelgen.load(str(folder), device="cpu", graphs=False, max_new_tokens=NEW_TOKENS).generate(PROMPTS)
    assert written == token_ids(eager)


@pytest.mark.parametrize("flag, traces", [(None, 1), ("--no-graphs", 0)])
def test_a_job_traces_its_decode_step_unless_graphs_are_turned_off(tiny_model_folder, tmp_path, capsys, flag, traces):
    folder = tiny_model_folder("opt")
    output = tmp_path / "out.jsonl"
    main(["run", "--device", "cpu", "--model", str(folder), "--prompt", PROMPTS[0], "--output", str(output),
          "--max-new-tokens", str(NEW_TOKENS), "--details", *([flag] if flag else [])])

    errors = capsys.readouterr().err
    assert ("decode steps traced: 1" in errors) == bool(traces)
    assert json.loads((tmp_path / "out.jsonl.run.json").read_text())["last_run"]["step_traces"] == traces


def test_an_offloaded_model_is_not_traced(tiny_model_folder, tmp_path):
    """Offloaded weights arrive at each pass as the offload hooks bring them: a trace would keep this pass's."""
    folder = str(tiny_model_folder("llama"))
    generator = accelgen.load(folder, device="cpu", max_new_tokens=NEW_TOKENS, offload="disk",
                               max_device_memory=400 * 1024, offload_folder=str(tmp_path / "offload"))
    written = generator.generate(PROMPTS)
    assert generator.stats.step_traces == 0
    eager = accelgen.load(folder, device="cpu", graphs=False, max_new_tokens=NEW_TOKENS).generate(PROMPTS)
    assert token_ids(written) == token_ids(eager)


# -- the CPU's trace --------------------------------------------------------------------------------------------


def test_a_trace_replays_the_step_on_its_buffers_and_on_the_tensors_it_holds():
    """A step updates its buffers and tensors of its own (a cache) in place; its trace, run on the same buffers, does
    the same at every call, and reads sizes as numbers without refusing."""
    cache = torch.zeros(4)
    counter = torch.zeros(1)

    def step(counter):
        width = static_shape(cache)[0]  # a branch on a size: a number
        if width == 4:
            cache.add_(counter)
        counter.add_(1)
        return cache * 2

    replay = traced(step, (counter,))  # the trace runs the step once
    assert counter.item() == 1 and cache.tolist() == [0, 0, 0, 0]
    for _ in range(3):
        replay(counter)
    assert counter.item() == 4 and cache.tolist() == [6, 6, 6, 6]


def test_a_step_that_branches_on_data_is_refused_with_where_it_reads():
    def step(buffer):
        if buffer.sum() > 0:
            buffer.add_(1)
        return buffer

    with pytest.raises(StepNotTraceable, match=r"^Converting a tensor to a Python boolean .* at .*test_step_trace\.py:"):
        traced(step, (torch.ones(2),))


def test_a_trace_leaves_the_callers_warning_filters_as_they_were():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before = list(warnings.filters)
        traced(lambda buffer: buffer.add_(1), (torch.ones(2),))
        assert warnings.filters == before
