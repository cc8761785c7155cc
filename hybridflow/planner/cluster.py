"""Clusters: machines of GPUs, each machine one device type, with the network between them.

``Cluster.parse("8xA100-80G")`` is one machine of eight; ``"2x8xH100"`` two machines of eight;
``"4xA100-80G+2xT4"`` two machines (one per ``+`` part). YAML lists nodes explicitly; a node with two
GPU types becomes two :class:`Machine` entries on the same host.

``host_cores`` is for logical GPUs that are processes on a CPU (tests, the CPU benchmarks): the cores each
host gives its logical GPUs. With more logical GPUs busy than cores, they share the cores (the schedule
slows every busy one alike: ``schedule.Sharing``). None, the default, gives every GPU its own compute.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.planner.devices import GB, DeviceSpec, device_from_mapping, get_device

DEFAULT_INTER_NODE_BANDWIDTH = 25 * GB  # one 200 Gb/s InfiniBand NIC per GPU, one direction
DEFAULT_DRIVER_BANDWIDTH = 10 * GB  # controller <-> worker data path (host memory and NIC)
# The planner keeps per-GPU tables (owners, placements), so a cluster's size is checked before any is built;
# this is above the largest clusters trained on today and far below what would exhaust a driver's memory.
MAX_CLUSTER_GPUS = 1 << 17

_PART = re.compile(r"^(?:(\d+)\s*[xX*]\s*)?(?:(\d+)\s*[xX*]\s*)?([A-Za-z][A-Za-z0-9.\-]*)$")


@dataclass(frozen=True, kw_only=True)
class Machine:
    """GPUs of one type on one host. ``first_gpu`` is the global id of its first GPU."""

    host: int
    device: DeviceSpec
    gpus: int
    first_gpu: int

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"machine {self.host} ({self.device.name}): gpus={self.gpus} must be >= 1")

    @property
    def gpu_ids(self) -> range:
        return range(self.first_gpu, self.first_gpu + self.gpus)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Machines in order; GPU ids run 0.. across them. Bandwidths are bytes/s per GPU, one direction."""

    machines: tuple[Machine, ...]
    inter_node_bandwidth: float = DEFAULT_INTER_NODE_BANDWIDTH
    driver_bandwidth: float = DEFAULT_DRIVER_BANDWIDTH
    spec: str = ""
    host_cores: int | None = None  # cores each host gives its logical GPUs (CPU runs); None: no sharing
    _gpu_machine: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _num_gpus: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.machines:
            raise ValueError("Cluster: needs at least one machine")
        check_cluster_size(sum(machine.gpus for machine in self.machines), where="Cluster")
        expected = 0
        for machine in self.machines:
            if machine.first_gpu != expected:
                raise ValueError(f"Cluster: machine {machine.host} starts at GPU {machine.first_gpu}, expected "
                                 f"{expected}; build clusters with Cluster.of or Cluster.parse")
            expected += machine.gpus
        if self.inter_node_bandwidth <= 0 or self.driver_bandwidth <= 0:
            raise ValueError("Cluster: inter_node_bandwidth and driver_bandwidth must be positive")
        if self.host_cores is not None and (isinstance(self.host_cores, bool) or not isinstance(self.host_cores, int)
                                            or self.host_cores < 1):
            raise ValueError(f"Cluster: host_cores={self.host_cores!r} must be a positive integer (the cores each "
                             "host gives its logical GPUs) or None (every GPU computes on its own)")
        owner = tuple(index for index, machine in enumerate(self.machines) for _ in range(machine.gpus))
        object.__setattr__(self, "_gpu_machine", owner)
        object.__setattr__(self, "_num_gpus", len(owner))

    @classmethod
    def of(cls, parts: list[tuple[int, str, int]] | list[tuple[int, DeviceSpec, int]], *,
           inter_node_bandwidth: float = DEFAULT_INTER_NODE_BANDWIDTH,
           driver_bandwidth: float = DEFAULT_DRIVER_BANDWIDTH, spec: str = "",
           devices: Mapping[str, DeviceSpec] | None = None, host_cores: int | None = None) -> Cluster:
        """Machines from ``(host, device, gpus)`` triples, numbered in order; ``devices`` adds user devices."""
        machines, first = [], 0
        for host, device, gpus in parts:
            spec_device = get_device(device, devices) if isinstance(device, str) else device
            machines.append(Machine(host=host, device=spec_device, gpus=gpus, first_gpu=first))
            first += gpus
        return cls(machines=tuple(machines), inter_node_bandwidth=inter_node_bandwidth,
                   driver_bandwidth=driver_bandwidth, spec=spec, host_cores=host_cores)

    @classmethod
    def parse(cls, spec: str, *, devices: Mapping[str, DeviceSpec] | None = None,
              inter_node_bandwidth: float = DEFAULT_INTER_NODE_BANDWIDTH, host_cores: int | None = None) -> Cluster:
        """``8xA100-80G``, ``2x8xH100``, ``4xA100-80G+2xT4`` (each ``+`` part is its own machine).

        ``devices`` are user-defined devices the spec may name; ``inter_node_bandwidth`` is bytes/s per GPU;
        ``host_cores`` the cores each host gives its logical GPUs (module docstring).
        """
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"cluster spec {spec!r} is empty; write e.g. 8xA100-80G or 2x8xH100")
        parts: list[tuple[int, str, int]] = []
        total = 0
        for text in spec.split("+"):
            match = _PART.match(text.strip())
            if not match:
                raise ValueError(f"cluster spec part {text.strip()!r} of {spec!r} is malformed; write "
                                 "[MACHINES x ]GPUS x DEVICE, e.g. 8xA100-80G or 2x8xH100")
            first, second, device = match.groups()
            machines, gpus = (int(first), int(second)) if second else (1, int(first or 1))
            if machines < 1 or gpus < 1:
                raise ValueError(f"cluster spec part {text.strip()!r}: machine and GPU counts must be >= 1")
            total += machines * gpus
            check_cluster_size(total, where=f"cluster spec {spec.strip()!r}")
            get_device(device, devices)
            parts.extend((len(parts), device, gpus) for _ in range(machines))
        if not inter_node_bandwidth > 0:
            raise ValueError(f"inter-node bandwidth {inter_node_bandwidth!r} must be positive (bytes/s per GPU)")
        return cls.of(parts, spec=spec.strip(), devices=devices, inter_node_bandwidth=inter_node_bandwidth,
                      host_cores=host_cores)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Cluster:
        """Nodes from YAML: ``nodes: [{type: A100-80G, gpus: 8, count: 2}, {gpus: {A100-80G: 4, T4: 2}}]``."""
        from hybridflow.files import read_yaml

        data = read_yaml(path, what="cluster file")
        if not isinstance(data, Mapping) or not isinstance(data.get("nodes"), list) or not data["nodes"]:
            raise ValueError(f"{path}: expected a mapping with a non-empty 'nodes' list")
        return cls.from_dict(data, name=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, name: str = "cluster") -> Cluster:
        """Nodes as in :meth:`from_yaml`; an optional ``devices:`` list defines devices the nodes may name, and
        ``host_cores:`` the cores each host gives its logical GPUs (CPU runs)."""
        devices = user_devices(data.get("devices"), where=f"{name}: devices")
        parts: list[tuple[int, str, int]] = []
        host = total = 0
        for index, node in enumerate(data["nodes"]):
            count = node.get("count", 1) if isinstance(node, Mapping) else None
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"{name}: nodes[{index}] must be a mapping whose 'count' (default 1) is a positive "
                                 f"integer; got {node!r}")
            total += count  # each node has a GPU at least: the GPUs are bounded before any node is listed
            check_cluster_size(total, where=f"{name}: nodes[{index}] count={count}")
            for _ in range(count):
                gpus = node.get("gpus")
                kinds = gpus.items() if isinstance(gpus, Mapping) else [(node.get("type"), gpus)]
                for device, count in kinds:
                    if not isinstance(device, str) or not isinstance(count, int) or count < 1:
                        raise ValueError(f"{name}: nodes[{index}] needs 'type' and a positive integer 'gpus' "
                                         f"(or gpus: {{TYPE: COUNT}}); got type={device!r} gpus={count!r}")
                    parts.append((host, device, count))
                host += 1
        for key in ("inter_node_bandwidth_gbs", "driver_bandwidth_gbs"):
            value = data.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name}: {key}={value!r} must be a positive number of GB/s per GPU")
        inter = float(data.get("inter_node_bandwidth_gbs", DEFAULT_INTER_NODE_BANDWIDTH / GB)) * GB
        driver = float(data.get("driver_bandwidth_gbs", DEFAULT_DRIVER_BANDWIDTH / GB)) * GB
        return cls.of(parts, inter_node_bandwidth=inter, driver_bandwidth=driver, spec=name, devices=devices,
                      host_cores=data.get("host_cores"))

    @property
    def num_gpus(self) -> int:
        return self._num_gpus

    @property
    def device_names(self) -> tuple[str, ...]:
        """Device types present, in order of first appearance."""
        return tuple(dict.fromkeys(machine.device.name for machine in self.machines))

    def device(self, name: str) -> DeviceSpec:
        for machine in self.machines:
            if machine.device.name == name:
                return machine.device
        raise KeyError(f"cluster has no {name}; it has {list(self.device_names)}")

    def machine_of(self, gpu: int) -> Machine:
        if not 0 <= gpu < self.num_gpus:
            raise IndexError(f"GPU {gpu} does not exist; the cluster has GPUs 0-{self.num_gpus - 1}")
        return self.machines[self._gpu_machine[gpu]]

    def machine_index(self, gpu: int) -> int:
        self.machine_of(gpu)
        return self._gpu_machine[gpu]

    def shared_hosts(self) -> dict[int, int]:
        """Hosts whose logical GPUs outnumber ``host_cores``: host -> cores (empty when none share)."""
        if self.host_cores is None:
            return {}
        gpus: dict[int, int] = {}
        for machine in self.machines:
            gpus[machine.host] = gpus.get(machine.host, 0) + machine.gpus
        return {host: self.host_cores for host, count in gpus.items() if count > self.host_cores}

    def __iter__(self) -> Iterator[Machine]:
        return iter(self.machines)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for machine in self.machines:
            counts[machine.device.name] = counts.get(machine.device.name, 0) + machine.gpus
        hosts = len({machine.host for machine in self.machines})
        cores = f", {self.host_cores} core(s) per host" if self.host_cores is not None else ""
        return " + ".join(f"{n}x{name}" for name, n in counts.items()) + f" on {hosts} machine(s){cores}"


def check_cluster_size(gpus: int, *, where: str) -> None:
    """Refuse a cluster of more than :data:`MAX_CLUSTER_GPUS` GPUs before anything per GPU is built."""
    if gpus > MAX_CLUSTER_GPUS:
        raise ValueError(f"{where}: {gpus} GPUs exceed the planner's bound of {MAX_CLUSTER_GPUS} GPUs; plan a "
                         "smaller cluster (the plan of one replica, e.g. 64xH100, scales by data parallelism)")


def user_devices(entries: Any, *, where: str = "devices") -> dict[str, DeviceSpec]:
    """User-defined devices from a list of mappings (cluster YAML ``devices:``), by name."""
    if entries is None:
        return {}
    if not isinstance(entries, list):
        raise ValueError(f"{where} must be a list of mappings such as "
                         "[{name: H20X, memory_gb: 96, bf16_tflops: 148, hbm_gbs: 4000, link_gbs: 450}]")
    found: dict[str, DeviceSpec] = {}
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}[{index}] must be a mapping of device keys, got {entry!r}")
        device = device_from_mapping(entry, where=f"{where}[{index}]")
        found[device.name] = device
    return found
