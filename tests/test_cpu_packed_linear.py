"""The CPU's linear layers over weights laid out at load (plugins/cpu/packed_linear.py: float32 panels for the
plugin's kernel, oneDNN's packed layout otherwise): the same values as ``nn.Linear``, used where they can be (untied
layers of a run in float32 or bfloat16), never where they cannot (a head tied to the embedding, int8 layers,
offloaded weights), counted in the parameters' bytes, and compiled. Whole runs' token-for-token
parity with Hugging Face ``generate`` over packed layers is in test_parity.py; compiled = eager in test_capture.py."""

import gc
import json
import subprocess
import sys
import weakref

import pytest
import torch
from conftest import PROMPTS
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import accelgen
from accelgen.model.memory import parameter_bytes
from accelgen_cpu.native_kernels import native_operator
from accelgen_cpu.packed_linear import FloatPanelsLinear, PackedLinear, pack_float_panels, packing_works


def float_panels_taken():
    """Skip where this processor's variant of the kernels does not take the float32 panels (torch's product does
    better there: benchmarks/RESULTS-log.md)."""
    if native_operator("float_panels_linear") is None:
        pytest.skip("this processor's kernels leave float32 products to torch")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_gives_the_plain_layers_values(dtype, tolerance, rows, bias):
    """Laid out for 16 rows, the product of 1, 3 or 16 rows, as a matrix and as [batch, positions, features]."""
    if not packing_works(dtype):
        pytest.skip(f"this CPU's oneDNN has no packed {dtype} product (bfloat16: AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80, bias=bias).to(dtype)
    packed = PackedLinear(linear, 16)
    for x in (torch.randn(rows, 96, dtype=dtype), torch.randn(2, rows, 96, dtype=dtype)):
        expected, ours = linear(x), packed(x)
        assert ours.shape == expected.shape and ours.dtype == dtype
        assert torch.allclose(ours.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("wrapper", ["python", "cpp"])
def test_a_compiled_packed_layer_gives_the_eager_values(wrapper):
    """Compiled as the plugin compiles (inductor's C++ wrapper, which calls the plugin's C++ operator) and with the
    Python wrapper."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 32))
    packed = torch.nn.Sequential(PackedLinear(layers[0], 4), torch.nn.SiLU(), PackedLinear(layers[2], 4))
    x = torch.randn(4, 64)
    with torch.no_grad():
        compiled = torch.compile(packed, dynamic=False, options={"cpp_wrapper": wrapper == "cpp"})
        assert torch.equal(compiled(x), packed(x))


def test_the_cpp_operators_number_for_a_packed_weight_keeps_no_layer_alive():
    """A compiled step names a packed weight by a number (inductor takes no oneDNN tensor); the number holds the
    weight only as long as its layer does, and a freed one is a clear error, not a crash."""
    torch.manual_seed(0)
    layer = PackedLinear(torch.nn.Linear(16, 8), 2)
    number, x = layer.native_handle, torch.randn(2, 16)
    assert number is not None  # the plugin's kernels are built on this machine (every variant takes this operator)
    product = native_operator("packed_linear")
    assert torch.equal(product(x, number, 8, layer.bias), layer(x))
    weight = weakref.ref(layer.weight)
    del layer
    gc.collect()
    assert weight() is None
    with pytest.raises(RuntimeError, match="was freed with its layer"):
        product(x, number, 8, None)


@pytest.mark.parametrize("outputs", [5, 16, 37, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_a_float32_panels_product_gives_the_plain_layers_values(kernel_variant, threads, outputs, bias):
    """Whole panels of 16 outputs and a partial one, 1 to 19 rows (tiles of rows and what is left), as a matrix and
    as [batch, positions, features], in every variant of the kernels this processor executes."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(72, outputs, bias=bias)
    panels = pack_float_panels(linear.weight.detach())
    assert panels.nbytes == linear.weight.nbytes
    with torch.no_grad():
        for rows in (1, 2, 3, 8, 11, 19):
            for x in (torch.randn(rows, 72), torch.randn(2, rows, 72)):
                expected = linear(x)
                ours = kernel_variant.operators.float_panels_linear(x, panels, outputs, linear.bias)
                assert ours.shape == expected.shape and ours.dtype == torch.float32
                assert torch.allclose(ours, expected, atol=1e-5, rtol=1e-5)


def test_a_rows_float32_panels_product_depends_on_that_row_alone(kernel_variant, threads):
    """Alone or among 1 to 23 others, each row of a tile or the rows left: the same bits."""
    torch.manual_seed(0)
    weight, x = torch.randn(53, 300), torch.randn(24, 300)
    panels = pack_float_panels(weight)

    def product(rows):
        return kernel_variant.operators.float_panels_linear(rows, panels, 53, None)

    alone = torch.cat([product(x[row:row + 1]) for row in range(24)])
    for rows in (2, 5, 8, 9, 16, 24):
        assert torch.equal(product(x[:rows]), alone[:rows])


@pytest.mark.parametrize("wrapper", ["python", "cpp"])
def test_a_compiled_float32_panels_layer_gives_the_eager_values(wrapper):
    """Between the products an exact operation (inductor's SiLU rounds the odd lane differently from torch's)."""
    float_panels_taken()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 130), torch.nn.ReLU(), torch.nn.Linear(130, 32))
    panels = torch.nn.Sequential(FloatPanelsLinear(layers[0]), torch.nn.ReLU(), FloatPanelsLinear(layers[2]))
    x = torch.randn(4, 64)
    with torch.no_grad():
        compiled = torch.compile(panels, dynamic=False, options={"cpp_wrapper": wrapper == "cpp"})
        assert torch.equal(compiled(x), panels(x))
        assert torch.allclose(panels(x), layers(x), atol=1e-5)


