"""The Gaudi plugin, run end to end against a test double of Habana's PyTorch bridge (tests/habana_double).

No Gaudi card is needed: the double keeps tensors on the CPU and counts what the plugin asks of the bridge
(mark_step, HPU graph captures and replays, hccl process groups). What these tests cannot show is how the
real bridge behaves (lazy-mode compilation, graph capture on the card, HCCL); see tests/habana_double/README.md.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, shared_memory_buffers_of, with_fault_drill
from test_parity import MAX_NEW_TOKENS, reference_completions

import accelgen
from accelgen.cli import main
from accelgen.common.errors import UsageError
from accelgen.common.settings import LaunchPlan
from accelgen.model.memory import parameter_bytes
from accelgen.parallel.launcher import free_port
from accelgen_hpu import HpuAccelerator, bridge

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

HABANA_DOUBLE = str(Path(__file__).parent / "habana_double")


@pytest.fixture
def habana_double(monkeypatch):
    """The double on sys.path (this process) and PYTHONPATH (processes it starts); returns its call counts.

    DeepSpeed picks its HPU accelerator whenever habana_frameworks imports, and that one puts the model on
    "hpu:0", which the double cannot hold: DS_ACCELERATOR=cpu keeps DeepSpeed's side on the CPU."""
    monkeypatch.syspath_prepend(HABANA_DOUBLE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HABANA_DOUBLE, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")  # what the plugin sets; restored (unset) afterwards
    monkeypatch.setattr(bridge, "torch_device", bridge.torch_device)  # the double replaces it: restored afterwards
    import habana_frameworks.torch

    habana_frameworks.torch.double_record.clear()
    yield habana_frameworks.torch.double_record
    for module_name in [name for name in sys.modules if name.split(".")[0] == "habana_frameworks"]:
        del sys.modules[module_name]


def hpu_completions(folder, prompts, **settings):
    generator = accelgen.load(folder, device="hpu", max_new_tokens=MAX_NEW_TOKENS, **settings)
    return [completion.completion_token_ids for completion in generator.generate(prompts)], generator


@pytest.mark.parametrize("architecture", ["llama", "bloom"])
def test_float32_matches_hugging_face_with_one_hpu_graph_per_bucket(tiny_model_folder, habana_double, architecture):
    folder = tiny_model_folder(architecture)
    generator = accelgen.load(folder, device="hpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=2, dtype="float32",
                              batching="static")
    marks_before_each_forward = []
    generator.model.register_forward_pre_hook(lambda *_: marks_before_each_forward.append(habana_double["mark_step"]))
    completions = [completion.completion_token_ids for completion in generator.generate(PROMPTS)]
    assert completions == reference_completions(folder, PROMPTS)

    stats = generator.stats
    decode_steps = sum(timing.decode_steps for timing in stats.timings)
    # two batches of the same bucket: one decode graph, captured once, replayed for every later decoded token;
    # and one graph per prefill shape (row count and bucket), replayed for each prefill
    assert stats.batches == 2 and stats.graph_captures == 1 and stats.prefill_captures == 2
    assert habana_double["graph_wrap"] == habana_double["graph_capture"] == 1 + stats.prefill_captures
    assert habana_double["graph_replay"] == decode_steps + stats.prefills
    # lazy mode: a mark_step hands each forward pass to the card before the next one is queued, and after the last
    assert all(later > earlier for earlier, later in zip(marks_before_each_forward, marks_before_each_forward[1:])), marks_before_each_forward
    assert habana_double["mark_step"] > marks_before_each_forward[-1]


@pytest.mark.parametrize("architecture", ["llama", "bloom"])
def test_bfloat16_is_the_default_and_matches_hugging_face_in_bfloat16(tiny_model_folder, habana_double, architecture):
    # the same reference as tests/test_parity.py: Hugging Face's static cache, padded like our 32-token bucket
    folder = tiny_model_folder(architecture)
    expected = reference_completions(folder, PROMPTS, dtype=torch.bfloat16, pad_to=32, cache_implementation="static")
    completions, generator = hpu_completions(folder, PROMPTS, batch_size=2)
    assert generator.run.dtype == "bfloat16" and generator.run.use_graphs
    assert completions == expected


def test_continuous_batching_replays_one_hpu_graph_whatever_rows_come_and_go(tiny_model_folder, habana_double):
    """Prompts of two buckets through two slots: every insertion prefills in a bucketed shape, and the slot step
    is wrapped in an HPU graph once (no new graph per insertion); each row is what it is alone."""
    folder = tiny_model_folder("llama")
    short, long = "Hello", "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun"
    prompts = [long, short, short, long, short, long, short]
    completions, generator = hpu_completions(folder, prompts, buckets=(4, 64), batch_size=2, batching="continuous",
                                             dtype="float32")
    assert generator.batching == "continuous"
    stats = generator.stats
    # one graph for the slot step, one per prefill shape met (rows 1 or 2, times the two buckets): no more
    assert stats.graph_captures == 1 and 1 <= stats.prefill_captures <= 2 * 2
    assert habana_double["graph_wrap"] == habana_double["graph_capture"] == 1 + stats.prefill_captures
    assert habana_double["graph_replay"] == stats.timings[-1].decode_steps + stats.prefills
    alone = {prompt: hpu_completions(folder, [prompt], dtype="float32")[0][0] for prompt in (short, long)}
    assert completions == [alone[prompt] for prompt in prompts]


def test_each_bucket_gets_its_own_graph(tiny_model_folder, habana_double):
    folder = tiny_model_folder("llama")
    short, long = "Hello", "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun"
    # the cache never grows; no prefix store (the second long prompt would find its first block stored and prefill a
    # window: a third prefill shape)
    _, generator = hpu_completions(folder, [long, short, long, short], buckets=(4, 64), batching="static", prefix_cache=0)
    assert generator.stats.graph_captures == 2 and generator.stats.prefill_captures == 2  # a decode and a prefill each
    assert habana_double["graph_wrap"] == habana_double["graph_capture"] == 4


def test_graphs_can_be_turned_off(tiny_model_folder, habana_double):
    folder = tiny_model_folder("llama")
    completions, generator = hpu_completions(folder, PROMPTS[:1], dtype="float32", graphs=False)
    assert completions == reference_completions(folder, PROMPTS[:1])
    assert generator.stats.graph_captures == 0 and habana_double["graph_wrap"] == 0


def test_devices_lists_hpu_with_its_cards(habana_double):
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", "devices"], env=dict(os.environ),
                            capture_output=True, text=True)
    assert result.returncode == 0
    assert "hpu      available, 8 device(s)" in result.stdout


