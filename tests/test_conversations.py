"""Conversations for instruction models: a column of messages (``--column messages``), ShareGPT's rows, ``--chat``
and ``--system-prompt``, rendered by the tokenizer's chat template (or ``--chat-template FILE``) into the very ids
Hugging Face's ``apply_chat_template`` gives, completed as Hugging Face ``generate`` completes those ids."""

import json
import os
import shutil

import pytest
import torch
from conftest import one_error_line, one_error_line_in
from test_parity import _new_dtype_keyword
from transformers import AutoModelForCausalLM, AutoTokenizer

import accelgen
from accelgen.cli import main

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

MAX_NEW_TOKENS = 10
#: A template in the usual shape: BOS once, a marker per role, EOS after each message, the assistant's marker as
#: the generation prompt.
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
OTHER_TEMPLATE = TEMPLATE.replace("<|{{ message['role'] }}|>", "[{{ message['role'] }}]: ")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, how are you"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}],
    [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello"},
     {"role": "user", "content": "Again, and more"}],
    [{"role": "user", "content": "Start a story"}, {"role": "assistant", "content": "Once upon a"}],  # continued
]


@pytest.fixture
def chat_model(tiny_model_folder, tmp_path):
    """The tiny Llama with a chat template in its tokenizer."""
    folder = tmp_path / "chat-llama"
    shutil.copytree(tiny_model_folder("llama"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def write_rows(path, rows, column="messages"):
    path.write_text("".join(json.dumps({column: row}) + "\n" for row in rows))
    return path


def run_rows(capsys, *arguments):
    status = main(["run", "--device", "cpu", "--max-new-tokens", str(MAX_NEW_TOKENS), "--quiet", *map(str, arguments)])
    error = capsys.readouterr().err
    assert status == 0, error
    return error


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def template_ids(folder, messages, template=None):
    """Hugging Face's own ids for ``messages``: the generation prompt added, or a final assistant turn continued."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    continues = messages[-1]["role"] == "assistant"
    encoded = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                            add_generation_prompt=not continues, continue_final_message=continues)
    return list(encoded["input_ids"])


def hf_greedy(folder, ids, max_new_tokens=MAX_NEW_TOKENS):
    """Hugging Face ``generate``'s new tokens for ``ids`` (greedy, float32), cut after EOS."""
    dtype = {"dtype" if _new_dtype_keyword() else "torch_dtype": torch.float32}
    model = AutoModelForCausalLM.from_pretrained(folder, **dtype)
    output = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.config.pad_token_id)
    new = output[0, len(ids):].tolist()
    eos = model.config.eos_token_id
    return new[: new.index(eos) + 1] if eos in new else new


def test_conversations_are_the_templates_own_ids_and_complete_as_hugging_face_does(chat_model, tmp_path, capsys):
    dataset, output = write_rows(tmp_path / "chats.jsonl", CONVERSATIONS), tmp_path / "out.jsonl"
    run_rows(capsys, "--model", chat_model, "--dataset", dataset, "--column", "messages", "--output", output,
             "--batch-size", "2")
    rows = rows_of(output)
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    for row, messages in zip(rows, CONVERSATIONS, strict=True):
        ids = template_ids(chat_model, messages)
        assert ids.count(tokenizer.bos_token_id) == 1  # the template's BOS, not a second one from tokenizing again
        assert row["prompt_token_count"] == len(ids)
        assert row["prompt"] == tokenizer.decode(ids)  # what the model saw, markers included
        assert row["completion_token_ids"] == hf_greedy(chat_model, ids)
        assert row["messages"][: len(messages) - 1] == messages[:-1]
    # an answered conversation gains the assistant's reply; a final assistant turn is continued in place
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": rows[0]["completion"]}
    assert len(rows[0]["messages"]) == 2
    assert rows[3]["messages"][-1] == {"role": "assistant", "content": "Once upon a" + rows[3]["completion"]}
    assert len(rows[3]["messages"]) == 2


def test_the_python_api_takes_lists_of_messages_as_the_command_line_takes_rows(chat_model, tmp_path, capsys):
    dataset, output = write_rows(tmp_path / "chats.jsonl", CONVERSATIONS), tmp_path / "out.jsonl"
    run_rows(capsys, "--model", chat_model, "--dataset", dataset, "--column", "messages", "--output", output)
    completions = accelgen.generate(CONVERSATIONS, model=chat_model, device="cpu", max_new_tokens=MAX_NEW_TOKENS)
    assert [(completion.completion_token_ids, completion.messages) for completion in completions] == [
        (row["completion_token_ids"], row["messages"]) for row in rows_of(output)]


def test_sharegpt_rows_are_the_same_conversations(chat_model, tmp_path, capsys):
    speakers = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = [[{"from": speakers[message["role"]], "value": message["content"]} for message in conversation]
                for conversation in CONVERSATIONS]
    outputs = []
    for name, rows in (("openai", CONVERSATIONS), ("sharegpt", sharegpt)):
        dataset, output = write_rows(tmp_path / f"{name}.jsonl", rows, column="conversations"), tmp_path / f"{name}-out.jsonl"
        run_rows(capsys, "--model", chat_model, "--dataset", dataset, "--column", "conversations", "--output", output)
        outputs.append([(row["completion_token_ids"], row["messages"]) for row in rows_of(output)])
    assert outputs[0] == outputs[1]


def test_a_system_prompt_comes_first_in_conversations_without_one(chat_model, tmp_path, capsys):
    dataset, output = write_rows(tmp_path / "chats.jsonl", CONVERSATIONS[:2]), tmp_path / "out.jsonl"
    run_rows(capsys, "--model", chat_model, "--dataset", dataset, "--column", "messages", "--output", output,
             "--system-prompt", "You are a pirate.")
    rows = rows_of(output)
    with_system = [{"role": "system", "content": "You are a pirate."}, *CONVERSATIONS[0]]
    assert rows[0]["prompt_token_count"] == len(template_ids(chat_model, with_system))
    assert rows[0]["messages"][:2] == with_system
    assert rows[1]["messages"][0] == CONVERSATIONS[1][0]  # the row's own system message is kept


def test_chat_makes_each_prompt_one_user_message(chat_model, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    run_rows(capsys, "--model", chat_model, "--prompt", "Hello there, how are you", "--chat", "--output", output)
    [row] = rows_of(output)
    ids = template_ids(chat_model, CONVERSATIONS[0])
    assert row["prompt_token_count"] == len(ids) and row["completion_token_ids"] == hf_greedy(chat_model, ids)
    assert row["messages"][0] == CONVERSATIONS[0][0]


def test_a_template_file_renders_instead_of_the_tokenizers_and_a_resume_with_another_is_refused(
        chat_model, tmp_path, capsys):
    template = tmp_path / "template.jinja"
    template.write_text(OTHER_TEMPLATE)
    dataset, output = write_rows(tmp_path / "chats.jsonl", CONVERSATIONS), tmp_path / "out.jsonl"
    command = ["--model", chat_model, "--dataset", dataset, "--column", "messages", "--output", output]
    run_rows(capsys, *command, "--chat-template", template)
    assert [row["prompt_token_count"] for row in rows_of(output)] == [
        len(template_ids(chat_model, messages, OTHER_TEMPLATE)) for messages in CONVERSATIONS]
    status = main(["run", "--device", "cpu", "--max-new-tokens", str(MAX_NEW_TOKENS), *map(str, command)])
    assert status == 2  # the tokenizer's own template now: not the run that wrote the file
    assert "holds completions of another run (different chat_template_sha256)" in one_error_line(capsys)


@pytest.mark.parametrize(("rows", "arguments", "message"), [
    ([[{"role": "user", "content": "hi"}], [{"speaker": "user", "text": "hi"}]], [],
     "row 1, column 'messages', message 0 is not {role, content} text"),
    ([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "  "}]], [],
     "row 1, column 'messages', is a conversation with no text"),
    ([[{"role": "user", "content": "hi " * 40}]], ["--max-input-tokens", "8"],
     "row 0 (column 'messages') makes"),
    ([[{"role": "user", "content": "hi"}], "plain text in a column of conversations", [{"role": "user", "content": "yo"}]],
     [], "row 1, column 'messages', is a text, not a conversation (a list of {role, content} messages): make it one, e.g. "
         "[{\"role\": \"user\", \"content\": ...}], or remove that row"),
    (["plain text first", [{"role": "user", "content": "hi"}]], ["--streaming"],
     "row 0, column 'messages', is a text, not a conversation"),
    ([[{"from": "human", "value": "hi"}], [{"from": "human", "value": "hi"}, {"from": "martian", "value": "ack"}]], [],
     "row 1, column 'messages', message 1 is from 'martian', not one of ShareGPT's speakers (human, gpt, system, "
     "user, assistant, tool, function_call, observation): fix it, or remove that row"),
])
def test_bad_conversations_are_one_line_naming_the_row(chat_model, tmp_path, capsys, rows, arguments, message):
    dataset = write_rows(tmp_path / "chats.jsonl", rows)
    status = main(["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(dataset), "--column",
                   "messages", "--max-new-tokens", "2", *arguments])
    line = one_error_line(capsys)
    assert status == 2 and message in line, line
    if "--max-input-tokens" in arguments:
        assert "over --max-input-tokens 8: shorten the conversation, or raise --max-input-tokens" in line