def _packed_and_plain(model):
    kinds = (PackedLinear, FloatPanelsLinear)
    layers = [module for module in model.modules() if isinstance(module, (*kinds, torch.nn.Linear))]
    return sum(isinstance(layer, kinds) for layer in layers), sum(type(layer) is torch.nn.Linear for layer in layers)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_packs_every_linear_layer_with_a_weight_of_its_own(tiny_model_folder, dtype):
    """float32 in panels where this processor's kernels take them, else (and bfloat16) oneDNN's layout, where oneDNN
    multiplies that type on this CPU (not bfloat16 on most AVX2 CPUs: the layers stay plain there, and the run runs)."""
    kind = FloatPanelsLinear if dtype == "float32" and native_operator("float_panels_linear") else PackedLinear
    generator = accelgen.load(tiny_model_folder("llama"), device="cpu", dtype=dtype, batch_size=2, max_new_tokens=4)
    packed, plain = _packed_and_plain(generator.model)
    layers = 2 * 7 + 1  # 2 layers of q, k, v, o, gate, up, down; the head (untied)
    laid_out = kind is FloatPanelsLinear or packing_works(getattr(torch, dtype))
    assert (packed, plain) == ((layers, 0) if laid_out else (0, layers))
    assert sum(isinstance(layer, kind) for layer in generator.model.modules()) == packed
    assert generator.model.get_output_embeddings().weight.dtype == getattr(torch, dtype)
    assert len(generator.generate(PROMPTS)[0].completion_token_ids) == 4


def test_a_head_tied_to_the_embedding_stays_plain(tiny_model_folder):
    generator = accelgen.load(tiny_model_folder("opt"), device="cpu", max_new_tokens=4)
    head = generator.model.get_output_embeddings()
    assert type(head) is torch.nn.Linear and head.weight is generator.model.get_input_embeddings().weight
    assert _packed_and_plain(generator.model)[0] > 0


