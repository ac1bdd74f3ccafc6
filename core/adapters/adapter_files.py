"""One PEFT LoRA adapter as its files hold it: ``adapter_config.json`` and ``adapter_model.safetensors``, the two files
PEFT's ``save_pretrained`` writes, in a local folder or a Hub repository (downloaded as models are, by
``accelgen.loading.checkpoint_download``). Read and checked before any model loads: what it adapts, at which rank and
scaling, and why accelgen cannot run it when it cannot (one line each).

The tensors are ``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r] for each adapted
module, named as the model names it; a module's output gains ``scaling * B (A x)``, with PEFT's scaling ``lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``; per module where ``rank_pattern`` / ``alpha_pattern`` say so). Any other
tensor (an embedding's ``lora_embedding_A``, DoRA's ``lora_magnitude_vector``, a trained bias, a module saved whole) and
any config field that changes what the layer computes is refused, named; so is a config field of a type or range PEFT
never writes (``adapter_config``), a rank in the config other than the matrices', and a matrix holding NaN or inf (every
value is read once, here, before the model loads: the adapter's rows would be wrong, and a NaN or inf in B reaches every
row of the batch, whose zeros in that adapter's columns it multiplies).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re

import torch

from accelgen.adapters.adapter_config import DEFAULT_ALPHA, by_pattern, config_problem, matching_pattern, shown
from accelgen.common.errors import UsageError, reason, user_errors
from accelgen.common.settings import World
from accelgen.loading.checkpoint_download import checkpoint_folder
from accelgen.loading.checkpoint_files import CheckpointFolder
from accelgen.loading.finite_values import all_finite
from accelgen.loading.model_files import looks_local
from accelgen.loading.model_identity import weights_digest

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
#: What PEFT's saved tensor names begin with; the adapted model's own module names follow.
SAVED_PREFIX = "base_model.model."
#: The two tensors of an adapted linear layer, by the suffix of their names.
MATRICES = {".lora_A.weight": "A", ".lora_B.weight": "B"}
#: The names of an embedding's LoRA matrices end so.
EMBEDDING_MATRIX = re.compile(r"\.lora_embedding_[AB](\.weight)?$")
#: Config fields that change what an adapted layer computes (or adapt something other than linear layers): a value other
#: than off refuses the adapter, naming the field.
UNSUPPORTED_FIELDS = {
    "use_dora": "weight-decomposed LoRA (DoRA)", "modules_to_save": "modules trained and saved whole",
    "trainable_token_indices": "trained token embeddings", "target_parameters": "parameters adapted directly",
    "layer_replication": "replicated layers", "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "quantization-aware LoRA (QALoRA)", "use_bdlora": "block-diagonal LoRA", "arrow_config": "Arrow routing",
    "lora_bias": "a trained bias on lora_B", "velora_config": "a LoRA variant (VeLoRA)", "kasa_config": "a LoRA variant (KaSA)",
    "monteclora_config": "a LoRA variant (MonteCLoRA)",
}


@dataclasses.dataclass(frozen=True)
class AdaptedLayer:
    """What an adapter adds to one linear layer: matrices of ``rank`` between its ``in_features`` and ``out_features``,
    their product multiplied by ``scaling``."""

    rank: int
    in_features: int
    out_features: int
    scaling: float


class AdapterFiles:
    """The adapter ``name`` (None: the one merged into the weights) at ``source`` (a folder or a Hub id, downloaded once
    per node as ``world`` says), read and checked when made: its config and the header of its weights; its tensors are
    read when asked for."""

    def __init__(self, name: str | None, source: str, world: World = World()):
        self.name, self.source = name, source
        self.folder = _adapter_folder(self.described, source, world)
        self.config = self._read_config()
        self._check_config()
        self.layers = self._read_layers()
        #: the largest magnitude of each saved tensor's values, B's times its layer's scaling (as the buffers hold it)
        self.largest = self._check_values()

    @property
    def described(self) -> str:
        """How messages name it: ``--lora NAME=PATH`` as given, or the merged adapter's path."""
        return f"--lora {self.source!r}" if self.name is None else f"--lora {self.name}={self.source}"

    @property
    def rank(self) -> int:
        """Its largest rank over the layers it adapts."""
        return max(layer.rank for layer in self.layers.values())

    @functools.cached_property
    def identity(self) -> dict[str, str]:
        """The adapter by content, for a run record: the SHA-256 of its config file and its weights' digest (as a
        model's are taken: ``accelgen.loading.model_identity``)."""
        with open(os.path.join(self.folder, CONFIG_FILE), "rb") as config_file:
            config_digest = hashlib.sha256(config_file.read()).hexdigest()
        return {"config_sha256": config_digest, "weights_sha256": weights_digest(self.folder)}

    def matrices(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each adapted module's (A [r, in], B [out, r]), as stored, read in one pass over the file."""
        from safetensors import safe_open

        with user_errors(f"{self.described}: cannot read {WEIGHTS_FILE}", "save the adapter again"):
            with safe_open(os.path.join(self.folder, WEIGHTS_FILE), framework="pt") as weights:
                return {module: tuple(weights.get_tensor(f"{SAVED_PREFIX}{module}{suffix}") for suffix in MATRICES)
                        for module in self.layers}

    def refuse(self, problem: str, fix: str) -> UsageError:
        """The error saying that this adapter ``problem`` (a clause), and the ``fix``."""
        return UsageError(f"{self.described}: the adapter {problem}: {fix}.")

    # -- reading ---------------------------------------------------------------------------------

    def _read_config(self) -> dict:
        path = os.path.join(self.folder, CONFIG_FILE)
        if not os.path.isfile(path):
            raise self.refuse(f"folder {self.folder!r} has no {CONFIG_FILE}", "pass a folder written by PEFT's save_pretrained")
        unreadable, fix = f"{self.described}: the adapter's {CONFIG_FILE} cannot be read", "save the adapter again with PEFT"

        def too_deep(error: BaseException) -> str | None:  # JSON nested deeper than Python's parser goes
            return f"{unreadable}: it is nested too deep: {fix}." if isinstance(error, RecursionError) else None

        with user_errors(unreadable, fix, (OSError, ValueError, RecursionError), too_deep):
            with open(path, encoding="utf-8") as config_file:
                config = json.load(config_file)
        if not isinstance(config, dict):
            raise self.refuse(f"config {CONFIG_FILE} is not a JSON object", "save the adapter again with PEFT")
        return config

    def _check_config(self) -> None:
        problem = config_problem(self.config)
        if problem:
            raise UsageError(f"{self.described}: the adapter's {CONFIG_FILE} says {problem}: correct it, or save the "
                             f"adapter again with PEFT.")
        kind = self.config.get("peft_type")
        if kind != "LORA":
            raise self.refuse(f"is a PEFT {kind} adapter, not LoRA", "accelgen runs LoRA adapters only")
        for field, what in UNSUPPORTED_FIELDS.items():
            if self.config.get(field) not in (None, False, [], {}, ""):
                raise self.refuse(f"uses {what} ({field} is {self.config[field]!r})",
                                  "accelgen runs plain LoRA on linear layers; merge it into the model with PEFT instead")
        if self.config.get("bias", "none") != "none":
            raise self.refuse(f"trains biases (bias {self.config['bias']!r})",
                              "accelgen runs adapters of bias 'none'; merge it into the model with PEFT instead")

    def _read_layers(self) -> dict[str, AdaptedLayer]:
        """The adapted layers by module name, from the weights' header (checked first: damaged, truncated)."""
        path = os.path.join(self.folder, WEIGHTS_FILE)
        if not os.path.isfile(path):
            found = ", ".join(sorted(os.listdir(self.folder)))
            raise self.refuse(f"folder {self.folder!r} has no {WEIGHTS_FILE} (it holds {found})",
                              "save the adapter with PEFT's save_pretrained (safe_serialization, the default)")
        checked = CheckpointFolder(self.folder)
        try:
            problem = checked.problem()
            header = None if problem else checked.header(path)[0]
        except OSError as error:
            problem = reason(error)
        if problem:
            raise self.refuse(f"weights are damaged ({problem})", "download or save the adapter again")
        tensors = [tensor for tensor in header if tensor != "__metadata__"]
        embedding = next((tensor for tensor in tensors if EMBEDDING_MATRIX.search(tensor)), None)
        if embedding is not None:
            module = EMBEDDING_MATRIX.sub("", embedding.removeprefix(SAVED_PREFIX))
            raise self.refuse(f"adapts {module!r}, an embedding", "accelgen adapts linear layers only")
        shapes: dict[str, dict[str, list[int]]] = {}
        for tensor in tensors:
            module, matrix = _module_and_matrix(tensor)
            if matrix is None:
                raise self.refuse(f"holds {tensor!r}, which is not a LoRA matrix of a linear layer (a variant's, a bias "
                                  f"or a whole module)", "accelgen runs plain LoRA on linear layers")
            shapes.setdefault(module, {})[matrix] = header[tensor]["shape"]
        if not shapes:
            raise self.refuse("holds no LoRA matrices", "save the adapter again with PEFT")
        return {module: self._layer(module, pair) for module, pair in sorted(shapes.items())}

    def _layer(self, module: str, pair: dict[str, list[int]]) -> AdaptedLayer:
        if set(pair) != {"A", "B"} or len(pair["A"]) != 2 or len(pair["B"]) != 2 or pair["A"][0] != pair["B"][1] \
                or not pair["A"][0]:
            raise self.refuse(f"holds matrices of {module!r} that do not make a LoRA pair ({pair})",
                              "save the adapter again with PEFT")
        rank = pair["A"][0]
        if "r" in self.config:  # PEFT scales by the config's rank: it must be the matrices'
            pattern = matching_pattern(self.config.get("rank_pattern"), module)
            said = f"r is {self.config['r']}" if pattern is None else f"rank_pattern's {shown(pattern)} is " \
                f"{self.config['rank_pattern'][pattern]}"
            if by_pattern(self.config.get("rank_pattern"), module, self.config["r"]) != rank:
                raise UsageError(f"{self.described}: the adapter's {CONFIG_FILE} says {said}, and the matrices of "
                                 f"{module!r} have rank {rank}: correct it, or save the adapter again with PEFT.")
        alpha = by_pattern(self.config.get("alpha_pattern"), module, self.config.get("lora_alpha", DEFAULT_ALPHA))
        scaling = alpha / (math.sqrt(rank) if self.config.get("use_rslora") else rank)
        return AdaptedLayer(rank, pair["A"][1], pair["B"][0], scaling)

    def _check_values(self) -> dict[str, float]:
        """Every value of the saved matrices read once: refused when one is NaN or inf; the largest magnitude of each
        tensor (B's times its scaling) returned, for the run's dtype to be checked against (``AdapterSet.check_fits``)."""
        from safetensors import safe_open

        largest = {}
        with user_errors(f"{self.described}: cannot read {WEIGHTS_FILE}", "save the adapter again"):
            with safe_open(os.path.join(self.folder, WEIGHTS_FILE), framework="pt") as weights:
                for module, layer in self.layers.items():
                    for suffix, matrix in MATRICES.items():
                        name = f"{SAVED_PREFIX}{module}{suffix}"
                        values = weights.get_tensor(name).float()
                        if not all_finite(values):
                            raise UsageError(f"{self.described}: the adapter's {WEIGHTS_FILE} holds NaN or inf in {name!r}: "
                                             f"train or save the adapter again (every value finite).")
                        peak = float(values.abs().max()) if values.numel() else 0.0
                        largest[name] = peak * abs(layer.scaling) if matrix == "B" else peak
        return largest


def _adapter_folder(described: str, source: str, world: World) -> str:
    """The local folder of the adapter at ``source``: the folder itself, or a Hub repository's, downloaded."""
    if looks_local(source):
        folder = os.path.expanduser(source)
        if not os.path.isdir(folder):
            raise UsageError(f"{described}: the adapter folder {folder!r} does not exist: pass a folder holding {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE} (PEFT's save_pretrained), or a Hub id.")
        return folder
    return checkpoint_folder(source, world, what="LoRA adapter")


def _module_and_matrix(tensor: str) -> tuple[str, str | None]:
    """(the module a saved tensor belongs to, "A" or "B"), or (its name, None) for a tensor that is neither."""
    for suffix, matrix in MATRICES.items():
        if tensor.startswith(SAVED_PREFIX) and tensor.endswith(suffix):
            return tensor[len(SAVED_PREFIX): -len(suffix)], matrix
    return tensor, None

