"""The tree is the map: each subpackage of core/ is a layer that imports only the layers below it."""

import ast
import pathlib

import pytest

CORE = pathlib.Path(__file__).resolve().parent.parent / "core"

#: Each layer's height; a module may import its own package and lower ones only (siblings at one height
#: do not import each other). The README's Layout section draws the same order.
LAYERS = {
    "common": 0, "plugin": 1, "model": 2, "parallel": 3, "loading": 4, "generation": 4, "session": 5,
    "jobs": 6, "bench": 6, "cli": 7,
}


def imported_packages(source: str) -> set[str]:
    """The accelgen subpackages a module's code imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "accelgen":
                found.add(parts[1] if len(parts) > 1 else "")
    return found & (set(LAYERS) | {""})


def upward_imports(core: pathlib.Path) -> list[str]:
    """``module imports package`` for every import of a package that is not below the module's own."""
    problems = []
    for path in sorted(core.rglob("*.py")):
        package = path.relative_to(core).parts[0]
        if package not in LAYERS:
            continue  # core/__init__.py: the facade over every layer
        for imported in imported_packages(path.read_text()):
            if imported == "":
                problems.append(f"{path.relative_to(core)} imports the accelgen facade (import the layer itself)")
            elif imported != package and LAYERS[imported] >= LAYERS[package]:
                problems.append(f"{path.relative_to(core)} imports accelgen.{imported}")
    return problems


def test_every_layer_imports_only_layers_below_it():
    assert upward_imports(CORE) == []


def test_every_subpackage_of_core_is_a_layer():
    packages = {path.name for path in CORE.iterdir() if (path / "__init__.py").exists()}
    assert packages == set(LAYERS)


@pytest.mark.parametrize("statement", [
    "from accelgen.session.request import Request",
    "import accelgen.jobs.progress",
    "def f():\n    from accelgen.cli import main",
    "from accelgen.generation import generator",
])
def test_an_upward_import_is_found_wherever_it_is_written(tmp_path, statement):
    layer = tmp_path / "loading"
    layer.mkdir()
    (layer / "__init__.py").write_text("")
    (layer / "planted.py").write_text("from accelgen.common.errors import UsageError\n" + statement + "\n")
    assert upward_imports(tmp_path) == [f"loading/planted.py imports accelgen.{statement.split('accelgen.')[1].split('.')[0].split()[0]}"]
