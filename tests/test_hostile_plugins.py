"""Installed plugins that misbehave: they call ``sys.exit``, raise KeyboardInterrupt, raise from the members the
core asks while listing and choosing devices, or never finish importing. Each is named in one line (its
package and what it did), the other devices keep working, and choosing the broken device is refused in one
``accelgen: error:`` line with exit status 2; a real Ctrl-C still stops the command with 130.

A plugin is "installed" as pip would leave it: a module and a ``.dist-info`` folder with its ``accelgen``
entry point, in a folder on the path (``sys.path`` for the commands run in this process, PYTHONPATH for
those run as a real process).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import as_a_terminal_starts_it, one_error_line_in

from accelgen.cli import main
from accelgen.plugin import manager

PLUGIN = "hostile"  # the entry point's name
PACKAGE = "accelgen-hostile 0.1"
FIX = "uninstall accelgen-hostile or set ACCELGEN_SKIP_PLUGINS=hostile"


def install_plugin(site: Path, source: str) -> Path:
    """Install a plugin package ``accelgen-hostile`` whose module ``accelgen_hostile`` is ``source``, into ``site``."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "accelgen_hostile.py").write_text(source)
    metadata = site / "accelgen_hostile-0.1.dist-info"
    metadata.mkdir(exist_ok=True)
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: accelgen-hostile\nVersion: 0.1\n")
    (metadata / "entry_points.txt").write_text(f"[accelgen]\n{PLUGIN} = accelgen_hostile\n")
    (metadata / "top_level.txt").write_text("accelgen_hostile\n")
    (metadata / "RECORD").write_text("")
    return site


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """``installed(source)``: the plugin package with that module, installed for the commands run in this process."""

    def install(source: str) -> None:
        monkeypatch.syspath_prepend(str(install_plugin(tmp_path / "site", source)))
        monkeypatch.delitem(sys.modules, "accelgen_hostile", raising=False)
        manager._distributions_by_top_level_module.cache_clear()  # the package list is read once per process

    yield install
    sys.modules.pop("accelgen_hostile", None)
    manager._distributions_by_top_level_module.cache_clear()


def accelerator_plugin(members: str, *, name: str = "npu", base: str = "accelgen.Accelerator") -> str:
    """Source of a plugin registering one accelerator ``name`` of class ``Npu``, whose class body is ``members``
    (with a setup() that must not be reached, unless ``base`` gives one)."""
    never_set_up = "def setup(self, world):\n    raise AssertionError('never set up')" if base == "accelgen.Accelerator" else ""
    return (
        "import sys\nimport accelgen\nfrom accelgen_cpu import CpuAccelerator\n\n"
        f"class Npu({base}):\n    name = {name!r}\n    priority = 50\n"
        + "".join(f"    {line}\n" for line in f"{members.strip()}\n{never_set_up}".splitlines())
        + "\n@accelgen.hookimpl\ndef accelgen_register_accelerators(register):\n    register(Npu())\n"
    )


def run_cpu(model: Path) -> list[str]:
    return ["run", "--device", "cpu", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "2", "--quiet"]


def warnings_in(stderr: str) -> list[str]:
    assert "Traceback" not in stderr and "accelgen: error" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("accelgen: warning:")]


def one_error_line(stderr: str) -> str:
    return one_error_line_in(stderr).rstrip("\n")


def device_lines(stdout: str, *names: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.split(" ")[0] in names]


# -- broken while loading or registering: listed by `devices`, one warning in a run on another device ----------


BROKEN_PLUGINS = {
    "sys.exit at import": ("import sys\nsys.exit(3)\n", "cannot be loaded: its import called sys.exit(3)"),
    "KeyboardInterrupt at import": ("raise KeyboardInterrupt\n", "cannot be loaded: its import raised KeyboardInterrupt"),
    "sys.exit in the registration hook": (
        "import sys\nimport accelgen\n\n@accelgen.hookimpl\ndef accelgen_register_accelerators(register):\n"
        "    sys.exit('bye')\n",
        "accelgen_register_accelerators called sys.exit('bye')",
    ),
    "an exception whose str() calls sys.exit": (
        "import sys\nimport accelgen\n\nclass Weird(Exception):\n    def __str__(self):\n        sys.exit(9)\n\n"
        "@accelgen.hookimpl\ndef accelgen_register_accelerators(register):\n    raise Weird()\n",
        "accelgen_register_accelerators raised Weird",
    ),
    "a member that is a property calling sys.exit": (
        accelerator_plugin("@property\ndef quantization_schemes(self):\n    sys.exit(7)\n"
                           "def is_available(self):\n    return True"),
        "registering Npu called sys.exit(7)",
    ),
    "a hook that returns its accelerator instead of registering it": (
        accelerator_plugin("def is_available(self):\n    return True").replace("    register(Npu())", "    return [Npu()]"),
        "its accelgen_register_accelerators hook returned list instead of calling register(accelerator) for each "
        "accelerator: nothing of it was registered",
    ),
    "a device named auto": (
        accelerator_plugin("def is_available(self):\n    return True", name="auto"),
        "registers Npu with the name 'auto', which --device keeps for the best available device",
    ),
}


