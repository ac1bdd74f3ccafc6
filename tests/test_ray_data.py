"""accelgen as a stage of a Ray Data pipeline (``accelgen.ray``): ``complete_dataset`` and ``Completions`` used with
``map_batches`` complete every row as ``accelgen.generate`` completes the same prompts on this machine (sampled rows
as the prompt at the row's number), carry the input columns through, make a bad row an error row, and say in one
line which prompt column a batch lacks. One local Ray instance of two CPUs for the module, the built-in model.

Each test's Ray Data stage is defined just above it (``@stage``); the module starts them all at once, in threads of the
driver, and a test waits for its own: a replica spends its seconds loading torch and the model on one core, and one
stage after another the file took twice as long on two cores. The stages of several replicas run one after another:
a pool holds the actors it has while it waits for the others, and two started at once, each holding one of the two
CPUs, waited for ever."""

import concurrent.futures
import threading

import numpy
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

import accelgen  # noqa: E402
from accelgen.ray import Completions, complete_dataset  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.xdist_group("ray_data")]

MAX_NEW_TOKENS = 8
TEXTS = [
    "DeepSpeed is a machine learning framework",
    "Hello",
    "The quick brown fox jumps over the lazy dog while",
    "In the beginning",
    "And the king said unto them",
    "Once upon a time there was",
    "The river runs",
    "Blessed are they",
    "a b c d",
    "Where shall we go",
    "Numbers one two three",
    "The house of the LORD",
]
#: The greedy dataset's rows: an "id" and a "text" each; ids 5 and 6 (one batch of four, with good rows) are bad.
BAD = {5: "", 6: None}
GREEDY_ROWS = [{"id": number, "text": BAD.get(number, text)} for number, text in enumerate(TEXTS[:5] + [""] * 2 + TEXTS[5:])]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, how are you"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}],
    [{"role": "user", "content": "Start a story"}, {"role": "assistant", "content": "Once upon a"}],
]
SAMPLING = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": True, "seed": 1234}
NUMBERS = [5, 2, 7, 0, 3, 6, 1, 4]  # the sampled rows' "id"s, in dataset order: not their order

#: The module's Ray Data stages by name: each makes a lazy dataset; with its number of replicas.
STAGES = {}


def stage(replicas: int = 1):
    def register(make):
        STAGES[make.__name__] = (make, replicas)
        return make
    return register


def by_id(rows: list[dict]) -> dict[int, dict]:
    """Ray Data's rows by their "id" (Ray keeps no order across replicas)."""
    found = {row["id"]: row for row in rows}
    assert len(found) == len(rows), "a row came out twice"
    return found


