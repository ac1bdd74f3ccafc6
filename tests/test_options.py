"""Every option declared once: the command line, the Python API's keywords, the check of each value and docs/options.md
all come from the declarations, and agree."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import accelgen
from accelgen.cli import main
from accelgen.cli.option_tables import BEGIN, END, page_with_tables
from accelgen.cli.parser import build_parser
from accelgen.common.run_options import RUN_SETTINGS, SETTING_NAMES
from accelgen.common.value_ranges import RANGES
from accelgen.session.request import build_request

OPTIONS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "options.md"


def test_a_run_of_no_options_is_the_same_from_the_command_line_and_from_python():
    """Defaults are the declarations': ``accelgen run`` given no option and ``build_request`` given no keyword make the
    same RunSettings (the command line's values handed to Python as its keywords change nothing)."""
    arguments = build_parser().parse_args(["run", "--prompt", "a"])
    given = {name: getattr(arguments, name) for name in SETTING_NAMES if hasattr(arguments, name)}
    assert set(SETTING_NAMES) - set(given) == {"chat_template", "json_schema"}  # the command line reads their FILEs
    assert build_request(device="cpu", **given).run == build_request(device="cpu").run


def test_every_setting_changes_the_run_the_python_api_makes():
    """Each declared setting reaches the run: given a value other than its default, the RunSettings differ."""
    other = {"dtype": "bfloat16", "quantize": "int8", "graphs": False, "skip_bad_rows": True, "chat": True,
             "system_prompt": "Be brief.", "chat_template": "{{ messages[0]['content'] }}",
             "chat_template_kwargs": {"enable_thinking": False}, "regex": "[a-z]+", "max_new_tokens": 7,
             "max_input_tokens": 9, "batch_size": 3, "batching": "static", "buckets": (16, 32), "ignore_eos": True,
             "prefix_cache": "1MiB", "prefill_chunk": 64, "logprobs": True, "prompt_logprobs": 2, "stop": ("\n",),
             "temperature": 0.5, "top_k": 5, "top_p": 0.9, "seed": 11, "lora": {"a": "/adapters/a"}, "offload": "cpu"}
    together = {("do_sample", "num_samples"): {"do_sample": True, "num_samples": 2},
                ("offload", "offload_folder"): {"offload": "disk", "offload_folder": "/weights"},
                ("json_schema",): {"json_schema": {"type": "object"}}, ("json_object",): {"json_object": True},
                ("choices",): {"choices": ["yes", "no"]},
                ("lora", "max_loras"): {"lora": {"a": "/a", "b": "/b"}, "max_loras": 1},
                ("lora", "max_lora_rank"): {"lora": {"a": "/a"}, "max_lora_rank": 4},
                ("offload", "max_device_memory"): {"offload": "cpu", "max_device_memory": "1GiB"}}
    from accelgen.plugin.manager import get_plugin_manager
    from accelgen.plugin.registry import select_accelerator
    from accelgen.session.request import run_settings

    accelerator = select_accelerator(get_plugin_manager(), "cpu")
    default = run_settings(accelerator)
    cases = {(name,): {name: value} for name, value in other.items()} | together
    assert set().union(*cases) == set(SETTING_NAMES)  # a setting declared without a case here is found
    # each case against its settings without the last one: that one alone changes the run
    unchanged = [names for names, given in cases.items() if run_settings(accelerator, **given) in (
        default, run_settings(accelerator, **{name: value for name, value in given.items() if name != names[-1]}))]
    assert not unchanged


@pytest.mark.parametrize("name", ["batch_size", "top_p", "prefill_chunk", "max_loras", "buckets"])
def test_a_value_out_of_range_is_refused_in_the_declarations_words_whichever_way_it_comes(name, capsys):
    bad = 0 if name != "prefill_chunk" else -1
    words = RANGES[name].describe()
    with pytest.raises(accelgen.UsageError, match=f"^{RUN_SETTINGS[name].option} must be {words}"):
        build_request(device="cpu", **{name: (bad,) if name == "buckets" else bad})
    assert main(["run", "--device", "cpu", "--prompt", "a", RUN_SETTINGS[name].option, str(bad)]) == 2
    error = capsys.readouterr().err
    assert RUN_SETTINGS[name].option in error and words in error and error.count("\n") == 1


def test_a_choice_that_is_not_one_is_refused_in_the_declarations_words():
    with pytest.raises(accelgen.UsageError, match=r"^--offload must be one of cpu, disk \(got 'ram'\)"):
        build_request(device="cpu", offload="ram")
    with pytest.raises(TypeError, match="unknown settings max_tokens; the settings are: "):
        build_request(device="cpu", max_tokens=3)


def test_the_option_tables_of_the_docs_are_made_from_the_declarations():
    page = OPTIONS_PAGE.read_text()
    assert page_with_tables(page) == page, "run: python -m accelgen.cli.option_tables docs/options.md"
    for flag in ("--max-new-tokens", "--token-logprobs", "--replica-resources", "--no-graphs", "--max-file-mib"):
        assert f"`{flag}`" in page
    # Made the same in every checkout: the demo model by its place in the repository, not this checkout's path.
    assert str(Path(accelgen.__file__).parent) not in page and "core/default_model" in page


def test_an_option_table_out_of_date_is_found(monkeypatch):
    """The check can fail: a table made before an option's help changed is told apart from the declarations'."""
    page = OPTIONS_PAGE.read_text()
    import accelgen.cli.command_options as declared

    summary, options = declared.COMMANDS["run"]
    changed = tuple(dataclasses.replace(option, help="another text") if option.name == "seed" else option
                    for option in options)
    monkeypatch.setitem(declared.COMMANDS, "run", (summary, changed))
    assert page_with_tables(page) != page
    with pytest.raises(ValueError, match="no markers"):
        page_with_tables(page.replace(BEGIN, "").replace(END, ""))


def test_every_environment_variable_accelgen_reads_is_on_the_options_page():
    root = OPTIONS_PAGE.parent.parent
    sources = [*(root / "core").rglob("*.py"), *(root / "plugins").rglob("*.py")]
    read = set().union(*(re.findall(r"\"(ACCELGEN_[A-Z0-9_]+)\"", path.read_text()) for path in sources))
    assert len(read) > 8, read  # the variables are found
    assert not {variable for variable in read if f"`{variable}`" not in OPTIONS_PAGE.read_text()}
