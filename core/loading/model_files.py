"""Loading a causal language model and its tokenizer, from the Hub or a local folder."""

from __future__ import annotations

import os
import stat

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from accelgen.common.errors import UsageError, reason, user_errors
from accelgen.common.settings import DEFAULT_MODEL as DEFAULT_MODEL  # loading takes it from here too
from accelgen.loading.hub_reach import check_hub_reachable, offline_or_network_problem

#: What reports and run records call it.
BUILT_IN_NAME = "accelgen built-in default"


def looks_local(model_name_or_path: str) -> bool:
    """True for what can only be a filesystem path (a Hub id is ``name`` or ``owner/name``)."""
    return (
        model_name_or_path.startswith((".", "/", "~"))
        or os.path.exists(model_name_or_path)
        or model_name_or_path.count("/") > 1
    )


def load_tokenizer(model_name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token (its EOS when it has none)."""
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.convert_ids_to_tokens(0)
    return tokenizer


def model_location(model_name_or_path: str | os.PathLike | None) -> str:
    """Where to load from: the built-in default model when None; a checked folder if it is a path; else a Hub id,
    its files cached or the Hub reachable."""
    source = str(DEFAULT_MODEL if model_name_or_path is None else model_name_or_path)
    if looks_local(source):
        source = os.path.expanduser(source)
        if not os.path.isdir(source):
            raise UsageError(f"Model folder {source!r} does not exist: pass a folder holding config.json, or a Hub id "
                             f"(omit --model to run the built-in model, whose folder is {DEFAULT_MODEL}).")
        with user_errors(f"Cannot read model folder {source!r}", "make it readable, or pass another folder"):
            odd_entry = _special_file(source)
        if odd_entry is not None:
            raise UsageError(f"Model folder {source!r} holds {odd_entry!r}, which is not a regular file (a pipe or a "
                             f"device): reading it would block or never end; remove it, or pass a folder made by "
                             f"save_pretrained.")
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise UsageError(f"Model folder {source!r} has no config.json: pass a folder made by save_pretrained.")
    else:
        check_hub_reachable(source)
    return source


def _special_file(folder: str) -> str | None:
    """The name of an entry of ``folder`` that is neither a regular file nor a folder once links are followed
    (a pipe, a device, a socket: config, tokenizer and weight readers would block on it or read it for ever),
    or None. Broken links are left to the reader that needs the file, which names it."""
    for entry in sorted(os.scandir(folder), key=lambda entry: entry.name):
        try:
            mode = os.stat(entry.path).st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return entry.name
    return None


def loading_errors_as_usage_errors(source: str, what: str = "model"):
    """Errors of loading the model (or ``what`` else) from ``source`` as one line (a damaged cached file of a Hub model
    included)."""
    from safetensors import SafetensorError

    def explain(error: BaseException) -> str | None:
        if isinstance(error, SafetensorError):
            return (f"Cannot load {what} {source!r}: a weight file is damaged ({reason(error)}): download it again "
                    f"(delete the model from the Hugging Face cache first) or save the model again.")
        if problem := offline_or_network_problem(error, what, source):
            return problem
        if "trust_remote_code" in str(error) or "custom code" in str(error):  # transformers' words for it
            return f"Cannot load {what} {source!r}: it runs code of its own: pass --trust-remote-code if you trust it."
        return None

    return user_errors(f"Cannot load {what} {source!r}", "pass a local folder, or a Hub id reachable from here",
                       errors=(OSError, ValueError, KeyError, ImportError, SafetensorError), explain=explain)


def load_config(location: str, trust_remote_code: bool = False):
    """The config of the model at ``location`` (a folder or Hub id: :func:`model_location`), alone: cheap, for
    checks made before any weights load."""
    with loading_errors_as_usage_errors(location):
        return AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)


def tokenizer_source(tokenizer: PreTrainedTokenizerBase) -> str:
    """Where ``tokenizer`` came from, for reports: its folder or Hub id, or the built-in model's."""
    path = tokenizer.name_or_path
    return BUILT_IN_NAME if path == str(DEFAULT_MODEL) else path
