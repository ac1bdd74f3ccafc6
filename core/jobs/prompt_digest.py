"""The digest of an output line's prompt, written in the line, by which a resumed run knows that each row it
keeps still stands for the dataset row (or prompt) it completed: a line whose prompt was edited by hand is
refused, not kept as the completion of a row that says otherwise.

What a line holds of its row is its ``prompt`` (as the model saw it: cut to --max-input-tokens, or a conversation
rendered by its chat template, "" for an error row of no text), a conversation's ``messages`` before the last (the
last holds the reply), a prompt request's fields and the LoRA adapter the row chose. The completion (its text,
tokens, samples, the reply message) is the user's to edit. ``prompt_sha256`` is the SHA-256 of that part as JSON
(keys sorted, ASCII): it is made from the completion being written, by whichever process writes the output, and goes
out in the line's own write, so a stop mid-write leaves a torn line (written again on resume), never a line without
its digest. Checking it reads the output alone: the dataset is not read again.

An output started since lines carry the digest says so in its run record (``line_digest``): each of its lines must
have one. An output started before keeps resuming as it did: its lines without one are kept unchecked.
"""

from __future__ import annotations

import hashlib
import json

#: The line field holding the digest of the line's prompt.
DIGEST_FIELD = "prompt_sha256"
#: The run record field saying that every line of the output carries :data:`DIGEST_FIELD`.
RECORD_FIELD = "line_digest"


def prompt_part(line: dict) -> dict:
    """The fields of ``line`` (an output line's, parsed or about to be written) that stand for its row."""
    part = {"prompt": line.get("prompt")}
    messages = line.get("messages")
    if messages is not None:
        part["messages"] = messages[:-1] if isinstance(messages, list) else messages
    if line.get("request") is not None:
        part["request"] = line["request"]
    if line.get("adapter") is not None:  # the LoRA adapter the row asked for
        part["adapter"] = line["adapter"]
    for scored in ("continuation", "choices"):  # a score row's continuations (``accelgen score``)
        if line.get(scored) is not None:
            part[scored] = line[scored]
    return part


def prompt_digest(line: dict) -> str:
    """The SHA-256 (hex) of :func:`prompt_part` of ``line``, as JSON with sorted keys and ASCII escapes."""
    return hashlib.sha256(json.dumps(prompt_part(line), sort_keys=True).encode()).hexdigest()


def with_digest(line: dict) -> dict:
    """``line`` with its :data:`DIGEST_FIELD`, as it is written."""
    return {**line, DIGEST_FIELD: prompt_digest(line)}


def digest_problem(line: dict, required: bool) -> str | None:
    """Why a written ``line`` no longer holds the prompt it was written with, as a clause, or None: its digest does
    not match, or it has none though ``required`` (every line of its output was written with one)."""
    if DIGEST_FIELD not in line:
        return f"has lost its {DIGEST_FIELD}, which every line of this output was written with" if required else None
    if line[DIGEST_FIELD] != prompt_digest(line):
        return f"had its prompt edited since it was written (it no longer matches its {DIGEST_FIELD})"
    return None
