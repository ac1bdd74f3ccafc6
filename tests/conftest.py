import contextlib
import fcntl
import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# One thread per test process, unless the developer set OMP_NUM_THREADS: float sums in one order on any machine and
# any load (a reference and the run it checks may not run at different thread counts), and no OpenMP thread
# spinning for a core a busy machine does not give it. Jobs the tests start inherit it (the CPU plugin keeps a
# thread count the user set); the tests of the plugin's own choice start their jobs without it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"].split(",")[0]))
# No int8 weights kept between loads (in the user's cache folder) unless a test asks for them in a folder of its own
# (tests/test_kept_int8_weights.py): every other int8 test quantizes as it loads, as a first load does.
os.environ.setdefault("ACCELGEN_WEIGHTS_CACHE", "off")

from family_models import family_config  # noqa: E402
from tiny_models import build_model, build_tokenizer, tiny_configs  # noqa: E402

ARCHITECTURES = ("bloom", "gpt2", "llama", "opt", "falcon")
PROMPTS = [
    "DeepSpeed is a machine learning framework",
    "Hello",
    "The quick brown fox jumps over the lazy dog while",
]


def one_error_line_in(stderr: str) -> str:
    """``stderr``, checked to be exactly one ``accelgen: error:`` line with no traceback; returns it."""
    assert stderr.startswith("accelgen: error: ") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr
    return stderr


def one_error_line(capsys) -> str:
    """The command's stderr (captured by ``capsys``), checked to be exactly one ``accelgen: error:`` line."""
    return one_error_line_in(capsys.readouterr().err)


