import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# One thread per test process, unless the developer set OMP_NUM_THREADS: float sums in one order on any machine and
# any load (a reference and the run it checks may not run at different thread counts), and no OpenMP thread
# spinning for a core a busy machine does not give it. Jobs the tests start inherit it (the CPU plugin keeps a
# thread count the user set); the tests of the plugin's own choice start their jobs without it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"].split(",")[0]))

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


@pytest.fixture(scope="session", autouse=True)
def _private_extensions_folder(tmp_path_factory) -> Path:
    """This session's own TORCH_EXTENSIONS_DIR, so that a compile of DeepSpeed's CPU all-reduce extension by another
    job or test session on the machine (its lock, a half-built folder) never meets these tests. A finished build
    from the machine's usual folder (the library there, no lock) is copied in; else the first tensor-parallel job
    of the session compiles it here. The CPU plugin's C++ kernels likewise: every variant this processor executes is
    built in the usual folder (once per machine and source: under the builds' own lock, checked before use), then
    copied, so that a session adds a build's minutes only when the kernels' sources changed."""
    from accelgen_cpu.extension_lock import EXTENSION, extension_build_folder
    from accelgen_cpu.kernel_variants import executable_variants
    from accelgen_cpu.native_build import KERNELS_FOLDER, LOCK, BuildFailure, built_library
    from accelgen_cpu.native_kernels import native_kernels

    usual = Path(extension_build_folder(EXTENSION))
    folder = tmp_path_factory.mktemp("torch_extensions")
    if (usual / f"{EXTENSION}.so").is_file() and not (usual / "lock").exists():
        shutil.copytree(usual, folder / EXTENSION, ignore=shutil.ignore_patterns("lock"))
    for variant in executable_variants():
        try:
            built_library(variant)
        except BuildFailure:
            pass  # the kernels' tests show it, with its reason
    if (usual.parent / KERNELS_FOLDER).is_dir():
        shutil.copytree(usual.parent / KERNELS_FOLDER, folder / KERNELS_FOLDER,
                        ignore=shutil.ignore_patterns(".building-*", LOCK))
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    native_kernels()  # this processor's variant, loaded (or its warning) before the first test's output
    return folder


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
def built_extension(_private_extensions_folder) -> Path:
    """The session's extensions folder with DeepSpeed's CPU all-reduce extension compiled in it (now, if no job has
    compiled it yet): ``<folder>/deepspeed_shm_comm``."""
    built = _private_extensions_folder / "deepspeed_shm_comm"
    if not (built / "deepspeed_shm_comm.so").is_file():
        subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder\n"
                        "ShareMemCommBuilder().load()"], check=True, capture_output=True)
    return built


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory):
    """``tiny_model_folder(arch)``: a folder holding a random-weight model and the test tokenizer."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = build_tokenizer(root / "tokenizer")
    configs = tiny_configs(len(tokenizer))
    built = {}

    def folder_for(architecture: str) -> Path:
        if architecture not in built:
            folder = build_model(root / architecture, configs[architecture])
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


def with_fault_drill(environment: dict, rank: int = 1, hook: str = "prepare_model", first_start_only: bool = False) -> dict:
    """``environment`` with the fault-drill plugin installed (``tests/fault_drill``): rank ``rank`` of the
    processes started with it raises in the accelerator's ``hook`` (with ``first_start_only``, not after a restart)."""
    path = os.pathsep.join(filter(None, [str(FAULT_DRILL), environment.get("PYTHONPATH")]))
    return dict(environment, PYTHONPATH=path, ACCELGEN_FAULT_RANK=str(rank), ACCELGEN_FAULT_HOOK=hook,
                ACCELGEN_FAULT_STARTS="first" if first_start_only else "every")