@pytest.mark.parametrize("source, problem", BROKEN_PLUGINS.values(), ids=BROKEN_PLUGINS)
def test_a_plugin_broken_at_load_is_listed_and_named_once_in_a_run_on_another_device(
        source, problem, installed, tiny_model_folder, capsys):
    installed(source)
    assert main(["devices"]) == 0
    listing = capsys.readouterr()
    assert warnings_in(listing.err) == []
    assert f"broken   plugin {PLUGIN} ({PACKAGE}): {problem}" in listing.out.splitlines()
    assert "available, 1 device(s)" in device_lines(listing.out, "cpu")[0]

    assert main(run_cpu(tiny_model_folder("gpt2"))) == 0
    assert warnings_in(capsys.readouterr().err) == [
        f"accelgen: warning: plugin {PLUGIN} ({PACKAGE}) is left out: {problem} ({FIX} to stop this warning)"
    ]


# -- the members the core asks to list and choose devices -------------------------------------------------------


def test_is_available_calling_sys_exit_makes_the_device_unavailable_with_its_plugin_named(
        installed, tiny_model_folder, capsys):
    installed(accelerator_plugin("def is_available(self):\n    sys.exit(4)"))
    reason = f"plugin {PLUGIN} ({PACKAGE}): npu.is_available() called sys.exit(4): {FIX} to run without it"

    assert main(["devices"]) == 0
    listing = capsys.readouterr()
    assert device_lines(listing.out, "npu") == [f"npu      unavailable: {reason}  [accelgen_hostile from {PACKAGE}]"]
    assert "available, 1 device(s)" in device_lines(listing.out, "cpu")[0] and listing.err == ""

    assert main(["run", "--device", "npu", "--prompt", "hi"]) == 2
    assert one_error_line(capsys.readouterr().err) == f"accelgen: error: --device npu is not available here: {reason}"

    assert main(run_cpu(tiny_model_folder("gpt2"))) == 0  # never asks npu
    assert warnings_in(capsys.readouterr().err) == []

    # --device auto asks npu first (priority 50), skips it with one warning, and runs on the CPU
    assert main(["run", "--device", "auto", *run_cpu(tiny_model_folder("gpt2"))[3:]]) == 0
    assert warnings_in(capsys.readouterr().err) == [
        f"accelgen: warning: plugin {PLUGIN} ({PACKAGE}) is left out: npu.is_available() called sys.exit(4) "
        f"({FIX} to stop this warning)"
    ]


@pytest.mark.parametrize("members, problem", [
    ("def is_available(self):\n    return False\ndef unavailable_reason(self):\n    raise RuntimeError('no reason')",
     "npu.unavailable_reason() raised RuntimeError: no reason"),
    ("def is_available(self):\n    raise KeyboardInterrupt", "npu.is_available() raised KeyboardInterrupt"),
    ("class Answer:\n    def __bool__(self):\n        sys.exit(5)\ndef is_available(self):\n    return self.Answer()",
     "npu.is_available() called sys.exit(5)"),
], ids=["unavailable_reason raises", "is_available raises KeyboardInterrupt", "is_available's answer exits"])
def test_other_availability_failures_name_the_plugin_in_the_listing_and_the_refusal(members, problem, installed, capsys):
    installed(accelerator_plugin(members))
    reason = f"plugin {PLUGIN} ({PACKAGE}): {problem}: {FIX} to run without it"
    assert main(["devices"]) == 0
    listing = capsys.readouterr()
    assert device_lines(listing.out, "npu") == [f"npu      unavailable: {reason}  [accelgen_hostile from {PACKAGE}]"]
    assert device_lines(listing.out, "cpu") and listing.err == ""
    assert main(["run", "--device", "npu", "--prompt", "hi"]) == 2
    assert one_error_line(capsys.readouterr().err) == f"accelgen: error: --device npu is not available here: {reason}"


