"""The nodes of a multi-node job meeting before torch's agent starts, saying what they wait for while they wait.

torch's agent meets the other nodes inside one C++ store call that blocks for up to ten minutes: nothing is said,
and SIGINT / SIGTERM wait until the call returns. So every node meets the others first, here, in Python and in
calls of well under a second each, where a signal is handled at once: node 0 opens the job's store on
``--master-port`` (a multi-tenant TCPStore: the agent's own store, opened later in this process on the same port,
is the same server), each node writes its key there, and each waits until every node's key is there. Within a
few seconds a waiting node says which nodes it waits for, at which address and port, again every
:data:`REPEAT_SECONDS` and when that changes; after ``--node-wait`` seconds it gives up in one line naming the nodes that never came.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from accelgen.common.settings import LaunchPlan

#: Seconds of waiting before the first line: nodes started together meet in less, and say nothing.
FIRST_LINE_SECONDS = 1.0
#: Seconds between the lines of a wait that goes on.
REPEAT_SECONDS = 30.0
#: Seconds between two looks at the store (or at node 0's port).
POLL_SECONDS = 0.2
#: Seconds a single store call may take before node 0 counts as gone.
STORE_CALL_SECONDS = 30


class NodesMissing(Exception):
    """The wait for the other nodes ended without them; the message is the job's last line, ``status`` the job's
    exit status: 2 when ``--node-wait`` ran out (a limit the user set, as for any refusal of a command), 1 when node 0
    went away during the wait (a failure of the job)."""

    def __init__(self, line: str, status: int = 1):
        super().__init__(line)
        self.status = status


def _node_key(node_rank: int) -> str:
    return f"accelgen/nodes/{node_rank}"


class NodeMeeting:
    """Around torch's agent on one node of a job over ``plan.nnodes`` nodes (nothing to do on one node): on entry,
    wait in Python until every node has come (:meth:`__enter__` raises :class:`NodesMissing` when they do not come
    in ``plan.node_wait`` seconds, or node 0 goes away); node 0's store stays open until the block ends, for the
    agent to share. :attr:`met` tells whether the wait was over when a signal ended the job."""

    def __init__(self, plan: LaunchPlan, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.plan, self.say, self.clock = plan, say, clock
        self.met = plan.nnodes == 1
        self._store = None
        self._missing: list[int] = []

    @property
    def where(self) -> str:
        return f"{self.plan.master_addr}:{self.plan.master_port}"

    def __enter__(self) -> NodeMeeting:
        if not self.met:
            self._wait()
            self.met = True
        return self

    def __exit__(self, *exception) -> None:
        self._store = None  # node 0's server closes with the agent's store, the last to hold it

    def waiting_for(self) -> str:
        """What the wait waits for, in words (for a line saying why it ended)."""
        if self._store is None and self.plan.node_rank != 0:
            return f"node 0 at {self.where}"
        return f"{_nodes(self._missing)} to join at {self.where}"

    def _wait(self) -> None:
        started = self.clock()
        next_line, said = started + FIRST_LINE_SECONDS, None
        self._missing = [0] if self.plan.node_rank else []
        while True:
            if self._store is None:
                self._store = self._open_store()
                if self._store is not None:
                    self._call(self._store.set, _node_key(self.plan.node_rank), "here")
            if self._store is not None:
                self._missing = [node for node in range(self.plan.nnodes)
                                 if not self._call(self._store.check, [_node_key(node)])]
                if not self._missing:
                    return
            now = self.clock()
            waited = now - started
            if waited >= self.plan.node_wait:
                raise NodesMissing(self._never_came(waited), status=2)
            what = self.waiting_for()
            if now >= next_line or (said is not None and what != said):  # in time, or at once when it changed
                self.say(f"waiting for {what} ({waited:.0f} s so far; this node gives up after {self.plan.node_wait} s: "
                         f"--node-wait)")
                next_line, said = now + REPEAT_SECONDS, what
            time.sleep(POLL_SECONDS)

    def _open_store(self):
        """Node 0: the job's store, listening now. Another node: a client of it once node 0 listens, else None."""
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=STORE_CALL_SECONDS)
        if self.plan.node_rank == 0:
            return TCPStore(self.plan.master_addr, self.plan.master_port, None, True, timeout,
                            wait_for_workers=False, multi_tenant=True)
        if not _listening(self.plan.master_addr, self.plan.master_port):
            return None  # asked in Python: torch's client would retry inside C++, and log each failure
        return TCPStore(self.plan.master_addr, self.plan.master_port, None, False, timeout, wait_for_workers=False)

    def _call(self, method, *arguments):
        from torch.distributed import DistError

        try:
            return method(*arguments)
        except DistError:
            raise NodesMissing(f"node 0 at {self.where} went away while this node waited for the others: start the "
                               f"job again on every node.") from None

    def _never_came(self, waited: float) -> str:
        if self._store is None:
            return (f"node 0 never listened at {self.where} in {waited:.0f} s: start accelgen there with --node-rank 0 "
                    f"and the same command, check that --master-addr and --master-port reach it from this node, or "
                    f"wait longer with --node-wait SECONDS.")
        ranks = ", ".join(str(node) for node in self._missing)
        return (f"{_nodes(self._missing)} never joined at {self.where} in {waited:.0f} s: start accelgen there with "
                f"the same command and --node-rank {ranks}, or wait longer with --node-wait SECONDS.")


def _nodes(ranks: list[int]) -> str:
    listed = ", ".join(str(rank) for rank in ranks)
    return f"node{'s' if len(ranks) > 1 else ''} {listed}"


def _listening(address: str, port: int) -> bool:
    """Whether something accepts connections at ``address:port`` (asked in at most a second)."""
    try:
        with socket.create_connection((address, port), timeout=1.0):
            return True
    except OSError:
        return False