def test_a_model_without_a_chat_template_asked_for_conversations_is_one_line_naming_chat_template(
        tiny_model_folder, tmp_path, capsys):
    status = main(["run", "--device", "cpu", "--model", str(tiny_model_folder("llama")), "--prompt", "hi", "--chat",
                   "--output", str(tmp_path / "out.jsonl")])
    assert status == 2
    assert "has no chat template to render conversations with: pass --chat-template FILE" in one_error_line(capsys)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_system_prompt_without_conversations_is_one_line(tiny_model_folder, capsys):
    status = main(["run", "--device", "cpu", "--model", str(tiny_model_folder("llama")), "--prompt", "hi",
                   "--system-prompt", "Be brief."])
    assert status == 2 and "--system-prompt goes with conversations: add --chat" in one_error_line(capsys)


# -- the chat template: a file that is no template, a template that does not compile ------------------------------


def refuse_loading(monkeypatch):
    """Make loading a model fail the test: what is checked must be checked before it."""
    import accelgen.jobs.completion_job

    monkeypatch.setattr(accelgen.jobs.completion_job, "load_request", lambda request: pytest.fail("the model was loaded"))


def _limited_memory() -> None:
    """In a started process: at most 6 GiB of address space, so that a file read whole without end fails there instead
    of filling the machine's memory."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


@pytest.mark.parametrize("special, kind", [
    ("fifo", "is a FIFO (named pipe)"),  # nothing ever writes into it: opened to read, it would wait for ever
    ("/dev/zero", "is a device"),  # read whole, it never ends
])
def test_a_chat_template_that_would_block_or_never_end_is_one_line(tmp_path, cli_environment, special, kind):
    import subprocess
    import sys

    path = tmp_path / special
    if special == "fifo":
        os.mkfifo(path)
    else:
        path = special
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--prompt", "hi", "--chat",
                             "--chat-template", str(path)], env=cli_environment, capture_output=True, text=True,
                            timeout=300, preexec_fn=_limited_memory)  # the test fails, neither hangs nor fills memory
    assert result.returncode == 2
    assert one_error_line_in(result.stderr) == (f"accelgen: error: --chat-template '{path}' {kind}, not a regular file: "
                                                f"pass a UTF-8 file holding a Jinja chat template.\n")


@pytest.mark.parametrize("make, kind", [
    (lambda path: path.mkdir() or path, "is a folder, not a regular file"),
    (lambda path: os.truncate(path.touch() or path, 2 << 30) or path, "holds more than 1,024 KiB, more than a file of "
                                                                      "its kind does"),  # sparse: no disk taken
    (lambda path: path.write_bytes(b"{{ messages }}\xff") and path, "is not UTF-8 text (byte 0xff at byte 14)"),
])
def test_a_chat_template_that_is_no_small_text_file_is_one_line(tmp_path, capsys, monkeypatch, make, kind):
    refuse_loading(monkeypatch)
    path = make(tmp_path / "template.jinja")
    status = main(["run", "--device", "cpu", "--prompt", "hi", "--chat", "--chat-template", str(path)])
    assert status == 2
    assert one_error_line(capsys) == (f"accelgen: error: --chat-template '{path}' {kind}: pass a UTF-8 file holding a "
                                      f"Jinja chat template.\n")


BROKEN_TEMPLATE = ("{{ bos_token }}\n{% for message in messages %}\n{% if message['role'] == %}{{ message['content'] }}"
                   "{% endif %}\n{% endfor %}\n")


def test_a_chat_template_that_does_not_compile_is_named_with_its_line_before_the_model_loads(
        chat_model, tmp_path, capsys, monkeypatch):
    refuse_loading(monkeypatch)
    template = tmp_path / "template.jinja"
    template.write_text(BROKEN_TEMPLATE)
    dataset = write_rows(tmp_path / "chats.jsonl", CONVERSATIONS)
    status = main(["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(dataset), "--column",
                   "messages", "--chat-template", str(template)])
    assert status == 2
    assert one_error_line(capsys) == (f"accelgen: error: --chat-template '{template}' line 3 is not valid Jinja "
                                      f"(unexpected 'end of statement block'): fix that line, or pass another --chat-template.\n")


def test_a_tokenizers_template_that_does_not_compile_is_named_before_the_model_loads(chat_model, tmp_path, capsys,
                                                                                     monkeypatch):
    folder = tmp_path / "broken-chat"
    shutil.copytree(chat_model, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = BROKEN_TEMPLATE
    tokenizer.save_pretrained(folder)
    refuse_loading(monkeypatch)
    status = main(["run", "--device", "cpu", "--model", str(folder), "--prompt", "hi", "--chat"])
    assert status == 2
    assert one_error_line(capsys) == (f"accelgen: error: The chat template of the tokenizer of model '{folder}' line 3 is "
                                      f"not valid Jinja (unexpected 'end of statement block'): pass --chat-template FILE with a template "
                                      f"that compiles.\n")
    with pytest.raises(accelgen.UsageError, match=r"^The chat template line 3 is not valid Jinja \(unexpected 'end of statement block'\)"):
        accelgen.generate([CONVERSATIONS[0]], model=folder, device="cpu", max_new_tokens=2)  # not row 0's fault


# -- a conversation too long: it is never cut, so --max-input-tokens is no fix -------------------------------------


@pytest.mark.parametrize("rows, arguments, message", [
    ([[{"role": "user" if number % 2 == 0 else "assistant", "content": f"turn {number}"} for number in range(10_000)]
      + [{"role": "user", "content": "and now?"}]], [],
     "A conversation makes {tokens} tokens, more than the largest bucket (2048): shorten the conversation (fewer or "
     "shorter messages, a shorter --system-prompt or chat template), or pass a larger bucket with --buckets."),
    ([[{"role": "user", "content": "hi"}]], ["--system-prompt", "Be brief. " * 10_000],
     "A conversation makes {tokens} tokens, more than the largest bucket (2048): shorten the conversation"),
    ([[{"role": "user", "content": "hi " * 100}]], ["--max-new-tokens", "200"],
     "A conversation of {tokens} tokens plus 200 new tokens exceeds the model's context of 256 positions: shorten the "
     "conversation (fewer or shorter messages, a shorter --system-prompt or chat template), or lower --max-new-tokens."),
], ids=["10,000 messages", "a 100 KB system prompt", "past the context"])
def test_a_conversation_too_long_is_told_what_shortens_a_conversation(chat_model, tmp_path, capsys, rows, arguments,
                                                                      message):
    dataset = write_rows(tmp_path / "chats.jsonl", rows)
    status = main(["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(dataset), "--column",
                   "messages", "--max-new-tokens", "2", *arguments])
    line = one_error_line(capsys)
    messages = list(rows[0])
    if "--system-prompt" in arguments:
        messages.insert(0, {"role": "system", "content": arguments[1]})
    tokens = len(template_ids(chat_model, messages))
    assert status == 2 and message.format(tokens=tokens) in line, line
    assert "--max-input-tokens" not in line  # which refuses conversations


def test_a_template_rendering_megabytes_is_told_what_shortens_a_conversation(chat_model, tmp_path, capsys):
    template = tmp_path / "template.jinja"
    template.write_text("{% for a in range(250) %}{% for b in range(1000) %}padding {% endfor %}{% endfor %}" + TEMPLATE)
    status = main(["run", "--device", "cpu", "--model", str(chat_model), "--prompt", "hi", "--chat", "--chat-template",
                   str(template), "--max-new-tokens", "2", "--skip-bad-rows", "--output", str(tmp_path / "out.jsonl")])
    capsys.readouterr()
    assert status == 3
    [row] = rows_of(tmp_path / "out.jsonl")
    assert row["error"].startswith("A conversation makes ") and "shorten the conversation" in row["error"]
    assert "--max-input-tokens" not in row["error"]
