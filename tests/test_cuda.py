"""The CUDA plugin: what every machine can check, then what only an NVIDIA GPU can (marked ``cuda``).

Without a GPU the ``cuda`` tests skip with their reason; on a GPU machine run them with
``python -m pytest tests/test_cuda.py``.
"""

import json
import subprocess
import sys

import pytest
import torch
from accelerators import CapturingCpu, plugin_manager_with
from conftest import PROMPTS
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

import accelgen
from accelgen.cli import main
from accelgen.common.errors import UsageError
from accelgen.common.settings import RunSettings, World
from accelgen.model.transformers_adapter import DTYPE_KEYWORD
from accelgen.parallel.launcher import free_port
from accelgen.parallel.process_groups import leave_process_group
from accelgen.parallel.worker_processes import end_worker_process
from accelgen.plugin.manager import get_plugin_manager
from accelgen.plugin.registry import registered_accelerators, select_accelerator
from accelgen.session.request import build_request
from accelgen_cuda import CudaAccelerator
from accelgen_cuda.gpus import known_gpu_peaks

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

MAX_NEW_TOKENS = 24
#: Architectures whose decode step can be captured: it never waits for the host (checked below on any machine).
CAPTURABLE_ARCHITECTURES = ("bloom", "gpt2", "llama", "opt", "falcon")

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and a CUDA build of torch")
requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on CUDA needs 2 GPUs")


# -- any machine -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device_name, variant",
    [  # names as torch.cuda.get_device_name() gives them
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA A100-SXM4-40GB", "A100 SXM 40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("Tesla V100S-PCIE-32GB", "V100S"),
    ],
)
def test_a_gpu_is_recognised_as_its_own_variant_from_the_name_torch_reports(device_name, variant):
    """The variant's own peaks, not those of a more general name that also matches (an H100 PCIe is no H100 SXM)."""
    peaks = known_gpu_peaks(device_name)
    assert peaks is not None and peaks.model == variant
    assert peaks.memory_bandwidth_gbps > 0 and (peaks.bf16_tflops is None or peaks.bf16_tflops > 0)


@pytest.mark.parametrize("device_name", ["NVIDIA GH200 480GB", "NVIDIA H800", "NVIDIA GeForce RTX 4090", "NVIDIA A100"])
def test_unknown_gpus_have_no_peaks(device_name):
    assert known_gpu_peaks(device_name) is None