@pytest.mark.parametrize("members, problem", [
    ("def is_available(self):\n    return True\ndef device_count(self):\n    sys.exit(6)", "called sys.exit(6)"),
    ("def is_available(self):\n    return True\ndef device_count(self):\n    return 'two'",
     "raised TypeError: returned 'two', not a number of devices"),
], ids=["sys.exit", "not a number"])
def test_device_count_failing_counts_no_device_with_one_warning(members, problem, installed, capsys):
    installed(accelerator_plugin(members))
    assert main(["devices"]) == 0
    listing = capsys.readouterr()
    assert device_lines(listing.out, "npu") == [f"npu      available, 0 device(s)  [accelgen_hostile from {PACKAGE}]"]
    assert device_lines(listing.out, "cpu")
    assert warnings_in(listing.err) == [
        f"accelgen: warning: plugin {PLUGIN} ({PACKAGE}): npu.device_count() {problem}: {FIX} to run without it; "
        f"counting 0 npu devices"
    ]


@pytest.mark.parametrize("members, problem", [
    ("def describe(self):\n    raise RuntimeError('no driver')", "raised RuntimeError: no driver"),
    ("def describe(self):\n    return {'device_name': object()}",
     "raised TypeError: Object of type object is not JSON serializable"),
], ids=["raises", "not JSON"])
def test_describe_failing_in_a_benchmark_reports_the_defaults_with_one_warning(members, problem, installed,
                                                                                 tiny_model_folder, tmp_path, capsys):
    """``bench`` records the device's facts: a plugin whose describe() fails still gets its benchmark."""
    installed(accelerator_plugin(members, base="CpuAccelerator"))
    output = tmp_path / "bench.json"
    assert main(["bench", "--device", "npu", "--model", str(tiny_model_folder("gpt2")), "--batch-sizes", "1",
                 "--max-new-tokens", "2", "--runs", "1", "--warmup-runs", "0", "--output", str(output)]) == 0
    assert warnings_in(capsys.readouterr().err) == [
        f"accelgen: warning: plugin {PLUGIN} ({PACKAGE}): npu.describe() {problem}: {FIX} "
        f"to run without it; reporting no facts about npu"
    ]
    assert json.loads(output.read_text())["measurements"][0]["hardware"]["device_name"] == "npu"


def test_what_a_plugin_changes_for_the_process_at_import_is_put_back(installed, tiny_model_folder, tmp_path,
                                                                      monkeypatch, capsys):
    """Warnings turned into errors or hidden, stderr thrown away, the working directory moved, Ctrl-C ignored."""
    installed("import os, signal, sys, warnings\nwarnings.simplefilter('error')\nos.chdir('/')\n"
              "sys.stderr = open(os.devnull, 'w')\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nsys.exit('tampered')\n")
    monkeypatch.chdir(tmp_path)
    handler_before = signal.getsignal(signal.SIGINT)  # Python's own, unless an earlier in-process job changed it
    assert main([*run_cpu(tiny_model_folder("gpt2")), "--output", "out.jsonl"]) == 0
    assert warnings_in(capsys.readouterr().err) == [
        f"accelgen: warning: plugin {PLUGIN} ({PACKAGE}) is left out: cannot be loaded: its import called "
        f"sys.exit('tampered') ({FIX} to stop this warning)"
    ]
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1
    assert signal.getsignal(signal.SIGINT) is handler_before


def test_a_thread_a_plugin_leaves_running_is_named(installed, capsys):
    """A thread that is not a daemon keeps the process from exiting once the command is done: say whose it is."""
    installed("import threading\nstop = threading.Event()\n"
              "threading.Thread(target=stop.wait, name='hostile-worker').start()\n")
    try:
        assert main(["devices"]) == 0
    finally:
        sys.modules["accelgen_hostile"].stop.set()
    assert warnings_in(capsys.readouterr().err) == [
        f"accelgen: warning: plugin {PLUGIN} ({PACKAGE}): the import started thread(s) hostile-worker, which keep "
        f"accelgen from exiting until they end; if it does not exit, press Ctrl-C, then {FIX}"
    ]


