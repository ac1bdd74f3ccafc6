"""Weight-only int8 (`--quantize int8`): the linear layers' weights as int8 with one scale per output channel,
on the CPU multiplied in int8 (each input row quantized too) by the kernel measured fastest for each weight shape."""

import json
import subprocess
import sys
import threading

import pytest
import torch
from accelerators import CapturingCpu, plugin_manager_with
from conftest import PROMPTS
from safetensors import safe_open
from tiny_models import build_model, build_tokenizer
from transformers import LlamaConfig

import accelgen
from accelgen.cli import main
from accelgen.common.settings import RunSettings
from accelgen.model.memory import parameter_bytes, parameter_bytes_of_config
from accelgen.parallel.launcher import free_port
from accelgen.quantization.int8_layer import INT8_LIMIT, Int8Linear, int8_product, quantize_rows
from accelgen.quantization.while_loading import QuantizingWeights
from accelgen_cpu import CpuAccelerator, int8_kernels
from accelgen_cpu.int8_kernels import (
    KERNELS,
    FusedInt8Product,
    PackedInt8Product,
    available_kernels,
    int8_product_on_cpu,
    use_int8_kernel,
)

MAX_NEW_TOKENS = 8


def completions(folder, **settings):
    generator = accelgen.load(str(folder), device="cpu", max_new_tokens=MAX_NEW_TOKENS, **settings)
    return [completion.completion_token_ids for completion in generator.generate(PROMPTS)], generator


@pytest.mark.parametrize("architecture", ["bloom", "llama", "opt"])
def test_int8_runs_through_the_command_line(tiny_model_folder, tmp_path, capsys, architecture):
    folder = tiny_model_folder(architecture)
    output = tmp_path / "out.jsonl"
    arguments = ["run", "--device", "cpu", "--dtype", "bfloat16", "--model", str(folder), "--max-new-tokens",
                 str(MAX_NEW_TOKENS), "--output", str(output), "--quiet", "--details"]
    assert main([*arguments, *(argument for prompt in PROMPTS for argument in ("--prompt", prompt)),
                 "--quantize", "int8"]) == 0
    summary = capsys.readouterr().err
    assert "dtype bfloat16 (int8 weights)" in summary
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["index"] for row in rows] == [0, 1, 2]
    expected, generator = completions(folder, dtype="bfloat16", quantize="int8")
    assert [row["completion_token_ids"] for row in rows] == expected
    linears = [module for module in generator.model.modules() if isinstance(module, Int8Linear)]
    # one byte a weight (int8, or the fused kernel's panels of it, unsigned)
    assert linears and all(module.weight.element_size() == 1 for module in linears)
    # the CPU makes an output head of its own int8 too; one tied to the input embedding keeps the run's dtype
    tied = generator.model.config.get_text_config().tie_word_embeddings
    assert generator.model.get_output_embeddings().weight.element_size() == (2 if tied else 1)
    assert generator.model.get_input_embeddings().weight.dtype == torch.bfloat16


def linear_heavy_llama(tmp_path):
    """A Llama whose linear layers hold most of the weights, as in any large model (in the tiny test models the
    embeddings, which stay in the run's dtype, are a third of the weights): its folder."""
    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    folder = build_model(tmp_path / "llama", config)
    tokenizer.save_pretrained(folder)
    return folder


def test_int8_parameters_take_at_most_0_55_of_bfloat16s(tmp_path):
    folder = str(linear_heavy_llama(tmp_path))
    sizes = {quantize: parameter_bytes(accelgen.load(folder, device="cpu", dtype="bfloat16", quantize=quantize).model)
             for quantize in (None, "int8")}
    assert sizes["int8"] <= 0.55 * sizes[None]


