"""Completions held to a structure (a JSON schema, any JSON object, a regex, choices): the tokens are those Hugging Face
``generate`` chooses under the same grammar engine's mask, every row that ends by its grammar parses and validates,
rows with other structures or none share the slots without a trace of each other's, and every path of the engine
(fixed batches, continuous batching, samples, prefix reuse, chunked prefill, conversations with stop texts, int8
weights) holds them alike."""

import json

import jsonschema
import pytest
import torch
from conftest import PROMPTS
from family_models import FAMILIES, skip_unless_installed
from test_parity import _new_dtype_keyword
from tiny_models import build_model, tiny_configs
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

import accelgen
from accelgen.cli import main

llguidance = pytest.importorskip("llguidance")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                            "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}

#: Twenty schemas of the shapes extraction asks for: nested objects, enums, arrays (of objects), bounded numbers,
#: required fields, optional ones, nulls, booleans, patterns, anyOf.
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"label": {"enum": ["pos", "neg", "neutral"]},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["label", "score"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                                "y": {"type": "integer"}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "string", "maxLength": 10},
    {"enum": ["red", "green", "blue", 7, None]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 4},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "number", "minimum": -1.5, "maximum": 2.5},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}},
     "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "null"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5},
                                      "b": {"type": "string", "maxLength": 3}},
     "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "event"}, "level": {"enum": [1, 2, 3]}},
     "required": ["kind", "level"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"deep": {"type": "object", "properties": {
        "flag": {"type": "boolean"}}, "required": ["flag"], "additionalProperties": False}},
        "required": ["deep"], "additionalProperties": False}}, "required": ["inner"], "additionalProperties": False},
]
#: What JSON is written as (accelgen.generation.grammars.JSON_OPTIONS): compact, no free whitespace.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def llama(tiny_model_folder):
    return tiny_model_folder("llama")


class GrammarProcessor(LogitsProcessor):
    """A Hugging Face logits processor that holds every row to ``grammar`` with llguidance, written from the engine's
    own API: one matcher per row, fed the row's last token at each call, its mask applied to the scores."""

    def __init__(self, tokenizer, grammar: str, width: int):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=width, eos_token=[tokenizer.eos_token_id])
        self.grammar, self.width, self.matchers, self.ended = grammar, width, None, None

    def __call__(self, input_ids, scores):
        if self.matchers is None:
            self.matchers = [llguidance.LLMatcher(self.tokenizer, self.grammar) for _ in range(len(input_ids))]
            self.ended = [False] * len(input_ids)
        else:
            for row, matcher in enumerate(self.matchers):
                if not self.ended[row]:
                    token = int(input_ids[row, -1])
                    assert matcher.consume_token(token), matcher.get_error()
                    self.ended[row] = token == self.tokenizer.eos_token
        allowed = torch.zeros(len(input_ids), self.width, dtype=torch.bool)
        for row, matcher in enumerate(self.matchers):
            if self.ended[row]:
                allowed[row] = True
                continue
            words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
            allowed[row] = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[: self.width].bool()
        return scores.masked_fill(~allowed[:, : scores.shape[-1]], float("-inf"))


def hugging_face_under(folder, prompts, schema) -> list[list[int]]:
    """New token ids per prompt from ``generate`` (greedy, float32, left padding) under ``schema``, cut after EOS."""
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, **{"dtype" if _new_dtype_keyword() else "torch_dtype": torch.float32})
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    processor = GrammarProcessor(tokenizer, grammar, model.config.vocab_size)
    inputs = tokenizer(prompts, return_tensors="pt", return_token_type_ids=False, padding=True)
    output = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                            logits_processor=LogitsProcessorList([processor]))
    rows = output[:, inputs.input_ids.shape[1]:].tolist()
    return [row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row for row in rows]


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("architecture", ["llama", "bloom", "gpt2", *FAMILIES])
def test_greedy_tokens_are_hugging_faces_under_the_same_engines_mask(tiny_model_folder, architecture):
    skip_unless_installed(architecture)
    folder = tiny_model_folder(architecture)
    completions = accelgen.generate(PROMPTS, model=folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=2,
                                    json_schema=PERSON, graphs=False)
    assert [completion.completion_token_ids for completion in completions] == hugging_face_under(folder, PROMPTS, PERSON)
    for completion in completions:
        assert completion.finish_reason == "stop" and valid(completion.completion, PERSON)