def test_describe_reports_the_gpu_by_name_with_its_peaks(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H200")
    description = CudaAccelerator().describe()
    assert description["device_name"] == "NVIDIA H200"
    assert description["device_count"] == 1
    assert description["compute_capability"] == "9.0"
    assert description["peak_memory_bandwidth_gbps"] == 4800 and description["peak_bf16_tflops"] == 989
    assert {"driver", "cuda_runtime"} <= description.keys()


def test_describe_gives_an_unknown_gpu_as_named_without_peaks(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA Future Accelerator X")
    description = CudaAccelerator().describe()
    assert description["device_name"] == "NVIDIA Future Accelerator X"
    assert description["peak_memory_bandwidth_gbps"] is None and description["peak_bf16_tflops"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes the machine without a GPU")
def test_describe_without_a_gpu_has_every_key_and_no_device():
    description = CudaAccelerator().describe()
    assert {"device_name", "device_count", "driver", "peak_memory_bandwidth_gbps", "peak_bf16_tflops"} <= description.keys()
    assert description["device_name"] is None and description["device_count"] == 0


def test_unavailable_reasons_say_what_to_install_or_check(monkeypatch):
    accelerator = CudaAccelerator()
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "install a CUDA build of torch" in accelerator.unavailable_reason()
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "finds no usable GPU: check that nvidia-smi lists one and that its driver supports CUDA 12.4" in (
        accelerator.unavailable_reason()
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert accelerator.unavailable_reason().startswith("CUDA_VISIBLE_DEVICES hides every GPU")


def test_the_plugin_registers_as_a_built_in():
    cuda = registered_accelerators(get_plugin_manager())["cuda"]
    assert type(cuda).__module__ == "accelgen_cuda"


def test_a_run_with_no_device_or_options_takes_the_gpu_in_bfloat16_with_graphs(monkeypatch):
    """What a user gets on a GPU machine from the defaults: --device auto picks the GPU over the CPU, the
    model runs in bfloat16 and the decode step is captured."""
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    request = build_request(world=World())
    assert request.accelerator.name == "cuda"
    assert (request.run.dtype, request.run.use_graphs) == ("bfloat16", True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the listing on a machine without a GPU")
def test_devices_lists_cuda_as_unavailable_with_its_reason(capsys):
    assert main(["devices"]) == 0
    [cuda_line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cuda")]
    assert f"unavailable: {CudaAccelerator().unavailable_reason()}" in cuda_line
    assert "accelgen_cuda" in cuda_line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_run_on_cuda_without_a_gpu_is_one_line_and_exit_status_2(capsys):
    assert main(["run", "--device", "cuda", "--prompt", "Hello"]) == 2
    error = capsys.readouterr().err
    assert error == f"accelgen: error: --device cuda is not available here: {CudaAccelerator().unavailable_reason()}\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the automatic choice on a machine without a GPU")
def test_auto_device_falls_back_to_the_cpu_without_a_gpu():
    assert select_accelerator(get_plugin_manager(), "auto").name == "cpu"


def test_a_local_rank_without_a_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UsageError, match=r"^Local rank 2 has no GPU: this machine shows 2 .*start at most 2 ranks per node\.$"):
        CudaAccelerator().setup(World(rank=2, size=4, local_rank=2))


def test_out_of_memory_errors_are_recognised():
    accelerator = CudaAccelerator()
    assert accelerator.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    assert accelerator.is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    assert not accelerator.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not accelerator.is_out_of_memory(ValueError("out of memory"))


#: Operations that show the captured step is the whole decode step, not only the forward pass: the end-of-sequence
#: check, recording the token, the advance; a fixed batch records tokens at one step (index_copy_), slots each at
#: its own (scatter_). The token choice besides: :data:`TOKEN_CHOICE`.
WHOLE_STEP_OPERATIONS = {
    "static": {"aten.index_select.default", "aten.index_copy_.default", "aten.add_.Tensor"},
    "continuous": {"aten.index_select.default", "aten.scatter_.src", "aten.add_.Tensor", "aten.clamp_.default"},
}
#: The token choice: argmax when greedy; a draw's cumulative sum when sampling.
TOKEN_CHOICE = {"greedy": "aten.argmax.default", "sampling": "aten.cumsum.default"}


@pytest.mark.parametrize("architecture", CAPTURABLE_ARCHITECTURES)
@pytest.mark.parametrize("sampling", [{}, dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8)],
                         ids=["greedy", "sampling"])
@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_decode_step_never_waits_for_the_host_while_captured(tiny_model_folder, architecture, sampling, batching):
    """A CUDA graph cannot hold an operation that reads a device value on the host (``.item()``, ``if tensor``,
    ``nonzero``) or copies host data in. Transformers avoids them while a CUDA stream is capturing; here the
    decode step runs on the CPU with transformers told a capture is under way, and every operation is recorded.
    The step handed to capture is the whole one: forward pass, token choice and bookkeeping."""
    recorder = HostSyncRecorder()
    generator = accelgen.load(
        tiny_model_folder(architecture), device="cpu", batch_size=2, max_new_tokens=4, batching=batching,
        plugin_manager=plugin_manager_with(CaptureEmulatingCpu(recorder)), **sampling,
    )
    generator.generate(PROMPTS[:2])
    assert generator.stats.graph_captures == 1
    choice = TOKEN_CHOICE["sampling" if sampling else "greedy"]
    assert WHOLE_STEP_OPERATIONS[batching] | {choice} <= set(recorder.operations)
    assert recorder.host_syncs == []


@pytest.mark.slow
@pytest.mark.parametrize("architecture", [CAPTURABLE_ARCHITECTURES[0], "llama"])  # bloom, llama
def test_sharded_decode_step_never_waits_for_the_host_while_captured(tiny_model_folder, cli_environment, architecture):
    """The same check on two CPU ranks (gloo): AutoTP's all-reduce and the vocabulary-parallel embedding and
    head add collectives, and nothing that reads a device value on the host."""
    pytest.importorskip("deepspeed")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         __file__, str(tiny_model_folder(architecture))],
        env=cli_environment, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    reports = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert reports == ["rank 0: host syncs [], collectives yes", "rank 1: host syncs [], collectives yes"]


# -- on an NVIDIA GPU ------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", CAPTURABLE_ARCHITECTURES)
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "no-graphs"])
@pytest.mark.usefixtures("clean_gpu")
@pytest.mark.cuda
@requires_gpu
def test_float32_greedy_matches_hugging_face_on_the_gpu(tiny_model_folder, architecture, graphs):
    folder = tiny_model_folder(architecture)
    expected = hugging_face_on_gpu(folder, PROMPTS, torch.float32)
    generator = accelgen.load(folder, device="cuda", dtype="float32", batch_size=len(PROMPTS),
                              max_new_tokens=MAX_NEW_TOKENS, graphs=graphs)
    assert token_ids(generator.generate(PROMPTS)) == expected
    assert generator.stats.graph_captures == (1 if graphs else 0)


