"""A group worker: one rank of a colocation group, holding every role the plan put on that group.

Roles that share a group share this process, so a field one of them produces (``responses``) is
read by the next (``ref_logprobs``) without leaving the process. The same class runs in-process
(local executor) and as a Ray actor; Ray calls go through the ``*_wire`` methods, which take and
return numpy so the object store never pickles torch tensors.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridflow.graph import SAMPLE_IMAGES_OPTION, Node, Op
from hybridflow.models.vision import IMAGE_GRID_THW, PIXEL_VALUES
from hybridflow.planner import RoleLayout, rollout_role
from hybridflow.registry import LOSSES
from hybridflow.runtime.agent_rollout import agent_generate, role_tokenizer
from hybridflow.runtime.batch import Batch, Wire
from hybridflow.runtime.engines import build_engines
from hybridflow.runtime.host_memory import keep_freed_host_memory
from hybridflow.runtime.loss_mask import with_loss_mask
from hybridflow.runtime.protocols import Collective, RoleSpec, SamplingParams, WorkerContext, capabilities_of
from hybridflow.runtime.step_store import Join, RankStore
from hybridflow.runtime.weights import (
    AdapterShipment,
    Shipment,
    adapter_weights,
    full_weights,
    state_from_wire,
    state_to_wire,
    wire_bytes,
)

# The prompt's attention mask travels with ``prompts`` wherever they go (it is not a graph field).
COMPANIONS = {"prompts": "prompt_mask"}
IMAGE_FIELDS = (PIXEL_VALUES, IMAGE_GRID_THW)  # a row's image inputs (hybridflow.data.vision_prompts)


def prompt_mask_field(prompts: str) -> str:
    """The mask field beside a left-padded prompt field: ``prompt_mask`` for the dataset's ``prompts``,
    ``<field>_mask`` for prompts a compute node writes (an LLM judge's ``judge_prompts``)."""
    return COMPANIONS.get(prompts, f"{prompts}_mask")


def companion_fields(node: Node) -> list[str]:
    """The companions a worker node reads with its inputs: the mask of the field bound to its ``prompts`` port
    (and ``prompt_mask`` wherever it reads ``prompts``), and the dataset prompts' images (a vision-language
    policy's ``pixel_values`` / ``image_grid_thw``) wherever it reads those prompts: every role that reads a
    sample sees its images (so does a node with :data:`~hybridflow.graph.SAMPLE_IMAGES_OPTION`: an LLM judge's
    generate, whose rendered prompts keep the samples' image placeholders). A node absent from a batch without images
    reads none (callers select non-strictly)."""
    bound = node.port_inputs().get("prompts")
    masks = [prompt_mask_field(bound)] if bound is not None else []
    images = list(IMAGE_FIELDS) if "prompts" in node.inputs or node.option(SAMPLE_IMAGES_OPTION) is True else []
    return [*masks, *(mask for field_name, mask in COMPANIONS.items()
                      if field_name in node.inputs and mask not in masks), *images]


_SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "greedy", "logprobs")


@dataclass(frozen=True, kw_only=True)
class NodeResult:
    """What a rank returns for one node: its output rows (graph field names) and scalar metrics."""

    outputs: Batch
    metrics: Mapping[str, float] = field(default_factory=dict)
    seconds: float = 0.0


class SoloCollective:
    """The collective of a group of one rank: nothing to average."""

    rank, world_size = 0, 1

    def all_reduce_mean(self, tensors: list[Any]) -> None:
        return None

    def all_gather_object(self, value: Any) -> list[Any]:
        return [value]


def torch_device(device: str) -> str:
    """The torch device for a plan's device name, resolved in the worker's own process.

    Plans name GPU types (``"A100-80G:0"``, ``"T4:1"``); where this process sees no CUDA device they
    are logical GPUs and the rank runs on the CPU. ``cpu``/``cuda...`` strings pass through.
    """
    kind, _, index = device.partition(":")
    if kind in ("cpu", "cuda") or not kind:
        return device or "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(index or 0) % torch.cuda.device_count()}"