@pytest.fixture
def without_habana(cli_environment):
    """An environment in which habana_frameworks cannot be imported (as on this machine)."""
    environment = dict(cli_environment)
    environment.pop("PYTHONPATH", None)
    return environment


def test_without_habanas_stack_run_on_hpu_is_one_line_naming_what_to_install(tiny_model_folder, without_habana):
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "hpu", "--model", str(tiny_model_folder("llama")),
         "--prompt", "Hello"],
        env=without_habana, capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("accelgen: error: --device hpu is not available here: ")
    for needed in ("habana_frameworks.torch", "Habana's installer", "keep its torch",
                   "git+https://github.com/HabanaAI/DeepSpeed.git"):
        assert needed in result.stderr


def test_without_habanas_stack_devices_says_why_hpu_is_unavailable(without_habana):
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", "devices"], env=without_habana,
                            capture_output=True, text=True)
    assert result.returncode == 0
    [hpu_line] = [line for line in result.stdout.splitlines() if line.startswith("hpu ")]
    assert "unavailable: Habana's software stack cannot be imported (ModuleNotFoundError" in hpu_line
    assert "cpu      available" in result.stdout


@pytest.mark.parametrize(
    "device_name, generation, bandwidth, tflops",
    [("GAUDI", "Gaudi", 900, 60), ("GAUDI2", "Gaudi2", 2460, 432), ("GAUDI3", "Gaudi3", 3670, 1835),
     ("NEWCHIP", None, None, None)],
)
def test_describe_names_the_generation_and_its_peaks(habana_double, monkeypatch, device_name, generation, bandwidth,
                                                      tflops):
    monkeypatch.setenv("HABANA_DOUBLE_DEVICE_NAME", device_name)
    facts = HpuAccelerator().describe()
    assert facts["device_name"] == device_name and facts["device_count"] == 8
    assert (facts["generation"], facts["peak_memory_bandwidth_gbps"], facts["peak_bf16_tflops"]) == (
        generation, bandwidth, tflops)
    assert facts["driver"] == "habana_frameworks.torch 0.0.0+test-double"


