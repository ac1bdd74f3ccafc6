"""What a non-editable install ships: every package of core/ and plugins/ is listed in pyproject.toml (setuptools
installs only the packages listed, so a subpackage left out imports in a checkout and fails once installed),
and every data file listed exists where it is looked for."""

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def packages_on_disk() -> set[str]:
    """Import names of every folder with an ``__init__.py`` under each listed package directory."""
    found = set()
    for name, directory in SETUPTOOLS["package-dir"].items():
        root = ROOT / directory
        for init in root.rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found.add(".".join([name, *init.parent.relative_to(root).parts]))
    return found


def test_every_package_on_disk_is_listed_for_installation():
    missing = packages_on_disk() - set(SETUPTOOLS["packages"])
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_every_listed_package_exists():
    assert set(SETUPTOOLS["packages"]) <= packages_on_disk()


def test_every_listed_data_file_exists_in_its_package():
    directories = {name: ROOT / directory for name, directory in SETUPTOOLS["package-dir"].items()}
    for package, patterns in SETUPTOOLS["package-data"].items():
        top, *rest = package.split(".")
        folder = directories[top].joinpath(*rest)
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: nothing matches {pattern} in {folder}"


def test_every_file_the_cpu_kernels_are_built_from_ships():
    """The CPU plugin compiles its C++ kernels where it runs, from the sources and headers in its ``kernels`` folder:
    an installed copy must hold each of them (a header left out fails the build on the user's machine)."""
    plugin = ROOT / SETUPTOOLS["package-dir"]["accelgen_cpu"]
    shipped = {path for pattern in SETUPTOOLS["package-data"]["accelgen_cpu"] for path in plugin.glob(pattern)}
    assert {path for path in (plugin / "kernels").iterdir() if path.is_file()} <= shipped
