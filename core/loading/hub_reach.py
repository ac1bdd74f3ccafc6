"""Whether the Hugging Face Hub can be reached, asked once before the files of a Hub id that is not in the local
cache are looked up, and what a failure to reach it or to find a file in the cache offline says.

Without a network, huggingface_hub retries a file it has not cached with a backoff (about half a minute) before
transformers reports it as a file it could not find; one request to the Hub's endpoint, without retries, says at once
that the network is the problem. A model already in the cache is not asked about: huggingface_hub then falls back to
the cached files at once when the Hub cannot be reached.
"""

from __future__ import annotations

import os
import re

from accelgen.common.errors import UsageError, reason

#: What a user without a network does (``{what}``: the model, a LoRA adapter).
NO_NETWORK_FIX = "pass a local folder, or set HF_HUB_OFFLINE=1 with the {what} in the Hugging Face cache"
#: What a user offline whose model is not cached does.
OFFLINE_FIX = "pass a local folder, or unset HF_HUB_OFFLINE so that it can be downloaded"


def check_hub_reachable(hub_id: str, what: str = "model") -> None:
    """Raise UsageError in one line when ``hub_id``'s files are not in the local cache and the Hub cannot be reached
    (no network, a refused or unknown endpoint): at once, instead of after huggingface_hub's retries."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    if constants.HF_HUB_OFFLINE:
        return  # the cache only: a file missing there is said by offline_or_network_problem
    snapshots = os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=hub_id, repo_type="model"), "snapshots")
    if os.path.isdir(snapshots) and os.listdir(snapshots):
        return  # cached: huggingface_hub falls back to these files at once where the Hub cannot be reached
    problem = _unreachable(constants.ENDPOINT, constants.HF_HUB_ETAG_TIMEOUT)
    if problem is not None:
        raise UsageError(f"Cannot load {what} {hub_id!r}: cannot reach the Hugging Face Hub at {constants.ENDPOINT} "
                         f"({problem}; no network?): {NO_NETWORK_FIX.format(what=what)}.")


def _unreachable(endpoint: str, timeout: float) -> str | None:
    """Why one request to ``endpoint`` (through huggingface_hub's own client: its proxies, certificates and headers)
    got no answer within ``timeout`` seconds, or None when any answer came (a status of any kind)."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=timeout, follow_redirects=False)
    except Exception as error:  # noqa: BLE001 - whatever stops the request (refused, no name, timeout, TLS) means no Hub
        return re.sub(r"^\[Errno -?\d+\] ", "", reason(error)) or type(error).__name__
    return None


def offline_or_network_problem(error: BaseException, what: str, source: str) -> str | None:
    """The one line for a loading error that is a file missing from the cache offline (HF_HUB_OFFLINE), or the Hub not
    reached mid-way (a network lost after the check); None for any other error."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, LocalEntryNotFoundError):
        cause = cause.__cause__
    if cause is None:
        return None
    if constants.HF_HUB_OFFLINE:
        return (f"Cannot load {what} {source!r}: HF_HUB_OFFLINE is set and its files are not in the Hugging Face "
                f"cache: {OFFLINE_FIX}.")
    return (f"Cannot load {what} {source!r}: cannot reach the Hugging Face Hub at {constants.ENDPOINT} (no network?): "
            f"{NO_NETWORK_FIX.format(what=what)}.")