def test_memory_stats_come_from_the_bridges_counters(habana_double):
    stats = HpuAccelerator().memory_stats()
    assert stats["total_bytes"] == 96 * 10**9
    assert 0 < stats["peak_allocated_bytes"] and stats["free_bytes"] == stats["total_bytes"] - stats["peak_allocated_bytes"]


@pytest.mark.parametrize(
    "error, out_of_memory",
    [(RuntimeError("[Rank:0] FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::939524096 (896)MB"), True),
     (torch.OutOfMemoryError("out of memory"), True),
     (RuntimeError("synStatus=26 [Generic failure] Device acquire failed."), False),
     (ValueError("PT_DEVMEM Allocation failed"), False)],
)
def test_out_of_memory_is_recognised_from_the_bridges_error(error, out_of_memory):
    assert HpuAccelerator().is_out_of_memory(error) is out_of_memory


def test_launch_command_is_deepspeeds_launcher_with_one_rank_per_card():
    """What DeepSpeed's launcher makes of the command: one rank per card of this node on the plan's port, each
    running ``python -m accelgen.cli`` with the user's arguments and no ``--local_rank`` added to them."""
    runner = pytest.importorskip("deepspeed.launcher.runner")
    plan = LaunchPlan(world_size=8, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=29600)
    worker_argv = ["run", "--device", "hpu", "--world-size", "8", "--prompt", "Hello"]
    command = HpuAccelerator().launch_command(worker_argv, plan)
    assert command[:3] == [sys.executable, "-m", runner.__name__]  # the launcher, with this interpreter
    launch = runner.parse_args(command[3:])
    assert (launch.num_gpus, launch.master_port) == (8, 29600)
    assert (launch.module, launch.user_script, launch.user_args) == (True, "accelgen.cli", worker_argv)
    assert launch.no_local_rank  # accelgen reads LOCAL_RANK from the environment; its parser has no --local_rank


def test_several_nodes_are_one_line_pointing_to_deepspeeds_hostfile():
    plan = LaunchPlan(world_size=16, nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port=29500)
    with pytest.raises(UsageError, match=r"--nnodes > 1 on hpu: start accelgen on every node with DeepSpeed's launcher"):
        HpuAccelerator().launch_command(["run"], plan)