class GroupWorker:
    """One rank of a worker group. Build engines with :meth:`setup`, run nodes with :meth:`run`."""

    def __init__(self, *, group: int, rank: int, world_size: int, device: str, specs: Sequence[RoleSpec],
                 layouts: Sequence[RoleLayout], collective: Collective | None = None) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.device = torch_device(device)
        self.specs = {spec.name: spec for spec in specs}
        self.layouts = {layout.role: layout for layout in layouts}
        self.collective: Collective = collective or SoloCollective()
        self.engines: dict[str, Any] = {}  # role -> Engine with the capabilities its ops need
        self.store = RankStore(f"group {group} rank {rank}")

    def init_collective(self, address: str, port: int) -> None:
        """Join the group's gloo process group (Ray executor; one process per rank)."""
        import datetime

        import torch.distributed as dist

        from hybridflow.runtime.collective import ProcessGroupCollective

        if self.world_size > 1 and not dist.is_initialized():
            # A short timeout: a dead peer must surface as an error, not a 30-minute hang.
            dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=self.rank,
                                    world_size=self.world_size, timeout=datetime.timedelta(seconds=60))
            self.collective = ProcessGroupCollective(rank=self.rank, world_size=self.world_size)

    def rendezvous_address(self) -> tuple[str, int]:
        """An address and a free port on this host for the group's process group (asked of rank 0)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return _node_ip(), port

    def setup(self) -> None:
        """Build every role's engine with the backend and the rollout engine its spec names. A CPU rank first makes
        malloc keep what it frees (:mod:`hybridflow.runtime.host_memory`)."""
        if self.device == "cpu":
            keep_freed_host_memory()
        context = WorkerContext(group=self.group, rank=self.rank, world_size=self.world_size, device=self.device,
                                collective=self.collective)
        build_engines(self.specs, self.layouts, context, into=self.engines)

    def capabilities(self) -> dict[str, list[str]]:
        """The capability protocols each role's engine satisfies (the controller checks them against the graph)."""
        return {name: sorted(capabilities_of(engine)) for name, engine in self.engines.items()}

    def info(self) -> dict[str, Any]:
        """Where this rank runs: pid, host, Ray node id and GPU ids (when under Ray), and what each role's engine
        runs of its layout (``executed_layout``, where the engine reports it)."""
        data: dict[str, Any] = {"group": self.group, "rank": self.rank, "pid": os.getpid(),
                                "host": socket.gethostname(), "roles": sorted(self.specs),
                                "layouts": {name: report() for name, engine in self.engines.items()
                                            if (report := getattr(engine, "executed_layout", None)) is not None}}
        try:
            import ray

            if ray.is_initialized():
                ctx = ray.get_runtime_context()
                data.update(node_id=ctx.get_node_id(), gpu_ids=[str(g) for g in ray.get_gpu_ids()],
                            placement_group=ctx.get_placement_group_id())
        except ImportError:
            pass
        return data

    def run(self, node: Node, batch: Batch, seed: int = 0, *, token: int | None = None,
            fields: Sequence[str] = (), part: int | None = None, joins: Sequence[Join] = ()) -> NodeResult:
        """Run ``node`` on this rank's rows. ``batch`` holds the node's inputs by graph field name.

        With a step ``token``, inputs named in ``fields`` but missing from ``batch`` come from what this
        rank kept earlier in the same step, and the inputs and outputs of this node are kept in turn
        (:class:`~hybridflow.runtime.step_store.RankStore`). Without one (a request of a subset of rows)
        nothing is read or kept. ``part``: the chunk partition the rows are (kept apart); ``joins``: fields
        of the step's rows to rebuild from this rank's chunk copies first.
        """
        start = time.perf_counter()
        role = self._engine_role(node)
        if role not in self.engines:
            raise KeyError(f"node {node.name!r}: role {node.role!r} is not on group {self.group}; "
                           f"roles here: {sorted(self.engines)}")
        dp = self.layouts[role].dp
        if token is not None:
            batch = self.store.inputs(batch, token=token, fields=fields, dp=dp, part=part, joins=joins)
        engine = self.engines[role]
        metrics: dict[str, float] = {}
        if node.op is Op.UPDATE:
            metrics = engine.train_step(batch, loss=LOSSES.get(str(node.loss)), options=node.options_dict)
            outputs = Batch()
        elif node.environment:
            outputs = run_agent_op(engine, node, batch, seed, model=self.specs[role].model, rank=self.rank,
                                   max_batch=self.layouts[role].rollout_batch_size)
        else:
            outputs = run_role_op(engine, node, batch, seed)
        if node.op is Op.GENERATE:
            metrics = rollout_metrics(engine)
        if token is not None:
            self.store.keep(outputs, dp, part)
        return NodeResult(outputs=outputs, metrics=metrics, seconds=time.perf_counter() - start)

    def _engine_role(self, node: Node) -> str:
        """The engine a node runs on here: a generate node of a policy may run on its detached rollout."""
        role = str(node.role)
        if node.op is Op.GENERATE and role not in self.engines and rollout_role(role) in self.engines:
            return rollout_role(role)
        return role

    def export_weights(self, role: str, dtype: str, adapter: bool = False,
                       trained_only: bool = False) -> Shipment | AdapterShipment | None:
        """``role``'s whole weights in ``dtype`` (with ``adapter``, its LoRA adapter alone; with ``trained_only``,
        without the weights that never train: :func:`~hybridflow.runtime.weights.full_weights`): rank 0 returns them
        packed, the other ranks only take part in the gathers (every rank of a sharded trainer must drain the
        stream together). A tied copy (``lm_head`` = embeddings) travels as its name only."""
        engine = self.engines[role]
        if adapter:
            tensors = adapter_weights(engine, dtype)
            if self.rank == 0:
                return AdapterShipment(tensors=state_to_wire(tensors), config=engine.adapter_config())
            for _ in tensors:
                pass
            return None
        aliases = dict(engine.tied_weights())
        named = full_weights(engine, dtype, trained_only=trained_only)
        if self.rank == 0:
            return state_to_wire((name, tensor) for name, tensor in named if name not in aliases), aliases
        for _ in named:
            pass
        return None

    def export_weights_parts(self, role: str, dtype: str, adapter: bool = False, trained_only: bool = False
                             ) -> tuple[int, Shipment | AdapterShipment | None]:
        """:meth:`export_weights` as (tensor count, weights): Ray returns the two as separate objects, so the
        controller can wait on the small one while the weights travel straight to the receivers."""
        shipment = self.export_weights(role, dtype, adapter, trained_only)
        if isinstance(shipment, AdapterShipment):
            return len(shipment.tensors), shipment
        return (len(shipment[0]) if shipment is not None else 0), shipment

    def import_weights(self, role: str, shipment: Shipment | AdapterShipment) -> dict[str, float]:
        """Load weights another group exported into ``role``'s engine (an adapter as its next version); returns
        what arrived."""
        start = time.perf_counter()
        if isinstance(shipment, AdapterShipment):
            self.engines[role].load_adapter(state_from_wire(shipment.tensors).items(), shipment.config)
            return {"bytes": float(wire_bytes(shipment.tensors)), "tensors": float(len(shipment.tensors)),
                    "seconds": time.perf_counter() - start}
        wire, aliases = shipment
        state = state_from_wire(wire)
        state.update({alias: state[name] for alias, name in aliases.items()})
        self.engines[role].load_weights(state.items())
        return {"bytes": float(wire_bytes(wire)), "tensors": float(len(wire)), "seconds": time.perf_counter() - start}

    def run_wire(self, node: Node, wire: Wire, seed: int = 0, *, token: int | None = None,
                 fields: Sequence[str] = (), part: int | None = None,
                 joins: Sequence[Join] = ()) -> tuple[Wire, dict[str, float], float]:
        result = self.run(node, Batch.from_wire(wire), seed, token=token, fields=fields, part=part, joins=joins)
        return result.outputs.to_wire(), dict(result.metrics), result.seconds

    def save_checkpoint(self, directory: str) -> None:
        for name, engine in self.engines.items():
            if self.specs[name].kind.trainable:
                engine.save_checkpoint(str(Path(directory) / name))

    def load_checkpoint(self, directory: str) -> None:
        for name, engine in self.engines.items():
            if self.specs[name].kind.trainable:
                engine.load_checkpoint(str(Path(directory) / name))

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        """Close every engine (each at most once), even when one of them fails; re-raise the first failure."""
        engines, self.engines = list(self.engines.values()), {}
        failure: BaseException | None = None
        for engine in engines:
            try:
                engine.close()
            except Exception as err:  # close the others first; the caller sees this one
                failure = failure or err
        if failure is not None:
            raise failure


