"""Prefix reuse (``--prefix-cache``): a row whose prompt begins like an earlier one gets that beginning's keys and
values from the device's store of 16-token blocks and prefills only the rest. Every test compares with the same
run without reuse (``--prefix-cache 0``): the tokens must not change, only the prefill work."""

import json
import shutil
import sys

import pytest
from conftest import one_error_line, run_to_the_end
from killed_runs import killed_then_resumed_and_whole
from test_conversations import TEMPLATE
from transformers import AutoConfig, AutoTokenizer

import accelgen
from accelgen.cli import main
from accelgen.common.host_memory import system_memory
from accelgen.generation.prefix_store import BLOCK_TOKENS
from accelgen.model.memory import GIB, bytes_per_sequence, kv_cache_bytes_per_position

FAMILIES = ["bloom", "gpt2", "llama", "opt", "falcon"]
#: a few-shot block that every row starts with (over a hundred tokens of the test tokenizer), then each row's own
SHARED = " ".join(f"Example {number} says the quick brown fox jumps over the dog." for number in range(5))
PROMPTS = [f"{SHARED} Row {number} asks" + " more" * (number % 5) for number in range(10)]
OTHER_SHARED = " ".join(f"Case {number} tells how a slow green turtle crossed the road." for number in range(5))


def token_ids(folder, prompts=PROMPTS, **settings) -> tuple[list[list[int]], accelgen.Generator]:
    generator = accelgen.load(folder, device="cpu", max_new_tokens=8, **settings)
    return [completion.completion_token_ids for completion in generator.generate(prompts)], generator


def block_bytes(folder) -> int:
    """What one stored block takes (keys and values of 16 positions over every layer, float32)."""
    return kv_cache_bytes_per_position(AutoConfig.from_pretrained(folder), "float32", 1) * BLOCK_TOKENS


@pytest.mark.transformers_release
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_row_has_the_same_tokens_with_and_without_reuse(tiny_model_folder, family, sampled):
    folder = tiny_model_folder(family)
    settings = dict(batch_size=4, do_sample=sampled, seed=3, top_k=50 if sampled else None)
    without, cold = token_ids(folder, prefix_cache=0, **settings)
    with_reuse, warm = token_ids(folder, **settings)
    assert with_reuse == without
    prompt_tokens = cold.stats.prompt_tokens
    assert cold.stats.prefilled_tokens == prompt_tokens and cold.stats.reused_tokens == 0
    assert warm.stats.prompt_tokens == prompt_tokens
    # every row but the first finds the shared blocks: the first insertion's other three rows are prefilled after it
    assert warm.stats.prefix_hits == len(PROMPTS) - 1
    assert warm.stats.reused_tokens >= (len(PROMPTS) - 1) * 4 * BLOCK_TOKENS
    assert warm.stats.prefilled_tokens <= prompt_tokens - warm.stats.reused_tokens + len(PROMPTS) * BLOCK_TOKENS


@pytest.mark.transformers_release
@pytest.mark.parametrize("settings", [dict(batching="static"), dict(num_samples=3, do_sample=True, seed=2),
                                      dict(dtype="bfloat16", quantize="int8")], ids=["static", "samples", "int8"])
def test_reuse_with_fixed_batches_several_samples_and_int8_weights(tiny_model_folder, settings):
    folder = tiny_model_folder("llama")
    without, _ = token_ids(folder, prefix_cache=0, batch_size=3, **settings)
    with_reuse, generator = token_ids(folder, batch_size=3, **settings)
    assert with_reuse == without and generator.stats.prefix_hits > 0


@pytest.mark.parametrize("size", ["1.5", "1KiB"])
def test_a_store_too_small_for_one_block_is_one_line_naming_the_smallest_size(tiny_model_folder, capsys, monkeypatch,
                                                                              size):
    """Such a store would hold nothing: reuse off, the summary saying "store 0 MiB"."""
    import accelgen.jobs.completion_job

    folder = tiny_model_folder("opt")
    block = block_bytes(folder)
    capsys.readouterr()
    monkeypatch.setattr(accelgen.jobs.completion_job, "load_request", lambda request: pytest.fail("the model was loaded"))
    status = main(["run", "--device", "cpu", "--model", str(folder), "--prompt", "Hello", "--prefix-cache", size])
    asked = {"1.5": 1, "1KiB": 1024}[size]
    assert status == 2 and one_error_line(capsys) == (
        f"accelgen: error: --prefix-cache {asked:,} bytes holds no block of prompt keys and values: one block (16 "
        f"positions over every layer, in float32) takes {block:,} bytes of this model; pass at least "
        f"{-(-block // 1024)}KiB (a store holds many blocks), or 0 to turn prefix reuse off.\n")
    monkeypatch.undo()
    with pytest.raises(accelgen.UsageError, match="holds no block of prompt keys and values"):
        accelgen.load(folder, device="cpu", prefix_cache=block - 1)
    assert token_ids(folder, prefix_cache=block)[1].stats.prefix_store_bytes == block  # one block: reuse on