def test_sampled_rows_validate_against_each_of_twenty_schemas(tiny_model_folder, tmp_path):
    """Each schema's rows, sampled at temperature 1 from random weights, on a model whose vocabulary is padded past its
    tokenizer's (the mask covers the tail: no row takes a token the tokenizer lacks)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_folder("llama"))
    folder = build_model(tmp_path / "padded", tiny_configs(len(tokenizer) + 40)["llama"])
    tokenizer.save_pretrained(folder)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"Row {number}: extract", "schema": schema}) + "\n"
                            for number, schema in enumerate(SCHEMAS * 2)))
    output = tmp_path / "out.jsonl"
    assert main(["run", "--device", "cpu", "--model", str(folder), "--dataset", str(rows), "--schema-column",
                              "schema", "--do-sample", "--seed", "11", "--max-new-tokens", "64", "--batch-size", "8",
                              "--output", str(output), "--quiet"]) == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    stopped = [(line, schema) for line, schema in zip(lines, SCHEMAS * 2) if line["finish_reason"] == "stop"]
    assert len(stopped) >= 0.9 * len(lines)
    for line, schema in stopped:
        assert valid(line["completion"], schema), (line["completion"], schema)
    assert max(token for line in lines for token in line["completion_token_ids"]) < len(tokenizer)


@pytest.mark.parametrize(("constraint", "check"), [
    (dict(regex=r"[a-z]{2,5}-[0-9]{2}"), lambda text: __import__("re").fullmatch(r"[a-z]{2,5}-[0-9]{2}", text)),
    (dict(choices=["yes", "no", "not sure"]), lambda text: text in ("yes", "no", "not sure")),
    (dict(json_object=True), lambda text: isinstance(json.loads(text), dict)),
])
def test_regex_choice_and_any_json_object(llama, constraint, check):
    completions = accelgen.generate([f"Prompt {number}" for number in range(6)], model=llama, device="cpu",
                                    max_new_tokens=48, batch_size=3, do_sample=True, seed=2, **constraint)
    for completion in completions:
        if completion.finish_reason == "stop":
            assert check(completion.completion), completion.completion
    assert sum(completion.finish_reason == "stop" for completion in completions) >= 4


def test_rows_of_other_schemas_and_rows_without_share_the_slots(llama, tmp_path):
    """A dataset whose rows each bring their schema, or none: the rows without one are token for token what a run with
    no structure at all gives them, and each constrained row validates against its own schema."""
    schemas = [SCHEMAS[0], None, SCHEMAS[2], None, SCHEMAS[3], SCHEMAS[7], None, SCHEMAS[0]]
    prompts = [f"Row {number} is about" for number in range(len(schemas))]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": prompt, "schema": None if schema is None else json.dumps(schema)}) + "\n"
                            for prompt, schema in zip(prompts, schemas)))
    output = tmp_path / "out.jsonl"
    common = ["--device", "cpu", "--model", str(llama), "--max-new-tokens", "40", "--batch-size", "3", "--quiet"]
    assert main(["run", *common, "--dataset", str(rows), "--schema-column", "schema", "--output",
                              str(output)]) == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    plain = accelgen.generate(prompts, model=llama, device="cpu", max_new_tokens=40, batch_size=3)
    for line, schema, alone in zip(lines, schemas, plain):
        if schema is None:
            assert (line["completion_token_ids"], line["finish_reason"]) == (alone.completion_token_ids, alone.finish_reason)
        else:
            assert line["finish_reason"] == "stop" and valid(line["completion"], schema)


PATHS = {
    "fixed batches": dict(batching="static", batch_size=4),
    "one slot": dict(batch_size=1),
    "prefix reuse, chunked prefill": dict(batch_size=3, prefill_chunk=8, prefix_cache="64MiB"),
    "no prefix reuse": dict(batch_size=3, prefix_cache=0),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_of_the_engine_gives_the_same_constrained_tokens(llama, path):
    """Sampled, float32: continuous batching at batch 3 against fixed batches, one slot, prefix reuse with chunked
    prefill (prompts sharing a beginning longer than a chunk: running rows take decode steps between its passes), no
    reuse."""
    prompts = [("A shared beginning of several words for every row, then " * 2) + f"row {number}" for number in range(7)]
    settings = dict(model=llama, device="cpu", max_new_tokens=40, json_schema=SCHEMAS[8], buckets=(32, 64),
                    do_sample=True, seed=1)
    reference = accelgen.generate(prompts, batch_size=3, **settings)
    other = accelgen.generate(prompts, **{**settings, **PATHS[path]})
    assert [completion.completion_token_ids for completion in other] == [c.completion_token_ids for c in reference]
    stopped = [completion for completion in reference if completion.finish_reason == "stop"]
    assert len(stopped) >= 5 and all(valid(completion.completion, SCHEMAS[8]) for completion in stopped)


def test_each_sample_follows_its_own_grammar(llama):
    generator = accelgen.load(llama, device="cpu", max_new_tokens=48, batch_size=5, do_sample=True, seed=4,
                              num_samples=4, json_schema=SCHEMAS[2])
    completions = generator.generate(["Label this", "And this one"])
    for completion in completions:
        samples = completion.completions
        assert len({sample["completion"] for sample in samples}) > 1
        assert all(valid(sample["completion"], SCHEMAS[2]) for sample in samples if sample["finish_reason"] == "stop")
    assert generator.stats.constrained_rows == 8


def test_conversations_with_stop_texts_and_int8_weights_hold_too(llama, tmp_path):
    """A conversation rendered by a chat template, with a stop text that never occurs, on int8 weights: valid JSON."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    completions = accelgen.generate([[{"role": "user", "content": f"Describe person {n}"}] for n in range(4)],
                                    model=llama, device="cpu", max_new_tokens=40, batch_size=2, chat_template=template,
                                    stop=["<never>"], quantize="int8", json_schema=PERSON)
    assert all(completion.finish_reason == "stop" and valid(completion.completion, PERSON) for completion in completions)
    assert all(completion.messages[-1]["content"] == completion.completion for completion in completions)


