"""accelgen as lm-evaluation-harness's model "accelgen": a multiple-choice task, a perplexity task and a generation
task, written here with their datasets, score on a tiny random model as lm-eval's own ``hf`` model (HFLM) scores them:
the same choices picked (acc and acc_norm), each request's log-likelihood within 1e-4, the same perplexity, the same
generated texts; ``accelgen.jobs.lm_eval_model.evaluate`` runs a task by name, and says so when it cannot."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import accelgen  # noqa: E402
from accelgen.common.errors import UsageError  # noqa: E402
from accelgen.jobs import lm_eval_model  # noqa: E402
from accelgen.jobs.lm_eval_model import AccelgenLM, evaluate, result_table  # noqa: E402

#: Questions and four answers each; the last question is longer than the tiny models' window, which cuts it on the left.
QUESTIONS = [
    ("The quick brown fox jumps over the", ["lazy dog", "moon", "river bank", "fence"], 0),
    ("DeepSpeed is a machine learning", ["framework", "banana", "library for fast training", "cat"], 0),
    ("Hello, my name is", ["Bob", "the quick brown fox", "nothing at all", "a machine"], 1),
    ("One, two, three, four,", ["five", "six", "seven and eight", "ten"], 0),
    ("The sky is", ["blue", "green", "falling down slowly", "made of cheese"], 0),
    ("Water boils at", ["one hundred degrees", "zero", "noon", "the top of the mountain"], 0),
    (" ".join(["the model reads every word of this row before the last one"] * 30), ["yes", "no", "maybe so", "never"], 2),
]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "DeepSpeed is a machine learning framework for training and inference of large models.",
    # longer than the window: scored in several disjoint windows
    " ".join(f"Sentence number {number} tells of a fox, a dog and a framework." for number in range(40)),
]
#: Prompts and their answers; the last prompt leaves less room than the new tokens take: it is cut on the left.
ANSWERS = [("Finish this: the quick brown fox", "jumps"), ("Count: one two three", "four"), ("Hello", "world"),
           ("DeepSpeed is a", "framework"), (" ".join(["Count: one two three four five six seven"] * 30), "eight")]


def write_lines(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def metrics(*names, aggregation="mean", higher=True) -> str:
    return "".join(f"  - metric: {name}\n    aggregation: {aggregation}\n    higher_is_better: {str(higher).lower()}\n"
                   for name in names)


@pytest.fixture(scope="module")
def tasks_folder(tmp_path_factory):
    """Three lm-eval tasks, each a YAML file and its JSON-lines dataset."""
    folder = tmp_path_factory.mktemp("tasks")
    write_lines(folder / "choices.jsonl", [{"question": question, "choices": choices, "answer": answer}
                                            for question, choices, answer in QUESTIONS])
    write_lines(folder / "texts.jsonl", [{"text": text} for text in TEXTS])
    write_lines(folder / "answers.jsonl", [{"question": question, "answer": answer} for question, answer in ANSWERS])
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "tiny_choice.yaml").write_text(
        f"task: tiny_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'choices.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\nmetric_list:\n" + metrics("acc", "acc_norm"))
    (folder / "tiny_perplexity.yaml").write_text(
        f"task: tiny_perplexity\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'texts.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n" + metrics("word_perplexity", "byte_perplexity", aggregation="weighted_perplexity", higher=False))
    (folder / "tiny_generation.yaml").write_text(
        f"task: tiny_generation\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'answers.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\\n\", \".\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n" + metrics("exact_match"))
    # the same rows with settings of their own (run as a group of their own), and stop texts the tiny models write
    (folder / "tiny_generation_stops.yaml").write_text(
        (folder / "tiny_generation.yaml").read_text().replace("tiny_generation", "tiny_generation_stops")
        .replace('until: ["\\n\\n", "."]', 'until: ["o", "e"]').replace("max_gen_toks: 12", "max_gen_toks: 20"))
    return folder


@pytest.fixture(scope="module")
def task_index(tasks_folder):
    return TaskManager(include_path=str(tasks_folder), include_defaults=False)


def run_tasks(model, task_index, tasks=("tiny_choice", "tiny_perplexity", "tiny_generation", "tiny_generation_stops")) -> dict:
    return lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=task_index, log_samples=True,
                                   bootstrap_iters=0)


def responses(results: dict, task: str) -> list:
    """Each document's model answers (log-likelihoods and greedy flags, a perplexity's sum, a generated text)."""
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda sample: sample["doc_id"])]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tasks_score_as_lm_evals_own_hugging_face_model(tiny_model_folder, task_index, family):
    folder = tiny_model_folder(family)
    ours = AccelgenLM(pretrained=str(folder), device="cpu:0", dtype="float32", batch_size=4)  # lm-eval's --device form
    # the same window as ours: HFLM reads a whole context, accelgen's engine keeps a position for the token it adds
    reference = HFLM(pretrained=str(folder), dtype="float32", batch_size=4, device="cpu", max_length=ours.max_length)
    assert ours.max_length < len(reference.tok_encode(QUESTIONS[-1][0]))  # the long question is cut
    assert ours.max_length < len(reference.tok_encode(ANSWERS[-1][0]))  # the long prompt too
    expected, got = run_tasks(reference, task_index), run_tasks(ours, task_index)

    for metric in ("acc,none", "acc_norm,none"):
        assert got["results"]["tiny_choice"][metric] == expected["results"]["tiny_choice"][metric]
    for theirs, mine in zip(responses(expected, "tiny_choice"), responses(got, "tiny_choice"), strict=True):
        assert [logprob for [(logprob, _)] in mine] == pytest.approx([logprob for [(logprob, _)] in theirs], abs=1e-4)
        assert [greedy for [(_, greedy)] in mine] == [greedy for [(_, greedy)] in theirs]
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        assert got["results"]["tiny_perplexity"][metric] == pytest.approx(
            expected["results"]["tiny_perplexity"][metric], rel=1e-4)
    assert [total for [[total]] in responses(got, "tiny_perplexity")] == pytest.approx(
        [total for [[total]] in responses(expected, "tiny_perplexity")], rel=1e-5)
    assert responses(got, "tiny_generation") == responses(expected, "tiny_generation")
    assert responses(got, "tiny_generation_stops") == responses(expected, "tiny_generation_stops")
    cut = [text for [[text]] in responses(got, "tiny_generation_stops")]
    uncut = [text for [[text]] in responses(got, "tiny_generation")]
    assert any("o" in text or "e" in text for text in uncut)  # the model writes the stop texts: they cut these rows
    assert not any("o" in text or "e" in text for text in cut)
    assert got["results"]["tiny_generation"]["exact_match,none"] == expected["results"]["tiny_generation"]["exact_match,none"]


def test_an_empty_context_and_a_rolling_text_of_several_windows(tiny_model_folder):
    """An empty context is scored after the prefix token (BOS here); a text longer than the window is the sum of its
    disjoint windows, each scored as the engine scores the ids alone."""
    from lm_eval.api.instance import Instance

    generator = accelgen.load(tiny_model_folder("llama"), device="cpu", dtype="float32", batch_size=2)
    model = AccelgenLM(generator=generator, max_length=16)
    text = TEXTS[1] + " " + TEXTS[0]
    ids = model.tok_encode(text)
    assert len(ids) > 2 * 16
    [rolling] = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    [whole] = generator.score([tuple([model.prefix_token_id] + ids[:16])])
    first = sum(whole.prompt_scores.logprobs[1:])
    # each later window: its 16 tokens, read after the token before them (cut from the whole context before them)
    rest = model._loglikelihood_tokens([(None, ids[:start], ids[start:start + 16]) for start in range(16, len(ids), 16)],
                                       disable_tqdm=True)
    assert rolling == pytest.approx(first + sum(logprob for logprob, _ in rest), abs=1e-4)
    [(empty, _)] = model.loglikelihood([Instance("loglikelihood", {}, ("", text[:20]), 0)], disable_tqdm=True)
    [alone] = generator.score([tuple([model.prefix_token_id] + model.tok_encode(text[:20]))])
    assert empty == pytest.approx(sum(alone.prompt_scores.logprobs[1:]), abs=1e-5)


def test_lm_eval_finds_accelgen_by_name_beside_its_own_models():
    assert get_model("accelgen") is AccelgenLM
    assert get_model("hf") is HFLM  # registering ours first left lm-eval's built-in models in place


def test_evaluate_runs_named_tasks_writes_the_results_and_tabulates_them(tiny_model_folder, tasks_folder, tmp_path):
    output = tmp_path / "results.json"
    results = evaluate(tiny_model_folder("gpt2"), "tiny_choice", include_path=tasks_folder, builtin_tasks=False, limit=3,
                       output_path=output, device="cpu", dtype="float32", batch_size=2)
    assert json.loads(output.read_text())["results"]["tiny_choice"]["acc,none"] == results["results"]["tiny_choice"]["acc,none"]
    table = result_table(results)
    assert "tiny_choice" in table and "acc_norm" in table


def test_an_unknown_task_is_one_line_naming_it(tasks_folder):
    with pytest.raises(UsageError, match=r"^lm-evaluation-harness has no task 'tiny_choise': .*`lm_eval ls tasks`\.$"):
        evaluate("no-model-loaded", ["tiny_choice", "tiny_choise"], include_path=tasks_folder, builtin_tasks=False)


def test_without_lm_eval_the_fix_is_the_extra(monkeypatch):
    monkeypatch.setattr(lm_eval_model, "harness_installed", lambda: False)
    with pytest.raises(UsageError, match=r"^lm-evaluation-harness is not installed: pip install 'accelgen\[eval\]'$"):
        evaluate("no-model-loaded", ["tiny_choice"])


def test_a_window_larger_than_the_engine_holds_is_refused(tiny_model_folder):
    generator = accelgen.load(tiny_model_folder("gpt2"), device="cpu", dtype="float32")
    assert AccelgenLM(generator=generator).max_length == 254  # 256 positions: the scored token's and a new one's kept
    with pytest.raises(UsageError, match="max_length 256 is over the 254 tokens"):
        AccelgenLM(generator=generator, max_length=256)


def test_a_tasks_sampling_settings_are_taken_and_others_refused(tiny_model_folder):
    from lm_eval.api.instance import Instance

    model = AccelgenLM(generator=accelgen.load(tiny_model_folder("gpt2"), device="cpu", dtype="float32"))
    sampling = model._generating(4, ["x"], {"do_sample": True, "temperature": 0.7, "top_p": 0.9}).run.sampling
    assert (sampling.do_sample, sampling.temperature, sampling.top_p) == (True, 0.7, 0.9)
    assert not model._generating(4, [], {"do_sample": False, "temperature": 0.7}).run.sampling.do_sample
    request = Instance("generate_until", {}, ("Hello", {"until": ["x"], "max_gen_toks": 4, "num_beams": 2}), 0)
    with pytest.raises(UsageError, match=r"^A task's generation settings hold num_beams, which accelgen does not take"):
        model.generate_until([request])