@pytest.mark.transformers_release
def test_a_store_holding_part_of_a_prefix_reuses_that_part(tiny_model_folder):
    folder = tiny_model_folder("llama")
    without, _ = token_ids(folder, prefix_cache=0, batch_size=1)
    with_reuse, generator = token_ids(folder, prefix_cache=3 * block_bytes(folder), batch_size=1)
    assert with_reuse == without
    # one row at a time: each row after the first finds the first three blocks, which are never evicted as the
    # most recently used blocks of every prompt
    assert generator.stats.reused_tokens == (len(PROMPTS) - 1) * 3 * BLOCK_TOKENS


def test_least_recently_used_blocks_make_room(tiny_model_folder):
    """Rows of prefix A, then of prefix B, then of A again, one at a time: a store with room for one prefix forgets
    A's blocks while B's rows fill it, so the last row of A prefills again what a larger store gives it."""
    folder = tiny_model_folder("llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [f"{SHARED} First", f"{SHARED} Second", f"{OTHER_SHARED} Third", f"{OTHER_SHARED} Fourth",
               f"{SHARED} Fifth"]
    one_prefix = max(len(tokenizer(prompt).input_ids) for prompt in prompts) // BLOCK_TOKENS
    reused = {}
    for blocks in (one_prefix + 1, 4 * one_prefix):
        generator = accelgen.load(folder, device="cpu", max_new_tokens=4, batch_size=1,
                                  prefix_cache=blocks * block_bytes(folder))
        reused[blocks] = []
        for prompt in prompts:  # one call each: the store lives as long as the generator
            before = generator.stats.reused_tokens
            generator.generate([prompt])
            reused[blocks].append(generator.stats.reused_tokens - before)
    small, large = reused[one_prefix + 1], reused[4 * one_prefix]
    assert large[0] == large[2] == 0 and large[1] > 0 and large[3] > 0 and large[4] == large[1]
    assert small[:4] == large[:4]
    assert small[4] < large[4]  # A's blocks were evicted for B's (at most A's first block is left)


def summary_line(stderr: str) -> str:
    """The line of ``--details`` that says how the run batched its rows and prefilled their prompts."""
    return next(line for line in stderr.splitlines() if " batching" in line)


def dataset_of(path, prompts) -> str:
    path.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in prompts))
    return str(path)


def test_the_summary_line_counts_prompt_tokens_prefilled_and_reused(tiny_model_folder, tmp_path, capsys):
    folder = str(tiny_model_folder("gpt2"))
    dataset = dataset_of(tmp_path / "rows.jsonl", PROMPTS)
    outputs = []
    for number, option in enumerate([[], ["--prefix-cache", "0"]]):
        outputs.append(tmp_path / f"out{number}.jsonl")
        status = main(["run", "--device", "cpu", "--model", folder, "--dataset", dataset, "--max-new-tokens", "6",
                       "--batch-size", "2", "--output", str(outputs[-1]), "--details", *option])
        assert status == 0
        summary = summary_line(capsys.readouterr().err)
        if option:
            assert summary.endswith("prefix reuse off") and "prefilled" in summary
        else:
            assert "from the prefix store (9 prompts found a beginning there; store" in summary
    assert outputs[0].read_text() == outputs[1].read_text()


def test_a_store_larger_than_the_free_memory_is_one_line(tiny_model_folder, capsys):
    folder = str(tiny_model_folder("llama"))
    capsys.readouterr()
    status = main(["run", "--device", "cpu", "--model", folder, "--prompt", "Hello", "--prefix-cache", "1000TiB"])
    line = one_error_line(capsys)
    assert status == 2 and "--prefix-cache 1,024,000.00 GiB is more than the" in line
    assert line.rstrip().endswith("pass a smaller size, or 0 to turn prefix reuse off.")


def test_the_memory_advice_counts_the_store_beside_the_kv_cache(tiny_model_folder, tmp_path, capsys):
    """A store that leaves too little of the free memory for the KV cache is named in the out-of-memory line (the
    check comes before anything is allocated)."""
    free = system_memory().get("free_bytes")
    if free is None or free < 8 * GIB:
        pytest.skip("needs /proc/meminfo and 8 GiB free")
    folder = tmp_path / "long-llama"  # a context long enough for the positions asked
    shutil.copytree(tiny_model_folder("llama"), folder)
    config = AutoConfig.from_pretrained(folder)
    config.max_position_embeddings = 2**40
    config.save_pretrained(folder)
    capsys.readouterr()
    per_position = bytes_per_sequence(config, 2, "float32", 1) - bytes_per_sequence(config, 1, "float32", 1)
    positions = 4 * GIB // per_position  # a row's cache and one whole prefill's activations: 4 GiB, which fit without the store
    status = main(["run", "--device", "cpu", "--model", str(folder), "--prompt", "Hello", "--max-new-tokens",
                   str(positions), "--prefix-cache", str(free - 2 * GIB), "--prefill-chunk", "0"])
    line = one_error_line(capsys)
    assert status == 2 and "The KV cache and prefill activations for --batch-size 1" in line
    assert "of the prefix store (--prefix-cache SIZE, or 0):" in line


