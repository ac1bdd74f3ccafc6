"""The tree is the map: each subpackage of core/ is a layer that imports only the layers below it."""

import ast
import pathlib

import pytest

CORE = pathlib.Path(__file__).resolve().parent.parent / "core"

#: Each layer's height; a module may import its own package and lower ones only (siblings at one height
#: do not import each other). docs/layout.md draws the same order.
LAYERS = {
    "common": 0, "plugin": 1, "model": 2, "parallel": 3, "quantization": 4, "loading": 5, "generation": 5,
    "adapters": 6, "session": 7, "jobs": 8, "bench": 8, "ray": 9, "cli": 10,
}


def module_name(source: ast.expr) -> str | None:
    """The module a call to ``importlib.import_module``, ``import_module`` or ``__import__`` imports, when the
    call names it by a string literal (relative names resolved against a literal ``package=``), else None."""
    if not isinstance(source, ast.Call) or not source.args:
        return None
    function = source.func
    called = function.attr if isinstance(function, ast.Attribute) else function.id if isinstance(function, ast.Name) else ""
    name = source.args[0]
    if called not in ("import_module", "__import__") or not isinstance(name, ast.Constant) or not isinstance(name.value, str):
        return None
    if not name.value.startswith("."):
        return name.value
    package = next((keyword.value for keyword in source.keywords if keyword.arg == "package"), None)
    if called != "import_module" or not isinstance(package, ast.Constant) or not isinstance(package.value, str):
        return None
    level = len(name.value) - len(name.value.lstrip("."))
    return resolved(package.value, level, name.value[level:])


def resolved(package: str, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in a module of ``package``."""
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imported_modules(source: str, package: str) -> set[str]:
    """Every module name a module of ``package`` (``accelgen.loading``) imports, wherever the import is written:
    import statements, relative ones resolved against ``package``, and ``importlib.import_module("...")`` /
    ``__import__("...")`` with a string literal. ``from a import b`` counts as both ``a`` and ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = resolved(package, node.level, node.module) if node.level else node.module
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif (name := module_name(node)) is not None:
            found.add(name)
    return found


def imported_packages(source: str, package: str) -> set[str]:
    """The layers of accelgen a module of ``package`` imports ("" for the ``accelgen`` facade itself)."""
    found = set()
    for name in imported_modules(source, package):
        parts = name.split(".")
        if parts[0] == "accelgen":
            found.add(parts[1] if len(parts) > 1 else "")
    return found & (set(LAYERS) | {""})


def upward_imports(core: pathlib.Path) -> list[str]:
    """``module imports package`` for every import of a package that is not below the module's own, and every module
    outside the layers (a top-level module of core/ other than the facade, a folder that is no layer)."""
    problems = []
    for path in sorted(core.rglob("*.py")):
        parts = path.relative_to(core).parts
        package = parts[0]
        if parts == ("__init__.py",):
            continue  # core/__init__.py: the facade over every layer
        if package not in LAYERS:
            problems.append(f"{path.relative_to(core).as_posix()} is in no layer (put it in one of {', '.join(LAYERS)})")
            continue
        # The package a module's relative imports start from: its folder (for __init__.py, the package itself).
        module_package = ".".join(("accelgen",) + parts[:-1])
        for imported in sorted(imported_packages(path.read_text(), module_package)):
            if imported == "":
                problems.append(f"{path.relative_to(core)} imports the accelgen facade (import the layer itself)")
            elif imported != package and LAYERS[imported] >= LAYERS[package]:
                problems.append(f"{path.relative_to(core)} imports accelgen.{imported}")
    return problems


def test_every_layer_imports_only_layers_below_it():
    assert upward_imports(CORE) == []


#: Folders of core/ that hold data, not code (the built-in model's files).
DATA_FOLDERS = {"default_model"}


def folders_that_are_not_packages(core: pathlib.Path) -> list[str]:
    """Every folder under ``core`` (any depth) without an ``__init__.py``, but the data folders and caches: Python would
    import it as a namespace package, which setuptools' package list leaves out of the installed distribution."""
    return sorted(path.relative_to(core).as_posix() for path in core.rglob("*")
                  if path.is_dir() and path.name != "__pycache__" and path.relative_to(core).parts[0] not in DATA_FOLDERS
                  and not (path / "__init__.py").exists())


def test_every_subpackage_of_core_is_a_layer():
    folders = {path.name for path in CORE.iterdir() if path.is_dir() and path.name not in DATA_FOLDERS | {"__pycache__"}}
    assert folders == set(LAYERS)
    assert folders_that_are_not_packages(CORE) == []


def test_a_folder_without_init_is_found_at_any_depth(tmp_path):
    (tmp_path / "loading" / "nested" / "deeper").mkdir(parents=True)
    (tmp_path / "loading" / "__init__.py").write_text("")
    (tmp_path / "loading" / "nested" / "__init__.py").write_text("")
    (tmp_path / "default_model").mkdir()  # data: not read
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "planted.py").write_text("")
    assert folders_that_are_not_packages(tmp_path) == ["jobs", "loading/nested/deeper"]


