"""The core names no device: device behaviour reaches it only through the plugin contract."""

import ast
import pathlib
import re

import pytest

CORE = pathlib.Path(__file__).resolve().parent.parent / "core"

#: Devices, their vendors and their collective libraries, as words of code.
DEVICE_WORDS = ("cuda", "nvidia", "nccl", "hpu", "habana", "gaudi", "hccl", "xpu", "npu", "mps", "rocm")
#: Libraries only a device's plugin may import.
DEVICE_LIBRARIES = ("habana_frameworks", "optimum", "torch_npu", "intel_extension_for_pytorch", "pynvml")
#: A device word standing alone in a string ("cuda", "cuda:0", "CUDA out of memory"), not inside a
#: module name such as "accelgen_cuda" (the built-in plugins' names, which the plugin manager registers).
DEVICE_IN_TEXT = re.compile(r"\b(" + "|".join(DEVICE_WORDS) + r")\b", re.IGNORECASE)


def names_a_device(identifier: str) -> bool:
    """Whether a name or attribute (``cuda``, ``is_cuda``, ``use_hpu_graphs``) has a device word as a part."""
    return any(part.lower() in DEVICE_WORDS for part in identifier.split("_"))


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
            for module in modules:
                parts = module.split(".")
                if parts[0] in DEVICE_LIBRARIES or any(names_a_device(part) for part in parts):
                    problems.append(f"{where}:{node.lineno}: imports {module}")
            if isinstance(node, ast.Attribute) and names_a_device(node.attr):
                problems.append(f"{where}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Name) and names_a_device(node.id):
                problems.append(f"{where}:{node.lineno}: {node.id}")
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
