"""The CPU's seeded draw in one operator (plugins/cpu/kernels/token_draw.cpp, ``CpuAccelerator.token_draw``) draws
the token the core's torch operations draw (accelgen.generation.sampling), in every variant of the C++ kernels this
processor executes, at 1 and 2 threads: the token whose share of the cumulative probability holds the row's uniform
number (checked against the exact cumulative probabilities, up to rounding), never a token of no weight, the same
token for float32 and bfloat16 logits of the same values, and the core's own token wherever rounding cannot decide."""

import pytest
import torch

from accelgen.common.settings import SamplingSettings
from accelgen.generation.sampling import RowSampling, choose_tokens, inverse_temperatures
from accelgen_cpu import CpuAccelerator

SAMPLING = SamplingSettings(do_sample=True, temperature=0.7, seed=0)


def rows_of(count: int, temperature: float = 0.7) -> RowSampling:
    return RowSampling.of_run(SamplingSettings(do_sample=True, temperature=temperature), count, torch.device("cpu"))


def exact_bounds(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's cumulative probability before it and after it [B, V], in float64."""
    probabilities = torch.softmax(logits.double() / temperature, dim=-1)
    after = probabilities.cumsum(-1)
    return after - probabilities, after


@pytest.mark.parametrize("vocabulary", [100, 4096, 32003])
@pytest.mark.parametrize("spread", [1.0, 4.0, 20.0])
def test_each_token_drawn_holds_its_rows_number_in_its_share_of_the_probability(kernel_variant, threads, vocabulary,
                                                                                 spread):
    generator = torch.Generator().manual_seed(vocabulary)
    logits = torch.randn(24, vocabulary, generator=generator) * spread
    uniform = torch.rand(24, generator=generator).clamp(min=1e-6)
    tokens = kernel_variant.operators.draw_tokens(logits, inverse_temperatures(rows_of(24)), uniform)
    assert tokens.dtype == torch.long and tokens.shape == (24,)
    before, after = exact_bounds(logits, 0.7)
    rows = torch.arange(24)
    slack = 1e-5  # float32 sums over up to 32,003 weights
    assert ((before[rows, tokens] <= uniform.double() + slack) & (uniform.double() <= after[rows, tokens] + slack)).all()


def test_where_rounding_cannot_decide_it_draws_the_cores_token(kernel_variant, threads):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 4096, generator=generator) * 20  # a few tokens hold each row's probability
    uniform = torch.rand(64, generator=generator)
    before, after = exact_bounds(logits, 0.7)
    tokens = choose_tokens(logits, SAMPLING, uniform, rows_of(64))
    rows = torch.arange(64)
    clear = ((uniform.double() - before[rows, tokens]).abs() > 1e-4) & ((after[rows, tokens] - uniform.double()).abs() > 1e-4)
    assert clear.sum() >= 60
    ours = kernel_variant.operators.draw_tokens(logits, inverse_temperatures(rows_of(64)), uniform)
    assert torch.equal(ours[clear], tokens[clear])


def test_a_token_of_no_weight_is_never_drawn_even_at_the_end_of_the_row(kernel_variant):
    logits = torch.full((3, 200), float("-inf"))
    logits[0, [5, 70]] = 0.0  # the rest -inf: a row's last tokens weigh nothing, its last blocks nothing
    logits[1, :130] = torch.linspace(-3, 0, 130)
    logits[1, 130:] = -200.0  # an exponent far below -87: weight 0, as the core's exp rounds it
    logits[2, 199] = 1.0
    for number in (1e-7, 0.5, 1.0):  # 1.0: the mark at the row's end takes its last token of any weight
        uniform = torch.full((3,), number)
        tokens = kernel_variant.operators.draw_tokens(logits, inverse_temperatures(rows_of(3, 1.0)), uniform)
        assert tokens[0].item() in (5, 70) and tokens[1].item() < 130 and tokens[2].item() == 199
    at_end = kernel_variant.operators.draw_tokens(logits, inverse_temperatures(rows_of(3, 1.0)), torch.ones(3))
    assert at_end.tolist() == [70, 129, 199]


def test_a_temperature_near_zero_takes_the_most_likely_token(kernel_variant):
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    tokens = kernel_variant.operators.draw_tokens(logits, inverse_temperatures(rows_of(8, 0.0)), torch.rand(8))
    assert torch.equal(tokens, logits.argmax(-1))


def test_bfloat16_logits_draw_what_their_float32_values_draw(kernel_variant):
    generator = torch.Generator().manual_seed(2)
    logits = (torch.randn(16, 5000, generator=generator) * 5).bfloat16()
    uniform, inverse = torch.rand(16, generator=generator), inverse_temperatures(rows_of(16))
    assert torch.equal(kernel_variant.operators.draw_tokens(logits, inverse, uniform),
                       kernel_variant.operators.draw_tokens(logits.float(), inverse, uniform))


def test_the_cpu_offers_its_draw_where_its_kernels_load():
    from accelgen_cpu.native_kernels import native_operator

    assert CpuAccelerator().token_draw() is native_operator("draw_tokens")