WORKER_CALLS = frozenset({"setup", "capabilities", "info", "ping", "save_checkpoint", "load_checkpoint", "close",
                          "export_weights", "import_weights"})
"""The :class:`GroupWorker` methods a worker group calls on every rank (besides ``run``)."""


def port_batch(node: Node, batch: Batch) -> Batch:
    """The node's inputs renamed from graph fields to the op's ports (plus companion fields)."""
    ports = node.port_inputs()
    renamed = batch.select([*ports.values(), *companion_fields(node)], strict=False)
    bound = ports.get("prompts")
    masks = {prompt_mask_field(bound): "prompt_mask"} if bound is not None and bound != "prompts" else {}
    return renamed.rename({**{field_name: port for port, field_name in ports.items()}, **masks})


def run_role_op(engine: Any, node: Node, batch: Batch, seed: int) -> Batch:
    """Dispatch a non-update node to the engine method of its op; outputs renamed to graph fields."""
    inputs = port_batch(node, batch)
    if node.op is Op.GENERATE:
        options: dict[str, Any] = {k: v for k, v in node.options_dict.items() if k in _SAMPLING_KEYS}
        result = with_loss_mask(node, engine.generate(inputs, SamplingParams(**options, seed=seed)))
    elif node.op in (Op.LOGPROB, Op.REF_LOGPROB):
        return engine.log_probs(inputs).select(["logprobs"]).rename({"logprobs": node.outputs[0]})
    elif node.op is Op.VALUES:
        result = engine.values(inputs)
    elif node.op is Op.SCORE:
        result = engine.score(inputs)
    else:
        raise ValueError(f"node {node.name!r}: op {node.op} does not run on a role engine")
    ports = node.port_outputs()
    return result.select(ports).rename(ports)


