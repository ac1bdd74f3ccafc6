"""Joining a Ray cluster for a job, and what each replica asks of it: Ray imported, connected to, and its nodes
checked against a replica's resources before any replica is placed."""

from __future__ import annotations

import dataclasses
import logging
import socket

from accelgen.common.errors import UsageError

#: Seconds a head's address may take to answer a connection before the job says it is not there.
REACH_SECONDS = 5.0
#: How to have Ray Data (never ``ray[llm]``, which pulls vLLM and its own torch).
INSTALL = 'pip install "accelgen[ray]"'


def import_ray():
    """The ``ray`` module, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError(f"--ray runs the replicas on a Ray cluster, and Ray is not installed: {INSTALL}") from None
    return ray


@dataclasses.dataclass(frozen=True)
class ReplicaResources:
    """What one replica asks of the cluster, as Ray says it: ``num_cpus``, ``num_gpus`` and custom ``resources``
    (``{"NAME": n}``), for all of its ranks together (they run on one node)."""

    num_cpus: float = 0
    num_gpus: float = 0
    resources: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, asked: dict, ranks: int = 1) -> "ReplicaResources":
        """``ranks`` times what one rank asks (``asked``: Ray's keywords), checked."""
        unknown = set(asked) - {"num_cpus", "num_gpus", "resources"}
        if unknown:
            raise UsageError(f"a replica's resources are said as Ray says them (num_cpus, num_gpus, resources), not "
                             f"{', '.join(sorted(unknown))}: e.g. {{\"num_gpus\": 1}} or {{\"resources\": {{\"NAME\": 1}}}}.")
        custom = asked.get("resources") or {}
        numbers = {"num_cpus": asked.get("num_cpus", 0), "num_gpus": asked.get("num_gpus", 0), **custom}
        for name, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise UsageError(f"a replica's {name} must be a number of 0 or more, not {value!r}.")
        return cls(numbers["num_cpus"] * ranks, numbers["num_gpus"] * ranks,
                   {name: value * ranks for name, value in custom.items()})

    def options(self) -> dict:
        """The keywords of ``ray.remote(...).options`` that ask for them."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, **({"resources": self.resources} if self.resources else {})}

    def needs(self) -> dict[str, float]:
        """Each resource asked, by Ray's name for it in a node's resources (``CPU``, ``GPU``, custom ones)."""
        return {name: value for name, value in {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}.items() if value}

    def describe(self) -> str:
        return ", ".join(f"{value:g} {name}" for name, value in self.needs().items()) or "nothing"

    def fits(self, node_resources: dict[str, float]) -> bool:
        return all(node_resources.get(name, 0) >= value for name, value in self.needs().items())


def connect(address: str | None):
    """Connect this process to the cluster at ``address`` (None: ``RAY_ADDRESS``, or the cluster ``ray start`` began
    on this machine, or else a new one on this machine; ``auto``: an existing one only; ``local``: a new one on this
    machine), Ray's own log lines kept back. Returns the ``ray`` module."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    _check_reachable(address)
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False,
                 configure_logging=True)
    except ConnectionError as error:
        where = f"at {address!r}" if address not in (None, "auto") else "on this machine (nor in RAY_ADDRESS)"
        raise UsageError(f"no Ray cluster {where}: start one with `ray start --head` (and `ray start --address HEAD:6379` "
                         f"on the other nodes), or pass --ray local for one on this machine ({_first_line(error)}).") from None
    except (ValueError, RuntimeError) as error:
        raise UsageError(f"--ray {address or ''}: {_first_line(error)}".replace("--ray : ", "--ray: ")) from None
    return ray


def _check_reachable(address: str | None) -> None:
    """Refuse at once a head's ``HOST:PORT`` that takes no connection (Ray would try it again for minutes)."""
    if address in (None, "auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=REACH_SECONDS).close()
    except ValueError:
        raise UsageError(f"--ray {address!r} is not a head's address: give HOST:PORT (the port `ray start --head` "
                         f"printed, 6379 by default), or ray://HOST:PORT.") from None
    except OSError as error:
        raise UsageError(f"no Ray cluster at {address!r} ({error.strerror or error}): start one there with `ray start "
                         f"--head`, or check the address and port.") from None


def check_fits(ray, resources: ReplicaResources) -> list[dict]:
    """The cluster's live nodes, once one is found that can hold a replica; else one line saying what they hold."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if not any(resources.fits(node.get("Resources", {})) for node in nodes):
        held = "; ".join(f"{node.get('NodeManagerAddress')}: {_resources_line(node.get('Resources', {}))}" for node in nodes)
        raise UsageError(f"no node of the Ray cluster has what a replica asks ({resources.describe()}): its nodes hold "
                         f"{held}. Ask for less with --replica-resources (e.g. '{{\"num_cpus\": 1}}'), or add a node "
                         f"that has it.")
    return nodes


def cluster_device(ray, plugin_manager, device: str) -> str:
    """``device``, or for ``auto`` the first device (by its plugin's priority) one rank of which some live node of the
    cluster can hold (``Accelerator.cluster_resources``): the machine driving the job need not have it."""
    from accelgen.plugin.registry import AUTO_DEVICE, registered_accelerators

    if device != AUTO_DEVICE:
        return device
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    for name, accelerator in registered_accelerators(plugin_manager).items():
        if any(ReplicaResources.of(accelerator.cluster_resources()).fits(node.get("Resources", {})) for node in nodes):
            return name
    raise UsageError(f"no device's rank fits a node of the Ray cluster ({cluster_line(nodes)}): pass --device, and "
                     f"--replica-resources saying what its replicas ask.")


def cluster_line(nodes: list[dict]) -> str:
    """The cluster in a few words: its nodes and what they hold together."""
    total: dict[str, float] = {}
    for node in nodes:
        for name, value in node.get("Resources", {}).items():
            total[name] = total.get(name, 0) + value
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} ({_resources_line(total)})"


def _resources_line(resources: dict[str, float]) -> str:
    shown = {name: value for name, value in resources.items()
             if value and not name.startswith("node:") and name not in ("memory", "object_store_memory")
             and not name.startswith("accelerator_type:")}
    return ", ".join(f"{value:g} {name}" for name, value in sorted(shown.items())) or "nothing"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