def test_a_module_outside_every_layer_is_found(tmp_path):
    (tmp_path / "__init__.py").write_text("from accelgen.cli import main\n")  # the facade may
    (tmp_path / "helpers.py").write_text("from accelgen.cli import main\n")
    (tmp_path / "extras").mkdir()
    (tmp_path / "extras" / "__init__.py").write_text("")
    assert upward_imports(tmp_path) == [
        "extras/__init__.py is in no layer (put it in one of " + ", ".join(LAYERS) + ")",
        "helpers.py is in no layer (put it in one of " + ", ".join(LAYERS) + ")",
    ]


@pytest.mark.parametrize(("statement", "layer"), [
    ("from accelgen.session.request import Request", "session"),
    ("import accelgen.jobs.progress", "jobs"),
    ("def f():\n    from accelgen.cli import main", "cli"),
    ("from accelgen.generation import generator", "generation"),
    ("from ...session import request", "session"),
    ("from ...jobs.progress import Progress", "jobs"),
    ("import importlib\nimportlib.import_module('accelgen.bench.measure')", "bench"),
    ("from importlib import import_module\ndef f():\n    return import_module('accelgen.session')", "session"),
    ("import importlib\nimportlib.import_module('...cli', package='accelgen.loading.nested')", "cli"),
    ("__import__('accelgen.jobs.progress')", "jobs"),
])
def test_an_upward_import_is_found_however_it_is_written(tmp_path, statement, layer):
    plant_in_loading_nested(tmp_path, statement)
    assert upward_imports(tmp_path) == [f"loading/nested/planted.py imports accelgen.{layer}"]


def plant_in_loading_nested(core: pathlib.Path, statement: str) -> None:
    """``core``/loading/nested/planted.py: imports its own layer and lower ones (absolute and relative), then
    ``statement``."""
    nested = core / "loading" / "nested"
    nested.mkdir(parents=True)
    (core / "loading" / "__init__.py").write_text("")
    (nested / "__init__.py").write_text("")
    allowed = "from accelgen.common.errors import UsageError\nfrom .. import weights\nfrom . import sibling\nfrom ...model import shape\n"
    (nested / "planted.py").write_text(allowed + statement + "\n")


def test_a_layer_imported_relatively_from_the_top_is_found_with_the_facade(tmp_path):
    plant_in_loading_nested(tmp_path, "from ... import generation")  # as `from accelgen import generation`
    assert upward_imports(tmp_path) == [
        "loading/nested/planted.py imports the accelgen facade (import the layer itself)",
        "loading/nested/planted.py imports accelgen.generation",
    ]


def test_a_relative_import_in_a_layers_own_init_starts_from_that_layer(tmp_path):
    (tmp_path / "loading").mkdir()
    (tmp_path / "loading" / "__init__.py").write_text("from . import weights\nfrom ..model import shape\nfrom ..jobs import progress\n")
    assert upward_imports(tmp_path) == ["loading/__init__.py imports accelgen.jobs"]