def test_a_row_cut_by_its_budget_says_length(llama):
    completion, = accelgen.generate(["Hello"], model=llama, device="cpu", max_new_tokens=5, json_schema=PERSON)
    assert completion.finish_reason == "length" and len(completion.completion_token_ids) == 5
    assert not valid(completion.completion, PERSON)


@pytest.mark.slow
def test_the_compiled_step_gives_the_eager_steps_tokens_and_is_captured_once(llama, tmp_path):
    """Compiled on the CPU (inductor): one decode step captured for rows that come with and without schemas, the
    same tokens as the eager step."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"Row {number} says", "schema": SCHEMAS[number] if number % 3 else None})
                            + "\n" for number in range(9)))
    outputs = {}
    for graphs in ("--graphs", "--no-graphs"):
        outputs[graphs] = tmp_path / f"out{graphs}.jsonl"
        assert main(["run", "--device", "cpu", "--model", str(llama), "--dataset", str(rows), "--schema-column", "schema",
                     "--max-new-tokens", "40", "--batch-size", "3", graphs, "--output", str(outputs[graphs]),
                     "--quiet"]) == 0
    captured, eager = ([json.loads(line)["completion_token_ids"] for line in path.read_text().splitlines()]
                       for path in outputs.values())
    assert captured == eager
    generator = accelgen.load(llama, device="cpu", max_new_tokens=40, batch_size=3, graphs=True, regex="[a-z]{3}")
    generator.generate(["One", "Two", "Three", "Four"])
    assert generator.stats.graph_captures == 1