@pytest.mark.transformers_release
@pytest.mark.parametrize("architecture", ["bloom", "llama", "opt"])
def test_int8_logits_stay_within_the_rounding_bound(tiny_model_folder, architecture):
    """Rounding a weight to the nearest of 255 levels per row moves it by at most half a step, absmax / 254;
    for uniform rounding the error's spread is step / sqrt(12), about 0.23% of the row's absmax. The test
    models' weights are normal with absmax about 3.5 standard deviations over their rows, so each layer's
    output moves by about 0.8% of its spread; over the tiny models' two decoder layers (each adding to the
    residual) the logits move by a few percent at most: 5% of their norm bounds it, where a wrong scale
    (twice the step, say) or a transposed weight gives tens of percent. Activations in float32, so that only
    the weights' rounding differs."""
    error = quantized_logits_error(str(tiny_model_folder(architecture)), "cpu", "int8")
    assert 0 < error < 0.05


@pytest.mark.transformers_release
@pytest.mark.parametrize("architecture", ["bloom", "llama", "opt"])
@pytest.mark.parametrize("one_token_per_pass, batch_size", [(True, 1), (False, 4)], ids=["one-row", "rows"])
def test_int8_logits_of_quantized_rows_stay_within_the_rounding_bound(tiny_model_folder, architecture,
                                                                      one_token_per_pass, batch_size):
    """Where the CPU quantizes each input row to int8 too (its own scale): one row per product (batch-1 decoding),
    or every product of a run of several slots (its weights laid out for int8 products of several rows). The
    rows' rounding adds an error of the weights' size, well inside the bound above."""
    error = quantized_logits_error(str(tiny_model_folder(architecture)), "cpu", "int8", one_token_per_pass,
                                   batch_size=batch_size)
    assert 0 < error < 0.05


def quantized_logits_error(folder: str, device: str, scheme: str, one_token_per_pass: bool = False,
                           batch_size: int = 1) -> float:
    """How far the logits of ``scheme`` are from the unquantized model's over a fixed sequence, as the relative
    L2 norm of their difference; float32 activations, so that only the quantization differs. ``one_token_per_pass``
    feeds the sequence a token at a time (a key/value cache between the passes), as batch-1 decoding does."""
    from transformers import DynamicCache

    tokens = torch.tensor([[3, 17, 42, 9, 120, 7, 64, 5]])
    logits = {}
    for quantize in (None, scheme):
        generator = accelgen.load(folder, device=device, dtype="float32", quantize=quantize, batch_size=batch_size)
        with torch.no_grad():
            if one_token_per_pass:
                cache = DynamicCache()
                logits[quantize] = torch.cat([generator.model(tokens[:, place:place + 1], past_key_values=cache,
                                                              use_cache=True).logits for place in range(tokens.shape[1])], 1)
            else:
                logits[quantize] = generator.model(tokens).logits
    return float((logits[scheme] - logits[None]).norm() / logits[None].norm())


def test_a_layer_of_rows_that_do_not_fit_the_int8_kernel_gives_the_plain_product():
    """torch's int8 product takes rows of a multiple of 16 values; other layers take the plain product."""
    torch.manual_seed(0)
    for inputs in (17, 24):
        values, scales = quantize_rows(torch.randn(8, inputs, dtype=torch.bfloat16))
        x = torch.randn(3, inputs, dtype=torch.bfloat16)
        assert torch.equal(int8_product_on_cpu(x, values, scales), int8_product(x, values, scales))


def skip_unless_available(kernel: str) -> None:
    if kernel not in available_kernels():
        pytest.skip(f"this machine or torch build lacks the {kernel!r} int8 kernel")


