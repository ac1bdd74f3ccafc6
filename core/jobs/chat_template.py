"""The chat template a job renders its conversations with: a ``--chat-template`` file, read only when it is a small
regular file, or the tokenizer's own; either is checked to compile and pinned by its hash in the run record, before
any model loads."""

from __future__ import annotations

import hashlib
import json

from accelgen.common.errors import UsageError
from accelgen.common.input_files import read_small_text_file
from accelgen.generation.text import NO_CHAT_TEMPLATE
from accelgen.model.transformers_adapter.chat_templates import template_syntax_problem
from accelgen.session.request import Request

#: The largest --chat-template file read: templates are a few KiB; a file far larger is not one.
TEMPLATE_MOST_BYTES = 1 << 20


def read_chat_template(path: str) -> str:
    """The text of the ``--chat-template`` file ``path``, checked to be a Jinja template transformers compiles;
    UsageError in one line naming the file (and the line of a syntax error) otherwise."""
    template = read_small_text_file(path, "--chat-template", TEMPLATE_MOST_BYTES,
                                    "pass a UTF-8 file holding a Jinja chat template")
    problem = template_syntax_problem(template)
    if problem:
        raise UsageError(f"--chat-template {path!r} {problem}: fix that line, or pass another --chat-template.")
    return template


def chat_template_hash(request: Request) -> str:
    """The hash of the chat template conversations are rendered with (``--chat-template``, else the
    tokenizer's), read before any model loads; a model without one, or whose template does not compile, is refused
    in one line."""
    template = request.run.chat.template
    if template is None:
        template = request.model.tokenizer().chat_template
        if template is None:
            raise UsageError(NO_CHAT_TEMPLATE)
        problem = isinstance(template, str) and template_syntax_problem(template)
        if problem:
            raise UsageError(f"The chat template of the tokenizer of model {request.model.name or 'built-in'!r} {problem}: "
                             f"pass --chat-template FILE with a template that compiles.")
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
