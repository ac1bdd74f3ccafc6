"""Nodes of a multi-node job waiting for each other (here all on localhost, one process per node): a node says what
it waits for, stops at once on SIGTERM / SIGINT during the wait, and gives up after --node-wait naming the nodes
that never came."""

import signal
import subprocess
import sys

import pytest
from stderr_lines import StderrLines

from accelgen.parallel.launcher import free_port

pytest.importorskip("deepspeed")

#: Generous bounds for a loaded machine: the test waits at most this long for a line or an end, it times nothing.
DEADLINE = 120


class Node:
    """``accelgen run`` as node ``node_rank`` of a job of ``nnodes`` nodes (one rank each) meeting at ``port``."""

    def __init__(self, environment, port: int, nnodes: int, node_rank: int, *more: str):
        self.where = f"127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", str(nnodes), "--nnodes",
             str(nnodes), "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--prompt", "Hello", "--max-new-tokens", "2", *more],
            env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.stderr = StderrLines(self.process)

    def wait_for_line(self, text: str) -> str:
        return self.stderr.wait_for(text, DEADLINE, while_running=True).strip()

    def end(self) -> tuple[int, list[str]]:
        """Its exit status and its lines."""
        status = self.process.wait(timeout=DEADLINE)
        return status, [line.strip() for line in self.stderr.text().splitlines() if line.startswith("accelgen:")]

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
def start_node(job_environment):
    """``start_node(port, nnodes, node_rank, *more)``: a Node, killed after the test if still running."""
    nodes = []

    def start(*arguments):
        nodes.append(Node(job_environment, *arguments))
        return nodes[-1]

    yield start
    for node in nodes:
        node.kill()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_node_0_says_which_node_it_waits_for_and_stops_at_once_on_a_signal(start_node, stop):
    node = start_node(free_port(), 2, 0)
    line = node.wait_for_line("waiting for")
    assert line.startswith(f"accelgen: waiting for node 1 to join at {node.where} (1 s so far; this node gives up "
                           f"after 600 s: --node-wait)"), line
    node.process.send_signal(stop)
    status, lines = node.end()
    ended = "interrupted" if stop == signal.SIGINT else "stopped"
    assert (status, lines[-1]) == (128 + stop, f"accelgen: {ended} ({stop.name}) while waiting for node 1 to join at "
                                               f"{node.where}")


def test_a_node_without_node_0_names_its_address_and_gives_up_after_node_wait(start_node):
    node = start_node(free_port(), 2, 1, "--node-wait", "3")
    assert node.wait_for_line("waiting for") == (f"accelgen: waiting for node 0 at {node.where} (1 s so far; this node "
                                                 f"gives up after 3 s: --node-wait)")
    status, lines = node.end()
    assert status == 2  # --node-wait is a limit the user set: its end is said as a refusal is
    assert lines[-1].startswith(f"accelgen: error: node 0 never listened at {node.where} in 3 s: start accelgen there "
                                f"with --node-rank 0 and the same command"), lines


def test_nodes_that_came_name_the_one_that_never_did_and_node_0_gone_is_said(start_node):
    """Of 3 nodes, node 1 comes first and waits for node 0; node 0 comes and both wait for node 2, which never comes:
    node 0 gives up naming it, and node 1 then says node 0 went away."""
    port = free_port()
    second = start_node(port, 3, 1, "--node-wait", "600", "--data-parallel", "3")
    second.wait_for_line(f"waiting for node 0 at 127.0.0.1:{port}")
    first = start_node(port, 3, 0, "--node-wait", "5", "--data-parallel", "3")  # node 1 looks for it five times a second: it finds it in time
    assert second.wait_for_line("waiting for node 2").startswith(f"accelgen: waiting for node 2 to join at {second.where}")
    status, lines = first.end()
    assert status == 2
    assert lines[-1] == (f"accelgen: error: node 2 never joined at {first.where} in 5 s: start accelgen there with the "
                         f"same command and --node-rank 2, or wait longer with --node-wait SECONDS."), lines
    status, lines = second.end()
    assert (status, lines[-1]) == (1, f"accelgen: error: node 0 at {second.where} went away while this node waited for "
                                      f"the others: start the job again on every node."), lines