@pytest.mark.parametrize("rows", [1, 3, 16, 19])
@pytest.mark.parametrize("kernel", KERNELS)
def test_each_row_is_multiplied_in_int8_within_its_own_rounding(rows, kernel):
    """Input rows (one when decoding batch 1, several for prompts and slots) are quantized to int8 too, each with its
    own scale: each product moves by at most its row's rounding, half a step (the row's absmax / 254) per value,
    whichever kernel the layer's weight shape takes; a wrong scale, a transposed weight or a scale shared by the rows
    moves it far more. Every kernel gives the same values, so that the one measured fastest never changes a token."""
    skip_unless_available(kernel)
    torch.manual_seed(0)
    values, scales = quantize_rows(torch.randn(64, 256))
    x = torch.randn(rows, 256) * torch.logspace(0, 3, rows)[:, None]  # rows of very different sizes
    exact = int8_product(x, values, scales)
    bound = (x.abs().amax(1, keepdim=True) / 254) * (values.float().abs() * scales[:, None]).sum(1)  # [rows, 64]
    layer = Int8Linear(values.clone(), scales, None, int8_product_on_cpu)
    use_int8_kernel(layer, kernel)
    product = layer(x)
    difference = (product - exact).abs()
    assert bool((difference <= bound * 1.001 + 1e-4).all()) and difference.max() > 0
    assert torch.equal(product, int8_product_on_cpu(x, values, scales))
    torch._dynamo.reset()  # each case compiles a layer of its own: not a recompilation of the last case's
    compiled = torch.compile(layer, dynamic=False, fullgraph=True)  # oneDNN's through an operator of ours
    assert torch.equal(compiled(x), product)


def exact_int8_product(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int8 product every kernel must give to the last bit: ``x``'s rows quantized as the kernels quantize them,
    the exact int32 sums of their and the weight's int8 ``values`` (in float64: every partial sum is an integer below
    2**53), scaled as ``(sums * weight scale) * row scale`` in float32, rounded to ``x``'s dtype."""
    row_values, row_scales = int8_kernels.quantize_input_rows(x)
    sums = (row_values.double() @ values.double().t()).float()
    return sums.mul(scales.float()).mul(row_scales).to(x.dtype)