def test_packed_weights_count_as_the_models_parameters(tiny_model_folder):
    """The parameters' bytes a run reports (per rank, in its summary) are the checkpoint's, packed or not."""
    folder = tiny_model_folder("llama")
    with safe_open(folder / "model.safetensors", "pt") as checkpoint:
        stored = sum(checkpoint.get_tensor(name).nbytes for name in checkpoint.keys())
    generator = accelgen.load(folder, device="cpu", dtype="float32", max_new_tokens=4)
    assert _packed_and_plain(generator.model)[0] > 0
    assert parameter_bytes(generator.model) == stored


def test_int8_runs_pack_nothing(tiny_model_folder):
    generator = accelgen.load(tiny_model_folder("llama"), device="cpu", dtype="bfloat16", quantize="int8",
                              max_new_tokens=4)
    assert _packed_and_plain(generator.model)[0] == 0


def test_offloaded_runs_pack_nothing(tiny_model_folder, tmp_path):
    generator = accelgen.load(tiny_model_folder("llama"), device="cpu", max_new_tokens=4, offload="disk",
                              max_device_memory=400_000, offload_folder=str(tmp_path))
    assert _packed_and_plain(generator.model)[0] == 0
    assert len(generator.generate(PROMPTS)[0].completion_token_ids) == 4


def test_a_prompts_rows_taken_in_chunks_give_what_each_row_gives_alone(kernel_variant, threads):
    """A prompt's hundreds of rows, which the product takes in chunks that stay in cache (here 300 rows of 2,048
    inputs: three chunks, the last one partial): each row's bits what it gives alone, the plain layer's values."""
    torch.manual_seed(0)
    weight, x = torch.randn(53, 2048), torch.randn(300, 2048)
    panels = pack_float_panels(weight)

    def product(rows):
        return kernel_variant.operators.float_panels_linear(rows, panels, 53, None)

    together = product(x)
    assert torch.equal(together, torch.cat([product(x[row:row + 1]) for row in range(300)]))
    assert torch.allclose(together, torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-4)


LOAD_PEAK = r"""
import json, re, sys
import accelgen
from accelgen.common.host_memory import peak_resident_bytes
options = json.loads(sys.argv[3])
accelgen.load(sys.argv[1], device="cpu", **options)  # the imports and kernels a load takes, counted before
before = int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
generator = accelgen.load(sys.argv[2], device="cpu", **options)
print(json.dumps({"before": before, "peak": peak_resident_bytes()}))
"""


def prepared_bytes(model: torch.nn.Module, dtype: str, quantize: str | None) -> int:
    """The bytes of ``model``'s weights as a run holds them: each in ``dtype``, or with ``quantize`` (int8) every
    linear layer's weight in int8 with a scale per output."""
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    total = 0
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if quantize and isinstance(module, torch.nn.Linear) and name == "weight":
                total += parameter.numel() + parameter.shape[0] * size
            else:
                total += parameter.numel() * size
    return total


@pytest.mark.parametrize("dtype, quantize", [("float32", None), ("bfloat16", None), ("float32", "int8")])
def test_a_loads_peak_is_the_prepared_weights_and_about_one_layer_more(tiny_model_folder, tmp_path, cli_environment,
                                                                        dtype, quantize):
    # a model of 300 MB of float32 weights read from its file (mapped): each layer's plain weight is let go as its
    # laid-out (or int8) form is made, so the load's peak is the weights as the run holds them and about one layer
    # more, never the checkpoint's and the run's whole
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_folder("llama"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=24,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    prepared = prepared_bytes(model, dtype, quantize)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    del model
    options = json.dumps({"dtype": dtype, "quantize": quantize})
    done = subprocess.run([sys.executable, "-c", LOAD_PEAK, str(tiny_model_folder("llama")), str(tmp_path / "model"),
                           options], env=cli_environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.splitlines()[-1])
    assert measured["peak"] - measured["before"] < 1.3 * prepared, (measured, prepared)