@pytest.mark.parametrize("architecture", ["llama", "bloom"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "no-graphs"])
@pytest.mark.usefixtures("clean_gpu")
@pytest.mark.cuda
@requires_gpu
def test_bfloat16_greedy_matches_hugging_face_static_cache_on_the_gpu(tiny_model_folder, architecture, graphs):
    # As in test_parity: in bfloat16, attention over a different number of (masked) keys rounds differently,
    # so the reference is Hugging Face's static cache with our 32-token bucket padding (not auto-compiled).
    folder = tiny_model_folder(architecture)
    expected = hugging_face_on_gpu(folder, PROMPTS, torch.bfloat16, pad_to=32, cache_implementation="static")
    generator = accelgen.load(folder, device="cuda", batch_size=len(PROMPTS), max_new_tokens=MAX_NEW_TOKENS,
                              graphs=graphs)
    assert generator.run.dtype == "bfloat16"  # the device default
    assert token_ids(generator.generate(PROMPTS)) == expected


@pytest.mark.usefixtures("clean_gpu")
@pytest.mark.cuda
@requires_gpu
def test_one_graph_per_bucket_is_replayed_by_later_batches(tiny_model_folder):
    folder = tiny_model_folder("llama")
    settings = dict(device="cuda", dtype="float32", batch_size=2, max_new_tokens=8, buckets=(8, 128))
    captured = accelgen.load(folder, graphs=True, **settings)
    plain = accelgen.load(folder, graphs=False, **settings)
    long_prompt = "a prompt longer than eight tokens needs the next bucket"
    for prompts in (PROMPTS, ["Hello", "DeepSpeed is"], [long_prompt], PROMPTS[:1]):
        assert token_ids(captured.generate(prompts)) == token_ids(plain.generate(prompts))
    assert captured.stats.batches == 5
    assert captured.stats.graph_captures == 2  # bucket 8, then bucket 128; every later batch replays


@pytest.mark.usefixtures("clean_gpu")
@pytest.mark.cuda
@requires_gpu
def test_a_replay_reads_the_buffers_as_they_are_now_and_refuses_others(gpu_accelerator):
    buffer = torch.arange(4.0, device="cuda")
    doubled = gpu_accelerator.capture(lambda tensor: tensor * 2, (buffer,), RunSettings(dtype="float32"))
    buffer.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert doubled(buffer).tolist() == [2.0, 4.0, 6.0, 8.0]
    with pytest.raises(ValueError, match="replayed on the buffers it was captured with"):
        doubled(buffer.clone())


@pytest.mark.usefixtures("clean_gpu")
@pytest.mark.cuda
@requires_gpu
def test_memory_stats_and_description_on_the_gpu(tiny_model_folder):
    generator = accelgen.load(tiny_model_folder("gpt2"), device="cuda", max_new_tokens=4)
    generator.generate(["Hello"])
    stats = generator.accelerator.memory_stats()
    assert stats["peak_allocated_bytes"] > 0
    assert 0 < stats["free_bytes"] <= stats["total_bytes"]
    description = generator.accelerator.describe()
    assert description["device_name"] == torch.cuda.get_device_name()
    assert description["device_count"] == torch.cuda.device_count() >= 1