def test_a_layer_whose_rows_are_not_a_multiple_of_16_values_takes_the_fused_kernel_with_exact_sums():
    """``_int_mm`` and oneDNN take rows of a multiple of 16 values only; the fused kernel takes any (the dataset
    benchmark's MLP is 682 wide): such a layer takes it, and its int32 sums are the exact products of the rows'
    and the weight's int8 values."""
    skip_unless_available("fused")
    torch.manual_seed(0)
    values, scales = quantize_rows(torch.randn(40, 682))
    model = torch.nn.Sequential(Int8Linear(values.clone(), scales, None, int8_product_on_cpu))
    int8_kernels.choose_int8_kernels(model, rows=4)
    assert isinstance(model[0].product, FusedInt8Product)
    x = torch.randn(5, 682) * torch.logspace(0, 2, 5)[:, None]
    assert torch.equal(model(x), exact_int8_product(x, values, scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_variants_fused_kernel_gives_the_exact_int8_sums(kernel_variant, threads, dtype):
    """Each build of the fused kernel this processor executes (AVX-512 VNNI's byte products, AVX2's by sign, where
    the sum of two products must not saturate 16 bits: the largest values, +-127, in every row), whether or not a run
    here takes it: the exact int32 sums of the rows' and the weight's int8 values, scaled, for 1 to 48 rows of
    any width, the last tile and panel partly filled."""
    operator = getattr(kernel_variant.operators, "int8_panels_linear", None)
    if operator is None:
        pytest.skip(f"the {kernel_variant.variant} build has no int8 kernel (torch's int8 product runs there)")
    torch.manual_seed(0)
    for inputs, outputs in ((256, 40), (682, 256), (20, 17)):
        values, scales = quantize_rows(torch.randn(outputs, inputs))
        values[0], values[1] = INT8_LIMIT, -INT8_LIMIT  # products at the bounds
        for rows in (1, 2, 5, 16, 17, 48):
            x = (torch.randn(rows, inputs) * torch.logspace(0, 3, rows)[:, None]).to(dtype)
            x[0] = x[0].abs().amax()  # a row of +127s: with the weights' +-127, sums of two products at +-32258
            ours = operator(x, int8_kernels.pack_int8_panels(values), scales.float().contiguous())
            assert torch.equal(ours, exact_int8_product(x, values, scales)), (inputs, outputs, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_variants_row_quantization_gives_torchs_values_in_onednns_unsigned_form(kernel_variant, threads, dtype):
    """Each build's one-pass quantization of the rows oneDNN's product takes (``quantize_rows_unsigned``): the values
    and scales of torch's operations (``int8_kernels.quantize_unsigned_rows``) to the last bit, for rows of any count,
    width and magnitude, halves among them (rounded to even), a row of zeros, and rows of more than two dimensions."""
    operator = getattr(kernel_variant.operators, "quantize_rows_unsigned", None)
    if operator is None:
        pytest.skip(f"the {kernel_variant.variant} build has no int8 kernel (torch's operations quantize there)")
    torch.manual_seed(0)
    for inputs in (2048, 682, 20, 1):
        for rows in (1, 5, 16, 17, 300):
            x = (torch.randn(rows, inputs) * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
            x[0, : min(3, inputs)] = torch.tensor([127.0, 0.5, -2.5])[: min(3, inputs)].to(dtype)  # halves: to even
            x[-1] = 0 if rows > 1 else x[-1]
            ours, theirs = operator(x), int8_kernels.quantize_unsigned_rows(x)
            assert all(torch.equal(mine, its) for mine, its in zip(ours, theirs)), (inputs, rows)
    x = torch.randn(3, 7, 64).to(dtype)
    assert all(torch.equal(mine, its) for mine, its in zip(operator(x), int8_kernels.quantize_unsigned_rows(x)))


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernel_gives_the_plain_products_values_to_the_last_bit(rows, dtype):
    """The fused kernel quantizes sixteen values at a time and writes bfloat16 with the processor's rounding: the
    int8 product's values to the last bit (each row its own scale, rounded half to even; the exact int32 sums scaled
    in float32, then rounded to the input's dtype), for rows of any count and width, the last tile and panel partly
    filled."""
    skip_unless_available("fused")
    torch.manual_seed(0)
    for inputs, outputs in ((256, 40), (682, 256), (20, 17)):
        values, scales = quantize_rows(torch.randn(outputs, inputs))
        layer = Int8Linear(values.clone(), scales, None, int8_product_on_cpu)
        use_int8_kernel(layer, "fused")
        x = (torch.randn(rows, inputs) * torch.logspace(0, 3, rows)[:, None]).to(dtype)
        assert torch.equal(layer(x), exact_int8_product(x, values, scales)), (inputs, outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_of_zeros_gives_zeros_and_leaves_the_other_rows_as_they_were(kernel, dtype):
    """A decode step's finished rows and empty slots run on zeros (ModelForward's zero_unseen_rows), which must stay
    zeros through every layer: each kernel gives a row of zeros exactly 0 (the fused one computes nothing for it), and
    the rows beside it the values they have alone."""
    skip_unless_available(kernel)
    torch.manual_seed(0)
    values, scales = quantize_rows(torch.randn(40, 256))
    layer = Int8Linear(values.clone(), scales, None, int8_product_on_cpu)
    use_int8_kernel(layer, kernel)
    x = torch.randn(19, 256).to(dtype)
    dead = torch.tensor([0, 3, 4, 17, 18])
    x[dead] = 0
    x[3] = -0.0  # zeros of either sign
    x[5] = 0
    x[5, -1] = 1e-3  # zeros but for its last value: computed
    product = layer(x)
    assert bool((product[dead] == 0).all()) and bool((product[5] != 0).any())
    alive = torch.ones(19, dtype=torch.bool).index_fill_(0, dead, False)
    assert torch.equal(product[alive], layer(x[alive]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_layers_taking_one_input_in_turn_see_it_as_it_is_when_each_runs(kernel):
    """Layers that take the same input in turn (query, key and value projections) quantize its rows once; an input
    changed in place between them, or another input in the same memory, is quantized anew."""
    skip_unless_available(kernel)
    torch.manual_seed(0)
    layers = []
    for _ in range(2):
        values, scales = quantize_rows(torch.randn(64, 256))
        layer = Int8Linear(values, scales, None, int8_product_on_cpu)
        use_int8_kernel(layer, kernel)
        layers.append(layer)
    fresh = [torch.randn(4, 256) for _ in range(3)]
    x = fresh[0].clone()
    for layer in layers:
        assert torch.equal(layer(x), layer(fresh[0]))
    x.mul_(3)  # in place: the same memory, shape and strides
    assert torch.equal(layers[1](x), layers[1](fresh[0] * 3))
    x.copy_(fresh[1])
    assert torch.equal(layers[0](x[:2]), layers[0](fresh[1][:2]))  # a view of fewer rows at the same address
    assert torch.equal(layers[0](x), layers[0](fresh[1]))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "captured"])
def test_whichever_kernel_a_layer_takes_the_completions_are_the_same(tiny_model_folder, monkeypatch, graphs):
    """Which int8 kernel a layer takes depends on the processor's instructions and the decode step's rows
    (``int8_kernel_for``), so it differs from machine to machine; the completions must not depend on it, eager or
    captured."""
    folder = str(tiny_model_folder("llama"))
    completions_by_kernel = {}
    for kernel in available_kernels():
        monkeypatch.setattr(int8_kernels, "int8_kernel_for", lambda rows, in_features, kernels, amx=False, kernel=kernel: kernel)
        completions_by_kernel[kernel], generator = completions(
            folder, dtype="float32", quantize="int8", batch_size=4, graphs=graphs,
            plugin_manager=plugin_manager_with(CapturingCpu()) if graphs else None)
        products = {type(layer.product) for layer in generator.model.modules() if isinstance(layer, Int8Linear)}
        assert (PackedInt8Product in products) == (kernel == "packed")
        assert (FusedInt8Product in products) == (kernel == "fused")
    assert {"rows", "columns"} <= set(completions_by_kernel)  # torch's own run everywhere; the others where built
    assert all(completions == completions_by_kernel["rows"] for completions in completions_by_kernel.values())


@pytest.mark.parametrize("rows", [1, 4, 16, 17, 64])
@pytest.mark.parametrize("in_features", [256, 682])
def test_the_kernel_a_layer_takes_is_a_rule_over_the_instructions_and_the_rows(rows, in_features):
    """The fused kernel where it is built (AVX-512 VNNI) up to FUSED_ROWS_AT_MOST rows, oneDNN's packed product past
    them and wherever the fused one is missing, ``_int_mm`` over the stored weight where oneDNN's is missing too; a
    layer whose rows are not a multiple of 16 values takes the fused kernel, else the plain product. With AMX,
    oneDNN's packed product from AMX_ROWS_AT_LEAST rows on for layers of AMX_INPUTS_AT_LEAST inputs or more."""
    with_fused, without = ("rows", "columns", "packed", "fused"), ("rows", "columns", "packed")
    for kernels in (with_fused, without):
        kernel = int8_kernels.int8_kernel_for(rows, in_features, kernels)
        if in_features % 16:
            assert kernel == ("fused" if "fused" in kernels else None)
        elif "fused" in kernels and rows <= int8_kernels.FUSED_ROWS_AT_MOST:
            assert kernel == "fused"
        else:
            assert kernel == "packed"
    assert int8_kernels.int8_kernel_for(rows, 256, ("rows", "columns")) == "rows"  # no oneDNN in this torch
    # with AMX's int8 tiles, oneDNN's packed product (on them) from 16 rows on, for layers of 1,024 inputs or more
    for in_features_amx in (in_features, 2048, 1024, 1008):
        kernel = int8_kernels.int8_kernel_for(rows, in_features_amx, with_fused, amx=True)
        wide = in_features_amx >= int8_kernels.AMX_INPUTS_AT_LEAST and not in_features_amx % 16
        if wide and rows >= int8_kernels.AMX_ROWS_AT_LEAST:
            assert kernel == "packed"
        else:
            assert kernel == int8_kernels.int8_kernel_for(rows, in_features_amx, with_fused)
    assert int8_kernels.int8_kernel_for(64, 2048, ("rows", "columns", "fused"), amx=True) == "fused"  # no oneDNN


def test_a_compiled_bfloat16_product_rounds_as_the_eager_one_whichever_kernel_a_shape_takes():
    """Compiled by the CPU, in bfloat16: the fused kernel rounds its products to bfloat16 inside its operator, the others
    in the compiled code around theirs, which must round there too, not carry float32 on into the next operation (here
    a residual sum): else what a step computes, and so the tokens, would depend on which kernel a shape was measured
    fastest with, from run to run."""
    torch.manual_seed(0)
    values, scales = quantize_rows(torch.randn(64, 256))
    x, residual = torch.randn(16, 256).bfloat16(), torch.randn(16, 64).bfloat16()
    eager = Int8Linear(values.clone(), scales, None, int8_product_on_cpu)(x) + residual
    for kernel in available_kernels():
        layer = Int8Linear(values.clone(), scales, None, int8_product_on_cpu)
        use_int8_kernel(layer, kernel)
        out = torch.empty_like(residual)
        CpuAccelerator().capture(lambda x, residual, out, layer=layer: out.copy_(layer(x) + residual), (x, residual, out),
                                 RunSettings(dtype="bfloat16"))
        assert torch.equal(out, eager), kernel


@pytest.mark.transformers_release
def test_the_quantized_decode_step_is_captured_once_and_writes_what_the_eager_one_writes(tiny_model_folder):
    folder = str(tiny_model_folder("llama"))
    eager, _ = completions(folder, dtype="bfloat16", quantize="int8", batch_size=2, graphs=False)
    captured, generator = completions(folder, dtype="bfloat16", quantize="int8", batch_size=2, graphs=True,
                                      plugin_manager=plugin_manager_with(CapturingCpu()))
    assert captured == eager
    assert generator.stats.graph_captures == 1 and generator.capture_failure is None


@pytest.mark.parametrize("arguments, message", [
    (["--quantize", "fp8"], "--quantize fp8 is not supported on cpu: it runs --quantize int8; drop --quantize"),
    (["--quantize", "int4"], "argument --quantize: invalid choice: 'int4'"),
])
def test_a_scheme_the_device_does_not_run_is_one_line(tiny_model_folder, capsys, arguments, message):
    folder = str(tiny_model_folder("llama"))
    capsys.readouterr()  # what building the model printed
    assert main(["run", "--device", "cpu", "--model", folder, "--prompt", "Hello", *arguments]) == 2
    error = capsys.readouterr().err
    assert error.startswith("accelgen: error: ") and message in error and error.count("\n") == 1


def test_a_model_without_linear_layers_to_quantize_is_one_line(tiny_model_folder, capsys):
    """GPT-2's layers are transformers' Conv1D, not linear layers: int8 would change nothing."""
    folder = str(tiny_model_folder("gpt2"))
    capsys.readouterr()  # what building the model printed
    assert main(["run", "--device", "cpu", "--quantize", "int8", "--model", folder, "--prompt", "Hello"]) == 2
    error = capsys.readouterr().err
    assert "--quantize int8 finds no linear layers to quantize in this gpt2 model" in error and error.count("\n") == 1


def test_an_output_written_with_int8_weights_is_not_resumed_without_them(tiny_model_folder, tmp_path, capsys):
    folder = str(tiny_model_folder("llama"))
    output = tmp_path / "out.jsonl"
    common = ["run", "--device", "cpu", "--model", folder, "--prompt", "Hello", "--prompt", "World",
              "--max-new-tokens", "4", "--output", str(output), "--quiet"]
    assert main([*common, "--quantize", "int8"]) == 0
    before = output.read_text()
    assert main(common) == 2
    assert "holds completions of another run (different quantize)" in capsys.readouterr().err
    assert output.read_text() == before


def test_bench_records_the_scheme_and_labels_the_column_with_it(tiny_model_folder, tmp_path, capsys):
    output = tmp_path / "int8.json"
    assert main(["bench", "--device", "cpu", "--dtype", "bfloat16", "--quantize", "int8", "--model",
                 str(tiny_model_folder("bloom")), "--max-new-tokens", "4", "--runs", "1", "--output", str(output)]) == 0
    [record] = json.loads(output.read_text())["measurements"]
    assert record["quantize"] == "int8" and record["dtype"] == "bfloat16"
    assert record["label"].endswith(" int8")
    assert record["model"]["parameter_bytes_per_rank"] < record["model"]["parameter_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["bloom", "llama"])
def test_two_ranks_quantizing_their_own_slices_write_what_one_process_writes(tiny_model_folder, tmp_path,
                                                                            cli_environment, architecture):
    """Each rank quantizes its slices after the split; a row-parallel layer's ranks agree on each row's scale
    first. Float32 activations, as in the unquantized tensor-parallel tests: in bfloat16 the all-reduce's
    order of additions alone already changes a token now and then, quantized or not."""
    folder = str(tiny_model_folder(architecture))
    output = tmp_path / "out.jsonl"
    prompt_arguments = [argument for prompt in PROMPTS for argument in ("--prompt", prompt)]
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", "2", "--master-port",
         str(free_port()), "--dtype", "float32", "--quantize", "int8", "--model", folder, *prompt_arguments,
         "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(output), "--quiet", "--details"],
        env=cli_environment, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    expected, _ = completions(folder, dtype="float32", quantize="int8")
    assert [json.loads(line)["completion_token_ids"] for line in output.read_text().splitlines()] == expected
    assert "(int8 weights)" in result.stderr


def linear_weight_dtypes(folder) -> set[str]:
    """The dtypes of the linear layers' weights in a pre-sharded folder's files (those with a scale beside)."""

    dtypes = set()
    for path in folder.glob("rank-*.safetensors"):
        with safe_open(str(path), "pt") as tensors:
            names = set(tensors.keys())
            dtypes |= {tensors.get_slice(name.removesuffix("_scale")).get_dtype() for name in names if name.endswith("_scale")}
            assert not any(name.endswith("dense.weight") and f"{name}_scale" not in names for name in names)
    return dtypes


def test_pre_quantized_shards_hold_int8_weights_and_generate_what_quantizing_while_loading_does(
        tiny_model_folder, tmp_path, capsys):
    folder = str(tiny_model_folder("llama"))
    shards = tmp_path / "llama-int8"
    assert main(["shard", "--device", "cpu", "--model", folder, "--world-size", "1", "--dtype", "bfloat16",
                 "--quantize", "int8", "--output", str(shards)]) == 0
    assert linear_weight_dtypes(shards) == {"I8"}
    # the CPU's int8 quantizes this model's untied head: the folder holds it in int8 too
    assert any("lm_head.weight_scale" in safe_open(str(path), "pt").keys() for path in shards.glob("rank-*.safetensors"))
    loaded, generator = completions(shards, dtype="bfloat16", quantize="int8")
    quantized_while_loading, on_the_fly = completions(folder, dtype="bfloat16", quantize="int8")
    assert loaded == quantized_while_loading
    assert parameter_bytes(generator.model) == parameter_bytes(on_the_fly.model)

    capsys.readouterr()
    assert main(["run", "--device", "cpu", "--dtype", "bfloat16", "--model", str(shards), "--prompt", "Hello"]) == 2
    assert "is sharded for --world-size 1 --dtype bfloat16 --quantize int8, not full-precision weights: add " \
           "--quantize int8" in capsys.readouterr().err


@pytest.mark.slow
def test_pre_quantized_shards_of_two_ranks_generate_what_one_process_quantizing_generates(tiny_model_folder, tmp_path,
                                                                                          cli_environment):
    folder = str(tiny_model_folder("bloom"))
    shards, output = tmp_path / "bloom-tp2-int8", tmp_path / "out.jsonl"
    common = ["--device", "cpu", "--world-size", "2", "--dtype", "float32", "--quantize", "int8"]
    subprocess.run([sys.executable, "-m", "accelgen.cli", "shard", *common, "--model", folder, "--output", str(shards)],
                   env=cli_environment, check=True, capture_output=True, timeout=300)
    assert linear_weight_dtypes(shards) == {"I8"}
    prompt_arguments = [argument for prompt in PROMPTS for argument in ("--prompt", prompt)]
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", *common, "--model", str(shards), *prompt_arguments,
         "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(output), "--quiet"],
        env=cli_environment, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    expected, _ = completions(folder, dtype="float32", quantize="int8")
    assert [json.loads(line)["completion_token_ids"] for line in output.read_text().splitlines()] == expected


def test_shard_refuses_fp8_whose_scales_are_measured_at_each_load(tiny_model_folder, tmp_path, capsys):
    folder = str(tiny_model_folder("llama"))
    capsys.readouterr()  # what building the model printed
    assert main(["shard", "--device", "cpu", "--model", folder, "--dtype", "bfloat16", "--output", str(tmp_path / "out"),
                 "--quantize", "fp8"]) == 2
    error = capsys.readouterr().err
    assert "fp8 is measured on the device when a run loads the model: shard without --quantize" in error
    assert error.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("architecture", ["bloom", "llama", "opt"])
def test_the_memory_estimate_before_loading_counts_int8_bytes(tiny_model_folder, architecture):
    """The out-of-memory line, when the weights themselves did not fit, advises from the config's bytes: with
    --quantize they are the quantized model's."""
    folder = str(tiny_model_folder(architecture))
    generator = accelgen.load(folder, device="cpu", dtype="bfloat16", quantize="int8")
    assert parameter_bytes_of_config(generator.model.config, "bfloat16", "int8", head=True) == parameter_bytes(
        generator.model)
    assert parameter_bytes_of_config(generator.model.config, "bfloat16") == parameter_bytes(
        accelgen.load(folder, device="cpu", dtype="bfloat16").model)


def test_pre_quantized_int8_weights_start_on_64_byte_boundaries_of_their_files(tmp_path, cli_environment):
    """So that a run maps them in place: torch's CPU int8 kernel faults on a weight not 16-byte aligned, and a
    map is aligned as the file is (the format itself aligns nothing past its header)."""
    folder = str(linear_heavy_llama(tmp_path))
    output = tmp_path / "int8"
    subprocess.run([sys.executable, "-m", "accelgen.cli", "shard", "--device", "cpu", "--model", folder, "--world-size", "1",
                    "--dtype", "bfloat16", "--quantize", "int8", "--output", str(output)], env=cli_environment, check=True,
                   capture_output=True)
    starts = []
    for path in output.glob("rank-*.safetensors"):
        data = path.read_bytes()
        header_length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_length])
        starts += [8 + header_length + entry["data_offsets"][0] for name, entry in header.items()
                   if name != "__metadata__" and entry["dtype"] == "I8"]
    assert starts and all(start % 64 == 0 for start in starts)


class SlowWeights:
    """A weight source whose reads of ``layer.weight`` wait until released (or a second read starts)."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.reads = weight, 0
        self.reading, self.second_read, self.release = threading.Event(), threading.Event(), threading.Event()

    def shape(self, name):
        return tuple(self.weight.shape)

    def view(self, name, part):
        return None  # not in one piece in memory: read by copy_into

    def copy_into(self, destination, name, part):
        self.reads += 1
        (self.second_read if self.reads > 1 else self.reading).set()
        self.release.wait(timeout=10)
        destination.copy_(self.weight)


def test_a_layers_values_and_scales_asked_for_at_once_read_and_quantize_its_weight_once():
    """Loading fills parameters from several threads: the values and the scales of one layer asked for at the same
    time must come from one read of its weight (a second read would leave a half nobody takes, held forever)."""
    weight = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    source = SlowWeights(weight)
    weights = QuantizingWeights(source, {"layer"}, torch.float32)
    values, scales = torch.empty(6, 8, dtype=torch.int8), torch.empty(6)
    first = threading.Thread(target=weights.copy_into, args=(values, "layer.weight", None))
    second = threading.Thread(target=weights.copy_into, args=(scales, "layer.weight_scale", None))
    first.start()
    assert source.reading.wait(timeout=10)
    second.start()
    source.second_read.wait(timeout=0.5)  # set at once where the second thread reads the weight again
    source.release.set()
    first.join(timeout=10)
    second.join(timeout=10)
    assert source.reads == 1
    expected_values, expected_scales = quantize_rows(weight)
    assert torch.equal(values, expected_values) and torch.equal(scales, expected_scales)
