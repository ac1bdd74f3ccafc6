"""The CPU kernels' cache (plugins/cpu/native_build.py) as a hostile machine leaves it: an extensions folder that cannot be
written, a ``kernels.so`` replaced by another loadable library whose checksum was written to match, and the process
building the kernels killed outright (SIGKILL) while its compilers run. Each is one line, and no build is real: the
stand-in compiler (tests/fake_compiler) copies the session's build, or a shell script stands in for one that hangs."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import as_a_terminal_starts_it

from accelgen_cpu.native_build import CHECKSUM, KERNELS_FOLDER, LIBRARY, built_library

FAKE_COMPILER = Path(__file__).parent / "fake_compiler" / "compiler.py"
RUN = ["run", "--device", "cpu", "--prompt", "Hello", "--max-new-tokens", "2", "--quiet"]


@pytest.fixture
def build_environment(tmp_path, cli_environment):
    """An environment whose first job builds the portable kernels in a folder of its own, with the stand-in compiler."""
    return dict(cli_environment, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"), ACCELGEN_CPU_KERNELS="portable",
                CXX=f"{sys.executable} {FAKE_COMPILER}", FAKE_COMPILER_LOG=str(tmp_path / "compiler.log"),
                FAKE_COMPILER_LIBRARY=str(built_library("portable")))


def accelgen(environment, *arguments, wrapper=()) -> subprocess.CompletedProcess:
    return subprocess.run([*wrapper, sys.executable, "-m", "accelgen.cli", *arguments], env=environment,
                          capture_output=True, text=True, timeout=300)


def links(environment) -> int:
    log = Path(environment["FAKE_COMPILER_LOG"])
    return sum("-shared" in line for line in log.read_text().splitlines()) if log.exists() else 0


def kernels_warning(stderr: str) -> str:
    """The one line that says the kernels are missing, checked to be the only warning, with no traceback."""
    warnings = [line for line in stderr.splitlines() if line.startswith("accelgen: warning:")]
    assert len(warnings) == 1 and "C++ kernels are missing" in warnings[0], stderr
    assert "Traceback" not in stderr
    return warnings[0]


def read_only_mount(folder: Path) -> list[str]:
    """A command prefix that runs its command with ``folder`` mounted read-only (a mount namespace of its own); the
    test is skipped where this machine does not allow one."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = ["unshare", "--mount", "sh", "-c", f'mount --bind -o ro "{folder}" "{folder}" && exec "$@"', "sh"]
    if shutil.which("unshare") is None or subprocess.run([*prefix, "touch", str(folder / "x")],
                                                         capture_output=True).returncode == 0:
        pytest.skip("no read-only mount here (unshare --mount needs privileges)")
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("no read-only mount here (unshare --mount needs privileges)")
    return prefix


def test_a_read_only_extensions_folder_runs_on_torchs_operations_in_one_warning(build_environment, tmp_path):
    """Before: an OSError (EROFS) traceback from run and devices --prepare."""
    folder = Path(build_environment["TORCH_EXTENSIONS_DIR"])
    read_only = read_only_mount(folder)
    ran = accelgen(build_environment, *RUN, wrapper=read_only)
    assert ran.returncode == 0, ran.stderr
    warning = kernels_warning(ran.stderr)
    assert f"cannot write {folder / KERNELS_FOLDER}" in warning and "Read-only file system" in warning
    assert "set TORCH_EXTENSIONS_DIR to a writable folder" in warning
    prepared = accelgen(build_environment, "devices", "--prepare", wrapper=read_only)
    assert prepared.returncode == 2 and "Traceback" not in prepared.stderr
    (error,) = [line for line in prepared.stderr.splitlines() if "error" in line.lower()]
    assert error.startswith("accelgen: error: The CPU plugin's C++ kernels could not be built: cannot write")
    assert "Read-only file system" in error


def test_an_extensions_folder_under_a_file_runs_on_torchs_operations_in_one_warning(build_environment, tmp_path):
    """The same where the machine allows no read-only mount: a path that cannot be a folder (NotADirectoryError)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    environment = dict(build_environment, TORCH_EXTENSIONS_DIR=str(blocker / "extensions"))
    ran = accelgen(environment, *RUN)
    assert ran.returncode == 0, ran.stderr
    assert "cannot write" in kernels_warning(ran.stderr) and links(environment) == 0


def test_a_library_that_lacks_the_kernels_operators_is_said_and_built_again(build_environment):
    """Before: another loadable library in place of kernels.so, its checksum rewritten, loaded silently with none of
    the kernels while accelgen devices said "built"."""
    assert accelgen(build_environment, "devices", "--prepare").returncode == 0
    (library,) = (Path(build_environment["TORCH_EXTENSIONS_DIR"]) / KERNELS_FOLDER).glob(f"portable-*/{LIBRARY}")
    foreign = Path(torch.__file__).parent / "lib" / "libtorch_global_deps.so"  # loadable, defines no operator
    shutil.copyfile(foreign, library)
    data = library.read_bytes()
    library.with_name(CHECKSUM).write_text(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
    listed = accelgen(build_environment, "devices")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    (kernels,) = [line for line in listed.stdout.splitlines() if "C++ kernels portable" in line]
    assert "built in" not in kernels and "is not a build of them" in kernels, kernels
    assert not library.exists()  # removed: the next job builds them again
    library.parent.mkdir(parents=True)
    shutil.copyfile(foreign, library)
    library.with_name(CHECKSUM).write_text(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
    ran = accelgen(build_environment, *RUN)
    assert ran.returncode == 0, ran.stderr
    assert "is not a build of them" in kernels_warning(ran.stderr) and "the next run builds them again" in ran.stderr
    again = accelgen(build_environment, *RUN)
    assert again.returncode == 0 and "warning" not in again.stderr, again.stderr
    assert links(build_environment) == 2  # built again, and loaded


HANGING_COMPILER = """#!/bin/sh
[ "$1" = --version ] && { echo "hanging compiler 1.0"; exit 0; }
sleep 300 &
echo $$ $! >> "{pids}"
wait
"""


def test_a_build_whose_process_is_killed_outright_leaves_no_compiler_running(build_environment, tmp_path):
    """Before: accelgen SIGKILLed while it built the kernels left c++ and cc1plus running (a compiler here, and the
    child it started, as cc1plus is the driver's)."""
    pids = tmp_path / "pids"
    compiler = tmp_path / "hanging-c++"
    compiler.write_text(HANGING_COMPILER.replace("{pids}", str(pids)))
    compiler.chmod(0o755)
    preparing = subprocess.Popen([sys.executable, "-m", "accelgen.cli", "devices", "--prepare"],
                                 env=dict(build_environment, CXX=str(compiler)), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, preexec_fn=as_a_terminal_starts_it)
    deadline = time.monotonic() + 120
    while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < deadline:
        assert preparing.poll() is None, preparing.stderr.read()
        time.sleep(0.05)
    preparing.send_signal(signal.SIGKILL)
    preparing.wait(timeout=30)
    compilers = [int(pid) for pid in pids.read_text().split()]
    assert len(compilers) >= 2
    deadline = time.monotonic() + 10
    while (left := [pid for pid in compilers if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # the test leaves nothing behind either way
        os.kill(pid, signal.SIGKILL)
    assert left == []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended: its parent has not reaped it yet