@pytest.fixture(autouse=True)
def _seeded_and_quiet(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


#: The signals whose handling a command changes while it runs (a Ctrl-C, a stop, a hang-up).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _signal_handling_as_it_was():
    """Each test leaves this process's handling of the stop signals as it found it. A command run here (``main``)
    that was stopped leaves them ignored on purpose (a launcher ignores a late Ctrl-C as it ends its ranks), and every
    process a later test starts would inherit that: a Python child keeps an inherited SIGINT ignored."""
    before = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    yield
    for number, handler in before.items():
        if signal.getsignal(number) is not handler:
            signal.signal(number, handler)


def as_a_terminal_starts_it() -> None:
    """For ``subprocess.Popen(preexec_fn=...)``: the child starts with the stop signals at their defaults and none
    blocked, as a terminal starts a command. Python keeps a stop signal ignored when it started ignored, and the test
    process may have it so: a shell's background job (CI started with ``&``), or a library that set it without Python
    knowing; a test that stops a child with a signal would then wait for nothing."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Each test leaves this process's environment as it found it. A job launched here (``main``) sets what its ranks
    inherit (their threads, a shutdown timeout) in ``os.environ``, and every process a later test starts would inherit
    that too."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


def processes_under(pid: int) -> list[int]:
    """The live processes descended from ``pid`` (torchrun's workers run in sessions of their own)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def run_to_the_end(command: list[str], environment: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(command)``, its output captured, for a command that may start processes of its own (a job's
    ranks). Still running after ``timeout`` seconds, every process of it is made to say where it stands (faulthandler's
    stacks, on SIGABRT), then killed, and the test fails with what they said: a hang is shown, not just timed."""
    process = subprocess.Popen(command, env=dict(environment, PYTHONFAULTHANDLER="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        everyone = [process.pid, *processes_under(process.pid)]
        for pid in everyone:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        for pid in everyone:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{' '.join(command)} had not ended after {timeout} s; where its processes stood:\n{stderr}\n"
                    f"standard output:\n{stdout}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@contextlib.contextmanager
def _one_process_at_a_time(lock: Path) -> Iterator[None]:
    """Inside the block, no other test process of this run (pytest-xdist's workers) is inside a block of ``lock``."""
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _run_folder(tmp_path_factory) -> Path:
    """The base temporary folder every test process of this run shares (the workers' own are inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


#: The user's own extensions folder (TORCH_EXTENSIONS_DIR as the run found it, else torch's default), where finished
#: builds are copied from: the tests' jobs build and load in a folder of the run's own.
_USUAL_EXTENSIONS_DIR = os.environ.get("TORCH_EXTENSIONS_DIR")


@contextlib.contextmanager
def _extensions_dir(folder: str | None) -> Iterator[None]:
    """Inside the block, TORCH_EXTENSIONS_DIR is ``folder`` (unset for None); put back after."""
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ.pop("TORCH_EXTENSIONS_DIR", None)
    if folder is not None:
        os.environ["TORCH_EXTENSIONS_DIR"] = folder
    try:
        yield
    finally:
        os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        if before is not None:
            os.environ["TORCH_EXTENSIONS_DIR"] = before


@pytest.fixture(scope="session", autouse=True)
def _private_extensions_folder(tmp_path_factory) -> Path:
    """This run's own TORCH_EXTENSIONS_DIR, shared by its test processes, so that a compile of DeepSpeed's CPU
    all-reduce extension by another job or test run on the machine (its lock, a half-built folder) never meets these
    tests. The CPU plugin's C++ kernels: every variant this processor executes is built in the user's folder (once per
    machine and source: under the builds' own lock, checked before use), then copied in by the run's first test
    process, so that a run adds a build's minutes only when the kernels' sources changed."""
    from accelgen_cpu.kernel_variants import executable_variants
    from accelgen_cpu.native_build import BuildFailure, built_library
    from accelgen_cpu.native_kernels import native_kernels

    with _extensions_dir(_USUAL_EXTENSIONS_DIR):
        from accelgen_cpu.extension_lock import torch_extensions_root

        usual_root = Path(torch_extensions_root())
        for variant in executable_variants():
            try:
                built_library(variant)
            except BuildFailure:
                pass  # the kernels' tests show it, with its reason
    run_folder = _run_folder(tmp_path_factory)
    folder = run_folder / "torch_extensions"
    with _one_process_at_a_time(run_folder / "torch_extensions.lock"):
        copied = folder.is_dir()
        folder.mkdir(exist_ok=True)
        if not copied:
            _copy_kernel_builds(usual_root, folder)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    native_kernels()  # this processor's variant, loaded (or its warning) before the first test's output
    return folder


def extensions_folder_with_the_kernels(folder: Path) -> Path:
    """A new TORCH_EXTENSIONS_DIR at ``folder`` holding the run's builds of the CPU plugin's C++ kernels, so that a job
    given it compiles nothing of ours (a test of DeepSpeed's extension lock is not slowed, nor its lines joined, by a
    kernels build and its wait)."""
    folder.mkdir(parents=True, exist_ok=True)
    _copy_kernel_builds(Path(os.environ["TORCH_EXTENSIONS_DIR"]), folder)
    return folder


def _copy_kernel_builds(source: Path, target: Path) -> None:
    """Copy the finished builds of the CPU kernels in the extensions folder ``source`` into ``target`` (no build in
    progress, no lock), where there are any."""
    from accelgen_cpu.native_build import KERNELS_FOLDER, LOCK

    if (source / KERNELS_FOLDER).is_dir():
        shutil.copytree(source / KERNELS_FOLDER, target / KERNELS_FOLDER, ignore=shutil.ignore_patterns(".building-*", LOCK))


KERNEL_VARIANTS = ("avx512", "avx2", "portable")


def loaded_variant(variant: str):
    """The CPU plugin's C++ kernels of ``variant`` (built by the session), loaded: their operators are
    ``loaded_variant(variant).operators``; the test is skipped, naming the instructions, where this processor lacks
    some that the variant needs."""
    from accelgen_cpu.kernel_variants import missing_instructions
    from accelgen_cpu.native_kernels import load_variant

    missing = missing_instructions(variant)
    if missing:
        pytest.skip(f"this processor lacks {', '.join(sorted(missing))}, which the {variant} kernels need")
    return load_variant(variant)


@pytest.fixture(params=KERNEL_VARIANTS)
def kernel_variant(request):
    """Each variant of the CPU plugin's C++ kernels this processor executes, loaded (:func:`loaded_variant`)."""
    return loaded_variant(request.param)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Run the test at 1 and 2 torch threads (the kernels split their work across threads), the session's count put
    back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def built_extension(_private_extensions_folder, tmp_path_factory) -> Path:
    """This install's build folder of DeepSpeed's CPU all-reduce extension in the run's extensions folder, the
    extension built in it: copied from this install's build in the user's folder, built there first where it is not
    (once per install, as the user's first tensor-parallel job would; in the run's folder where the user's cannot be
    written), one test process at a time: ``<folder>/accelgen-deepspeed-<key>/deepspeed_shm_comm``."""
    from accelgen_cpu.extension_lock import EXTENSION, deepspeed_build_folder

    built = Path(deepspeed_build_folder())
    with _one_process_at_a_time(_run_folder(tmp_path_factory) / "torch_extensions.lock"):
        if not (built / f"{EXTENSION}.so").is_file():
            with _extensions_dir(_USUAL_EXTENSIONS_DIR):
                usual = Path(deepspeed_build_folder())
            if _build_extension_in(usual.parent) and not (usual / "lock").exists():
                shutil.copytree(usual, built, ignore=shutil.ignore_patterns("lock"), dirs_exist_ok=True)
            else:
                _build_extension_in(built.parent)
    return built


def _build_extension_in(root: Path) -> bool:
    """Build DeepSpeed's CPU all-reduce extension with ``root`` as torch's extensions folder (nothing when built there
    already); whether it could."""
    built = subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder\n"
                            "ShareMemCommBuilder().load()"], capture_output=True,
                           env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(root)))
    return built.returncode == 0