# -- leaving plugins out ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip", ["hostile", "accelgen-hostile", "accelgen_hostile", "*", "other, hostile"])
def test_accelgen_skip_plugins_leaves_a_plugin_out_unimported(skip, installed, monkeypatch, capsys):
    installed("raise SystemExit('imported although skipped')\n")
    monkeypatch.setenv("ACCELGEN_SKIP_PLUGINS", skip)
    assert main(["devices"]) == 0
    listing = capsys.readouterr()
    assert "broken" not in listing.out and listing.err == "" and device_lines(listing.out, "cpu")
    assert "accelgen_hostile" not in sys.modules
    assert main(["run", "--device", "npu", "--prompt", "hi"]) == 2
    assert one_error_line(capsys.readouterr().err).endswith(" Left out by ACCELGEN_SKIP_PLUGINS: hostile.")


def test_a_built_in_plugin_can_be_left_out(monkeypatch, capsys):
    monkeypatch.setenv("ACCELGEN_SKIP_PLUGINS", "accelgen_hpu")
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert device_lines(out, "hpu", "cuda", "cpu")[0].split()[0] == "cuda"
    assert "skipped  plugin accelgen_hpu (left out by ACCELGEN_SKIP_PLUGINS)" in out.splitlines()


# -- as a real process: nothing ends it early, a plugin that hangs is named, Ctrl-C still stops it --------------


def test_a_plugin_calling_sys_exit_at_import_does_not_end_a_real_run(tmp_path, tiny_model_folder, cli_environment):
    site = install_plugin(tmp_path / "site", "import sys\nsys.exit(3)\n")
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", *run_cpu(tiny_model_folder("gpt2"))],
                            env=dict(cli_environment, PYTHONPATH=str(site)), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert warnings_in(result.stderr) == [
        f"accelgen: warning: plugin {PLUGIN} ({PACKAGE}) is left out: cannot be loaded: its import called "
        f"sys.exit(3) ({FIX} to stop this warning)"
    ]


@pytest.mark.parametrize("source", [
    "import os\nos._exit(3)\n",
    "from os import _exit\ntry:\n    _exit(4)\nexcept Exception:\n    pass\n",  # catching what it can does not help it
], ids=["os._exit", "os._exit caught"])
def test_a_plugin_calling_os_exit_at_import_is_listed_and_every_command_goes_on(source, tmp_path, tiny_model_folder,
                                                                                cli_environment):
    """os._exit ends a process at once, without a word: run in this process, the test itself would end."""
    site = install_plugin(tmp_path / "site", source)
    status = source.split("_exit(")[1][0]
    environment = dict(cli_environment, PYTHONPATH=str(site))
    devices = subprocess.run([sys.executable, "-m", "accelgen.cli", "devices"], env=environment, capture_output=True,
                             text=True, timeout=300)
    assert devices.returncode == 0 and "Traceback" not in devices.stderr, devices.stderr
    assert device_lines(devices.stdout, "broken") == [
        f"broken   plugin {PLUGIN} ({PACKAGE}): cannot be loaded: its import called os._exit({status})"]
    assert device_lines(devices.stdout, "cpu")[0].startswith("cpu      available")
    run = subprocess.run([sys.executable, "-m", "accelgen.cli", *run_cpu(tiny_model_folder("gpt2"))], env=environment,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert warnings_in(run.stderr) == [
        f"accelgen: warning: plugin {PLUGIN} ({PACKAGE}) is left out: cannot be loaded: its import called "
        f"os._exit({status}) ({FIX} to stop this warning)"
    ]


@pytest.mark.parametrize("source", [
    "import time\ntime.sleep(3600)\n",
    "import time\ntry:\n    time.sleep(3600)\nexcept KeyboardInterrupt:\n    pass\n",  # swallows the user's Ctrl-C
], ids=["sleeps", "sleeps and catches KeyboardInterrupt"])
def test_a_plugin_that_hangs_at_import_is_named_and_ctrl_c_still_stops_the_command(source, tmp_path, cli_environment):
    site = install_plugin(tmp_path / "site", source)
    process = subprocess.Popen([sys.executable, "-m", "accelgen.cli", "devices"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=dict(cli_environment, PYTHONPATH=str(site)),
                               preexec_fn=as_a_terminal_starts_it)
    deadline = threading.Timer(300, process.kill)  # the test fails, not hangs, if the line never comes
    deadline.start()
    try:
        notice = process.stderr.readline()  # waits for the notice: the command is blocked in the plugin's import
        assert notice == (f"accelgen: warning: still waiting for the import of plugin {PLUGIN} ({PACKAGE}) after 5 s; "
                          f"if it never finishes, press Ctrl-C, then {FIX}\n")
        os.kill(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate()
    finally:
        deadline.cancel()
        process.kill()
    assert process.returncode == 130
    assert (stdout, stderr) == ("", "accelgen: interrupted\n")