@pytest.mark.slow
@pytest.mark.parametrize("pre_sharded", [False, True])
def test_two_ranks_started_by_deepspeeds_launcher_generate_what_one_rank_generates(
    tiny_model_folder, habana_double, tmp_path, pre_sharded
):
    """Each rank reads its slices of the checkpoint, or (pre_sharded) its own files of a folder that
    `accelgen shard` wrote on the CPU: the split does not depend on the device."""
    folder = str(tiny_model_folder("bloom"))
    output, records = tmp_path / "out.jsonl", tmp_path / "records"
    records.mkdir()
    environment = dict(os.environ, HABANA_DOUBLE_RECORD_DIR=str(records), HF_HUB_OFFLINE="1",
                       TRANSFORMERS_VERBOSITY="error")
    environment.pop("PT_HPU_LAZY_MODE")  # the plugin must set it in each rank
    model = folder
    if pre_sharded:
        model = str(tmp_path / "bloom-tp2")
        subprocess.run([sys.executable, "-m", "accelgen.cli", "shard", "--device", "cpu", "--model", folder, "--world-size",
                        "2", "--dtype", "float32", "--output", model], env=environment, check=True, capture_output=True)
    prompt_arguments = [argument for prompt in PROMPTS for argument in ("--prompt", prompt)]
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "hpu", "--world-size", "2", "--dtype", "float32",
         "--model", model, *prompt_arguments, "--batch-size", "2", "--max-new-tokens", "10", "--output", str(output),
         "--details", "--master-port", str(port)],
        env=environment, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "deepspeed.launcher.launch" in result.stdout + result.stderr  # DeepSpeed's launcher started the ranks
    # as on a Gaudi (HCCL), the ranks reduced without DeepSpeed's shared-memory buffers, so none is left behind
    assert not shared_memory_buffers_of(port)

    expected = accelgen.generate(PROMPTS, model=folder, device="hpu", dtype="float32", batch_size=2,
                                 max_new_tokens=10)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["completion_token_ids"] for row in rows] == [c.completion_token_ids for c in expected]
    assert "world size 2" in result.stderr and "(0.50x / 0.50x)" in result.stderr

    ranks = [json.loads(path.read_text()) for path in records.iterdir()]
    ranks = sorted((record for record in ranks if record.get("mark_step")), key=lambda record: record["rank"])
    assert [record["rank"] for record in ranks] == [0, 1]
    for record in ranks:
        assert record["lazy_mode"] == "1" and record["hccl_process_group"] >= 1
        assert record["lazy_collectives"] == "true"  # set by the launching side, which Habana requires for HPU graphs under TP
        assert record["graph_capture"] >= 1 and record["graph_replay"] > 0
    # every rank took the same slot decisions: the same graphs, replayed as often, the same flushes
    assert all(ranks[0][name] == ranks[1][name] for name in ("graph_capture", "graph_replay", "mark_step"))


@pytest.mark.slow
def test_two_replicas_started_by_deepspeeds_launcher_write_what_one_rank_writes(tiny_model_folder, habana_double, tmp_path):
    """--data-parallel 2 on hpu: DeepSpeed's launcher starts the ranks (rank 0 then hosts the store the replicas
    share), each replica one card with its own HPU graphs and no process group."""
    folder = str(tiny_model_folder("llama"))
    output, records = tmp_path / "out.jsonl", tmp_path / "records"
    records.mkdir()
    environment = dict(os.environ, HABANA_DOUBLE_RECORD_DIR=str(records), HF_HUB_OFFLINE="1",
                       TRANSFORMERS_VERBOSITY="error")
    prompts = [f"{prompt} {number}" for number in range(4) for prompt in PROMPTS]
    prompt_arguments = [argument for prompt in prompts for argument in ("--prompt", prompt)]
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "hpu", "--world-size", "2", "--data-parallel", "2",
         "--dtype", "float32", "--model", folder, *prompt_arguments, "--batch-size", "2", "--max-new-tokens", "10",
         "--output", str(output), "--details"],
        env=environment, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "deepspeed.launcher.launch" in result.stdout + result.stderr
    assert "world size 2 (2 replicas of 1)" in result.stderr

    expected = accelgen.generate(prompts, model=folder, device="hpu", dtype="float32", batch_size=2, max_new_tokens=10)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["completion_token_ids"] for row in rows] == [c.completion_token_ids for c in expected]
    records = [json.loads(path.read_text()) for path in records.iterdir()]
    assert all(record.get("hccl_process_group", 0) == 0 for record in records)  # one card per replica: no all-reduce
    # the replicas that got rows (which ones, and how many each, depends on who asked first) ran HPU graphs
    decoding = [record for record in records if record.get("graph_replay")]
    assert decoding and all(record["graph_capture"] >= 1 for record in decoding)