@pytest.mark.usefixtures("clean_gpu")
@pytest.mark.cuda
@requires_gpu
def test_a_sweep_of_batch_sizes_and_a_second_load_capture_in_one_process(tiny_model_folder, tmp_path, capsys):
    """Every batch size of a sweep, and a model loaded after another, gets its own graph (torch's allocator
    refuses a capture into a pool whose graphs are all gone: the sweep crash of the first H100 run)."""
    folder = str(tiny_model_folder("bloom"))
    output = tmp_path / "sweep.json"
    assert main(["bench", "--device", "cuda", "--model", folder, "--batch-sizes", "1,2,4", "--max-new-tokens", "8",
                 "--runs", "1", "--output", str(output)]) == 0
    rows = json.loads(output.read_text())["measurements"][0]["results"]
    assert [(row["batch_size"], row["status"], row["graph_captures"]) for row in rows] == [(1, "ok", 1), (2, "ok", 1), (4, "ok", 1)]
    assert "warning" not in capsys.readouterr().err
    settings = dict(device="cuda", dtype="float32", batch_size=2, max_new_tokens=MAX_NEW_TOKENS)
    for _ in range(2):  # load, drop, load again
        generator = accelgen.load(folder, **settings)
        assert token_ids(generator.generate(PROMPTS)) == hugging_face_on_gpu(folder, PROMPTS, torch.float32)
        assert generator.stats.graph_captures == 1 and generator.capture_failure is None
        del generator


@pytest.mark.usefixtures("clean_gpu")
@pytest.mark.cuda
@requires_gpu
def test_a_step_that_cannot_be_captured_raises_its_own_error_and_leaves_the_gpu_usable(gpu_accelerator):
    buffer = torch.arange(4.0, device="cuda")
    stream = torch.cuda.current_stream()
    with pytest.raises(RuntimeError) as raised:
        gpu_accelerator.capture(lambda tensor: tensor * tensor.sum().item(), (buffer,), RunSettings(dtype="float32"))
    assert "capturing" in str(raised.value)
    assert torch.cuda.current_stream() == stream
    assert (buffer * 2).sum().item() == 12.0  # eager work goes on
    doubled = gpu_accelerator.capture(lambda tensor: tensor * 2, (buffer,), RunSettings(dtype="float32"))
    assert doubled(buffer).tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.usefixtures("clean_gpu")
@pytest.mark.cuda
@requires_gpu
def test_a_compiled_decode_step_is_captured_and_matches_hugging_face(tiny_model_folder, monkeypatch):
    monkeypatch.setenv("ACCELGEN_CUDA_COMPILE", "1")
    folder = tiny_model_folder("llama")
    generator = accelgen.load(folder, device="cuda", dtype="float32", batch_size=len(PROMPTS), max_new_tokens=MAX_NEW_TOKENS)
    assert token_ids(generator.generate(PROMPTS)) == hugging_face_on_gpu(folder, PROMPTS, torch.float32)
    assert generator.stats.graph_captures == 1 and generator.capture_failure is None


@pytest.mark.usefixtures("clean_gpu")
@pytest.mark.cuda
@requires_gpu
def test_sampling_inside_the_graph_repeats_and_resumes_at_any_row(tiny_model_folder):
    """The draw of a row depends on the seed, its prompt number and the step: the same run twice, or the rows
    from the third on generated alone (a resumed run), give the same tokens."""
    folder = tiny_model_folder("llama")
    prompts = PROMPTS * 2
    settings = dict(device="cuda", dtype="float32", batch_size=2, max_new_tokens=MAX_NEW_TOKENS, do_sample=True,
                    top_p=0.9, temperature=1.2, seed=7)
    generator = accelgen.load(folder, **settings)
    first = token_ids(generator.generate(prompts))
    assert token_ids(generator.generate(prompts)) == first
    resumed = [completion for batch in generator.generate_batches(prompts[3:], first_index=3) for completion in batch]
    assert token_ids(resumed) == first[3:]
    assert generator.stats.graph_captures == 1