def rollout_metrics(engine: Any) -> dict[str, float]:
    """A generate node's metrics from its rollout (itself, or a hybrid engine's ``rollout``) where it reports
    some (its ``rollout_metrics()``: the ``server`` rollout's replica restarts and retried requests)."""
    for owner in (engine, getattr(engine, "rollout", None)):
        take = getattr(owner, "rollout_metrics", None)
        if callable(take):
            return dict(take())
    return {}


def run_agent_op(engine: Any, node: Node, batch: Batch, seed: int, *, model: str, rank: int,
                 max_batch: int = 0) -> Batch:
    """A multi-turn generate node (``environment=``) on this rank's rows; outputs renamed to graph fields."""
    options: dict[str, Any] = {k: v for k, v in node.options_dict.items() if k in _SAMPLING_KEYS}
    tokenizer = role_tokenizer(model)
    config = _model_config(engine)
    eos = config.eos_token_id if config is not None else tokenizer.eos_token_id
    pad = getattr(config, "pad_token_id", None) if config is not None else tokenizer.pad_token_id
    result = agent_generate(engine, node, port_batch(node, batch), SamplingParams(**options, seed=seed),
                            tokenizer=tokenizer, eos_token_id=int(eos), pad_token_id=int(eos if pad is None else pad),
                            rank=rank, max_batch=max_batch)
    ports = node.port_outputs()
    return with_loss_mask(node, result).select(ports).rename(ports)


def _model_config(engine: Any) -> Any:
    """The HF config of the model an engine samples with (a hybrid engine's trainer holds it), if any."""
    for holder in (engine, getattr(engine, "trainer", None)):
        model = getattr(holder, "model", None)
        config = getattr(getattr(model, "module", model), "config", None)
        if config is not None:
            return config
    return None


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"