def test_a_store_larger_than_any_machine_is_parsed_and_refused_in_a_true_sentence(tiny_model_folder, capsys):
    folder = str(tiny_model_folder("llama"))
    capsys.readouterr()
    status = main(["run", "--device", "cpu", "--model", folder, "--prompt", "Hello", "--prefix-cache", "1PiB"])
    line = one_error_line(capsys)  # not "is not a memory size"
    assert status == 2 and "--prefix-cache 1,048,576.00 GiB is more than the" in line and "free on the device" in line


@pytest.mark.parametrize("value", ["lots", "-1GiB"])
def test_a_bad_store_size_is_one_line(tiny_model_folder, capsys, value):
    folder = str(tiny_model_folder("llama"))
    capsys.readouterr()
    status = main(["run", "--device", "cpu", "--model", folder, "--prompt", "Hello", "--prefix-cache", value])
    assert status == 2 and "--prefix-cache" in one_error_line(capsys)


@pytest.mark.transformers_release
def test_conversations_share_their_system_prompt_as_a_prefix(tiny_model_folder, tmp_path, capsys):
    folder = tmp_path / "chat-llama"
    shutil.copytree(tiny_model_folder("llama"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {number}?"}]}) + "\n"
                            for number in range(8)))
    outputs, summaries = [], []
    for number, option in enumerate([[], ["--prefix-cache", "0"]]):
        outputs.append(tmp_path / f"out{number}.jsonl")
        status = main(["run", "--device", "cpu", "--model", str(folder), "--dataset", str(rows), "--column", "messages", "--system-prompt", SHARED,
                       "--max-new-tokens", "6", "--batch-size", "2", "--do-sample", "--seed", "4", "--num-samples", "2",
                       "--output", str(outputs[-1]), "--details", *option])
        assert status == 0
        summaries.append(summary_line(capsys.readouterr().err))
    assert outputs[0].read_text() == outputs[1].read_text()
    # two slots, two samples a prompt: one prompt an insertion; every prompt after the first finds the system prompt
    assert "from the prefix store (7 prompts found a beginning there" in summaries[0]
    assert summaries[1].endswith("prefix reuse off")


# -- whole jobs ------------------------------------------------------------------------------------------------

def run_job(environment, *arguments, timeout=300):
    return run_to_the_end([sys.executable, "-m", "accelgen.cli", "run", *arguments], environment, timeout)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [["--world-size", "2"], ["--world-size", "2", "--data-parallel", "2"]],
                         ids=["tensor-parallel", "data-parallel"])
def test_reuse_under_two_ranks_writes_what_no_reuse_writes(tiny_model_folder, tmp_path, job_environment, parallel):
    pytest.importorskip("deepspeed")
    dataset = dataset_of(tmp_path / "rows.jsonl", PROMPTS)
    outputs = []
    for number, option in enumerate([[], ["--prefix-cache", "0"]]):
        outputs.append(tmp_path / f"out{number}.jsonl")
        result = run_job(job_environment, "--device", "cpu", *parallel, "--model", str(tiny_model_folder("bloom")),
                         "--dataset", dataset, "--batch-size", "2", "--max-new-tokens", "8", "--do-sample", "--seed", "6",
                         "--output", str(outputs[-1]), "--quiet", "--details", *option)
        assert result.returncode == 0, result.stderr
        assert ("prefix reuse off" in result.stderr) == bool(option)
        assert bool(option) or " from the prefix store (" in result.stderr
    assert outputs[0].read_text() == outputs[1].read_text()


@pytest.mark.slow
def test_a_killed_run_with_reuse_resumes_to_the_uninterrupted_file(tiny_model_folder, tmp_path, cli_environment):
    """The resumed run starts with an empty store: the rows after the stop are prefilled whole at first."""
    dataset = dataset_of(tmp_path / "rows.jsonl", [f"{SHARED} Row {number} asks" + " more" * (number % 5)
                                                   for number in range(40)])
    command = [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(tiny_model_folder("llama")),
               "--dataset", dataset, "--max-new-tokens", "24", "--do-sample", "--seed", "5", "--batch-size", "2",
               "--quiet"]
    resumed, whole, written = killed_then_resumed_and_whole(command, tmp_path, cli_environment)
    assert 5 <= written < 40
    assert resumed.read_text() == whole.read_text()
