"""The core names no device: device behaviour reaches it only through the plugin contract."""

import ast
import pathlib
import re

import pytest
from test_layers import module_name

CORE = pathlib.Path(__file__).resolve().parent.parent / "core"

#: Devices, their vendors and their collective libraries, as words of code; a word of code that begins with one of
#: them names the device too (``cudagraphs``, ``hpugraph``, ``ncclComm``).
DEVICE_WORDS = ("cuda", "nvidia", "nccl", "hpu", "habana", "gaudi", "hccl", "xpu", "npu", "mps", "rocm")
#: The devices' own libraries and terms, as whole words only (their letters begin ordinary words too: ``hipster``).
DEVICE_TERMS = ("cudnn", "cublas", "cublaslt", "cusparse", "cufft", "curand", "cutlass", "nvml", "nvtx", "nvcc", "cupti",
                "tensorrt", "hip", "hipblas", "miopen", "rccl", "synapse", "tpu", "xla")
#: Libraries only a device's plugin may import.
DEVICE_LIBRARIES = ("habana_frameworks", "optimum", "torch_npu", "intel_extension_for_pytorch", "pynvml", "triton")
#: The plugins' own packages: the core reaches a plugin through the plugin manager only, never by importing it (the
#: manager registers the built-ins by these names, as strings).
PLUGIN_PACKAGE = re.compile(r"accelgen_\w+")
#: A device word or term standing alone in a string ("cuda", "cuda:0", "CUDA out of memory", "cudagraphs"), not inside
#: a module name such as "accelgen_cuda" (the built-in plugins' names, which the plugin manager registers).
DEVICE_IN_TEXT = re.compile(r"\b((" + "|".join(DEVICE_WORDS) + r")[a-z0-9]*|" + "|".join(DEVICE_TERMS) + r")\b",
                            re.IGNORECASE)


def names_a_device(identifier: str) -> bool:
    """Whether a name or attribute (``cuda``, ``is_cuda``, ``use_hpu_graphs``, ``cudagraphs``, ``cudnn``) has a device
    word or term as a part, or a part that begins with a device word."""
    return any(part.lower() in DEVICE_TERMS or part.lower().startswith(DEVICE_WORDS) for part in identifier.split("_"))


