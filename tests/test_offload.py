"""Models larger than the device: `--offload disk` on the cpu device with a memory cap below the model's size,
through Hugging Face Accelerate's big-model inference (the real engine, not a double). What is kept where is
read from the run itself; memory is measured in a subprocess."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple

import pytest
import torch
from safetensors import safe_open
from test_parity import MAX_NEW_TOKENS, reference_completions
from tiny_models import EOS_ID, PAD_ID, build_model
from transformers import AutoModelForCausalLM, BloomConfig, LlamaConfig

import accelgen
from accelgen.cli import main
from accelgen.quantization.int8_layer import Int8Linear

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

pytest.importorskip("accelerate")

PROMPTS = ["DeepSpeed is a machine learning framework", "Hello", "The quick brown fox jumps"]
NEW_TOKENS = MAX_NEW_TOKENS
KIB = 1024

#: Four-layer models (about 1 MB in float32): a cap of 640 KiB keeps a part of them on the device.
CONFIGS = {
    "bloom": BloomConfig(hidden_size=64, n_layer=4, n_head=4, vocab_size=384, bos_token_id=1, eos_token_id=EOS_ID,
                         pad_token_id=PAD_ID),
    "llama": LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, vocab_size=384, bos_token_id=1,
                         eos_token_id=EOS_ID, pad_token_id=PAD_ID),
}
CAP = 640 * KIB

Model = namedtuple("Model", "folder bytes")


@pytest.fixture(scope="module")
def four_layer_model(tiny_model_folder, tmp_path_factory):
    """``four_layer_model(architecture)``: the model saved with the test tokenizer, and its weight bytes."""
    root = tmp_path_factory.mktemp("offload-models")
    built = {}

    def folder_for(architecture):
        if architecture not in built:
            folder = build_model(root / architecture, CONFIGS[architecture])
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tiny_model_folder(architecture) / name, folder / name)
            model = AutoModelForCausalLM.from_pretrained(folder)
            built[architecture] = Model(folder, sum(p.numel() * p.element_size() for p in model.parameters()))
        return built[architecture]

    return folder_for


def offloaded(model, cap=CAP, **options):
    return accelgen.load(str(model.folder), device="cpu", max_new_tokens=NEW_TOKENS, offload="disk",
                         max_device_memory=cap, **options)


def token_ids(completions):
    return [completion.completion_token_ids for completion in completions]


@pytest.mark.parametrize("architecture", ["bloom", "llama"])
def test_an_offloaded_model_generates_what_hugging_face_generates(four_layer_model, architecture):
    model = four_layer_model(architecture)
    assert model.bytes > CAP
    generator = offloaded(model)
    placement = generator.loaded.placement
    # the cap holds the weights kept on the device, the room for the largest layer and one batch's cache
    assert 0 < placement.device_bytes < CAP and placement.disk_bytes > 0 and placement.host_bytes == 0
    assert placement.device_bytes + placement.disk_bytes == model.bytes
    assert token_ids(generator.generate(PROMPTS)) == reference_completions(str(model.folder), PROMPTS)
    # every forward pass brought every offloaded byte to the device once (a tied weight once per use)
    # (a pass per token at most; transformers 4.55 sizes its static cache with one more, a probe)
    assert len(PROMPTS) < placement.forward_passes <= len(PROMPTS) * NEW_TOKENS + 1
    assert placement.disk_bytes <= placement.moved_bytes_per_pass <= 2 * placement.disk_bytes
    assert generator.stats.graph_captures == 0


def test_seeded_sampling_with_offload_is_the_sampling_without(four_layer_model):
    model = four_layer_model("llama")
    sampling = dict(do_sample=True, seed=7, temperature=1.3, batch_size=2)
    generator = offloaded(model, cap=2**20, **sampling)  # room for the cache of two rows
    assert generator.loaded.placement.disk_bytes > 0
    with_offload = token_ids(generator.generate(PROMPTS))
    assert with_offload == token_ids(offloaded(model, cap=2**20, **sampling).generate(PROMPTS))
    assert with_offload == token_ids(accelgen.generate(PROMPTS, model=str(model.folder), device="cpu",
                                                       max_new_tokens=NEW_TOKENS, **sampling))


def test_offloaded_weights_written_to_a_folder_are_read_from_it_and_removed_after(four_layer_model, tmp_path):
    model = four_layer_model("bloom")
    folder = tmp_path / "offload"
    generator = offloaded(model, offload_folder=str(folder))
    [run_folder] = folder.iterdir()
    written = {}
    for path in run_folder.glob("offloaded-*.safetensors"):
        with safe_open(path, framework="pt") as file:
            written.update({name: file.get_tensor(name).numel() * 4 for name in file.keys()})
    assert sum(written.values()) == generator.loaded.placement.disk_bytes
    assert token_ids(generator.generate(PROMPTS)) == reference_completions(str(model.folder), PROMPTS)
    del generator
    import gc

    gc.collect()
    assert list(folder.iterdir()) == []


def test_a_pickle_checkpoint_offloads_through_a_folder(four_layer_model, tmp_path, capsys):
    model = four_layer_model("llama")
    pickled = tmp_path / "pickled"
    shutil.copytree(model.folder, pickled)
    torch.save(AutoModelForCausalLM.from_pretrained(pickled).state_dict(), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    capsys.readouterr()
    status = main(["run", "--device", "cpu", "--model", str(pickled), "--prompt", "Hello", "--offload", "disk",
                   "--max-device-memory", str(CAP), "--max-new-tokens", str(NEW_TOKENS)])
    assert status == 2
    assert capsys.readouterr().err.endswith("pass --offload-folder DIR to write them there once.\n")
    generator = accelgen.load(str(pickled), device="cpu", max_new_tokens=NEW_TOKENS, offload="disk",
                              max_device_memory=CAP, offload_folder=str(tmp_path / "offload"))
    assert token_ids(generator.generate(PROMPTS)) == reference_completions(str(model.folder), PROMPTS)


def test_the_summary_says_where_the_weights_are_and_what_moved(four_layer_model, cli_environment):
    model = four_layer_model("bloom")
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(model.folder),
                             "--prompt", "Hello", "--max-new-tokens", "4", "--offload", "disk", "--max-device-memory",
                             "640KiB", "--quiet", "--details"], env=cli_environment, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    line = re.search(r"accelgen: offload disk: ([\d.]+) GiB of weights on the device, ([\d.]+) GiB on disk, "
                     r"([\d.]+) GiB moved to the device per forward pass; decode steps not captured", result.stderr)
    assert line, result.stderr
    assert "graph captures: 0" in result.stderr


@pytest.mark.slow
def test_offloaded_dataset_completion_resumes_to_the_uninterrupted_output(four_layer_model, tmp_path, capsys):
    model = four_layer_model("llama")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"{prompt} {number}"}) + "\n" for number in range(3) for prompt in PROMPTS))
    arguments = ["run", "--device", "cpu", "--model", str(model.folder), "--dataset", str(rows), "--batch-size", "2",
                 "--max-new-tokens", "6", "--do-sample", "--seed", "3", "--quiet", "--offload", "disk",
                 "--max-device-memory", "1MiB"]
    whole = tmp_path / "whole.jsonl"
    assert main([*arguments, "--output", str(whole)]) == 0
    stopped = tmp_path / "stopped.jsonl"  # what a run stopped after 3 rows (mid-batch) left
    stopped.write_bytes(b"".join(whole.read_bytes().splitlines(keepends=True)[:3]))
    shutil.copy(f"{whole}.run.json", f"{stopped}.run.json")
    capsys.readouterr()
    assert main([*arguments, "--output", str(stopped)]) == 0
    assert "resuming: 3 rows already" in capsys.readouterr().err
    assert stopped.read_bytes() == whole.read_bytes()
    plain = tmp_path / "plain.jsonl"  # the same rows without offloading
    assert main([*arguments[:-4], "--output", str(plain)]) == 0
    assert [json.loads(line)["completion_token_ids"] for line in plain.read_text().splitlines()] == [
        json.loads(line)["completion_token_ids"] for line in whole.read_text().splitlines()]


def peak_and_placement(environment, folder, *options):
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(folder),
                             "--prompt", "DeepSpeed is", "--max-new-tokens", "3", "--quiet", "--details", *options],
                            env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return int(re.search(r"peak_rss_bytes per rank ([\d,]+)", result.stderr).group(1).replace(",", ""))


@pytest.mark.slow
def test_an_offloaded_run_holds_no_more_host_memory_than_its_cap_and_one_layer(tiny_model_folder, tmp_path, cli_environment):
    """A 300 MB model under a 100 MiB cap: the run's peak resident memory, less what a run of the tiny model
    holds (the interpreter and libraries), stays under the cap plus one layer brought in (Accelerate's
    working set), far below the model."""
    big = tmp_path / "bloom-300mb"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(BloomConfig(n_layer=6, hidden_size=1024, n_head=16, vocab_size=384))
    model.save_pretrained(big)
    model_bytes = sum(parameter.numel() * 4 for parameter in model.parameters())
    layer_bytes = sum(parameter.numel() * 4 for parameter in model.transformer.h[0].parameters())
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_folder("bloom") / name, big / name)
    cap = 100 * 2**20
    fixed_cost = peak_and_placement(cli_environment, tiny_model_folder("bloom"))
    peak = peak_and_placement(cli_environment, big, "--offload", "disk", "--max-device-memory", str(cap))
    assert model_bytes > 2.5 * cap
    assert peak - fixed_cost < cap + layer_bytes, f"{(peak - fixed_cost) / 2**20:.0f} MiB over the tiny model's run"


@pytest.mark.parametrize("arguments, message", [
    (["--max-device-memory", "lots"], "--max-device-memory 'lots' is not a memory size: write it like 8GiB, 1500MiB or 20GB."),
    (["--max-device-memory", "0"], "--max-device-memory must be more than 0 bytes"),
    (["--max-device-memory", "64KiB"], "is below the"),
    (["--offload", "cpu", "--max-device-memory", "1GiB"], "--offload cpu keeps offloaded weights in host memory, which is "
                                                          "this device's own memory: use --offload disk"),
    (["--offload", "cpu", "--offload-folder", "x"], "--offload-folder is where --offload disk writes weights"),
    (["--world-size", "2"], "--offload runs the model in one process"),
])
def test_bad_offload_requests_are_one_line(four_layer_model, capsys, arguments, message):
    model = four_layer_model("llama")
    offload = [] if "--offload" in arguments else ["--offload", "disk"]
    status = main(["run", "--device", "cpu", "--model", str(model.folder), "--prompt", "a", *offload, *arguments])
    error = capsys.readouterr().err
    assert status == 2 and message in error and error.count("\n") == 1, error


def test_a_cap_too_small_names_the_minimum(four_layer_model, capsys):
    model = four_layer_model("llama")
    status = main(["run", "--device", "cpu", "--model", str(model.folder), "--prompt", "a", "--offload", "disk",
                   "--max-device-memory", "64KiB"])
    error = capsys.readouterr().err
    minimum = re.search(r"pass --max-device-memory (\d+)KiB or more\.\n$", error)
    assert status == 2 and minimum, error
    assert main(["run", "--device", "cpu", "--model", str(model.folder), "--prompt", "a", "--offload", "disk",
                 "--max-device-memory", f"{minimum.group(1)}KiB", "--max-new-tokens", "2"]) == 0


def test_max_device_memory_without_offload_is_one_line(four_layer_model, capsys):
    status = main(["run", "--device", "cpu", "--model", str(four_layer_model("llama").folder), "--prompt", "a",
                   "--max-device-memory", "1GiB"])
    error = capsys.readouterr().err
    assert status == 2 and "--max-device-memory goes with --offload: add --offload disk" in error


def test_an_offload_folder_that_cannot_be_written_or_lacks_room_is_one_line(four_layer_model, tmp_path, capsys,
                                                                          monkeypatch):
    model = four_layer_model("llama")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    arguments = ["run", "--device", "cpu", "--model", str(model.folder), "--prompt", "a", "--offload", "disk",
                 "--max-device-memory", str(CAP), "--max-new-tokens", str(NEW_TOKENS)]
    capsys.readouterr()
    assert main([*arguments, "--offload-folder", str(blocked / "offload")]) == 2
    error = capsys.readouterr().err
    assert f"Cannot write --offload-folder {str(blocked / 'offload')!r}" in error and error.count("\n") == 1

    full = namedtuple("usage", "total used free")(10**9, 10**9 - 1000, 1000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)  # a nearly full disk
    assert main([*arguments, "--offload-folder", str(tmp_path / "offload")]) == 2
    error = capsys.readouterr().err
    assert "has 0.98 KiB free; the offloaded weights need" in error and error.count("\n") == 1


def test_bench_records_the_offload_and_what_it_moved(four_layer_model, tmp_path):
    model = four_layer_model("llama")
    output = tmp_path / "offload.json"
    assert main(["bench", "--device", "cpu", "--model", str(model.folder), "--batch-sizes", "1,2", "--max-new-tokens", "4",
                 "--runs", "1", "--offload", "disk", "--max-device-memory", "700KiB", "--output", str(output)]) == 0
    [measurement] = json.loads(output.read_text())["measurements"]
    offload = measurement["offload"]
    assert offload["engine"] == "accelerate" and offload["mode"] == "disk" and measurement["graphs"] is False
    assert offload["device_bytes"] + offload["disk_bytes"] == model.bytes and offload["disk_bytes"] > 0
    for row in measurement["results"]:
        assert offload["disk_bytes"] <= row["offload_moved_bytes_per_pass"] <= 2 * offload["disk_bytes"]


# -- with --quantize int8 -----------------------------------------------------------------------

#: A cap that keeps part of a four-layer model's int8 weights on the device (the float32 activations and cache of
#: one batch take about 340 KiB of it).
INT8_CAP = 520 * KIB


@pytest.mark.parametrize("architecture", ["bloom", "llama"])
def test_int8_layers_offloaded_through_a_folder_generate_what_int8_without_offload_generates(
    four_layer_model, tmp_path, architecture
):
    """The offloaded layers are written once in int8 (values and one scale per output channel): half of bfloat16's
    bytes kept off the device and brought in per step; the tokens are those of int8 held whole on the device."""
    model = four_layer_model(architecture)
    expected = token_ids(accelgen.generate(PROMPTS, model=str(model.folder), device="cpu", dtype="float32",
                                           quantize="int8", max_new_tokens=NEW_TOKENS))
    folder = tmp_path / "offload"
    generator = offloaded(model, cap=INT8_CAP, dtype="float32", quantize="int8", offload_folder=str(folder))
    placement = generator.loaded.placement
    assert placement.device_bytes > 0 and placement.disk_bytes > 0
    [run_folder] = folder.iterdir()
    written = {}
    for path in run_folder.glob("offloaded-*.safetensors"):
        with safe_open(path, framework="pt") as file:
            written.update({name: file.get_tensor(name) for name in file.keys()})
    int8_weights = [name for name, tensor in written.items() if tensor.dtype == torch.int8]
    assert int8_weights and all(f"{name}_scale" in written for name in int8_weights)
    assert sum(tensor.numel() * tensor.element_size() for tensor in written.values()) == placement.disk_bytes
    assert token_ids(generator.generate(PROMPTS)) == expected
    # every pass brought the offloaded int8 bytes in, not float32's
    assert placement.moved_bytes_per_pass <= placement.disk_bytes


def test_offloaded_int8_layers_keep_their_stored_layout_whichever_kernel_would_be_fastest(
        four_layer_model, tmp_path, monkeypatch):
    """The CPU gives each int8 layer the kernel its rule names for the run's rows, some over a copy of the weight in
    another layout; an offloaded layer's weight arrives at each pass as stored, so offloaded runs keep that layout
    (here the rule is made to name one over another layout: oneDNN's over a packed copy, or where this CPU refuses
    oneDNN's int8 product, the plugin's over panels, or ``_int_mm`` over an input-major copy)."""
    from accelgen_cpu import int8_kernels

    other_layout = next(kernel for kernel in ("packed", "fused", "columns") if kernel in int8_kernels.available_kernels())
    monkeypatch.setattr(int8_kernels, "int8_kernel_for", lambda rows, in_features, kernels, amx=False: other_layout)
    model = four_layer_model("llama")
    expected = token_ids(accelgen.generate(PROMPTS, model=str(model.folder), device="cpu", dtype="float32",
                                           quantize="int8", max_new_tokens=NEW_TOKENS, batch_size=2))
    generator = offloaded(model, cap=INT8_CAP + 200 * KIB, dtype="float32", quantize="int8",  # two rows of cache
                          offload_folder=str(tmp_path / "off"),
                          batch_size=2)
    assert generator.loaded.placement.disk_bytes > 0
    assert token_ids(generator.generate(PROMPTS)) == expected
    assert all(layer.weight.layout == torch.strided and layer.weight.stride()[-1] == 1
               for layer in generator.model.modules() if isinstance(layer, Int8Linear))


def test_a_pre_quantized_folder_is_offloaded_in_place(four_layer_model, tmp_path, cli_environment):
    model = four_layer_model("llama")
    sharded = tmp_path / "llama-int8"
    subprocess.run([sys.executable, "-m", "accelgen.cli", "shard", "--device", "cpu", "--model", str(model.folder),
                    "--world-size", "1", "--dtype", "float32", "--quantize", "int8", "--output", str(sharded)],
                   env=cli_environment, check=True, capture_output=True)
    expected = token_ids(accelgen.generate(PROMPTS, model=str(model.folder), device="cpu", dtype="float32",
                                           quantize="int8", max_new_tokens=NEW_TOKENS))
    generator = offloaded(Model(sharded, None), cap=INT8_CAP, dtype="float32", quantize="int8")
    assert generator.loaded.placement.disk_bytes > 0
    assert token_ids(generator.generate(PROMPTS)) == expected


def test_int8_offloaded_without_a_folder_from_full_precision_weights_is_one_line(four_layer_model, capsys):
    model = four_layer_model("llama")
    capsys.readouterr()
    assert main(["run", "--device", "cpu", "--model", str(model.folder), "--prompt", "a", "--offload", "disk",
                 "--max-device-memory", str(INT8_CAP), "--quantize", "int8", "--dtype", "float32",
                 "--max-new-tokens", str(NEW_TOKENS)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--offload disk with --quantize int8 writes the offloaded layers' int8 weights " \
                                       "once: pass --offload-folder DIR" in error


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
def test_a_run_stopped_by_sigterm_removes_its_offloaded_copies_and_keeps_its_rows(four_layer_model, tmp_path,
                                                                                  cli_environment, stop):
    """The weights an offloaded run writes to --offload-folder are its own: a run stopped by SIGTERM (or SIGHUP)
    unwinds as Ctrl-C does, removes them, and keeps every row written; the status is 128 + the signal."""
    model = four_layer_model("llama")
    folder, output, dataset = tmp_path / "offload", tmp_path / "out.jsonl", tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": f"Row {number} says"}) + "\n" for number in range(400)))
    process = subprocess.Popen(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(model.folder), "--dataset",
         str(dataset), "--max-new-tokens", "16", "--offload", "disk", "--max-device-memory", "640KiB",
         "--offload-folder", str(folder), "--output", str(output), "--quiet"],
        env=cli_environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (output.exists() and output.read_text().count("\n") >= 2):  # the offloaded model is generating
            assert process.poll() is None and time.monotonic() < deadline, "the run ended or never got going"
            time.sleep(0.2)
        assert list(folder.iterdir())  # its copy of the offloaded weights
        process.send_signal(stop)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + stop, stderr[-4000:]  # the tail names the final error
    assert stderr.strip().splitlines()[-1] == (f"accelgen: stopped ({signal.Signals(stop).name}): the rows finished are "
                                               f"kept in {output}, and the same command resumes")
    assert "Traceback" not in stderr
    assert list(folder.iterdir()) == []
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(rows))) and len(rows) < 400
