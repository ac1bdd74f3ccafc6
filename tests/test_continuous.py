"""Continuous batching: a finished row's slot takes the next prompt at once, and no row's text changes.

The tiny test models rarely choose their end-of-sequence token, so each test model here is given one its
greedy completions do choose, at different points: rows then end at very different lengths, as real ones do,
and slots free up mid-run.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from accelerators import RefillingCpu, plugin_manager_with
from conftest import ARCHITECTURES
from killed_runs import kill_after_rows
from transformers import AutoModelForCausalLM, AutoTokenizer, FalconConfig

import accelgen
from accelgen.cli import main

NEW_TOKENS = 16
PROMPTS = [
    "DeepSpeed is a machine learning framework", "Hello", "The quick brown fox jumps over the lazy dog while",
    "a b c", "one two three four five six seven", "x", "And it came to pass", "In the beginning",
    "Thou shalt not", "Blessed are the meek", "For God so loved", "The LORD is my shepherd",
]


def hugging_face_alone(folder, prompts, eos_token_id):
    """Each prompt's greedy completion by Hugging Face ``generate`` on that prompt alone, cut after its EOS."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)  # float32, as the runs it is compared with
    completions = []
    for prompt in prompts:
        inputs = tokenizer([prompt], return_tensors="pt", return_token_type_ids=False)
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
        row = output[0, inputs.input_ids.shape[1] :].tolist()
        completions.append(row[: row.index(eos_token_id) + 1] if eos_token_id in row else row)
    return completions


@pytest.fixture(scope="module")
def ending_model(tiny_model_folder, tmp_path_factory):
    """``ending_model(arch, **sampling)``: (a copy of the tiny model whose end-of-sequence token its rows choose at
    varied points, that token); rows drawn with ``sampling`` (``accelgen.generate``'s options; default greedy)."""
    made = {}

    def make(architecture, **sampling):
        key = (architecture, *sorted(sampling.items()))
        if key not in made:
            source = tiny_model_folder(architecture)
            rows = [c.completion_token_ids for c in accelgen.generate(
                PROMPTS, model=source, device="cpu", max_new_tokens=NEW_TOKENS, ignore_eos=True, batching="static",
                **sampling)]
            # the token that ends the most rows early while leaving some to run to the end
            counts = {}
            for row in rows:
                for token in set(row[1:-2]):
                    counts[token] = counts.get(token, 0) + 1
            eos = max(counts, key=lambda token: (min(counts[token], len(rows) - 3), -token))
            folder = tmp_path_factory.mktemp(f"ending-{architecture}")
            shutil.copytree(source, folder, dirs_exist_ok=True)
            config = json.loads((folder / "generation_config.json").read_text()) if (folder / "generation_config.json").exists() else {}
            config["eos_token_id"] = eos
            (folder / "generation_config.json").write_text(json.dumps(config))
            made[key] = (folder, eos)
        return made[key]

    return make


def cli_rows(capsys, *arguments):
    output = Path(arguments[arguments.index("--output") + 1])
    assert main(["run", "--device", "cpu", "--quiet", *arguments]) == 0, capsys.readouterr().err
    return [json.loads(line) for line in output.read_text().splitlines()], capsys.readouterr().err


@pytest.mark.transformers_release
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_row_is_what_hugging_face_generates_for_its_prompt_alone(ending_model, architecture, tmp_path, capsys):
    folder, eos = ending_model(architecture)
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in PROMPTS))
    rows, summary = cli_rows(capsys, "--model", str(folder), "--dataset", str(dataset), "--batch-size", "3",
                             "--max-new-tokens", str(NEW_TOKENS), "--batching", "continuous", "--output", str(tmp_path / "out.jsonl"))
    expected = hugging_face_alone(folder, PROMPTS, eos)
    assert [row["index"] for row in rows] == list(range(len(PROMPTS)))  # in dataset order
    assert [row["completion_token_ids"] for row in rows] == expected
    lengths = sorted(len(row) for row in expected)
    assert lengths[0] < NEW_TOKENS // 2 and lengths[-1] == NEW_TOKENS  # rows did end at different points
    assert [row["finish_reason"] for row in rows] == ["eos" if row[-1] == eos else "length" for row in expected]
    assert "slot occupancy" in summary


def test_continuous_batching_fills_the_slots_that_fixed_batches_leave_idle(ending_model, tmp_path, capsys):
    """The plain policy, each freed slot refilled at the next look (the CPU's own waits for more slots to free first:
    the next test)."""
    folder, _ = ending_model("llama")
    options = dict(model=str(folder), device="cpu", batch_size=4, max_new_tokens=NEW_TOKENS,
                   plugin_manager=plugin_manager_with(RefillingCpu()))
    static = accelgen.load(batching="static", **options)
    continuous = accelgen.load(batching="continuous", **options)
    prompts = PROMPTS * 2
    assert [c.completion_token_ids for c in continuous.generate(prompts)] == [
        c.completion_token_ids for c in static.generate(prompts)]
    assert continuous.stats.new_tokens == static.stats.new_tokens
    assert continuous.stats.slot_occupancy > static.stats.slot_occupancy
    assert continuous.stats.slot_tokens < static.stats.slot_tokens  # fewer token places computed for the same text


