"""How the CPU plugin's C++ kernels are built and loaded (plugins/cpu/native_build.py), tried as an attacker would:
a damaged library is built again, never loaded; a failing compiler says its first error once and is not tried again
at every run; a build stopped half-way stops its compiler and leaves nothing; two first runs at once compile once;
CXX may hold a command with arguments; builds unused for weeks go. A stand-in compiler (tests/fake_compiler) makes
each build take a moment: its link copies the session's real build of the portable variant."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import as_a_terminal_starts_it

from accelgen.common.errors import UsageError
from accelgen_cpu import kernel_variants
from accelgen_cpu.native_build import KERNELS_FOLDER, LAST_USED, LIBRARY, built_library

FAKE_COMPILER = Path(__file__).parent / "fake_compiler" / "compiler.py"
LOAD = ("from accelgen_cpu.native_kernels import loaded_kernels\n"
        "kernels = loaded_kernels()\n"
        "print(kernels.variant if kernels else None)")


@pytest.fixture
def build_environment(tmp_path, cli_environment):
    """An environment whose first load of the portable kernels builds them in a folder of its own, with the stand-in
    compiler given as a command with an argument (``python compiler.py``, as ``ccache g++`` would be)."""
    log = tmp_path / "compiler.log"
    return dict(cli_environment, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"), ACCELGEN_CPU_KERNELS="portable",
                CXX=f"{sys.executable} {FAKE_COMPILER}", FAKE_COMPILER_LOG=str(log),
                FAKE_COMPILER_LIBRARY=str(built_library("portable")))


def load(environment) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD], env=environment, capture_output=True, text=True, timeout=120)


def compiler_runs(environment) -> list[str]:
    """What the stand-in compiler was asked, one line a run (``--version`` runs not counted)."""
    log = Path(environment["FAKE_COMPILER_LOG"])
    return log.read_text().splitlines() if log.exists() else []


def kernels_root(environment) -> Path:
    return Path(environment["TORCH_EXTENSIONS_DIR"]) / KERNELS_FOLDER


def the_library(environment) -> Path:
    (library,) = kernels_root(environment).glob(f"portable-*/{LIBRARY}")
    return library


def test_the_first_load_says_what_it_builds_before_it_starts_and_later_loads_build_nothing(build_environment):
    first = load(build_environment)
    assert first.returncode == 0 and first.stdout.strip() == "portable", first.stderr
    building = [line for line in first.stderr.splitlines() if "building the CPU plugin's C++ kernels" in line]
    assert len(building) == 1 and "once per machine" in building[0] and "about" in building[0]
    runs = compiler_runs(build_environment)
    sources = list(Path(kernel_variants.__file__).with_name("kernels").glob("*.cpp"))
    assert sum("-shared" in run for run in runs) == 1 and len(runs) == len(sources) + 1  # a compiler a source, a link
    again = load(build_environment)
    assert again.returncode == 0 and again.stdout.strip() == "portable" and again.stderr == ""
    assert compiler_runs(build_environment) == runs  # nothing compiled again


@pytest.mark.parametrize("damage", ["empty", "truncated", "foreign", "no checksum"])
def test_a_damaged_library_is_built_again_never_loaded(build_environment, damage):
    """Today's faults: an empty library (a full disk) was taken for a missing compiler for ever, a truncated one killed
    every run with SIGBUS, another library in its place gave a traceback. Each is now built again, and loads."""
    assert load(build_environment).returncode == 0
    library = the_library(build_environment)
    good = library.read_bytes()
    if damage == "empty":
        library.write_bytes(b"")
    elif damage == "truncated":
        library.write_bytes(good[: len(good) // 2])
    elif damage == "foreign":
        library.write_bytes(Path(sys.executable).resolve().read_bytes()[:len(good)])
    else:
        library.with_name("kernels.so.sha256").unlink()
    result = load(build_environment)
    assert result.returncode == 0 and result.stdout.strip() == "portable", result.stderr
    assert "is damaged" in result.stderr and "building it again" in result.stderr
    assert "install a C++ compiler" not in result.stderr and "Traceback" not in result.stderr
    assert the_library(build_environment).read_bytes() == good
    assert sum("-shared" in run for run in compiler_runs(build_environment)) == 2


def test_a_failing_compiler_says_its_first_error_and_is_not_run_again_until_something_changes(build_environment):
    failing = dict(build_environment, FAKE_COMPILER_MODE="fail")
    first = load(failing)
    assert first.returncode == 0 and first.stdout.strip() == "None"
    assert "kernels/rms_norm.cpp:3:1: error: boom" in first.stderr and "Traceback" not in first.stderr
    runs = len(compiler_runs(failing))
    second = load(failing)
    assert second.stdout.strip() == "None" and len(compiler_runs(failing)) == runs  # remembered, not tried again
    warning = [line for line in second.stderr.splitlines() if "C++ kernels are missing" in line]
    assert len(warning) == 1 and "error: boom" in warning[0] and "remove it to try again" in warning[0]
    assert "install a C++ compiler" not in second.stderr
    # another compiler is another build: tried, and it works
    working = dict(build_environment, CXX=f"{sys.executable} -B {FAKE_COMPILER}")
    assert load(working).stdout.strip() == "portable"


@pytest.mark.parametrize("compiler, said", [
    ("/bin/false", "/bin/false failed (exit 1)"),
    ("/no/such/compiler", "cannot run the compiler '/no/such/compiler'"),
])
def test_a_compiler_that_does_not_work_is_named_with_what_it_said(build_environment, compiler, said):
    result = load(dict(build_environment, CXX=compiler))
    assert result.returncode == 0 and result.stdout.strip() == "None"
    warning = [line for line in result.stderr.splitlines() if "C++ kernels are missing" in line]
    assert len(warning) == 1 and said in warning[0] and "failed: str" not in warning[0]
    if compiler.startswith("/no/"):
        assert "install a C++ compiler" in warning[0]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_run_stopped_during_its_build_stops_its_compilers_and_leaves_nothing(build_environment, tmp_path, stop):
    pids = tmp_path / "pids"
    environment = dict(build_environment, FAKE_COMPILER_MODE="hang", FAKE_COMPILER_PIDS=str(pids))
    # -X faulthandler: a run that has not ended a minute after the signal is made to say where it stands (SIGABRT)
    process = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", LOAD], env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=as_a_terminal_starts_it)
    deadline = time.monotonic() + 60
    while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    compilers = [int(pid) for pid in pids.read_text().split()]
    process.send_signal(stop)
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        _, stderr = process.communicate(timeout=60)
        pytest.fail(f"the run did not end within 60 s of {stop.name}; where it stood:\n{stderr}")
    assert process.returncode != 0 and compilers
    for pid in compilers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    left = sorted(path.name for path in kernels_root(environment).iterdir())
    assert left == ["build.lock"], left  # no staging folder, no half-written library, no remembered failure


def test_two_first_runs_at_once_compile_once_and_the_second_says_what_it_waits_for(build_environment):
    slow = dict(build_environment, FAKE_COMPILER_DELAY="1")
    runs = [subprocess.Popen([sys.executable, "-c", LOAD], env=slow, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    results = [run.communicate(timeout=120) for run in runs]
    assert [stdout.strip() for stdout, _ in results] == ["portable", "portable"]
    assert sum("-shared" in run for run in compiler_runs(slow)) == 1
    stderrs = [stderr for _, stderr in results]
    assert sum("accelgen: building the CPU plugin's C++ kernels" in stderr for stderr in stderrs) == 1
    assert sum("waiting for process" in stderr for stderr in stderrs) == 1


def test_builds_unused_for_weeks_go_and_recent_ones_and_others_files_stay(build_environment):
    root = kernels_root(build_environment)
    old, recent, foreign = root / "avx2-0123456789abcdef", root / "portable-fedcba9876543210", root / "notes"
    for folder in (old, recent, foreign):
        folder.mkdir(parents=True)
        (folder / LIBRARY).write_bytes(b"a build of another torch")
        (folder / LAST_USED).touch()
    weeks_ago = time.time() - 40 * 86400
    for folder in (old, foreign):
        os.utime(folder / LAST_USED, (weeks_ago, weeks_ago))
    assert load(build_environment).stdout.strip() == "portable"
    assert not old.exists() and recent.exists() and foreign.exists()  # a folder not named as builds are: not ours


def test_a_variant_this_processor_cannot_run_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(kernel_variants, "instruction_sets", lambda: frozenset({"avx2", "fma", "f16c", "bmi2"}))
    monkeypatch.setattr(kernel_variants.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("ACCELGEN_CPU_KERNELS", "avx512")
    with pytest.raises(UsageError, match="this processor lacks avx512") as refused:
        kernel_variants.chosen_variant()
    assert "\n" not in str(refused.value) and "avx2, portable" in str(refused.value)
    monkeypatch.setenv("ACCELGEN_CPU_KERNELS", "sse9")
    with pytest.raises(UsageError, match="names no build of the CPU kernels"):
        kernel_variants.chosen_variant()
    monkeypatch.setenv("ACCELGEN_CPU_KERNELS", "off")
    assert kernel_variants.chosen_variant() is None
    monkeypatch.delenv("ACCELGEN_CPU_KERNELS")
    assert kernel_variants.chosen_variant() == "avx2"  # the most capable it runs


def test_devices_says_which_kernels_this_processor_takes_and_prepare_builds_them(build_environment):
    before = subprocess.run([sys.executable, "-m", "accelgen.cli", "devices"], env=build_environment,
                            capture_output=True, text=True, timeout=120)
    assert before.returncode == 0 and "C++ kernels portable" in before.stdout and "not built yet" in before.stdout
    assert compiler_runs(build_environment) == []  # listing builds nothing
    prepared = subprocess.run([sys.executable, "-m", "accelgen.cli", "devices", "--prepare"], env=build_environment,
                              capture_output=True, text=True, timeout=120)
    assert prepared.returncode == 0, prepared.stderr
    assert "building the CPU plugin's C++ kernels" in prepared.stderr and "built in" in prepared.stdout
    assert sum("-shared" in run for run in compiler_runs(build_environment)) == 1


def test_prepare_fails_in_one_line_when_the_kernels_cannot_be_built(build_environment):
    """For an image or CI, a build that fails must fail the command, not pass with a warning."""
    prepared = subprocess.run([sys.executable, "-m", "accelgen.cli", "devices", "--prepare"],
                              env=dict(build_environment, CXX="/bin/false"), capture_output=True, text=True,
                              timeout=120)
    assert prepared.returncode == 2
    error = [line for line in prepared.stderr.splitlines() if line.startswith("accelgen: error:")]
    assert error == [line for line in prepared.stderr.splitlines() if "error" in line.lower()] and len(error) == 1
    assert "could not be built: /bin/false failed (exit 1)" in error[0] and "Traceback" not in prepared.stderr
