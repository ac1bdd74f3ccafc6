"""The loop's small pure functions."""

import dataclasses

import pytest
import torch

from accelgen.common.errors import UsageError
from accelgen.common.settings import SamplingSettings
from accelgen.generation import decoding, sampling


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
    probs = sampling.logits_to_probs(logits, SamplingSettings(do_sample=True, top_k=2))
    assert (probs[0, 2:] == 0).all() and torch.isclose(probs.sum(), torch.tensor(1.0))
    # the first token alone holds ~64% of the mass, the first two ~88%
    assert (sampling.logits_to_probs(logits, SamplingSettings(do_sample=True, top_p=0.5))[0, 1:] == 0).all()
    kept = sampling.logits_to_probs(logits, SamplingSettings(do_sample=True, top_p=0.8))[0]
    assert (kept[:2] > 0).all() and (kept[2:] == 0).all()


def test_greedy_choice_is_the_argmax():
    logits = torch.randn(4, 50)
    assert torch.equal(sampling.choose_tokens(logits, SamplingSettings(), torch.rand(4)), logits.argmax(-1))


def seeded_choice(logits, settings, rows, step):
    """choose_tokens with each row's draw number made from the run's seed, the row's number and the step."""
    seed_keys = torch.full_like(rows, sampling.seed_key(settings.seed))
    return sampling.choose_tokens(logits, settings, sampling.uniform_draws(seed_keys, rows, step))


def test_a_rows_table_of_draw_numbers_holds_each_steps_number():
    """What a decode step reads from a row's table (made when the row starts, every step at once) is the number
    that row's draw takes at that step alone."""
    seed_keys, rows = torch.tensor([sampling.seed_key(3), sampling.seed_key(2**40)]), torch.tensor([7, 2**33 + 5])
    table = sampling.uniform_draws(seed_keys.unsqueeze(-1), rows.unsqueeze(-1), torch.arange(50).unsqueeze(0))
    assert table.shape == (2, 50) and bool(((table > 0) & (table < 1)).all())
    for step in (0, 1, 49):
        assert torch.equal(table[:, step], sampling.uniform_draws(seed_keys, rows, torch.tensor([step])))
    assert len(set(table.flatten().tolist())) == 100


def test_a_draw_depends_on_the_seed_row_and_step_only():
    logits = torch.randn(1, 500).repeat(6, 1)  # six rows with the same distribution
    settings = SamplingSettings(do_sample=True, temperature=2.0, seed=11)
    rows, step = torch.tensor([40, 41, 42, 43, 44, 45]), torch.tensor([3])
    draws = seeded_choice(logits, settings, rows, step)
    # the same rows in another batch, in another order, give the same draws
    reordered = seeded_choice(logits[:3], settings, rows[[5, 0, 3]], step)
    assert reordered.tolist() == draws[[5, 0, 3]].tolist()
    # different rows, steps or seeds draw differently (six rows from 500 likely tokens: not all the same)
    assert len(set(draws.tolist())) > 1
    other_step = seeded_choice(logits, settings, rows, torch.tensor([4]))
    other_seed = seeded_choice(logits, SamplingSettings(do_sample=True, temperature=2.0, seed=12), rows, step)
    assert other_step.tolist() != draws.tolist() and other_seed.tolist() != draws.tolist()


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    settings = SamplingSettings(do_sample=True, seed=5)
    draws = seeded_choice(probs.log().repeat(4000, 1), settings, torch.arange(4000), torch.tensor([0]))
    frequencies = torch.bincount(draws, minlength=4) / 4000
    # binomial standard deviation at n=4000 is at most 0.008: five of them
    assert torch.allclose(frequencies, probs, atol=0.04), frequencies


def test_a_draw_never_picks_a_token_filtered_out():
    """Top-k leaves the other tokens a probability of 0: no draw lands on one, at the edges of the vocabulary
    included (the first and last tokens are among the kept ones in some rows)."""
    torch.manual_seed(0)
    logits = torch.randn(3000, 40)
    logits[:1000, 0] += 10  # rows where the first token is kept, and likely
    logits[1000:2000, -1] += 10
    draws = seeded_choice(logits, SamplingSettings(do_sample=True, top_k=3, seed=1), torch.arange(3000), torch.tensor([0]))
    assert bool((draws[:, None] == logits.topk(3).indices).any(1).all())
    assert len(set(draws[2000:].tolist())) > 3  # the other rows spread over many tokens


def test_seeds_of_any_size_hash_into_the_draw():
    logits = torch.randn(2, 300)
    rows, step = torch.tensor([0, 1]), torch.tensor([0])
    timestamp_seed = 1_732_300_000_123_456_789
    draws = [
        seeded_choice(logits, SamplingSettings(do_sample=True, seed=seed), rows, step).tolist()
        for seed in (timestamp_seed, timestamp_seed + 1, timestamp_seed)
    ]
    assert draws[0] == draws[2] != draws[1]


