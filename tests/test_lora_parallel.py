"""LoRA adapters over several processes: two tensor-parallel ranks (the adapters' matrices split as their layers are)
and two data-parallel replicas write what one process writes, rows of several adapters and the base mixed."""

import json
import subprocess
import sys

import pytest
from lora_adapters import build_adapters

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 8
TEXTS = ["DeepSpeed is a machine learning framework", "Hello", "The quick brown fox jumps", "In the beginning God",
         "Static shapes let one", "Tensor parallelism splits each layer", "Hello world, this is", "The quick brown"]
CHOSEN = ["a0", None, "a1", "a2", "", "a0", "a1", "a2"]


@pytest.fixture(scope="module")
def adapters_of(tiny_model_folder, tmp_path_factory):
    built = {}

    def adapters(architecture: str):
        if architecture not in built:
            folder = tiny_model_folder(architecture)
            built[architecture] = folder, build_adapters(folder, tmp_path_factory.mktemp(f"tp-{architecture}"), architecture)
        return built[architecture]

    return adapters


def run_job(environment, tmp_path, folder, adapters, output_name, *options):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": text, "adapter": name}) + "\n" for text, name in zip(TEXTS, CHOSEN)))
    output = tmp_path / output_name
    lora = [option for name, path in adapters.items() for option in ("--lora", f"{name}={path}")]
    lora += ["--lora-column", "adapter"] if adapters else []
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(folder),
                             "--dataset", str(rows), *lora, "--batch-size", "3",
                             "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(output), "--quiet", "--details", *options],
                            env=environment, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr
    return [json.loads(line)["completion_token_ids"] for line in output.read_text().splitlines()], result.stderr


@pytest.mark.parametrize("architecture, options", [("llama", []), ("bloom", []), ("llama", ["--max-loras", "1"])],
                         ids=["llama", "bloom", "llama-one-slot"])
def test_two_tensor_parallel_ranks_write_what_one_process_writes(adapters_of, tmp_path, job_environment, architecture,
                                                                 options):
    folder, adapters = adapters_of(architecture)
    one, _ = run_job(job_environment, tmp_path, folder, adapters, "one.jsonl", *options)
    two, stderr = run_job(job_environment, tmp_path, folder, adapters, "two.jsonl", "--world-size", "2", *options)
    assert two == one
    assert "world size 2" in stderr and "rows: base 2, a0 2, a1 2, a2 2" in stderr


def test_int8_ranks_add_each_adapter_to_their_partial_products_before_the_sum(adapters_of, tmp_path, job_environment):
    """Row-parallel int8 layers take the adapter's partial output into their one all-reduce. Two int8 ranks do not
    write one int8 process's tokens even without adapters (the CPU's int8 product quantizes each rank's slice of a row
    on its own: a few rows of this dataset differ), so the checks are within two ranks: the base model's rows are
    those of a run without adapters, and every row is the same with one buffer slot as with three."""
    folder, adapters = adapters_of("llama")
    int8 = ["--world-size", "2", "--dtype", "float32", "--quantize", "int8"]
    mixed, stderr = run_job(job_environment, tmp_path, folder, adapters, "mixed.jsonl", *int8)
    one_slot, _ = run_job(job_environment, tmp_path, folder, adapters, "one-slot.jsonl", *int8, "--max-loras", "1")
    base, _ = run_job(job_environment, tmp_path, folder, {}, "base.jsonl", *int8)
    assert one_slot == mixed and "(int8 weights)" in stderr
    assert [row for row, name in zip(mixed, CHOSEN) if not name] == [row for row, name in zip(base, CHOSEN) if not name]
    assert all(row != other for row, other, name in zip(mixed, base, CHOSEN) if name)


def test_two_data_parallel_replicas_write_what_one_process_writes(adapters_of, tmp_path, job_environment):
    folder, adapters = adapters_of("llama")
    one, _ = run_job(job_environment, tmp_path, folder, adapters, "one.jsonl")
    two, stderr = run_job(job_environment, tmp_path, folder, adapters, "two.jsonl", "--world-size", "2",
                          "--data-parallel", "2")
    assert two == one
    assert "2 replicas of 1" in stderr and "rows: base 2, a0 2, a1 2, a2 2" in stderr