@pytest.fixture(scope="module")
def local_ray():
    """A new local Ray instance of two CPUs (never a cluster ``ray start`` left running), its progress bars off."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    context = ray.data.DataContext.get_current()
    bars = context.enable_progress_bars
    context.enable_progress_bars = False
    yield
    context.enable_progress_bars = bars
    ray.shutdown()


@pytest.fixture(scope="module")
def rows_of(local_ray):
    """``rows_of(name)``: the rows of stage ``name`` by id, or what its execution raised. The stages of one replica
    start at once, those of several one after another beside them; Ray runs the replicas as its two CPUs free up."""
    futures = {name: concurrent.futures.Future() for name in STAGES}

    def run(names):
        for name in names:
            try:
                futures[name].set_result(by_id(STAGES[name][0]().take_all()))
            except Exception as error:  # noqa: BLE001 - the test of the stage raises it
                futures[name].set_exception(error)

    several = [name for name, (_, replicas) in STAGES.items() if replicas > 1]
    lanes = [several] + [[name] for name, (_, replicas) in STAGES.items() if replicas == 1]
    threads = [threading.Thread(target=run, args=(lane,), daemon=True) for lane in lanes]
    for thread in threads:
        thread.start()
    yield lambda name: futures[name].result(timeout=300)
    for thread in threads:
        thread.join(timeout=60)


@pytest.fixture(scope="module")
def greedy():
    """The built-in model loaded here, greedy, with the settings the Ray stages are given: the reference."""
    return accelgen.load(max_new_tokens=MAX_NEW_TOKENS)


def good_rows(rows: dict[int, dict]) -> dict[int, dict]:
    return {number: row for number, row in rows.items() if number not in BAD}


@stage(replicas=2)
def two_replicas():
    return complete_dataset(ray.data.from_items(GREEDY_ROWS), replicas=2, rows_per_batch=4, max_new_tokens=MAX_NEW_TOKENS)


def test_two_replicas_complete_each_row_as_accelgen_generate_does_and_keep_its_columns(rows_of, greedy):
    rows = rows_of("two_replicas")
    assert sorted(rows) == list(range(len(GREEDY_ROWS)))
    good = good_rows(rows)
    local = greedy.generate([row["text"] for row in good.values()])
    for (number, row), expected in zip(good.items(), local):
        assert {"id", "text", "index", "prompt", "completion", "finish_reason"} <= row.keys()
        assert row["text"] == row["prompt"] == GREEDY_ROWS[number]["text"]
        assert isinstance(row["index"], int)
        assert (row["completion"], row["completion_token_ids"], row["finish_reason"]) == (
            expected.completion, expected.completion_token_ids, expected.finish_reason), number
        assert row["prompt_token_count"] == expected.prompt_token_count
    assert len({row["completion"] for row in good.values()}) > 1  # the prompts are read, not one text for all


@stage(replicas=2)  # one replica of two ranks: in the lane of several, one stage after another
def tensor_parallel():
    rows = [row for row in GREEDY_ROWS if row["id"] not in BAD]
    return complete_dataset(ray.data.from_items(rows), world_size=2, num_cpus=1, rows_per_batch=4, dtype="float32",
                            max_new_tokens=MAX_NEW_TOKENS)


def test_a_replica_split_over_two_ranks_completes_each_row_as_one_process_does(rows_of):
    # DeepSpeed AutoTP over two ranks of the actor's node, in float32: the split's tokens are one process's
    rows = rows_of("tensor_parallel")
    local = accelgen.load(max_new_tokens=MAX_NEW_TOKENS, dtype="float32").generate([row["text"] for row in rows.values()])
    assert [row["completion_token_ids"] for row in rows.values()] == [expected.completion_token_ids for expected in local]


def test_a_bad_row_is_an_error_row_saying_why_and_the_others_complete(rows_of):
    rows = rows_of("two_replicas")
    assert rows[5]["finish_reason"] == rows[6]["finish_reason"] == "error"
    assert (rows[5]["error"], rows[6]["error"]) == ("is empty", "is null (no text)")
    assert rows[5]["completion"] == rows[6]["completion"] == ""
    for number, row in good_rows(rows).items():
        assert row["finish_reason"] in ("length", "stop") and row.get("error") is None, number
        assert row["completion_token_ids"], number


@stage()
def map_batches():
    return ray.data.from_items(GREEDY_ROWS).map_batches(Completions, fn_constructor_kwargs={"max_new_tokens": MAX_NEW_TOKENS},
                                                        compute=ray.data.ActorPoolStrategy(size=1), batch_size=4)


def test_completions_with_map_batches_is_complete_dataset(rows_of):
    rows, reference = rows_of("map_batches"), rows_of("two_replicas")
    assert rows.keys() == reference.keys()
    fields = ("text", "prompt", "completion", "completion_token_ids", "prompt_token_count", "finish_reason", "error")
    for number, row in rows.items():
        assert {name: row.get(name) for name in fields} == {name: reference[number].get(name) for name in fields}, number


@stage()
def sampled():
    items = [{"id": number, "text": text} for number, text in zip(NUMBERS, TEXTS)]
    return complete_dataset(ray.data.from_items(items), rows_per_batch=3, number_column="id", **SAMPLING)


def test_sampled_rows_draw_as_the_prompt_at_their_number(rows_of):
    # a row's draws must follow its "id", not its place in the dataset nor in its batch
    texts = TEXTS[:len(NUMBERS)]
    at_number = [texts[NUMBERS.index(number)] for number in range(len(NUMBERS))]
    sampler = accelgen.load(**SAMPLING)
    local = sampler.generate(at_number)
    rows = rows_of("sampled")
    assert sorted(rows) == list(range(len(NUMBERS)))
    for number, row in rows.items():
        assert row["index"] == number
        assert row["text"] == at_number[number]
        assert (row["completion"], row["completion_token_ids"]) == (
            local[number].completion, local[number].completion_token_ids), number
    # the check can fail: the same prompts drawn at their places in the dataset come out otherwise
    in_dataset_order = sampler.generate(texts)
    assert any(in_dataset_order[place].completion != rows[number]["completion"] for place, number in enumerate(NUMBERS))


@stage()
def conversations():
    items = [{"id": number, "conversation": messages} for number, messages in enumerate(CONVERSATIONS)]
    return complete_dataset(ray.data.from_items(items), column="conversation", max_new_tokens=MAX_NEW_TOKENS)


def test_a_conversation_column_completes_with_the_chat_template_and_gives_messages(rows_of, greedy):
    local = greedy.generate(CONVERSATIONS)
    rows = rows_of("conversations")
    for number, messages in enumerate(CONVERSATIONS):
        row, expected = rows[number], local[number]
        assert row["conversation"] == messages  # the input column, as it was
        assert (row["prompt"], row["completion"], row["completion_token_ids"]) == (
            expected.prompt, expected.completion, expected.completion_token_ids), number
        assert row["prompt"].startswith("<|") and row["finish_reason"] != "error"  # the template's rendering
        assert row["messages"] == expected.messages
    assert rows[0]["messages"] == [*CONVERSATIONS[0], {"role": "assistant", "content": rows[0]["completion"]}]
    # a final assistant turn is continued in place
    assert rows[2]["messages"][-1] == {"role": "assistant", "content": "Once upon a" + rows[2]["completion"]}


def check_own_lengths(rows: dict[int, dict], asked: list[int | None], greedy) -> None:
    """Each row has as many new tokens as its column asks (None: the run's), greedy: a prefix of the run's."""
    local = greedy.generate(TEXTS[:len(asked)])
    assert all(completion.finish_reason == "length" for completion in local)  # no row ends early on its own
    for number, tokens in enumerate(asked):
        row, expected = rows[number], local[number].completion_token_ids
        assert row["finish_reason"] == "length", number
        assert len(row["completion_token_ids"]) == (tokens or MAX_NEW_TOKENS), number
        assert row["completion_token_ids"] == expected[:len(row["completion_token_ids"])], number


ASKED = [2, 5, 8, 3]


@stage()
def own_lengths():
    items = [{"id": number, "text": text, "max_new_tokens": tokens} for number, (text, tokens) in enumerate(zip(TEXTS, ASKED))]
    return complete_dataset(ray.data.from_items(items), settings_columns=True, max_new_tokens=MAX_NEW_TOKENS)


def test_settings_columns_give_each_row_its_own_max_new_tokens(rows_of, greedy):
    check_own_lengths(rows_of("own_lengths"), ASKED, greedy)


def test_a_null_in_a_settings_column_is_the_runs_setting(greedy):
    # the batch as Ray Data hands map_batches an integer column with a null (seen with ray 2.60): float64, NaN for
    # null; called here, where a Ray stage of its own would cost a replica's load
    asked = [2, None, 5]
    completions = Completions(settings_columns=True, max_new_tokens=MAX_NEW_TOKENS)
    batch = completions({"id": numpy.arange(len(asked)), "text": numpy.array(TEXTS[:len(asked)], dtype=object),
                         "max_new_tokens": numpy.array([numpy.nan if tokens is None else tokens for tokens in asked])})
    rows = {number: {name: values[number] for name, values in batch.items()} for number in range(len(asked))}
    check_own_lengths(rows, asked, greedy)


@stage()
def missing_column():
    return complete_dataset(ray.data.from_items([{"id": 0, "text": "Hello"}]), column="prompt", max_new_tokens=MAX_NEW_TOKENS)


def test_a_missing_prompt_column_is_one_usage_error_naming_it(rows_of):
    with pytest.raises(Exception) as raised:  # noqa: B017 - Ray wraps it (RayTaskError(UserCodeException)): its text
        rows_of("missing_column")
    assert ("UsageError: the batch has no column 'prompt' (its columns: id, text): pass column= the one holding the "
            "prompts.") in str(raised.value)