def test_a_row_ends_on_any_of_its_end_tokens_and_on_no_other_id():
    """The end-of-sequence lookup answers for any id, those past the table's largest end token and below 0 included."""
    rules = decoding.TokenRules(sampling=SamplingSettings(), ending_tokens=decoding.ending_table([7, 2, 30], torch.device("cpu")),
                                pad_token_id=0, stop_at_eos=True)
    tokens = torch.tensor([0, 2, 7, 8, 30, 31, 4095, -1])
    assert decoding.ends_on(rules, tokens).tolist() == [False, True, True, False, True, False, False, False]
    nothing = dataclasses.replace(rules, ending_tokens=decoding.ending_table([], torch.device("cpu")))
    assert not decoding.ends_on(nothing, tokens).any()


@pytest.mark.parametrize("width", [1, 63, 64, 65, 4096, 5000])
def test_a_draw_takes_the_first_token_whose_cumulative_weight_passes_the_mark(width):
    """sampling.draw (by blocks of tokens) against the same count over the whole row in float64, on weights with
    zeros (runs of equal sums): the same token wherever the mark is not within rounding of a token's edge."""
    generator = torch.Generator().manual_seed(width)
    weights = torch.rand(400, width, generator=generator) ** 4 * 7
    weights[:, torch.rand(width, generator=generator) < 0.3] = 0
    weights[:, width // 2] += 0.01  # a token of weight in every row
    uniform = torch.rand(400, generator=generator).clamp(1e-6, 1 - 1e-6)
    drawn = sampling.draw(weights, uniform)
    cumulative = weights.double().cumsum(-1)
    mark = uniform.double().unsqueeze(-1) * cumulative[:, -1:]
    expected = (cumulative <= mark).sum(-1)
    clear = ((cumulative - mark).abs() > 1e-5 * cumulative[:, -1:]).all(-1)
    assert clear.sum() > 350 and torch.equal(drawn[clear], expected[clear])
    assert bool((weights.gather(1, drawn.unsqueeze(-1)) > 0).all())


def test_a_draw_at_the_ends_of_the_distribution_takes_a_token_of_weight():
    """The smallest and largest numbers a draw gets take the first and the last token of any weight, whatever
    weightless tokens lie before or after them, within a block or at the end of the vocabulary."""
    weights = torch.zeros(4, 200)
    weights[0, [5, 70, 130]] = torch.tensor([1.0, 2.0, 3.0])
    weights[1, [0, 199]] = 1.0
    weights[2, 64:128] = 0.5  # one whole block
    weights[3, [0, 130]] = torch.tensor([1.0, 1e-9])  # 1e-9 is lost in a float32 sum with 1
    # the extremes of sampling.uniform_draws: its largest number rounds to 1 in float32
    smallest, largest = torch.full((4,), 0.5 / (1 << 24)), torch.full((4,), 1.0)
    assert sampling.draw(weights, smallest).tolist() == [5, 0, 64, 0]
    assert sampling.draw(weights, largest).tolist() == [130, 199, 127, 130]
    at_edge = torch.tensor([1 / 6, 0.5, 0.5, 0.5])  # marks on a token's end: the next token of weight
    assert sampling.draw(weights, at_edge).tolist() == [70, 199, 96, 0]


@pytest.mark.parametrize("rows_aligned", [False, True])
def test_a_decode_step_shows_a_finished_row_or_an_empty_slot_nothing(rows_aligned):
    """Slot 0 runs, slot 1's row ends at this step (its last new token), slot 2 holds none: the mask the model gets
    shows slot 0 its prompt and its own position, slot 1 (still running when the step starts) likewise, slot 2
    nothing, so that an attention reading only what a row sees reads nothing for it; at the next step slot 1 sees
    nothing either. A model that builds its masks from one position for the batch (``rows_aligned``) gets the
    rows' masks as they were (slots at one position: its masks are its own)."""
    state = decoding.DecodeState.allocate(3, 8, 4, torch.device("cpu"))
    start = decoding.RowStart(torch.tensor([5, 6]), torch.zeros(2), torch.tensor([[0, 1, 1], [1, 1, 1]]),
                              torch.tensor([0, 1]), torch.tensor([4, 2]),
                              sampling.RowSampling(torch.ones(2), torch.ones(2), torch.zeros(2, dtype=torch.long)),
                              torch.zeros(2, dtype=torch.long))
    rules = decoding.TokenRules(SamplingSettings(), decoding.ending_table([2], torch.device("cpu")), 0, True)
    decoding.insert_rows(state, torch.tensor([0, 1]), start, rules)
    masks = []

    def forward(input_ids, attention_mask, position_ids, cache_position):
        masks.append(attention_mask.clone())
        return torch.nn.functional.one_hot(torch.tensor([7, 7, 7]), 10).float()

    for _ in range(2):
        decoding.decode_one_token(forward, state, rules, rows_aligned)
    assert state.finished.tolist() == [False, True, True]
    assert masks[0][0].tolist() == [0, 1, 1, 1, 0, 0, 0, 0] and masks[0][1].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert masks[1][0].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    if rows_aligned:
        assert masks[1][1].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    else:
        assert masks[0][2].sum() == 0 and masks[1][1].sum() == 0 and masks[1][2].sum() == 0