@functools.cache
def _starts_ranks(module_file: str) -> bool:
    """Whether tests of the module may start several ranks (it names --world-size)."""
    return '"--world-size"' in Path(module_file).read_text()


@pytest.fixture(autouse=True)
def _extension_built_before_jobs_of_ranks(request):
    """Tests that may start tensor-parallel jobs (slow ones, and any of a module naming --world-size) find DeepSpeed's
    extension built: no test's job compiles it, or waits on another's compile, saying so in lines it would not expect."""
    if importlib.util.find_spec("deepspeed") is not None and (
            request.node.get_closest_marker("slow") is not None or _starts_ranks(str(request.node.path))):
        request.getfixturevalue("built_extension")


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory):
    """``tiny_model_folder(arch)``: a folder holding a random-weight model and the test tokenizer: one of tiny_models'
    five, or of any family of family_models."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = build_tokenizer(root / "tokenizer")
    configs = tiny_configs(len(tokenizer))
    built = {}

    def folder_for(architecture: str) -> Path:
        if architecture not in built:
            config = configs[architecture] if architecture in configs else family_config(architecture, len(tokenizer))
            folder = build_model(root / architecture, config)
            tokenizer.save_pretrained(folder)
            built[architecture] = folder
        return built[architecture]

    return folder_for


@pytest.fixture
def cli_environment():
    """Environment for running the ``accelgen`` script in a subprocess."""
    environment = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    return environment


@pytest.fixture
def job_environment(cli_environment):
    """Environment of a job whose processes can be found afterwards by a unique marker
    (``test_tensor_parallel.processes_of``)."""
    return dict(cli_environment, ACCELGEN_TEST_JOB=uuid.uuid4().hex)


FAULT_DRILL = Path(__file__).parent / "fault_drill"


def shared_memory_buffers_of(port: int) -> list[Path]:
    """The DeepSpeed shared-memory all-reduce buffers in /dev/shm named after a job on ``port`` (any address, any
    rank): none may be left once the job is over."""
    return list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def with_fault_drill(environment: dict, rank: int = 1, hook: str = "prepare_model", first_start_only: bool = False) -> dict:
    """``environment`` with the fault-drill plugin installed (``tests/fault_drill``): rank ``rank`` of the
    processes started with it raises in the accelerator's ``hook`` (with ``first_start_only``, not after a restart)."""
    path = os.pathsep.join(filter(None, [str(FAULT_DRILL), environment.get("PYTHONPATH")]))
    return dict(environment, PYTHONPATH=path, ACCELGEN_FAULT_RANK=str(rank), ACCELGEN_FAULT_HOOK=hook,
                ACCELGEN_FAULT_STARTS="first" if first_start_only else "every")