def imports_a_plugin(module: str) -> bool:
    """Whether importing ``module`` reaches into a plugin's package (``accelgen_cpu``, ``accelgen_cpu.threads``)."""
    return PLUGIN_PACKAGE.fullmatch(module.split(".")[0]) is not None


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of the string constants that are docstrings: prose that may mention devices as examples."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def device_names(root: pathlib.Path) -> list[str]:
    """``module:line: what`` for every device named in the code of the modules under ``root`` (all depths):
    device libraries imported, device attributes and names (``torch.cuda``, ``x.is_cuda``), device words in
    string literals (``"hpu"`` branches, ``"cuda:0"``). Comments and docstrings are prose and not read."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        prose = docstrings(tree)
        where = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if (literal := module_name(node)) is not None:  # importlib.import_module("...") / __import__("...")
                modules = [literal]
            for module in modules:
                parts = module.split(".")
                if parts[0] in DEVICE_LIBRARIES or any(names_a_device(part) for part in parts) or imports_a_plugin(module):
                    problems.append(f"{where}:{node.lineno}: imports {module}")
            if isinstance(node, ast.Attribute) and names_a_device(node.attr):
                problems.append(f"{where}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Name) and names_a_device(node.id):
                problems.append(f"{where}:{node.lineno}: {node.id}")
            elif isinstance(node, ast.arg) and names_a_device(node.arg):  # a parameter
                problems.append(f"{where}:{node.lineno}: {node.arg}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and names_a_device(node.name):
                problems.append(f"{where}:{node.lineno}: {node.name}")
            elif isinstance(node, ast.keyword) and node.arg and names_a_device(node.arg):  # f(cudagraphs=True)
                problems.append(f"{where}:{node.lineno}: {node.arg}=")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                if DEVICE_IN_TEXT.search(node.value):
                    problems.append(f"{where}:{node.lineno}: {node.value!r}")
    return problems


def test_the_core_names_no_device_and_imports_no_device_library():
    assert device_names(CORE) == []


#: Put above each planted code: a docstring and a comment naming devices, which are prose and not read.
PROSE = '"""Prose may name cuda and torch.cuda."""\n\n# so may comments: torch.cuda.synchronize()\n'


@pytest.mark.parametrize(("code", "found"), [
    ("import torch\n\n\ndef wait():\n    torch.cuda.synchronize()\n", [(5, ".cuda")]),
    ("def kind(device):\n    if device.type == 'hpu':\n        return 1\n", [(2, "'hpu'")]),
    ("def place(x):\n    return x.to('cuda:0')\n", [(2, "'cuda:0'")]),
    ("def is_fast(x):\n    return x.is_cuda\n", [(2, ".is_cuda")]),
    ("def step():\n    import habana_frameworks.torch.core as htcore\n", [(2, "imports habana_frameworks.torch.core")]),
    ("from torch.cuda import graphs\n", [(1, "imports torch.cuda"), (1, "imports torch.cuda.graphs")]),
    ("def fail(card):\n    raise RuntimeError(f'Gaudi {card} is busy')\n", [(2, "'Gaudi '")]),
    ("import accelgen_cpu\n", [(1, "imports accelgen_cpu")]),
    ("def threads():\n    from accelgen_cpu.threads import ThreadChooser\n",
     [(2, "imports accelgen_cpu.threads"), (2, "imports accelgen_cpu.threads.ThreadChooser")]),
    ("import importlib\nplugin = importlib.import_module('accelgen_cuda')\n", [(2, "imports accelgen_cuda")]),
    ("def capture(step, cudagraphs):\n    return cudagraphs\n", [(1, "cudagraphs"), (2, "cudagraphs")]),
    ("def use_hpu_graphs():\n    return compile(mode='x', cudagraphs=True)\n", [(1, "use_hpu_graphs"), (2, "cudagraphs=")]),
    ("import torch\nfast = torch.backends.cudnn.enabled\n", [(2, ".cudnn")]),
    ("options = {'triton.cudagraphs': True}\n", [(1, "'triton.cudagraphs'")]),
    ("def fast(module):\n    return module.hpugraph_wrapped\n", [(2, ".hpugraph_wrapped")]),
])
def test_a_device_planted_in_a_nested_module_is_found(tmp_path, code, found):
    layer = tmp_path / "deep" / "layer"
    layer.mkdir(parents=True)
    (tmp_path / "deep" / "__init__.py").write_text("")
    (layer / "__init__.py").write_text('"""A layer whose docstring may say CUDA graph or HPU graph."""\n')
    (layer / "planted.py").write_text(PROSE + code)
    assert device_names(tmp_path) == [f"deep/layer/planted.py:{line + PROSE.count(chr(10))}: {what}" for line, what in found]


def test_prose_and_the_built_in_plugins_names_are_not_device_names(tmp_path):
    (tmp_path / "manager.py").write_text(PROSE + 'DEFAULT_PLUGINS = ("accelgen_cpu", "accelgen_cuda", "accelgen_hpu")\n')
    assert device_names(tmp_path) == []


# -- the registry's rule for a device's own name: one word, as --device takes it ------------------------------------


@pytest.mark.parametrize("bad_name", ["my device", "cuda:0", "", "npu\n"])
def test_a_plugin_registering_a_name_that_is_not_one_word_is_refused_in_one_line(bad_name, capsys):
    import torch
    from accelerators import RegisteringPlugin
    from conftest import one_error_line

    import accelgen
    from accelgen.cli import main
    from accelgen.plugin.manager import get_plugin_manager

    class BadlyNamed(accelgen.Accelerator):
        name = bad_name

        def is_available(self):
            return True

        def setup(self, world):
            return torch.device("cpu")

    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RegisteringPlugin(BadlyNamed()), name="named_badly")
    problem = f"registers BadlyNamed with the name {bad_name!r}: a device name is one word of letters, digits"

    assert main(["devices"], plugin_manager) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line for line in listed if line.startswith("broken")] == [
        f"broken   plugin named_badly (package unknown): {problem}, '_' and '-'"]
    assert any(line.startswith("cpu ") and "available" in line for line in listed)  # the others still work

    assert main(["run", "--device", bad_name, "--prompt", "hi", "--max-new-tokens", "1"], plugin_manager) == 2
    error = one_error_line(capsys)
    assert f"named_badly (package unknown): {problem}" in error  # "--device X cannot be used", or "" unknown