@pytest.mark.slow
def test_a_failing_rank_ends_the_deepspeed_job(tiny_model_folder, habana_double):
    environment = with_fault_drill(dict(os.environ, HF_HUB_OFFLINE="1"))
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "hpu", "--world-size", "2",
         "--model", str(tiny_model_folder("llama")), "--prompt", "Hello", "--max-new-tokens", "200"],
        env=environment, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 1, result.stderr
    assert "RuntimeError: injected fault on rank 1" in result.stderr, result.stderr  # whole: it failed once, unexplained
    assert "accelgen: error: the job's launcher" in result.stderr


# -- --quantize fp8: Intel Neural Compressor's FP8 route, against its test double (tests/inc_double) -------------

INC_DOUBLE = str(Path(__file__).parent / "inc_double")


@pytest.fixture
def inc_double(habana_double, monkeypatch):
    """Intel Neural Compressor's double beside Habana's (see tests/inc_double/README.md): its calls are counted
    in the Habana double's record."""
    monkeypatch.syspath_prepend(INC_DOUBLE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([INC_DOUBLE, os.environ["PYTHONPATH"]]))
    yield habana_double
    for module_name in [name for name in sys.modules if name.split(".")[0] == "neural_compressor"]:
        del sys.modules[module_name]


def linear_layers(model) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


@pytest.mark.parametrize("architecture", ["bloom", "llama"])
def test_fp8_measures_then_converts_every_linear_layer_but_the_head_before_the_graph_is_captured(
    tiny_model_folder, inc_double, architecture
):
    """INC's one-process flow: prepare (measure), the core's calibration passes, finalize_calibration, convert;
    then the decode step is captured with the fp8 layers in it."""
    folder = str(tiny_model_folder(architecture))
    plain_layers = linear_layers(accelgen.load(folder, device="hpu", dtype="bfloat16").model)
    inc_double.clear()
    tokens, generator = hpu_completions(folder, PROMPTS, dtype="bfloat16", quantize="fp8")
    assert inc_double["inc_prepare"] == inc_double["inc_finalize_calibration"] == inc_double["inc_convert"] == 1
    assert inc_double["inc_calibration_inputs"] > 0
    assert inc_double["inc_fp8_layers"] == len(plain_layers) - 1  # all but the head
    assert linear_layers(generator.model) == [name for name in plain_layers if "lm_head" in name]
    fp8_weights = [parameter for parameter in generator.model.parameters() if parameter.dtype == torch.float8_e4m3fn]
    assert len(fp8_weights) == len(plain_layers) - 1
    # captured after converting: one decode graph, and the prefill graphs
    assert generator.stats.graph_captures == 1
    assert inc_double["graph_capture"] == 1 + generator.stats.prefill_captures
    assert all(len(row) == MAX_NEW_TOKENS for row in tokens)


@pytest.mark.parametrize("architecture", ["bloom", "llama", "opt"])
def test_fp8_logits_stay_within_e4m3s_rounding_bound(tiny_model_folder, inc_double, architecture):
    """E4M3 keeps 3 mantissa bits: rounding moves a value by at most 1/16 of itself, and for values spread over
    a binade the error's spread is about 1/16 / sqrt(3), 3.6%; a product of fp8 inputs and fp8 weights adds two
    such errors per term (about 5%), which average over a row's terms only as far as they are independent.
    Through the tiny models' two decoder layers (residual additions keep the unquantized stream) the logits move
    by several percent: 15% of their norm bounds it, where a wrong scale (a factor of 2) or a layer left
    unmeasured gives tens of percent or more. Float32 activations, so that only fp8 rounding differs."""
    from test_quantization import quantized_logits_error

    error = quantized_logits_error(str(tiny_model_folder(architecture)), "hpu", "fp8")
    assert 0 < error < 0.15, error


