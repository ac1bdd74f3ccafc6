"""The KV cache memory a generator holds: one cache, sized for the largest bucket it met, whatever the number
of buckets; and the caches that share that memory never disturb each other."""

import json
import subprocess
import sys
import textwrap

import pytest
from accelerators import CapturingCpu, plugin_manager_with
from tiny_models import CORPUS, build_model, build_tokenizer
from transformers import AutoTokenizer, LlamaConfig

import accelgen

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each


def text_of_at_most(tokenizer, tokens: int) -> str:
    """The longest run of the corpus's words that is at most ``tokens`` tokens long."""
    words = " ".join(CORPUS).split() * 40
    text = ""
    for count in range(1, len(words)):
        candidate = " ".join(words[:count])
        if len(tokenizer(candidate)["input_ids"]) > tokens:
            return text
        text = candidate
    raise AssertionError("the corpus is too short")


@pytest.mark.parametrize("architecture", ["llama", "bloom", "falcon"])
def test_buckets_met_in_any_order_give_what_a_fresh_generator_gives(tiny_model_folder, architecture):
    folder = tiny_model_folder(architecture)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    short, middle, long = (text_of_at_most(tokenizer, tokens) for tokens in (8, 30, 120))  # buckets 8, 32, 128
    settings = dict(device="cpu", max_new_tokens=12, buckets=(8, 32, 128), batching="static")
    fresh = {prompt: accelgen.generate([prompt], model=folder, **settings)[0].completion_token_ids
             for prompt in (short, middle, long)}
    generator = accelgen.load(folder, plugin_manager=plugin_manager_with(CapturingCpu()), **settings)
    for prompt in (short, middle, long, short, middle, long, middle, short):  # the cache grows twice, then is shared
        assert generator.generate([prompt])[0].completion_token_ids == fresh[prompt]
    assert generator.cache_length_in_use == 128 + 12
    # a bucket met before the cache grew is captured once more (its graph held the smaller cache's addresses):
    # short, middle (grown), long (grown), then short and middle again; nothing after that
    assert generator.stats.graph_captures == 5


MEASURE = textwrap.dedent("""
    import gc, json, os, sys
    import accelgen

    def resident_bytes():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    folder, prompts = sys.argv[1], json.loads(sys.argv[2])
    generator = accelgen.load(folder, device="cpu", batch_size=16, max_new_tokens=8, buckets=(128, 256, 512))
    gc.collect()
    loaded = resident_bytes()
    for prompt in prompts:
        generator.generate([prompt])
    gc.collect()
    print(json.dumps({"grown": resident_bytes() - loaded, "cache_length": generator.cache_length_in_use}))
""")


@pytest.mark.slow
def test_a_generator_that_meets_three_bucket_lengths_holds_one_caches_memory(tmp_path, cli_environment):
    """Resident memory measured in fresh processes: one meets a prompt of each of three buckets (smallest first),
    another only the largest. The model's cache is made large next to everything else (8 layers of 8 key/value
    heads of 64 values: 32 KiB per position per row, 16 rows): the largest bucket's cache is 16 x 520 x 32 KiB =
    260 MiB, and one cache per bucket would hold 200 MiB more (136 and 264 positions). A first generation also
    grows a process by tens of MiB that are no cache (kernels, workspaces, the traced steps' graphs: torch keeps a
    trace's graph until the process ends, about 8 MiB for this model's step), hence the comparison."""
    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    folder = build_model(tmp_path / "model", config)
    tokenizer.save_pretrained(folder)
    prompts = [text_of_at_most(tokenizer, tokens) for tokens in (120, 250, 500)]  # buckets 128, 256, 512

    def grown_bytes(prompts_met):
        # every allocation over 128 KiB is its own mapping, given back to the system when freed: resident memory
        # then counts what is held, not what the allocator keeps for later
        environment = dict(cli_environment, MALLOC_MMAP_THRESHOLD_="131072")
        result = subprocess.run([sys.executable, "-c", MEASURE, str(folder), json.dumps(prompts_met)], env=environment,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        measured = json.loads(result.stdout.splitlines()[-1])
        assert measured["cache_length"] == 512 + 8
        return measured["grown"]

    one_cache = 16 * 520 * 2 * 8 * 8 * 64 * 4
    largest_only, all_three = grown_bytes(prompts[2:]), grown_bytes(prompts)
    assert largest_only > one_cache  # the measurement sees the cache
    assert all_three - largest_only < 0.25 * one_cache, (all_three, largest_only, one_cache)
