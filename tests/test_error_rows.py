"""Error rows (``--skip-bad-rows``): a row that cannot be completed (empty, null, not a prompt, too long for the
model's context, a conversation that is malformed or that the chat template refuses) is written in its place as
a row with ``finish_reason: "error"`` and ``error: "<why>"``; every other row completes as it would alone, the
summary counts them, and a resume does not retry them. Without the flag the run stops at the first, in one line."""

import json

import pytest
from test_conversations import TEMPLATE

import accelgen
from accelgen.cli import main

MAX_NEW_TOKENS = 6
GOOD = ["Hello there", "The quick brown fox", "DeepSpeed is", "a b c d"]
TOO_LONG = "hello " * 400  # past the tiny models' 256-position context


def run(capsys, *arguments):
    status = main(["run", "--device", "cpu", "--max-new-tokens", str(MAX_NEW_TOKENS), "--quiet", "--batch-size", "2",
                   *map(str, arguments)])
    error = capsys.readouterr().err
    return status, error


def rows_of(path):
    # lines end at \n only: str.splitlines() also splits at characters a completion may hold (U+0085, U+2028)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def test_bad_text_rows_become_error_rows_and_the_others_complete_as_alone(tiny_model_folder, tmp_path, capsys):
    folder = tiny_model_folder("llama")
    values = [GOOD[0], "", GOOD[1], None, TOO_LONG, GOOD[2], 7, GOOD[3]]
    dataset, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    dataset.write_text("".join(json.dumps({"text": value}) + "\n" for value in values))
    command = ["--model", folder, "--dataset", dataset, "--output", output, "--skip-bad-rows"]
    status, error = run(capsys, *command)
    assert status == 0, error
    rows = rows_of(output)
    assert [row["index"] for row in rows] == list(range(len(values)))
    bad = {1: "is empty", 3: "is null", 4: "exceeds the model's context", 6: "not text"}
    for row in rows:
        if row["index"] in bad:
            assert row["finish_reason"] == "error" and row["completion_token_ids"] == [] and row["completion"] == ""
            assert bad[row["index"]] in row["error"], row["error"]
        else:
            assert "error" not in row and row["finish_reason"] in ("eos", "length")
    alone = accelgen.generate(GOOD, model=folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=2)
    assert [row["completion_token_ids"] for row in rows if "error" not in row] == [
        completion.completion_token_ids for completion in alone]
    assert f"accelgen: 4 of 8 rows could not be completed and were written as error rows in {output}" in error

    before = output.read_bytes()
    status, error = run(capsys, *command)  # the same command again: the error rows are answers, not retried
    assert status == 0 and "nothing to do" in error
    assert output.read_bytes() == before


def test_a_run_of_bad_rows_alone_still_writes_every_row(tiny_model_folder, tmp_path, capsys):
    dataset, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    values = ["", "", "", "", "", GOOD[0]]  # more bad rows in a row than slots
    dataset.write_text("".join(json.dumps({"text": value}) + "\n" for value in values))
    status, error = run(capsys, "--model", tiny_model_folder("llama"), "--dataset", dataset, "--output", output,
                        "--skip-bad-rows")
    assert status == 0, error
    assert [row["finish_reason"] == "error" for row in rows_of(output)] == [True] * 5 + [False]


@pytest.mark.parametrize("value", [None, "  "])
def test_a_run_whose_every_row_is_an_error_row_says_so_and_exits_3(tiny_model_folder, tmp_path, capsys, value):
    """Five rows of nulls (a column of type null) or of blanks: five error rows, and a status a script tells from success."""
    dataset, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    dataset.write_text((json.dumps({"text": value}) + "\n") * 5)
    status, error = run(capsys, "--model", tiny_model_folder("llama"), "--dataset", dataset, "--output", output,
                        "--skip-bad-rows")
    assert status == 3, error
    assert [(row["index"], row["finish_reason"]) for row in rows_of(output)] == [(index, "error") for index in range(5)]
    assert error.splitlines()[-1] == (f"accelgen: error: none of the 5 rows could be completed: each was written as an "
                                      f"error row in {output} (finish_reason \"error\", the reason in \"error\"): fix "
                                      f"them, then run again with --overwrite.")
    assert "Traceback" not in error


def test_a_column_of_nulls_without_the_flag_names_its_first_row(tiny_model_folder, tmp_path, capsys):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"text": null}\n' * 5)
    status, error = run(capsys, "--model", tiny_model_folder("llama"), "--dataset", dataset)
    assert status == 2 and error == (f"accelgen: error: Dataset '{dataset}' row 0, column 'text', is null (no text): fill "
                                     f"it in, or remove that row (rows count from 0, as the output's \"index\").\n")


def test_bad_conversations_become_error_rows(tiny_model_folder, tmp_path, capsys):
    from test_conversations import write_rows

    folder = tmp_path / "chat"
    import shutil

    from transformers import AutoTokenizer
    shutil.copytree(tiny_model_folder("llama"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = ("{% for message in messages %}{% if message['role'] == 'tool' %}"
                               "{{ raise_exception('no tools here') }}{% endif %}{% endfor %}" + TEMPLATE)
    tokenizer.save_pretrained(folder)
    conversations = [
        [{"role": "user", "content": "Hello there"}],
        [{"role": "user", "content": "   "}],
        [{"role": "tool", "content": "refused by the template"}],
        [{"role": "user", "content": TOO_LONG}],
        [{"role": "user", "content": "The quick brown fox"}],
        [{"from": "martian", "value": "ack"}],
        "a text among conversations",
    ]
    dataset, output = write_rows(tmp_path / "chats.jsonl", conversations), tmp_path / "out.jsonl"
    status, error = run(capsys, "--model", folder, "--dataset", dataset, "--column", "messages", "--output", output,
                        "--skip-bad-rows")
    assert status == 0, error
    rows = rows_of(output)
    assert [row["finish_reason"] == "error" for row in rows] == [False, True, True, True, False, True, True]
    assert rows[6]["error"] == "is a text, not a conversation (a list of {role, content} messages)"
    assert "no text" in rows[1]["error"] and "no tools here" in rows[2]["error"]
    assert rows[5]["error"].startswith("message 0 is from 'martian', not one of ShareGPT's speakers (human, gpt")


@pytest.mark.parametrize("value, message", [("", "row 1, column 'text', is empty"), (TOO_LONG, "row 1 (column 'text'): A prompt of")])
def test_without_the_flag_the_first_bad_row_stops_the_run_in_one_line(tiny_model_folder, tmp_path, capsys, value,
                                                                      message):
    dataset, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    dataset.write_text("".join(json.dumps({"text": text}) + "\n" for text in [GOOD[0], value, GOOD[1]]))
    status, error = run(capsys, "--model", tiny_model_folder("llama"), "--dataset", dataset, "--output", output)
    assert status == 2 and message in error and error.count("accelgen: error:") == 1, error