def test_on_the_cpu_freed_slots_wait_for_others_so_that_one_prefill_pass_starts_several_rows(ending_model):
    """A CPU prefill pass costs more than its prompts' work: slots freed while rows run wait, idle, until they have
    idled as long as a pass costs, then one pass starts rows in all of them. The same rows, in fewer passes; and the
    same passes every time (the rule counts decode steps, never seconds)."""
    folder, _ = ending_model("llama")
    options = dict(model=str(folder), device="cpu", batch_size=8, max_new_tokens=NEW_TOKENS, do_sample=True, seed=5)
    prompts = PROMPTS * 4
    refilling = accelgen.load(plugin_manager=plugin_manager_with(RefillingCpu()), **options)
    gathering = accelgen.load(**options)
    expected = [c.completion_token_ids for c in refilling.generate(prompts)]
    assert [c.completion_token_ids for c in gathering.generate(prompts)] == expected
    assert gathering.stats.prefill_passes < refilling.stats.prefill_passes
    passes = gathering.stats.prefill_passes
    assert [c.completion_token_ids for c in gathering.generate(prompts)] == expected
    assert gathering.stats.prefill_passes == 2 * passes


@pytest.mark.transformers_release
@pytest.mark.parametrize("architecture", ["bloom", "llama"])
def test_a_sampled_run_writes_the_same_rows_in_both_modes(ending_model, architecture, tmp_path, capsys):
    # the end-of-sequence token is one that these sampled rows choose (their draws do not depend on the ending)
    folder, _ = ending_model(architecture, do_sample=True, temperature=0.9, top_k=50, seed=7)
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in PROMPTS))
    sampling = ["--do-sample", "--temperature", "0.9", "--top-k", "50", "--seed", "7"]
    common = ["--model", str(folder), "--dataset", str(dataset), "--max-new-tokens", str(NEW_TOKENS), *sampling]
    static, _ = cli_rows(capsys, *common, "--batch-size", "4", "--batching", "static", "--output", str(tmp_path / "a.jsonl"))
    continuous, _ = cli_rows(capsys, *common, "--batch-size", "3", "--batching", "continuous",
                             "--output", str(tmp_path / "b.jsonl"))
    assert continuous == static
    assert len({len(row["completion_token_ids"]) for row in static}) > 1  # rows of different lengths


def test_an_output_resumes_in_the_other_mode(ending_model, tmp_path, capsys):
    """The batching mode changes speed, never text: a run stopped in one mode resumes in the other."""
    folder, _ = ending_model("gpt2")
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in PROMPTS))
    common = ["--model", str(folder), "--dataset", str(dataset), "--max-new-tokens", str(NEW_TOKENS), "--batch-size", "2"]
    reference, _ = cli_rows(capsys, *common, "--output", str(tmp_path / "reference.jsonl"))
    output = tmp_path / "out.jsonl"
    cli_rows(capsys, *common, "--batching", "static", "--limit", "5", "--output", str(output))
    assert main(["run", "--device", "cpu", "--quiet", *common, "--batching", "continuous", "--output", str(output)]) == 0
    assert "resuming: 5 rows already in" in capsys.readouterr().err
    assert [json.loads(line) for line in output.read_text().splitlines()] == reference


@pytest.mark.transformers_release
def test_prompts_longer_than_the_slots_hold_wait_and_the_slots_grow(ending_model, tmp_path):
    folder, eos = ending_model("opt")
    long_prompt = " ".join(PROMPTS[:6])
    prompts = ["Hello", "x", long_prompt, "a b c", long_prompt, "Hello"]
    generator = accelgen.load(folder, device="cpu", batch_size=2, max_new_tokens=NEW_TOKENS, buckets=(8, 128),
                              batching="continuous")
    assert [c.completion_token_ids for c in generator.generate(prompts)] == hugging_face_alone(folder, prompts, eos)
    assert generator.cache_length_in_use == 128 + NEW_TOKENS


