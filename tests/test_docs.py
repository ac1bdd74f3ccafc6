"""The README and docs/ against the command line they describe: every flag of every command is documented, every
command they show parses, every link they give leads somewhere, and the README stays a front door."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from accelgen.cli.parser import build_parser
from accelgen.common.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: The README's two set-up commands: CI runs the second verbatim (.ci/run).
SET_UP_COMMANDS = (
    'pip install torch==2.13.0 -e . && accelgen run --device cpu --prompt "DeepSpeed is a machine learning framework"',
    'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q',
)
#: A README a newcomer reads in five minutes.
README_MOST_LINES = 250
#: Fenced blocks whose lines are commands typed into a shell (``console`` blocks show what a command prints).
SHELL_BLOCKS = ("sh", "shell", "bash")
#: What ends the command a line runs: a pipe, a redirection, the next command.
COMMAND_ENDS = ("|", "||", "&&", ";", ">", ">>", "2>", "&")


def documents() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def command_flags() -> dict[str, list[str]]:
    """Each command's long options (``accelgen`` itself: the options before a command), --help aside."""
    parser = build_parser()
    [commands] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    parsers = {"accelgen": parser, **{f"accelgen {name}": command for name, command in commands.choices.items()}}
    return {name: [option for action in command._actions for option in action.option_strings
                   if option.startswith("--") and option != "--help"]
            for name, command in parsers.items()}


def documented_flags(text: str) -> set[str]:
    """The flags a text documents: each inline code span that starts with one (`` `--flag` ``, `` `--flag N` ``)."""
    return set(re.findall(r"`(--[a-z][a-z0-9-]*)(?=[`\s=\[])", text))


def shell_commands(text: str) -> list[str]:
    """The ``accelgen`` commands of a Markdown text's shell blocks, each a line (continuation lines joined), less a
    prompt's ``$`` and the variables set before the command."""
    commands = []
    for language, block in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        if language not in SHELL_BLOCKS:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            words = line.strip().removeprefix("$ ").split(" ")
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words.pop(0)
            if words and words[0] == "accelgen":
                commands.append(" ".join(words))
    return commands


def parse_problem(command: str) -> str | None:
    """Why ``accelgen``'s parser refuses ``command`` (``...`` stands for options left out), or None."""
    words = []
    for word in shlex.split(command, comments=True)[1:]:
        if word in COMMAND_ENDS:
            break
        if word != "...":
            words.append(word)
    try:
        build_parser().parse_args(words)
    except UsageError as error:
        return str(error)
    except SystemExit as exit:  # --help, --version
        return None if exit.code in (0, None) else f"exit status {exit.code}"
    return None


def test_every_flag_of_every_command_is_documented():
    documented = set().union(*(documented_flags(page.read_text()) for page in DOCS.glob("*.md")))
    missing = {name: [flag for flag in flags if flag not in documented] for name, flags in command_flags().items()}
    assert not any(missing.values()), f"flags with no `--flag` line in docs/: {missing}"


def test_every_command_shown_parses():
    shown = [(page.name, command) for page in documents() for command in shell_commands(page.read_text())]
    assert len(shown) > 40, shown  # the blocks are found
    problems = [(page, command, problem) for page, command in shown if (problem := parse_problem(command))]
    assert not problems, problems


def test_the_readme_keeps_the_set_up_commands_that_ci_runs():
    readme = README.read_text()
    for command in SET_UP_COMMANDS:
        assert command in readme.splitlines(), command
    assert f"readme_test_command='{SET_UP_COMMANDS[1]}'" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= README_MOST_LINES


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {github_anchor(heading) for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("page", documents(), ids=lambda page: page.name)
def test_every_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, broken


# -- the checks can fail ---------------------------------------------------------------------------------------

def test_an_undocumented_flag_and_a_command_that_does_not_parse_are_found():
    assert documented_flags("- `--stop TEXT`: ... `--max-new-tokens N` and `--graphs`/`--no-graphs`") == {
        "--stop", "--max-new-tokens", "--graphs", "--no-graphs"}
    assert "--stop" not in documented_flags("accelgen run --stop x")  # an example is no documentation
    block = "```sh\nHF_HUB_OFFLINE=1 accelgen run --prompt a \\\n    --no-such-flag 3   # a comment\n```\n"
    [command] = shell_commands(block)
    assert "unrecognized arguments: --no-such-flag 3" in parse_problem(command)
    assert parse_problem("accelgen run ... --batch-size 0") is not None  # out of its range
    assert parse_problem('accelgen run --prompt "a b" ... --stop "\\n" | head -1') is None
    assert parse_problem("accelgen devices --help") is None