@pytest.mark.parametrize("architecture", [CAPTURABLE_ARCHITECTURES[0], "llama"])  # bloom, llama
@pytest.mark.cuda
@requires_two_gpus
def test_two_gpus_generate_what_one_generates(tiny_model_folder, tmp_path, cli_environment, architecture):
    # float32: in bfloat16 two half-sums added after an all-reduce round differently from one whole sum.
    pytest.importorskip("deepspeed")
    folder = str(tiny_model_folder(architecture))
    output = tmp_path / "out.jsonl"
    prompt_arguments = [argument for prompt in PROMPTS for argument in ("--prompt", prompt)]
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cuda", "--dtype", "float32", "--world-size", "2",
         "--model", folder, *prompt_arguments, "--batch-size", "2", "--max-new-tokens", str(MAX_NEW_TOKENS),
         "--output", str(output)],
        env=cli_environment, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    expected = accelgen.generate(PROMPTS, model=folder, device="cuda", dtype="float32", batch_size=2,
                                 max_new_tokens=MAX_NEW_TOKENS)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["completion_token_ids"] for row in rows] == token_ids(expected)
    assert "world size 2" in result.stderr and "graph captures: 1" in result.stderr


# -- helpers ---------------------------------------------------------------------------------------


def token_ids(completions):
    return [completion.completion_token_ids for completion in completions]


def hugging_face_on_gpu(folder, prompts, dtype, pad_to=None, **generate_options):
    """New token ids per prompt from Hugging Face ``generate`` on the GPU (left padding), cut after EOS.

    Auto-compilation (which transformers turns on for static caches on CUDA) is off: the reference runs eagerly."""
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, **{DTYPE_KEYWORD: dtype}).to("cuda").eval()
    padding = dict(padding="max_length", max_length=pad_to) if pad_to else dict(padding=True)
    inputs = tokenizer(prompts, return_tensors="pt", return_token_type_ids=False, **padding).to("cuda")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id, disable_compile=True, **generate_options)
    completions = []
    for row in output[:, inputs["input_ids"].shape[1] :].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        completions.append(row)
    return completions


@pytest.fixture
def gpu_accelerator():
    """The cuda accelerator, set up for one process."""
    accelerator = select_accelerator(get_plugin_manager(), "cuda")
    accelerator.setup(World())
    return accelerator


@pytest.fixture
def clean_gpu():
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def fake_gpu(monkeypatch, device_name):
    """Make torch report one GPU called ``device_name`` with compute capability 9.0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


#: Operations that wait for the device or copy host data to it; a CUDA graph cannot contain them.
HOST_SYNC_OPERATIONS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "lift_fresh", "item")


class HostSyncRecorder(TorchDispatchMode):
    """Records every aten operation run under it, and separately those in HOST_SYNC_OPERATIONS."""

    def __init__(self):
        super().__init__()
        self.operations, self.host_syncs = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.operations.append(name)
        if any(operation in name for operation in HOST_SYNC_OPERATIONS):
            self.host_syncs.append(name)
        return func(*args, **(kwargs or {}))


class CaptureEmulatingCpu(CapturingCpu):
    """A CPU accelerator whose capture runs the step once with transformers believing a CUDA capture is on."""

    def __init__(self, recorder):
        self.recorder = recorder

    def capture(self, step, example_inputs, run):
        capturing = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = lambda: True  # what transformers asks before a host sync
        try:
            with self.recorder:
                step(*example_inputs)
        finally:
            torch.cuda.is_current_stream_capturing = capturing
        return step


if __name__ == "__main__":
    # One rank of test_sharded_decode_step_never_waits_for_the_host_while_captured, started by torch's launcher.
    recorder = HostSyncRecorder()
    generator = accelgen.load(sys.argv[1], device="cpu", batch_size=2, max_new_tokens=4,
                              plugin_manager=plugin_manager_with(CaptureEmulatingCpu(recorder)))
    generator.generate(PROMPTS[:2])
    collectives = any("c10d" in operation or "deepspeed" in operation for operation in recorder.operations)
    # one write per line: the ranks share the pipe, and print() may write the text and its newline apart
    sys.stdout.write(f"rank {generator.world.rank}: host syncs {recorder.host_syncs}, "
                     f"collectives {'yes' if collectives else 'no'}\n")
    sys.stdout.flush()
    # ends as accelgen's own ranks do: every rank waits for the others, the process groups are torn down (no
    # collective, nor gloo thread behind one, still running), then the process ends without finalizing its
    # interpreter (see end_worker_process)
    leave_process_group()
    end_worker_process(0)
