"""``accelgen run --ray`` on a real local Ray cluster of two nodes: a head (``ray start --head``) and a second node
(``ray start --address``, a temp folder and a resource of its own), each one CPU, so each of the job's two replicas runs
on a node of its own. Jobs run as a user runs them (the command in a process of its own); their outputs are compared
byte for byte with one accelgen process's.

The cluster is started once for the module (a few seconds) and the tests share it on one test worker (xdist group).
Its processes run with ``RAY_AUTH_MODE=disabled`` (a cluster on loopback only): Ray 2.60 turns token authentication
on wherever ``~/.ray/auth_token`` exists, which a ``ray.init()`` elsewhere on the machine may have written.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import processes_under, run_to_the_end

from accelgen.cli import main

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]

ROWS = 48
NEW_TOKENS = 24
JOB_SECONDS = 300


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalCluster:
    """A head node and a second node on this machine, each its own Ray processes under a temp folder of its own."""

    def __init__(self):
        self.environment = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # short folders: Ray's socket paths live inside them and a Unix socket's path is short
        self.head_folder = tempfile.mkdtemp(prefix="agh", dir="/tmp")
        self.second_folder = tempfile.mkdtemp(prefix="ags", dir="/tmp")
        self._ray(["start", "--head", f"--port={self.port}", "--num-cpus=1", f"--temp-dir={self.head_folder}",
                   "--include-dashboard=false",
                   f"--dashboard-agent-listen-port={_free_port()}",
                   # a node gone is found within seconds, not Ray's default half a minute
                   '--system-config={"health_check_period_ms": 500, "health_check_failure_threshold": 4}'])
        self.start_second_node()

    def _ray(self, arguments: list[str]) -> None:
        ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        done = subprocess.run([ray, *arguments], env=self.environment, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"ray {' '.join(arguments)} failed:\n{done.stdout}\n{done.stderr}"

    def start_second_node(self) -> None:
        self._ray(["start", f"--address={self.address}", "--num-cpus=1", f"--temp-dir={self.second_folder}",
                   '--resources={"second_node": 1}', f"--dashboard-agent-listen-port={_free_port()}"])

    def ran_on_second_node(self, pid: int) -> bool:
        """Whether the worker process ``pid`` was one of the second node's (its log files are in the node's folder)."""
        return any(Path(self.second_folder).glob(f"session_*/logs/worker-*-{pid}.out"))

    def kill_second_node(self) -> list[int]:
        return _kill_processes_of(self.second_folder)

    def stop(self) -> None:
        """Every process of both nodes killed (``ray stop`` would end any other Ray instance of the machine too)."""
        _kill_processes_of(self.head_folder, self.second_folder)
        for folder in (self.head_folder, self.second_folder):
            shutil.rmtree(folder, ignore_errors=True)


def _kill_processes_of(*folders: str) -> list[int]:
    """SIGKILL every process naming one of ``folders`` (a node's raylet, GCS, log monitor...) and their children (its
    workers); the pids killed."""
    named = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if any(folder.encode() in (entry / "cmdline").read_bytes() for folder in folders):
                    named.append(int(entry.name))
    killed = sorted({pid for top in named for pid in (top, *processes_under(top))})
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return killed


@pytest.fixture(scope="module")
def cluster():
    started = LocalCluster()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray_rows") / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": f"Row {index} of the job says that"}) + "\n" for index in range(ROWS)))
    return path


def _job(*options: str) -> list[str]:
    return ["--max-new-tokens", str(NEW_TOKENS), "--quiet", *options]


def _local_output(rows_file: Path, folder: Path, *options: str) -> bytes:
    """What one accelgen process writes for the rows (in this process: the reference)."""
    output = folder / "local.jsonl"
    assert main(["run", "--dataset", str(rows_file), "--output", str(output), *_job(*options)]) == 0
    return output.read_bytes()


def _on_cluster(cluster: LocalCluster, *arguments: str) -> list[str]:
    return [sys.executable, "-m", "accelgen.cli", "run", "--ray", cluster.address, "--replicas", "2", *arguments]


def _rows_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _wait_for_rows(path: Path, rows: int, job: subprocess.Popen) -> None:
    deadline = time.monotonic() + JOB_SECONDS
    while _rows_in(path) < rows:
        assert job.poll() is None, f"the job ended before {rows} rows were written: {job.communicate()}"
        assert time.monotonic() < deadline, f"no {rows} rows in {path} after {JOB_SECONDS} s"
        time.sleep(0.05)


def test_two_replicas_on_two_nodes_write_what_one_process_writes(cluster, rows_file, tmp_path):
    expected = _local_output(rows_file, tmp_path)
    output = tmp_path / "cluster.jsonl"
    done = run_to_the_end(_on_cluster(cluster, "--dataset", str(rows_file), "--output", str(output), *_job()),
                          cluster.environment, JOB_SECONDS)
    assert done.returncode == 0, done.stderr
    assert output.read_bytes() == expected
    lines = done.stderr.splitlines()
    assert lines[0].startswith("accelgen: Ray cluster of 2 nodes (2 CPU, 1 second_node): 2 replicas on cpu, each asking 1 CPU")
    ready = [line for line in lines if " ready on node " in line]
    assert sorted(line.split()[2] for line in ready) == ["0", "1"]
    # one replica on each node: the second's process is one of the second node's
    pids = {int(line.split("pid ")[1].split(")")[0]) for line in ready}
    assert sum(cluster.ran_on_second_node(pid) for pid in pids) == 1
    assert f"accelgen: {ROWS} rows, {ROWS * NEW_TOKENS:,} new tokens" in done.stderr


def test_a_driver_stopped_mid_job_resumes_to_the_same_sampled_output(cluster, rows_file, tmp_path):
    sampled = ("--do-sample", "--seed", "7", "--temperature", "0.9")
    expected = _local_output(rows_file, tmp_path, *sampled)
    output = tmp_path / "cluster.jsonl"
    command = _on_cluster(cluster, "--dataset", str(rows_file), "--output", str(output), *_job(*sampled))
    job = subprocess.Popen(command, env=cluster.environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_rows(output, 4, job)
    job.send_signal(signal.SIGKILL)  # the driver gone outright: Ray ends its replicas with it
    job.communicate()
    kept = _rows_in(output)
    assert 4 <= kept < ROWS
    done = run_to_the_end(command, cluster.environment, JOB_SECONDS)
    assert done.returncode == 0, done.stderr
    assert f"resuming: {kept} rows already in {output}" in done.stderr
    assert output.read_bytes() == expected


def test_a_bad_row_is_an_error_row_or_stops_the_job_as_it_does_on_one_machine(cluster, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    texts = [f"Row {index} says that" for index in range(12)]
    texts[9] = ""
    rows.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    expected = _local_output(rows, tmp_path, "--skip-bad-rows")
    output = tmp_path / "cluster.jsonl"
    done = run_to_the_end(_on_cluster(cluster, "--dataset", str(rows), "--output", str(output), *_job("--skip-bad-rows")),
                          cluster.environment, JOB_SECONDS)
    assert done.returncode == 0, done.stderr
    assert output.read_bytes() == expected
    assert json.loads(expected.splitlines()[9])["finish_reason"] == "error"

    # without --skip-bad-rows the dataset is checked before any replica starts, as on one machine
    capsys.readouterr()
    assert main(["run", "--dataset", str(rows), "--output", str(tmp_path / "local_stopped.jsonl"), *_job()]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"accelgen: error: Dataset {str(rows)!r} row 9, column 'text', is empty")
    stopped = run_to_the_end(_on_cluster(cluster, "--dataset", str(rows), "--output", str(tmp_path / "o.jsonl"), *_job()),
                             cluster.environment, JOB_SECONDS)
    assert stopped.returncode == 2
    assert stopped.stderr.splitlines() == [line]


def test_a_replica_that_cannot_load_the_model_says_why_once(cluster, rows_file, tmp_path):
    from safetensors.torch import load_file, save_file

    from accelgen.loading.model_files import DEFAULT_MODEL

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    weights = load_file(model / "model.safetensors")
    name = sorted(weights)[0]
    weights[name][0] = float("nan")  # found as the weights load, in the replicas: the driver reads headers alone
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    done = run_to_the_end(_on_cluster(cluster, "--model", str(model), "--dataset", str(rows_file), "--output",
                                      str(tmp_path / "out.jsonl"), *_job()), cluster.environment, JOB_SECONDS)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("accelgen: error: replica ")
    assert "could not load the model: " in errors[0] and "NaN" in errors[0]
    assert "Traceback" not in done.stderr


def test_what_no_node_has_and_a_cluster_not_there_are_one_line_each(cluster, rows_file, tmp_path, capsys):
    status = main(["run", "--ray", cluster.address, "--replicas", "2", "--replica-resources", '{"num_gpus": 1}',
                   "--dataset", str(rows_file), "--output", str(tmp_path / "out.jsonl"), *_job()])
    error = capsys.readouterr().err.splitlines()
    assert status == 2
    assert len(error) == 1 and error[0].startswith(
        "accelgen: error: no node of the Ray cluster has what a replica asks (1 GPU): its nodes hold ")
    assert not (tmp_path / "out.jsonl").exists() or _rows_in(tmp_path / "out.jsonl") == 0

    closed = _free_port()
    done = run_to_the_end([sys.executable, "-m", "accelgen.cli", "run", "--ray", f"127.0.0.1:{closed}", "--prompt", "Hi"],
                          cluster.environment, 120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"accelgen: error: no Ray cluster at '127.0.0.1:{closed}' (Connection refused): "
                                        f"start one there with `ray start --head`, or check the address and port."]


def test_the_device_is_the_one_the_clusters_nodes_hold_not_the_drivers(cluster, tmp_path):
    # a third node saying it holds a GPU (Ray takes a node's word for it): --device auto picks the GPU device for the
    # replicas though this machine has none; the replica, placed on that node, finds no GPU and says so, once
    gpu_folder = tempfile.mkdtemp(prefix="agg", dir="/tmp")
    try:
        cluster._ray(["start", f"--address={cluster.address}", "--num-cpus=0", "--num-gpus=1", f"--temp-dir={gpu_folder}",
                      f"--dashboard-agent-listen-port={_free_port()}"])
        done = run_to_the_end([sys.executable, "-m", "accelgen.cli", "run", "--ray", cluster.address, "--prompt", "Hi",
                               "--max-new-tokens", "4"], cluster.environment, JOB_SECONDS)
    finally:
        _kill_processes_of(gpu_folder)
        shutil.rmtree(gpu_folder, ignore_errors=True)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("accelgen: Ray cluster of 3 nodes (2 CPU, 1 GPU, 1 second_node): 1 replica on cuda, "
                               "each asking 1 GPU")
    assert lines[-1].startswith("accelgen: error: replica 0 could not load the model: --device cuda is not available here")
    assert sum("error" in line for line in lines) == 1


def _replica_ranks() -> list[int]:
    """The processes of ranks 1 and up of tensor-parallel replicas (each started by its replica's actor)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if b"accelgen.ray.replica_ranks" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def test_tensor_parallel_replicas_with_a_rank_killed_mid_job_write_what_one_process_writes(cluster, rows_file, tmp_path):
    # two replicas, each split over two ranks of its node (DeepSpeed AutoTP over gloo), in float32: the split's output
    # equals one process's token for token. A rank of one of them killed: that replica ends and is started again
    expected = _local_output(rows_file, tmp_path, "--dtype", "float32")
    output = tmp_path / "cluster.jsonl"
    command = _on_cluster(cluster, "--world-size", "2", "--replica-resources", '{"num_cpus": 1}', "--dataset",
                          str(rows_file), "--output", str(output), *_job("--dtype", "float32"))
    job = subprocess.Popen(command, env=cluster.environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_rows(output, 4, job)
        ranks = _replica_ranks()
        assert len(ranks) == 2  # rank 1 of each replica
        os.kill(ranks[0], signal.SIGKILL)
        stdout, stderr = job.communicate(timeout=JOB_SECONDS)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr
    assert stderr.splitlines()[0].startswith("accelgen: Ray cluster of 2 nodes (2 CPU, 1 second_node): 2 replicas of 2 "
                                             "ranks on cpu, each asking 1 CPU")
    [lost] = [line for line in stderr.splitlines() if " was lost (" in line]
    assert "starting it again (restart 1 of 3)" in lost
    assert output.read_bytes() == expected
    assert not _replica_ranks()  # none left behind by the replica lost, nor by those the job ended


def test_options_that_do_not_go_with_ray_are_refused_before_anything_starts(rows_file, capsys):
    for options, words in ((["--data-parallel", "2"], "--data-parallel is for a job accelgen launches itself"),
                           (["--offload", "disk"], "--offload goes with one process on one machine")):
        assert main(["run", "--ray", "local", "--dataset", str(rows_file), *options]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert words in line
    assert main(["run", "--replicas", "2", "--dataset", str(rows_file)]) == 2
    assert "--replicas says how replicas run on a Ray cluster: add --ray" in capsys.readouterr().err


def test_the_second_node_killed_mid_job_every_row_is_written_once(cluster, rows_file, tmp_path):
    expected = _local_output(rows_file, tmp_path)
    output = tmp_path / "cluster.jsonl"
    command = _on_cluster(cluster, "--dataset", str(rows_file), "--output", str(output), *_job())
    job = subprocess.Popen(command, env=cluster.environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_rows(output, 4, job)
        assert cluster.kill_second_node()
        stdout, stderr = job.communicate(timeout=JOB_SECONDS)
    finally:
        if job.poll() is None:
            job.kill()
        cluster.start_second_node()  # whole again for any test after this one
    assert job.returncode == 0, stderr
    [lost] = [line for line in stderr.splitlines() if " was lost (" in line]
    assert lost.startswith("accelgen: replica ") and "node is gone); starting it again (restart 1 of 3)" in lost
    assert output.read_bytes() == expected
    assert f"accelgen: {ROWS} rows, {ROWS * NEW_TOKENS:,} new tokens" in stderr  # the lost replica's rows counted once
