"""A row kept on resume must still be the row it completes: a line of a stopped run's output whose prompt was edited
by hand is refused in one ``accelgen: error:`` line naming it (exit status 2, no traceback, every file left as it
was), while edits of a completion are the user's own and resume. Each kind of line is covered: text rows (cut to
--max-input-tokens too), prompts given on the command line, conversations, several samples, error rows and OpenAI
batch output lines (whose custom_id names their request). Once the edit is undone, the run resumes to exactly
what an uninterrupted one writes.

A stopped run is the first lines of an uninterrupted run's output with its run record, as a run stopped there
leaves them (``tests/test_runs_in_conflict.py``); every run calls ``accelgen.cli.main`` on the built-in model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import one_error_line
from test_conversations import TEMPLATE

from accelgen.cli import main

QUICK = ["run", "--device", "cpu", "--max-new-tokens", "3", "--quiet"]
TEXTS = ["In the beginning", "And God said", "Let there be light", "And it was so"]
KEPT = 2  # lines of the stopped run; the edits are made to its second line (row 1)


def jsonl(rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def texts(folder: Path) -> list[str]:
    (folder / "rows.jsonl").write_text(jsonl({"text": text} for text in TEXTS))
    return ["--dataset", str(folder / "rows.jsonl")]


def cut_texts(folder: Path) -> list[str]:
    return [*texts(folder), "--max-input-tokens", "2"]


def prompts(folder: Path) -> list[str]:
    return [argument for text in TEXTS for argument in ("--prompt", text)]


def conversations(folder: Path) -> list[str]:
    (folder / "template.jinja").write_text(TEMPLATE)
    rows = [[{"role": "user", "content": TEXTS[0]}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]}],
            [{"role": "user", "content": TEXTS[2]}, {"role": "assistant", "content": "And"}],  # continued
            [{"role": "user", "content": TEXTS[3]}]]
    (folder / "rows.jsonl").write_text(jsonl({"messages": row} for row in rows))
    return ["--dataset", str(folder / "rows.jsonl"), "--column", "messages", "--chat-template",
            str(folder / "template.jinja")]


def samples(folder: Path) -> list[str]:
    return [*texts(folder), "--num-samples", "2", "--do-sample", "--seed", "3"]


def error_rows(folder: Path) -> list[str]:
    (folder / "rows.jsonl").write_text(jsonl({"text": text} for text in [TEXTS[0], "", *TEXTS[2:]]))
    return ["--dataset", str(folder / "rows.jsonl"), "--skip-bad-rows"]


def batch(folder: Path) -> list[str]:
    requests = [{"custom_id": f"request-{number}", "method": "POST", "url": "/v1/completions", "body": {"prompt": text}}
                for number, text in enumerate(TEXTS)]
    (folder / "requests.jsonl").write_text(jsonl(requests))
    return ["--dataset", str(folder / "requests.jsonl")]


def stopped_run(folder: Path, capsys, kind) -> tuple[list[str], Path, Path]:
    """(the run's arguments, but --output; an uninterrupted run's output; the output of that run stopped after
    :data:`KEPT` rows)."""
    arguments = kind(folder)
    whole, stopped = folder / "whole.jsonl", folder / "out.jsonl"
    assert main([*QUICK, *arguments, "--output", str(whole)]) == 0
    capsys.readouterr()
    stopped.write_bytes(b"".join(whole.read_bytes().splitlines(keepends=True)[:KEPT]))
    shutil.copy(f"{whole}.run.json", f"{stopped}.run.json")
    return arguments, whole, stopped


def edit_second_line(output: Path, edit) -> None:
    """Edit the second line of ``output`` by hand: ``edit`` changes its fields in place."""
    lines = output.read_text().splitlines(keepends=True)
    line = json.loads(lines[1])
    edit(line)
    lines[1] = json.dumps(line, ensure_ascii=False) + "\n"
    output.write_text("".join(lines))


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` and its bytes."""
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def lines_of(output: Path) -> list[dict]:
    """The output's lines, without what depends on when they were written (a batch line's ``created``)."""
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    for line in lines:
        if isinstance(line.get("response"), dict):
            line["response"]["body"].pop("created")
    return lines


def resumes(capsys, arguments: list[str], output: Path, rows: int = KEPT) -> None:
    capsys.readouterr()
    assert main([*QUICK, *arguments, "--output", str(output)]) == 0
    assert f"resuming: {rows} rows already in" in capsys.readouterr().err


def set_field(name: str, value):
    def edit(line: dict) -> None:
        line[name] = value
    return edit


def drop_field(name: str):
    return lambda line: line.pop(name)


def edit_user_message(line: dict) -> None:
    line["messages"][1]["content"] = "And Moses said"


EDITED_PROMPT = "had its prompt edited since it was written (it no longer matches its prompt_sha256)"


