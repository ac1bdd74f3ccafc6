"""Which of the CPU's kernels a run takes is a rule over the processor's instructions and the shapes
(plugins/cpu/kernel_variants.py, int8_kernels.int8_kernel_for), never a timing: loads of one model take the same
kernels and give the same tokens, every time."""

import pytest
import torch
from conftest import PROMPTS

import accelgen
from accelgen.quantization.int8_layer import Int8Linear
from accelgen_cpu.int8_kernels import FusedInt8Product, PackedInt8Product, available_kernels, int8_kernel_for
from accelgen_cpu.kernel_variants import OPERATORS_TAKEN, chosen_variant
from accelgen_cpu.native_kernels import loaded_kernels

PRODUCTS = {"fused": FusedInt8Product, "packed": PackedInt8Product}


def kernels_taken(model: torch.nn.Module) -> list[tuple[str, str, str]]:
    """Each module's class and, for an int8 layer, its product's kind and its weight's layout."""
    taken = []
    for name, module in model.named_modules():
        product = getattr(module, "product", None)
        kind = getattr(product, "__name__", type(product).__name__) if product is not None else ""
        layout = f"{module.weight.layout}{tuple(module.weight.stride())}" if isinstance(module, Int8Linear) else ""
        taken.append((name, type(module).__name__, kind + layout))
    return taken


@pytest.mark.parametrize("dtype, quantize", [("float32", None), ("bfloat16", "int8")])
def test_five_loads_of_a_model_take_the_same_kernels_and_give_the_same_tokens(tiny_model_folder, dtype, quantize):
    folder = str(tiny_model_folder("llama"))
    loads = []
    for _ in range(5):
        generator = accelgen.load(folder, device="cpu", dtype=dtype, quantize=quantize, batch_size=4, max_new_tokens=8)
        tokens = [completion.completion_token_ids for completion in generator.generate(PROMPTS)]
        loads.append((kernels_taken(generator.model), tokens))
        if quantize:  # each int8 layer takes what the rule names for the run's rows, not what a stopwatch found
            for layer in generator.model.modules():
                if isinstance(layer, Int8Linear):
                    kernel = int8_kernel_for(4, layer.in_features, available_kernels())
                    if kernel in PRODUCTS:
                        assert type(layer.product) is PRODUCTS[kernel]
                    else:
                        assert not isinstance(layer.product, tuple(PRODUCTS.values())), kernel
    assert all(load == loads[0] for load in loads[1:])


def test_the_kernels_loaded_are_the_variant_the_processor_names_and_take_its_operators():
    kernels = loaded_kernels()
    assert kernels is not None and kernels.variant == chosen_variant()
    assert kernels.taken == OPERATORS_TAKEN[kernels.variant]
    for name in ("decode_attention", "float_panels_linear", "int8_panels_linear", "rms_norm"):
        assert (kernels.operator(name) is not None) == (name in kernels.taken and hasattr(kernels.operators, name))