@pytest.mark.transformers_release
def test_an_eager_prefill_starts_prompts_of_several_buckets_in_one_pass(ending_model):
    """On a device whose prefills run eagerly (the CPU), the prompts that start together take one forward pass, at the
    largest of their buckets: a pass costs more for being a pass than a short prompt's padding does. Each row's text
    is what it is alone, and a sample parked by that pass (its prompt's other samples did not fit the slots) starts
    later from its prompt's cache row at that bucket, as the samples that all fit write it."""
    folder, eos = ending_model("llama")
    long_prompt = " ".join(PROMPTS)
    prompts = ["Hello", long_prompt, "x", "Once " + long_prompt]  # no two share a beginning (no prefix reuse's split)
    generator = accelgen.load(folder, device="cpu", batch_size=4, max_new_tokens=NEW_TOKENS, buckets=(8, 160),
                              batching="continuous")
    assert [c.completion_token_ids for c in generator.generate(prompts)] == hugging_face_alone(folder, prompts, eos)
    assert (generator.stats.prefills, generator.stats.prefill_passes) == (1, 1)  # two buckets, one pass

    options = dict(device="cpu", max_new_tokens=NEW_TOKENS, buckets=(8, 160), batching="continuous", do_sample=True,
                   seed=5, num_samples=2)
    parked = accelgen.load(folder, batch_size=3, **options)  # "Hello"'s second sample waits for a slot

    def samples(generator):
        return [[sample["completion_token_ids"] for sample in completion.completions]
                for completion in generator.generate([long_prompt, "Hello"])]

    assert samples(parked) == samples(accelgen.load(folder, batch_size=4, **options))
    assert parked.stats.prefill_passes == 1


@pytest.mark.transformers_release
def test_a_model_the_slot_step_cannot_serve_runs_in_fixed_batches_with_one_line(tmp_path, capsys):
    """Falcon's ALiBi variant builds its attention bias inside the model from one position for the batch."""
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import build_model, build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    folder = build_model(tmp_path / "falcon-alibi", FalconConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    tokenizer.save_pretrained(folder)
    assert main(["run", "--device", "cpu", "--model", str(folder), "--prompt", "Hello", "--prompt", "x",
                 "--batch-size", "2", "--max-new-tokens", "4"]) == 0
    [line] = [line for line in capsys.readouterr().err.splitlines() if "fixed batches" in line]
    assert line.startswith("accelgen: warning: falcon models run in fixed batches (--batching static)")


def test_a_bad_batching_mode_is_one_line(capsys):
    assert main(["run", "--device", "cpu", "--prompt", "x", "--batching", "dynamic"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--batching" in error and "continuous" in error
    with pytest.raises(accelgen.UsageError, match="--batching must be one of continuous, static"):
        accelgen.load(device="cpu", batching="dynamic")


def test_two_ranks_batch_continuously_as_one_process_does(ending_model, tmp_path, cli_environment):
    pytest.importorskip("deepspeed")
    folder, _ = ending_model("llama")
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in PROMPTS))
    common = ["--device", "cpu", "--model", str(folder), "--dataset", str(dataset), "--batch-size", "3",
              "--max-new-tokens", str(NEW_TOKENS), "--batching", "continuous", "--do-sample", "--seed", "3", "--quiet"]
    outputs = {}
    for world_size in (1, 2):
        outputs[world_size] = tmp_path / f"out-{world_size}.jsonl"
        result = subprocess.run([sys.executable, "-m", "accelgen.cli", "run", *common, "--world-size", str(world_size),
                                 "--output", str(outputs[world_size])], env=cli_environment, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    assert outputs[2].read_text() == outputs[1].read_text()


@pytest.mark.parametrize("batching", [None, "continuous"])
def test_bench_keeps_fixed_batches_unless_asked_and_records_the_occupancy(tiny_model_folder, batching, capsys):
    chosen = [] if batching is None else ["--batching", batching]
    assert main(["bench", "--device", "cpu", "--model", str(tiny_model_folder("gpt2")), "--batch-sizes", "1,3",
                 "--max-new-tokens", "6", "--runs", "1", "--json", *chosen]) == 0
    out = capsys.readouterr().out
    [measurement] = json.loads(out[out.index("{\n") :])["measurements"]  # after any library's own lines
    assert measurement["batching"] == (batching or "static")
    for row in measurement["results"]:
        assert row["kept_tokens_per_second"] > 0
        assert row["slot_occupancy"] == 1.0  # the protocol ignores EOS: every token place is kept


@pytest.mark.slow
def test_a_sampled_continuous_run_killed_mid_way_resumes_to_the_uninterrupted_file(ending_model, tmp_path, cli_environment):
    """SIGKILL while slots hold rows at every stage: the rows written are a prefix in dataset order, and the
    same command writes the rest, equal to a run that was never stopped."""
    folder, _ = ending_model("llama")
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": PROMPTS[number % len(PROMPTS)] + f" {number}"}) + "\n"
                               for number in range(400)))
    command = [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(folder), "--dataset",
               str(dataset), "--batch-size", "4", "--max-new-tokens", str(NEW_TOKENS), "--batching", "continuous",
               "--do-sample", "--seed", "11", "--quiet"]
    reference = tmp_path / "reference.jsonl"
    subprocess.run([*command, "--output", str(reference)], env=cli_environment, check=True, capture_output=True)
    output = tmp_path / "out.jsonl"
    kept = kill_after_rows([*command, "--output", str(output)], output, cli_environment)
    assert 5 <= kept < 400, "the run should have been killed mid-way"
    resumed = subprocess.run([*command, "--output", str(output)], env=cli_environment, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert output.read_text() == reference.read_text()