@pytest.mark.parametrize("kind, edit, clause", [
    (texts, set_field("prompt", "And Moses said"), EDITED_PROMPT),
    (texts, drop_field("prompt_sha256"), "has lost its prompt_sha256, which every line of this output was written with"),
    (cut_texts, set_field("prompt", "And"), EDITED_PROMPT),
    (prompts, set_field("prompt", "And Moses said"), EDITED_PROMPT),
    (conversations, edit_user_message, EDITED_PROMPT),  # its messages before the reply: the row itself
    (conversations, lambda line: line.update(prompt=line["prompt"].replace("God", "Moses")), EDITED_PROMPT),
    (samples, set_field("prompt", "And Moses said"), EDITED_PROMPT),
    (error_rows, set_field("prompt", "And God said"), EDITED_PROMPT),
    (batch, set_field("custom_id", "request-7"),
     "has custom_id 'request-7' where the batch file's request of that row has 'request-1'"),
], ids=["text", "text-digest-dropped", "cut-text", "prompts", "conversation-messages", "conversation-prompt",
        "samples", "error-row", "batch"])
def test_a_line_whose_prompt_was_edited_is_refused_naming_it_until_the_edit_is_undone(tmp_path, capsys, kind, edit,
                                                                                      clause):
    arguments, whole, stopped = stopped_run(tmp_path, capsys, kind)
    written = stopped.read_bytes()
    edit_second_line(stopped, edit)
    before = snapshot(tmp_path)
    assert main([*QUICK, *arguments, "--output", str(stopped)]) == 2
    error = one_error_line(capsys)
    assert error == (f"accelgen: error: --output '{stopped}' line 2 (row 1) {clause}: kept, it would stand for a row "
                     f"that says otherwise; restore that line, keep its first 1 lines (head -n 1) to resume after "
                     f"them, or pass --overwrite to start it again.\n")
    assert snapshot(tmp_path) == before  # nothing written, nothing lost
    stopped.write_bytes(written)  # the edit undone: the run resumes to what an uninterrupted one writes
    resumes(capsys, arguments, stopped)
    assert lines_of(stopped) == lines_of(whole)


def test_the_fixes_the_refusal_names_resume(tmp_path, capsys):
    arguments, whole, stopped = stopped_run(tmp_path, capsys, texts)
    edit_second_line(stopped, set_field("prompt", "And Moses said"))
    stopped.write_bytes(stopped.read_bytes().splitlines(keepends=True)[0])  # head -n 1
    resumes(capsys, arguments, stopped, rows=1)
    assert stopped.read_bytes() == whole.read_bytes()
    edit_second_line(stopped, set_field("prompt", "And Moses said"))
    assert main([*QUICK, *arguments, "--output", str(stopped), "--overwrite"]) == 0
    assert stopped.read_bytes() == whole.read_bytes()


def edit_reply(line: dict) -> None:
    line["completion"] = line["messages"][-1]["content"] = "Amen"


def edit_choice(line: dict) -> None:
    line["response"]["body"]["choices"][0]["text"] = "Amen"


@pytest.mark.parametrize("kind, edit", [
    (texts, set_field("completion", "Amen")),
    (conversations, edit_reply),
    (samples, lambda line: line["completions"][1].update(completion="Amen")),
    (error_rows, set_field("error", "my own note")),
    (batch, edit_choice),
], ids=["text", "conversation", "samples", "error-row", "batch"])
def test_an_edited_completion_is_the_users_own_and_resumes(tmp_path, capsys, kind, edit):
    arguments, whole, stopped = stopped_run(tmp_path, capsys, kind)
    edit_second_line(stopped, edit)
    edited = stopped.read_bytes()
    resumes(capsys, arguments, stopped)
    assert stopped.read_bytes().startswith(edited)  # kept as edited
    expected = lines_of(whole)
    edit(expected[1])
    assert lines_of(stopped) == expected


def test_an_edited_row_is_named_when_the_dataset_changed_too(tmp_path, capsys):
    """Rows appended to the dataset make the run compare the rows done with the dataset's: the edited line is
    named as edited, not taken for a change of the dataset."""
    arguments, whole, stopped = stopped_run(tmp_path, capsys, texts)
    dataset = Path(arguments[1])
    dataset.write_text(dataset.read_text() + jsonl([{"text": "And the evening"}]))
    edit_second_line(stopped, set_field("prompt", "And Moses said"))
    before = snapshot(tmp_path)
    assert main([*QUICK, *arguments, "--output", str(stopped)]) == 2
    assert f"--output '{stopped}' line 2 (row 1) {EDITED_PROMPT}" in one_error_line(capsys)
    assert snapshot(tmp_path) == before


def test_an_output_written_before_lines_carried_a_digest_resumes_as_it_did(tmp_path, capsys):
    arguments, whole, stopped = stopped_run(tmp_path, capsys, texts)
    old_lines = [{name: value for name, value in line.items() if name != "prompt_sha256"} for line in lines_of(stopped)]
    stopped.write_text(jsonl(old_lines))
    record_file = Path(f"{stopped}.run.json")
    record = json.loads(record_file.read_text())
    assert record.pop("line_digest") == "prompt_sha256"
    record_file.write_text(json.dumps(record))
    old = stopped.read_bytes()
    resumes(capsys, arguments, stopped)
    assert stopped.read_bytes().startswith(old)
    assert lines_of(stopped) == [*old_lines, *lines_of(whole)[KEPT:]]
    assert "line_digest" not in json.loads(record_file.read_text())  # resumed as it was started
