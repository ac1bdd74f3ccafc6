"""Data parallelism for real: `accelgen run --world-size N --data-parallel R` starts N processes in R replicas
that take rows from the launcher's store as they free up, and one writer puts every row in dataset order."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import run_to_the_end
from test_tensor_parallel import accelgen_command, processes_of, rows_of

import accelgen
from accelgen.cli import main
from accelgen.common.settings import World
from accelgen.generation.text import Completion
from accelgen.jobs import row_exchange
from accelgen.jobs.row_exchange import ReplicaReport, ReplicaResults, RowTaking
from accelgen.parallel.launcher import free_port

ROWS = [f"Row {number} says" + " hello" * (number % 5) for number in range(24)]
MAX_NEW_TOKENS = 12


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in ROWS))
    return path


def token_ids(path) -> list[list[int]]:
    return [row["completion_token_ids"] for row in rows_of(path)]


def one_process_token_ids(folder, **settings) -> list[list[int]]:
    completions = accelgen.generate(ROWS, model=folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, **settings)
    return [completion.completion_token_ids for completion in completions]


def replica_rows(stderr: str) -> dict[int, int]:
    """Rows per replica, from the summary line."""
    [line] = [line for line in stderr.splitlines() if "replica 0:" in line]
    parts = [part.split(":") for part in line.removeprefix("accelgen: ").split("; ") if part.startswith("replica ")]
    return {int(name.split()[1]): int(figures.split()[0]) for name, figures in parts}


# -- the store's exchange, in one process --------------------------------------------------------------------


def replica(number: int, size: int = 1, rank: int = 0) -> World:
    return World(rank=rank, size=size, replica=number, replicas=2)


def completion(number: int) -> Completion:
    return Completion(number, f"prompt {number}", "text", [number], 1, "length")


def taking(store, world: World, first_row: int, rows_ahead: int = 1024) -> RowTaking:
    return RowTaking(store, world, first_row, ReplicaResults(store, world, first_row), rows_ahead)


def test_rows_go_to_whichever_replica_asks_next_not_in_shares_fixed_up_front():
    store = torch.distributed.HashStore()
    texts = [f"text {number}" for number in range(10)]
    fast = taking(store, replica(0), first_row=3).numbered_texts(iter(texts))
    slow = taking(store, replica(1), first_row=3).numbered_texts(iter(texts))
    taken = [next(fast), next(fast), next(slow), next(fast), next(fast), next(slow)]
    assert taken == [(3, "text 3"), (4, "text 4"), (5, "text 5"), (6, "text 6"), (7, "text 7"), (8, "text 8")]
    assert list(fast) == [(9, "text 9")] and list(slow) == []  # past the last row each replica stops


def test_every_rank_of_a_replica_takes_its_leaders_rows():
    store = torch.distributed.HashStore()
    texts = [f"text {number}" for number in range(6)]
    other_replica = taking(store, replica(1), 0).numbered_texts(iter(texts))
    leader = taking(store, replica(0, size=2, rank=0), 0).numbered_texts(iter(texts))
    follower = taking(store, replica(0, size=2, rank=1), 0).numbered_texts(iter(texts))
    next(other_replica)
    led = list(leader)
    assert led == [(1, "text 1"), (2, "text 2"), (3, "text 3"), (4, "text 4"), (5, "text 5")]
    assert list(follower) == led
    assert store.num_keys() <= 3  # the turns the follower read are gone (the counter and join keys stay)


def test_the_writer_gets_every_row_in_dataset_order_whoever_finished_it_first():
    store = torch.distributed.HashStore()
    writer = ReplicaResults(store, replica(0), first_row=2)
    other = ReplicaResults(store, replica(1), first_row=2)
    assert other.hand_in([completion(3), completion(5)]) == []
    assert writer.hand_in([completion(4)]) == []  # row 2 is not finished: nothing can be written yet
    assert [row.index for row in writer.hand_in([completion(2)])] == [2, 3, 4, 5]
    other.hand_in([completion(7)])
    assert [row.index for row in writer.hand_in([completion(6)])] == [6, 7]
    writer.finish(ReplicaReport(0, rows=3, new_tokens=3, seconds=1.0))
    other.hand_in([completion(8)])  # after the writer's replica has finished: waits for the writer's last look
    other.finish(ReplicaReport(1, rows=4, new_tokens=4, seconds=1.0))
    assert [[row.index for row in rows] for rows in writer.rest()] == [[8]]
    assert [report.rows for report in writer.reports()] == [3, 4]


TEXTS = [f"text {number}" for number in range(10)]


def two_replicas(store, rows_ahead: int):
    """The writer's replica (0) and another (1): each one's results, and its rows as it takes them."""
    sides = []
    for world in (replica(0), replica(1)):
        results = ReplicaResults(store, world, 0)
        sides.append((results, RowTaking(store, world, 0, results, rows_ahead).numbered_texts(iter(TEXTS))))
    return sides


def test_while_a_slower_replica_holds_the_first_unwritten_row_the_others_take_at_most_rows_ahead_past_it(monkeypatch):
    store = torch.distributed.HashStore()
    (writer, slow), (fast_results, fast) = two_replicas(store, rows_ahead=3)
    assert next(slow) == (0, "text 0")  # the writer's replica is the slow one: row 0 takes long
    assert [next(fast), next(fast)] == [(1, "text 1"), (2, "text 2")]
    assert fast_results.hand_in([completion(1), completion(2)]) == []  # finished, held for order in the store
    looks = []

    def held(seconds):  # the fast replica's leader, held: meanwhile the slow row finishes and is written
        looks.append(store.add("rows taken", 0))
        if len(looks) == 3:
            assert [row.index for row in writer.hand_in([completion(0)])] == [0, 1, 2]

    monkeypatch.setattr(row_exchange.time, "sleep", held)
    assert next(fast) == (3, "text 3")
    assert looks == [3, 3, 3]  # no fourth row was taken while row 0 was unwritten
    assert writer.first_unwritten() == fast_results.first_unwritten() == 3


def test_the_replica_holding_the_first_unwritten_row_is_never_held(monkeypatch):
    store = torch.distributed.HashStore()
    (writer, mine), (other_results, other) = two_replicas(store, rows_ahead=2)
    monkeypatch.setattr(row_exchange.time, "sleep", lambda seconds: pytest.fail("held"))
    assert next(mine) == (0, "text 0") and next(other) == (1, "text 1")
    assert next(mine) == (2, "text 2")  # past the limit, but row 0 is its own: its decoding must go on
    (writer2, first), (other2_results, second) = two_replicas(torch.distributed.HashStore(), rows_ahead=2)
    assert next(second) == (0, "text 0") and next(first) == (1, "text 1")
    other2_results.hand_in([completion(0)])
    assert next(first) == (2, "text 2")  # the writer: row 0 is finished, only waiting for it to be written


def test_the_summary_says_which_replicas_a_slower_one_held_back(capsys):
    from accelgen.cli.terminal import print_details
    from accelgen.jobs.completion_job import RunReport

    replicas = [ReplicaReport(0, 5, 50, 2.0), ReplicaReport(1, 7, 70, 2.0, waited_seconds=1.25)]
    report = RunReport(rows=12, new_tokens=120, load_seconds=1.0, generate_seconds=2.0, decode_seconds=1.5,
                       decode_steps=100, device="cpu", device_settings=None, dtype="float32", quantize=None,
                       world_size=1, graph_captures=0, capture_seconds=0.0, capture_failure=None, batching="continuous", slot_occupancy=0.9,
                       offload=None, unsharded_parameter_bytes=100, rank_memory=[{"parameter_bytes": 100}],
                       replicas=replicas)
    print_details(report)
    stderr = capsys.readouterr().err
    assert "held back by a slower replica's row: replica 1 waited 1.25 s" in stderr
    assert replica_rows(stderr) == {0: 5, 1: 7}


# -- whole jobs ------------------------------------------------------------------------------------------------

def run_job(environment, *arguments, timeout=300):
    return run_to_the_end(accelgen_command("run", *arguments), environment, timeout)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    dict(batching="continuous"),
    dict(batching="static"),
    dict(batching="continuous", do_sample=True, seed=7, top_k=20),
    dict(batching="continuous", dtype="bfloat16", quantize="int8"),
], ids=["greedy", "greedy-static", "sampled", "int8"])
def test_two_single_rank_replicas_write_what_one_process_writes(tiny_model_folder, dataset, tmp_path, job_environment,
                                                                settings):
    folder = str(tiny_model_folder("llama"))
    output = tmp_path / "out.jsonl"
    options = ["--batching", settings["batching"]] + (
        ["--do-sample", "--seed", "7", "--top-k", "20"] if settings.get("do_sample") else []) + (
        ["--dtype", "bfloat16", "--quantize", "int8"] if settings.get("quantize") else [])
    result = run_job(job_environment, "--device", "cpu", "--world-size", "2", "--data-parallel", "2", "--model", folder,
                     "--dataset", str(dataset), "--batch-size", "3", "--max-new-tokens", str(MAX_NEW_TOKENS), *options,
                     "--output", str(output), "--quiet", "--details")
    assert result.returncode == 0, result.stderr
    assert token_ids(output) == one_process_token_ids(folder, batch_size=3, **settings)
    assert [row["index"] for row in rows_of(output)] == list(range(len(ROWS)))
    assert "world size 2 (2 replicas of 1)" in result.stderr
    assert sum(replica_rows(result.stderr).values()) == len(ROWS)
    assert processes_of(job_environment) == []


@pytest.mark.slow
def test_two_replicas_of_two_tensor_parallel_ranks_write_what_one_process_writes(tiny_model_folder, dataset, tmp_path,
                                                                                 job_environment):
    folder = str(tiny_model_folder("bloom"))
    output = tmp_path / "out.jsonl"
    result = run_job(job_environment, "--device", "cpu", "--world-size", "4", "--data-parallel", "2", "--model", folder,
                     "--dataset", str(dataset), "--batch-size", "3", "--max-new-tokens", str(MAX_NEW_TOKENS),
                     "--do-sample", "--seed", "3", "--output", str(output), "--quiet", "--details")
    assert result.returncode == 0, result.stderr
    assert token_ids(output) == one_process_token_ids(folder, batch_size=3, do_sample=True, seed=3)
    assert "world size 4 (2 replicas of 2)" in result.stderr
    assert "(0.50x / 0.50x)" in result.stderr  # each replica's ranks hold half the model each
    assert processes_of(job_environment) == []


@pytest.mark.slow
def test_two_nodes_on_one_machine_each_one_replica(tiny_model_folder, dataset, tmp_path, job_environment):
    """--nnodes 2: one launcher per node, meeting at node 0's store; node 1's replica hands its rows to node 0."""
    folder = str(tiny_model_folder("llama"))
    output = tmp_path / "out.jsonl"
    common = ["--device", "cpu", "--world-size", "2", "--nnodes", "2", "--data-parallel", "2", "--master-addr",
              "127.0.0.1", "--master-port", str(free_port()), "--model", folder, "--dataset", str(dataset),
              "--batch-size", "2", "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(output), "--quiet"]
    nodes = [subprocess.Popen(accelgen_command("run", *common, "--node-rank", str(rank)), env=job_environment,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], results
    assert token_ids(output) == one_process_token_ids(folder, batch_size=2)
    assert processes_of(job_environment) == []


def worker_of(environment, job_rank: int) -> int:
    """The PID of the job's worker of rank ``job_rank`` (found by the job's marker and its RANK variable), looked for
    until it is found or 30 seconds have passed."""
    deadline = time.monotonic() + 30
    while True:
        for pid in processes_of(environment):
            try:
                variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={job_rank}".encode() in variables and b"TORCHELASTIC_RUN_ID" in b"".join(variables):
                return pid
        if time.monotonic() > deadline:
            raise AssertionError(f"no worker of rank {job_rank} found")
        time.sleep(0.05)


@pytest.mark.slow
def test_a_killed_replica_ends_the_job_and_the_same_command_resumes_it_exactly(tiny_model_folder, tmp_path,
                                                                              job_environment):
    folder = str(tiny_model_folder("llama"))
    rows = [f"Row {number} of a longer run" for number in range(300)]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": text}) + "\n" for text in rows))
    output = tmp_path / "out.jsonl"
    command = accelgen_command("run", "--device", "cpu", "--world-size", "2", "--data-parallel", "2", "--model", folder,
                               "--dataset", str(dataset), "--batch-size", "2", "--max-new-tokens", "30",
                               "--do-sample", "--seed", "11", "--output", str(output), "--quiet")
    # without restarts, the job stops (tests/test_restarts.py has the job that starts its workers again)
    job = subprocess.Popen([*command, "--max-restarts", "0"], env=job_environment, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not output.exists() or output.read_text().count("\n") < 5):
        time.sleep(0.01)
    os.kill(worker_of(job_environment, job_rank=1), signal.SIGKILL)  # replica 1, not the writer
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 1
    assert "worker rank 1 was killed by SIGKILL; the job was stopped." in stderr
    kept = output.read_text().count("\n")
    assert 5 <= kept < len(rows)  # it stopped part-way
    assert processes_of(job_environment) == []

    resumed = subprocess.run(command, env=job_environment, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming: {kept} rows already in" in resumed.stderr
    expected = accelgen.generate(rows, model=folder, device="cpu", batch_size=2, max_new_tokens=30, do_sample=True,
                                 seed=11)
    assert token_ids(output) == [completion.completion_token_ids for completion in expected]
    assert processes_of(job_environment) == []


@pytest.mark.parametrize("arguments, message", [
    (["--world-size", "4", "--data-parallel", "3"],
     "--data-parallel 3 must divide --world-size 4 (each replica runs on world-size / data-parallel ranks)"),
    (["--data-parallel", "2"], "--data-parallel 2 must divide --world-size 1"),
    (["--world-size", "8", "--nnodes", "4", "--data-parallel", "2"],
     "--data-parallel 2 makes replicas of 4 ranks, which would span nodes of 2 ranks each"),
    (["--world-size", "2", "--data-parallel", "0"], "argument --data-parallel: must be"),
    (["--world-size", "2", "--data-parallel", "2", "--offload", "cpu"], "--offload runs the model in one process"),
])
def test_bad_data_parallel_settings_are_one_line(tiny_model_folder, capsys, arguments, message):
    folder = tiny_model_folder("llama")
    capsys.readouterr()  # what building the model printed, when this test builds it first
    status = main(["run", "--device", "cpu", "--model", str(folder), "--prompt", "Hello", *arguments])
    assert status == 2
    error = capsys.readouterr().err
    assert error.startswith("accelgen: error: ") and message in error
    assert error.count("\n") == 1
