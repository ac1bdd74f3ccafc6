"""Scoring across processes and at length: two ranks score every family that splits as Hugging Face's forward does,
tensor- and data-parallel jobs score what one process scores, and a row of 32k tokens over a vocabulary of 150k is
scored in bounded memory. The same code paths as tests/test_scoring.py's (which runs on every transformers release CI
runs); these start processes and run long, so they run with the newest release only."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import run_to_the_end
from family_models import skip_unless_installed
from test_scoring import CHOICE_ROWS, FAMILIES, TEXTS, HuggingFace, rows_of, write_rows
from transformers import AutoTokenizer

from accelgen.cli import main
from accelgen.model.architectures import ARCHITECTURES
from accelgen.parallel.launcher import free_port

pytestmark = pytest.mark.slow


#: The families whose tiny model splits over two ranks (others are refused under --world-size 2, in one line: a family
#: that cannot be split, GPT-2 which DeepSpeed's AutoTP refuses, the tiny Falcon's single key/value head).
SPLIT_FAMILIES = [family for family in FAMILIES
                  if ARCHITECTURES[family].not_split_because is None and family not in ("gpt2", "falcon")]


@pytest.mark.slow
@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_two_ranks_score_as_hugging_faces_forward(tiny_model_folder, tmp_path, job_environment, family):
    skip_unless_installed(family)
    folder = tiny_model_folder(family)
    reference = HuggingFace(folder)
    rows = write_rows(tmp_path / "rows.jsonl", [{"text": text} for text in TEXTS])
    output = tmp_path / "two.jsonl"
    result = run_to_the_end([sys.executable, "-m", "accelgen.cli", "score", "--device", "cpu", "--dtype", "float32",
                             "--model", str(folder), "--dataset", str(rows), "--token-logprobs", "--batch-size", "8",
                             "--world-size", "2", "--master-port", str(free_port()), "--output", str(output), "--quiet"],
                            job_environment, 240)
    assert result.returncode == 0, result.stderr
    for text, line in zip(TEXTS, rows_of(output), strict=True):
        ids = reference.tokenizer(text)["input_ids"]
        expected, _ = reference.logprobs(ids)
        assert line["tokens"] == ids and line["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("split", [["--world-size", "2"], ["--world-size", "2", "--data-parallel", "2"]],
                         ids=["tensor-parallel", "data-parallel"])
def test_two_ranks_score_what_one_process_scores(tiny_model_folder, tmp_path, job_environment, split):
    pytest.importorskip("deepspeed")

    folder = str(tiny_model_folder("llama"))
    rows = write_rows(tmp_path / "rows.jsonl", CHOICE_ROWS)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    common = ["score", "--device", "cpu", "--dtype", "float32", "--model", folder, "--dataset", str(rows),
              "--choices-column", "choices", "--token-logprobs", "1", "--batch-size", "8", "--quiet"]
    assert main([*common, "--output", str(one)]) == 0
    result = run_to_the_end([sys.executable, "-m", "accelgen.cli", *common, *split, "--output", str(two),
                             "--master-port", str(free_port())], job_environment, 240)
    assert result.returncode == 0, result.stderr
    for single, ranked in zip(rows_of(one), rows_of(two), strict=True):
        assert ranked["token_logprobs"][1:] == pytest.approx(single["token_logprobs"][1:], abs=1e-5)
        assert ranked["choice_logprobs"] == pytest.approx(single["choice_logprobs"], abs=1e-4)
        assert ranked["best_choice"] == single["best_choice"] and ranked["tokens"] == single["tokens"]
        assert ranked["top_logprobs"][1][0]["id"] == single["top_logprobs"][1][0]["id"]


#: A row of 32k tokens over a vocabulary of 150k: its logits whole would be 32k x 150k floats (19.9 GB).
LONG_ROW, WIDE_VOCABULARY = 32_768, 151_936
LONG_ROW_SCRIPT = """
import json, sys
import torch
import accelgen
from accelgen.common.host_memory import peak_resident_bytes
from accelgen.common.prompts import ScoreRequest

generator = accelgen.load(sys.argv[1], device="cpu", dtype="float32", buckets=(LONG_ROW,), prefill_chunk=512)
ids = torch.randint(0, WIDE_VOCABULARY, (LONG_ROW,), generator=torch.Generator().manual_seed(0)).tolist()
[completion] = generator.score([ScoreRequest(tuple(ids))])
logprobs = completion.prompt_scores.logprobs[1:]
print(json.dumps({"scored": len(logprobs), "finite": all(-1e4 < value <= 0 for value in logprobs),
                  "peak_bytes": peak_resident_bytes()}))
""".replace("LONG_ROW", str(LONG_ROW)).replace("WIDE_VOCABULARY", str(WIDE_VOCABULARY))


@pytest.mark.slow
def test_a_long_row_of_a_wide_vocabulary_is_scored_in_bounded_memory(tiny_model_folder, tmp_path, cli_environment):
    """Measured in a process of its own (its peak since loading began: VmHWM, which, unlike getrusage's maximum, does not
    carry the forked test process's memory over the exec): what loading and scoring took, 0.75 GB here, a small share of
    the 19.9 GB its logits would hold at once."""
    from tiny_models import build_model
    from transformers import LlamaConfig

    folder = build_model(tmp_path / "wide", LlamaConfig(
        vocab_size=WIDE_VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=LONG_ROW + 64))
    AutoTokenizer.from_pretrained(tiny_model_folder("llama")).save_pretrained(folder)
    result = run_to_the_end([sys.executable, "-c", LONG_ROW_SCRIPT, str(folder)], cli_environment, 600)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["scored"] == LONG_ROW - 1 and measured["finite"]
    assert measured["peak_bytes"] < 1.5 * 2**30, measured
