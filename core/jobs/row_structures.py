"""The structures a job's rows are held to, checked against the model that completes them: the job's own
(``--json-schema``, ``--json``, ``--regex``, ``--choice``) with its tokenizer before the model loads, each row's own
(a schema column, a batch request's ``response_format``) as the row is read. The engine's own check, which needs no
tokenizer, was made where the structure was read (``accelgen.generation.grammars.structure_problem``).

A stop text can occur inside structured text (a "," inside JSON, a word inside a string) and would end the completion
there, leaving text that does not parse: stop texts and a structure are not asked for together.
"""

from __future__ import annotations

from typing import Iterator

from accelgen.common.errors import UsageError
from accelgen.common.prompts import BadPrompt, PromptRequest
from accelgen.common.settings import RowSettings, RunSettings
from accelgen.generation.grammars import GrammarCompiler

#: What a structured completion cut by a stop text would be, and the fix.
STOPS_CUT = ("a stop text can occur inside the structured text, and would end the completion there with text that "
             "does not parse: drop the stop texts (a structured completion ends where its structure does)")


def check_job_structure(run: RunSettings, schema_column: str | None = None) -> None:
    """Raise UsageError for stop texts (``--stop``) with a structure for every row, or for rows' own schemas
    (``schema_column``)."""
    flag = run.structure.flag if run.structure is not None else None if schema_column is None else "--schema-column"
    if run.stop and flag:
        raise UsageError(f"--stop and {flag} together: {STOPS_CUT}.")


def check_with_tokenizer(request) -> None:
    """Raise UsageError, before the model loads, when the job's structure (``request.run.structure``) admits no text
    the model's tokenizer can write, or cannot be compiled for it."""
    structure = request.run.structure
    if structure is None:
        return
    tokenizer = request.model.tokenizer()
    compiler = GrammarCompiler(tokenizer, request.model.config().vocab_size,
                               [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id])
    if problem := compiler.problem(structure):
        raise UsageError(f"{structure.flag} {problem}: fix it, drop {structure.flag}, or use a model whose vocabulary "
                         f"writes it.")


def checked_rows(texts: Iterator[object], compiler: GrammarCompiler, run: RunSettings) -> Iterator[object]:
    """``texts`` (a job's rows), each that brings its own structure (a PromptRequest) checked with ``compiler`` (the
    loaded model's): one that its tokenizer cannot write or compile, or that asks for stop texts too (its own or the
    run's), becomes a request that cannot be served (an error row, or with the run's --skip-bad-rows off, the row
    refused by number)."""
    problems: dict[object, str | None] = {}
    for text in texts:
        structure = text.settings.structure if isinstance(text, PromptRequest) else None
        if structure is None or isinstance(text.prompt, BadPrompt):
            yield text
            continue
        stops = text.settings.stop if text.settings.stop is not None else run.stop
        if structure not in problems:
            problems[structure] = compiler.problem(structure)
        problem = f"its {structure.describe()} {problems[structure]}" if problems[structure] else None
        if stops:
            problem = f"asks for stop texts {list(stops)!r} and a structure: {STOPS_CUT}"
        yield text if problem is None else PromptRequest(BadPrompt(problem), RowSettings(), text.fields)