def test_fp8_parameters_take_at_most_0_55_of_bfloat16s(inc_double, tmp_path):
    """On a shape whose linear layers hold most of the weights (see test_quantization)."""
    from test_quantization import linear_heavy_llama

    folder = str(linear_heavy_llama(tmp_path))
    sizes = {quantize: parameter_bytes(accelgen.load(folder, device="hpu", dtype="bfloat16", quantize=quantize).model)
             for quantize in (None, "fp8")}
    assert sizes["fp8"] <= 0.55 * sizes[None]


def test_fp8_runs_through_the_command_line(tiny_model_folder, inc_double, tmp_path):
    output = tmp_path / "out.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "hpu", "--quantize", "fp8", "--model",
         str(tiny_model_folder("llama")), "--prompt", "Hello", "--prompt", "World", "--max-new-tokens", "4",
         "--output", str(output), "--details"],
        env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert len(output.read_text().splitlines()) == 2
    assert "dtype bfloat16 (fp8 weights)" in result.stderr


@pytest.mark.parametrize("device_name, with_inc, message", [
    ("GAUDI", True, "--quantize fp8 needs Gaudi2 or later; this card is GAUDI (first-generation Gaudi, no fp8)"),
    ("GAUDI2", False, "--quantize fp8 on hpu needs Intel Neural Compressor"),
])
def test_fp8_where_it_cannot_run_is_one_line(tiny_model_folder, habana_double, device_name, with_inc, message):
    environment = dict(os.environ, HABANA_DOUBLE_DEVICE_NAME=device_name, HF_HUB_OFFLINE="1")
    if with_inc:
        environment["PYTHONPATH"] = os.pathsep.join([INC_DOUBLE, environment["PYTHONPATH"]])
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "hpu", "--quantize", "fp8", "--model",
         str(tiny_model_folder("llama")), "--prompt", "Hello", "--max-new-tokens", "2"],
        env=environment, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("accelgen: error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_int8_on_hpu_is_one_line_naming_fp8(tiny_model_folder, habana_double, capsys):
    assert main(["run", "--device", "hpu", "--quantize", "int8", "--model", str(tiny_model_folder("llama")),
                 "--prompt", "Hello"]) == 2
    error = capsys.readouterr().err
    assert "--quantize int8 is not supported on hpu: it runs --quantize fp8" in error and error.count("\n") == 1


@pytest.mark.slow
def test_two_ranks_each_measure_and_convert_their_own_slices(tiny_model_folder, inc_double, tmp_path):
    """Under DeepSpeed's launcher each rank measures its slices (its own measurement file) and converts its
    column- and row-parallel layers; the job writes its completions. (fp8 scales are per rank, so the tokens
    need not equal one rank's: no parity is claimed.)"""
    output, records = tmp_path / "out.jsonl", tmp_path / "records"
    records.mkdir()
    environment = dict(os.environ, HABANA_DOUBLE_RECORD_DIR=str(records), HF_HUB_OFFLINE="1",
                       TRANSFORMERS_VERBOSITY="error")
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "hpu", "--world-size", "2", "--quantize", "fp8",
         "--model", str(tiny_model_folder("llama")), "--prompt", "Hello", "--prompt", "World", "--max-new-tokens", "4",
         "--output", str(output)],
        env=environment, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert len(output.read_text().splitlines()) == 2
    ranks = [json.loads(path.read_text()) for path in records.iterdir()]
    ranks = [record for record in ranks if record.get("inc_convert")]
    assert sorted(record["rank"] for record in ranks) == [0, 1]
    assert len({record["inc_fp8_layers"] for record in ranks}) == 1 and ranks[0]["inc_fp8_layers"] > 0
