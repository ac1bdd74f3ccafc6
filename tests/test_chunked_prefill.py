"""Chunked prefill (``--prefill-chunk``): a prompt longer than a chunk is prefilled in passes of fixed shapes, the
rows already running taking a decode step between two passes. Every test compares with whole-prompt prefills
(``--prefill-chunk 0``): the tokens must not change, only how long a running row waits."""

import json
import random
import shutil
import subprocess
import sys

import pytest
from accelerators import RefillingCpu, plugin_manager_with
from conftest import one_error_line
from transformers import AutoConfig, GenerationConfig

import accelgen
from accelgen.cli import main
from accelgen.model.memory import bytes_per_sequence

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

FAMILIES = ["bloom", "gpt2", "llama", "opt", "falcon"]
CHUNK = 32
LONG = " ".join(f"Line {number} of a long prompt tells of a fox." for number in range(4))  # about 100 tokens
#: long prompts among short ones; one long prompt first, so that the slots are made for long prompts from the start
#: and the later ones arrive while short rows run
PROMPTS = [f"{LONG} Part {number}" if number % 4 == 0 else f"Short {number}" + " word" * number for number in range(12)]


@pytest.fixture
def ending_model(tiny_model_folder, tmp_path):
    """``ending_model(family)``: the tiny model with an eighth of its vocabulary ending a row, so that rows end at
    different steps and slots free up while others run."""

    def folder_of(family: str) -> str:
        folder = tmp_path / family
        shutil.copytree(tiny_model_folder(family), folder)
        vocabulary = AutoConfig.from_pretrained(folder).vocab_size
        ending = sorted(random.Random(0).sample(range(3, vocabulary), vocabulary // 8))
        GenerationConfig(eos_token_id=ending, pad_token_id=0).save_pretrained(folder)
        return str(folder)

    return folder_of


def run(folder, prompts=PROMPTS, **settings) -> tuple[list[list[int]], accelgen.Generator]:
    # each freed slot refilled at the next look, so that the long prompts start while short rows run
    generator = accelgen.load(folder, device="cpu", max_new_tokens=16, batch_size=3, prefix_cache=0,
                              plugin_manager=plugin_manager_with(RefillingCpu()), **settings)
    return [completion.completion_token_ids for completion in generator.generate(prompts)], generator


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_chunked_and_whole_prefills_give_the_same_tokens(ending_model, family, sampled):
    folder = ending_model(family)
    settings = dict(do_sample=sampled, seed=3, top_k=50 if sampled else None)
    whole, unchunked = run(folder, prefill_chunk=0, **settings)
    chunked, generator = run(folder, prefill_chunk=CHUNK, **settings)
    assert chunked == whole
    assert generator.stats.prefill_passes > generator.stats.prefills
    assert unchunked.stats.prefill_passes == unchunked.stats.prefills
    assert generator.stats.prompt_tokens == unchunked.stats.prompt_tokens


def test_a_long_prompt_holds_the_running_rows_for_one_chunk_at_most(ending_model):
    """The long prompts that come while rows run are prefilled a chunk at a time, the running rows taking a decode
    step between two chunks; without chunks they wait for a whole prompt (counted in prompt positions, which do not
    depend on the machine's speed)."""
    folder = ending_model("llama")
    settings = dict(do_sample=True, seed=3)
    whole, unchunked = run(folder, prefill_chunk=0, **settings)
    chunked, generator = run(folder, prefill_chunk=CHUNK, **settings)
    assert chunked == whole
    assert 0 < generator.stats.longest_wait_positions <= CHUNK < unchunked.stats.longest_wait_positions
    assert generator.stats.longest_decode_gap > 0 and generator.stats.longest_prefill_pass > 0


@pytest.mark.parametrize("settings", [dict(batching="static"), dict(num_samples=2, do_sample=True, seed=2),
                                      dict(prefix_cache="64MiB"), dict(logprobs=True)],
                         ids=["static", "samples", "prefix-reuse", "logprobs"])
def test_chunks_with_fixed_batches_samples_prefix_reuse_and_logprobs(tiny_model_folder, settings):
    folder = tiny_model_folder("llama")
    generator = accelgen.load(folder, device="cpu", max_new_tokens=10, batch_size=3, **{"prefix_cache": 0, **settings})
    whole = generator.generate(PROMPTS)
    chunked_generator = accelgen.load(folder, device="cpu", max_new_tokens=10, batch_size=3, prefill_chunk=16,
                                      **{"prefix_cache": 0, **settings})
    chunked = chunked_generator.generate(PROMPTS)
    assert [completion.completion_token_ids for completion in chunked] == [
        completion.completion_token_ids for completion in whole]
    if settings.get("logprobs"):
        for mine, theirs in zip(chunked, whole):
            assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    assert chunked_generator.stats.prefill_passes > chunked_generator.stats.prefills


def test_a_prompt_within_one_chunk_runs_as_before(tiny_model_folder):
    """Short prompts only: one pass per prefill with or without chunking."""
    short = [prompt for prompt in PROMPTS if not prompt.startswith("Line")]
    whole, _ = run(tiny_model_folder("gpt2"), short, prefill_chunk=0)
    chunked, generator = run(tiny_model_folder("gpt2"), short, prefill_chunk=CHUNK)
    assert chunked == whole and generator.stats.prefill_passes == generator.stats.prefills


def test_a_job_with_chunks_writes_what_a_job_without_writes(tiny_model_folder, tmp_path):
    folder = str(tiny_model_folder("opt"))
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in PROMPTS))
    outputs = []
    for number, chunk in enumerate(["16", "0"]):
        outputs.append(tmp_path / f"out{number}.jsonl")
        status = main(["run", "--device", "cpu", "--model", folder, "--dataset", str(dataset), "--max-new-tokens", "8",
                       "--batch-size", "2", "--prefill-chunk", chunk, "--output", str(outputs[-1]), "--quiet"])
        assert status == 0
    assert outputs[0].read_text() == outputs[1].read_text()


