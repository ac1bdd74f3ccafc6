"""RMSNorm modules that compute what Llama's does run the CPU plugin's C++ operator (plugins/cpu/norms.py): the
values of the modules' own seven operations (bfloat16 and float16 to the bit, float32 to the last bit: the sum of squares runs in
another order), in every variant of the kernels this processor executes, at 1 and 2 threads; and a run's norms all
go through it. Whole runs' tokens equal Hugging Face's: test_parity.py."""

import pytest
import torch
from conftest import PROMPTS
from family_models import skip_unless_installed
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import accelgen
from accelgen_cpu.native_kernels import loaded_kernels, native_operator
from accelgen_cpu.norms import use_fused_norms

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_operator_normalizes_as_the_module_does(kernel_variant, threads, dtype):
    """Rows of 96 values, more rows than a thread's share (the rows are split among threads 16 at a time)."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data.normal_()
    rows = torch.randn(12, 3, 96, dtype=dtype) * 5
    with torch.no_grad():
        ours = kernel_variant.operators.rms_norm(rows, norm.weight, norm.variance_epsilon)
        expected = norm(rows)
    assert ours.dtype == dtype and ours.shape == expected.shape
    if dtype != torch.float32:
        assert torch.equal(ours, expected)
    else:
        assert torch.allclose(ours, expected, rtol=1e-6, atol=0)


def test_a_llama_runs_its_norms_through_the_operator(tiny_model_folder):
    assert native_operator("rms_norm") is not None  # every variant takes it
    generator = accelgen.load(tiny_model_folder("llama"), device="cpu", max_new_tokens=4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        generator.generate(PROMPTS)
    calls = {event.key: event.count for event in profile.key_averages()}
    norms = 2 * generator.model.config.num_hidden_layers + 1
    assert calls.get(f"{loaded_kernels().operators.name}::rms_norm", 0) >= norms * generator.stats.decode_steps > 0
    assert "aten::rsqrt" not in calls


@pytest.mark.parametrize("family, takes", [("llama", True), ("qwen3", True), ("mistral", True), ("granite", True),
                                           ("gemma2", False)])
def test_a_familys_norms_take_the_operator_only_where_they_compute_its_values(tiny_model_folder, family, takes):
    """Gemma's norm scales by 1 + weight: its modules keep their own forward; families that compute Llama's take the
    operator, whatever their classes are called."""
    skip_unless_installed(family)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder(family))
    norms = [module for module in model.modules() if type(module).__name__.endswith("RMSNorm")]
    assert norms and use_fused_norms(model) == (len(norms) if takes else 0)