def test_the_layers_allowed_imports_are_not_reported(tmp_path):
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("from ..jobs import runner\nimport importlib\nimportlib.import_module('accelgen.bench')\n")
    assert upward_imports(tmp_path) == []


# -- the plugins: they reach the core through the contract, never through what drives a run --------------------------

REPOSITORY = CORE.parent
#: Every plugin's source the guard reads: the built-in plugins and the example third-party plugin.
PLUGIN_SOURCES = (REPOSITORY / "plugins", REPOSITORY / "examples" / "accelgen-fake-device")
#: The highest layer a plugin may import (DESIGN.md, section 2: a device reaches the core only through the contract):
#: the contract (plugin), what it is written in (common, model) and the helpers it names for a plugin's members
#: (``shard_with_deepspeed`` in parallel, ``quantize_linear_layers`` in quantization). Never the layers that call a
#: plugin's accelerator (loading, generation, adapters) or drive a run (session, jobs, bench, cli).
PLUGIN_CEILING = LAYERS["quantization"]


def facade_names(source: str) -> set[str]:
    """The public names of the ``accelgen`` facade a module uses (``accelgen.Accelerator``, ``from accelgen import
    generate``), as the module each comes from (``accelgen.plugin.contract``)."""
    import accelgen

    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "accelgen":
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module == "accelgen" and not node.level:
            used.update(alias.name for alias in node.names)
    return {accelgen._EXPORTS[name] for name in used if name in accelgen._EXPORTS}


def plugin_imports_above_the_contract(*sources: pathlib.Path) -> list[str]:
    """``file imports accelgen.LAYER`` for each import of a layer above PLUGIN_CEILING in the plugins' sources (their
    build folders left out), directly or through a name of the facade."""
    problems = []
    for source in sources:
        for path in sorted(source.rglob("*.py")):
            if "build" in path.relative_to(source).parts:
                continue
            text = path.read_text()
            # a plugin's relative imports stay in its own package: resolve them against a package outside accelgen
            modules = {name for name in imported_modules(text, "accelgen_plugin") if name.startswith("accelgen.")}
            layers = {name.split(".")[1] for name in modules | facade_names(text)} & set(LAYERS)
            problems += [f"{path.relative_to(source.parent).as_posix()} imports accelgen.{layer}"
                         for layer in sorted(layers) if LAYERS[layer] > PLUGIN_CEILING]
    return problems


def test_plugins_import_only_the_contract_and_the_layers_below_it():
    read = [path.relative_to(REPOSITORY).as_posix() for source in PLUGIN_SOURCES for path in source.rglob("*.py")]
    assert {"plugins/cpu/__init__.py", "plugins/cuda/__init__.py", "plugins/hpu/__init__.py",
            "examples/accelgen-fake-device/accelgen_fake_device.py"} <= set(read)  # the guard reads every plugin
    assert plugin_imports_above_the_contract(*PLUGIN_SOURCES) == []


@pytest.mark.parametrize(("statement", "layer"), [
    ("from accelgen.cli import main", "cli"),
    ("def f():\n    import accelgen.jobs.progress", "jobs"),
    ("import importlib\nimportlib.import_module('accelgen.session.request')", "session"),
    ("from accelgen.generation.sampling import draw", "generation"),
    ("import accelgen\ndef f():\n    return accelgen.generate", "session"),
    ("from accelgen import Generator", "generation"),
])
def test_a_plugin_importing_what_drives_a_run_is_found(tmp_path, statement, layer):
    """A copy of the plugins' tree with one forbidden import planted in the CPU plugin: the guard names it."""
    import shutil

    copy = tmp_path / "plugins"
    shutil.copytree(REPOSITORY / "plugins", copy, ignore=shutil.ignore_patterns("__pycache__", "build", "*.so"))
    assert plugin_imports_above_the_contract(copy) == []
    planted = copy / "cpu" / "__init__.py"
    planted.write_text(planted.read_text() + "\n" + statement + "\n")
    assert plugin_imports_above_the_contract(copy) == [f"plugins/cpu/__init__.py imports accelgen.{layer}"]