@pytest.mark.parametrize("value", ["-1", "many", "2.5"])
def test_a_bad_chunk_is_one_line(tiny_model_folder, capsys, value):
    capsys.readouterr()
    status = main(["run", "--device", "cpu", "--model", str(tiny_model_folder("llama")), "--prompt", "Hi",
                   "--prefill-chunk", value])
    line = one_error_line(capsys)
    assert status == 2 and "argument --prefill-chunk: must be a whole number from 0 to" in line


def test_the_memory_estimate_counts_one_chunk_of_activations(tiny_model_folder):
    """A row's prefill activations are those of one pass: a chunk's positions, not its whole cache length."""
    config = AutoConfig.from_pretrained(tiny_model_folder("llama"))
    whole = bytes_per_sequence(config, 4096, "float32", 1)
    chunked = bytes_per_sequence(config, 4096, "float32", 1, prefill_chunk=512)
    cache_only = bytes_per_sequence(config, 4096, "float32", 1, prefill_chunk=1)
    assert cache_only < chunked < whole
    assert (whole - cache_only) == pytest.approx((chunked - cache_only) * 4095 / 511, rel=1e-6)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_chunk_as_one_process_does(tiny_model_folder, tmp_path, job_environment):
    """Each rank prefills its heads in the same passes, with the same decode steps between them."""
    pytest.importorskip("deepspeed")
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in PROMPTS))
    outputs = []
    for number, chunk in enumerate(["16", "0"]):
        outputs.append(tmp_path / f"out{number}.jsonl")
        result = subprocess.run(
            [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", "2", "--model",
             str(tiny_model_folder("bloom")), "--dataset", str(dataset), "--batch-size", "2", "--max-new-tokens", "8",
             "--do-sample", "--seed", "6", "--prefill-chunk", chunk, "--output", str(outputs[-1]), "--quiet"],
            env=job_environment, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    assert outputs[0].read_text() == outputs[1].read_text()
