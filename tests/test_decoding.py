"""The loop's small pure functions, and the rule that the core names no device."""

import re
from pathlib import Path

import pytest
import torch

from accelgen import decoding
from accelgen.errors import UsageError
from accelgen.settings import SamplingSettings

CORE = Path(__file__).resolve().parents[1] / "core"


def test_choose_bucket_takes_the_smallest_that_fits():
    assert decoding.choose_bucket(5, (32, 64), None, 100) == 32
    assert decoding.choose_bucket(33, (64, 32), None, 100) == 64
    with pytest.raises(UsageError, match="more than the largest bucket"):
        decoding.choose_bucket(65, (32, 64), None, 100)


def test_choose_bucket_shrinks_to_the_model_context():
    assert decoding.choose_bucket(20, (32, 64), 120, 100) == 20
    with pytest.raises(UsageError, match="exceeds the model's context of 120"):
        decoding.choose_bucket(21, (32, 64), 120, 100)


def test_left_pad_right_aligns_prompts_and_fills_the_batch():
    input_ids, mask = decoding.left_pad([[5, 6], [7]], bucket_length=4, batch_size=3, pad_token_id=0)
    assert input_ids.tolist() == [[0, 0, 5, 6], [0, 0, 0, 7], [0, 0, 5, 6]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1]]
    assert decoding.positions_from_mask(mask).tolist() == [[1, 1, 0, 1], [1, 1, 1, 0], [1, 1, 0, 1]]


def test_top_k_and_top_p_keep_the_likely_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = decoding.logits_to_probs(logits, SamplingSettings(do_sample=True, top_k=2))
    assert (probs[0, 2:] == 0).all() and torch.isclose(probs.sum(), torch.tensor(1.0))
    # the first token alone holds ~64% of the mass, the first two ~88%
    assert (decoding.logits_to_probs(logits, SamplingSettings(do_sample=True, top_p=0.5))[0, 1:] == 0).all()
    kept = decoding.logits_to_probs(logits, SamplingSettings(do_sample=True, top_p=0.8))[0]
    assert (kept[:2] > 0).all() and (kept[2:] == 0).all()


def test_sampling_with_a_seeded_generator_repeats():
    logits = torch.randn(4, 50)
    settings = SamplingSettings(do_sample=True, temperature=0.7)
    draws = [decoding.sample(logits, settings, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert torch.equal(decoding.sample(logits, SamplingSettings(), None), logits.argmax(-1))


def test_core_names_no_device_and_imports_no_device_library():
    pattern = re.compile(r"torch\.cuda|habana|\bhpu\b|[\"']cuda[\"']|torch\.xpu|torch_npu")
    offenders = [
        f"{path.name}:{number}: {line.strip()}"
        for path in CORE.glob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert offenders == []
