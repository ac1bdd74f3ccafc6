"""What a job needs beyond the base install, asked for without it: one line naming the extra, before any rank starts;
and DeepSpeed's extension built in a folder of each install's own."""

import os
import subprocess
import sys

import pytest
from conftest import one_error_line_in


@pytest.fixture
def without_deepspeed(tmp_path, cli_environment) -> dict:
    """An environment whose interpreters find no DeepSpeed (as after ``pip install accelgen`` without the extra)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["deepspeed"] = None  # as if it were not installed\n')
    return dict(cli_environment, PYTHONPATH=os.pathsep.join(filter(None, [str(site), cli_environment.get("PYTHONPATH")])))


def accelgen(environment: dict, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accelgen.cli", *arguments], env=environment, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("arguments", [["--world-size", "2"], ["--world-size", "4", "--data-parallel", "2"]],
                         ids=["tensor-parallel", "replicas-of-two"])
def test_tensor_parallelism_without_deepspeed_is_one_line_naming_the_extra(without_deepspeed, arguments):
    result = accelgen(without_deepspeed, "run", "--device", "cpu", *arguments, "--prompt", "Hello", "--max-new-tokens", "2")
    assert result.returncode == 2
    assert one_error_line_in(result.stderr) == (
        'accelgen: error: Tensor parallelism (the model split over 2 ranks) needs DeepSpeed, which is not installed here: '
        'pip install "accelgen[deepspeed]" (or run each replica on one rank: --data-parallel equal to --world-size).\n')


@pytest.mark.slow
def test_replicas_of_one_rank_need_no_deepspeed(without_deepspeed, tmp_path):
    output = tmp_path / "out.jsonl"
    result = accelgen(without_deepspeed, "run", "--device", "cpu", "--world-size", "2", "--data-parallel", "2", "--quiet",
                      "--prompt", "Hello", "--prompt", "DeepSpeed is", "--max-new-tokens", "2", "--output", str(output))
    assert result.returncode == 0, result.stderr
    assert len(output.read_text().splitlines()) == 2


def deepspeed_build_folder_in(environment: dict) -> str:
    return subprocess.run([sys.executable, "-c", "from accelgen_cpu.extension_lock import deepspeed_build_folder\n"
                           "print(deepspeed_build_folder())"], env=environment, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_deepspeed_builds_in_a_folder_of_the_installs_own_named_by_what_the_build_depends_on(tmp_path, cli_environment):
    """Two installs sharing one extensions folder each rebuilt the other's build on every alternate run: a build folder
    per install, under the one the user names, the same for every process of one install, another for another
    compiler (benchmarks/two_installs.py runs two real installs)."""
    shared = dict(cli_environment, TORCH_EXTENSIONS_DIR=str(tmp_path))
    folder = deepspeed_build_folder_in(shared)
    assert os.path.dirname(os.path.dirname(folder)) == str(tmp_path)
    assert os.path.basename(os.path.dirname(folder)).startswith("accelgen-deepspeed-")
    assert os.path.basename(folder) == "deepspeed_shm_comm"
    assert deepspeed_build_folder_in(shared) == folder
    assert deepspeed_build_folder_in(dict(shared, CXX="clang++")) != folder
