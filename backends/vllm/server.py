"""The ``server`` rollout: a policy generating through N vLLM OpenAI-server replicas behind a router.

hybridflow starts the replicas itself (``python -m vllm.entrypoints.openai.api_server``, one process group
each, loopback, :class:`~hybridflow.runtime.servers.ServerFleet`) and ``vllm-router`` in front. ``generate``
sends one ``/v1/completions`` request per row, token ids in and token ids with their raw-logit log-probs out
(``--logprobs-mode raw_logprobs``, the trainer's definition), each row seeded ``base + i`` as the in-process
``vllm`` rollout does and keyed by its prompt (``X-Session-ID``: the samples of one prompt share a replica and
its prefix cache; an agent trajectory's turns by the trajectory's key). New weights are written once as a
safetensors snapshot (``/dev/shm`` where it exists) and each replica, paused (``/pause?mode=wait``), reloads it
through the dev-mode ``/collective_rpc`` (``reload_weights(weights_path=...)``), empties its prefix cache and
resumes. Every rank of the role runs a fleet of its own.

A replica that dies mid-step costs retries (the router's and the client's), not the step: before and after each
generate call the fleet restarts dead replicas, reloads the last weights snapshot into each before the router
admits it, and the generate node's metrics count it (``rollout/replica_restarts``, ``rollout/requests_retried``:
totals since this rank's fleet started). Every replica dead: one error naming each and its log. A replica that
fails a weight sync is restarted and synced again (the others keep the new weights); a router that exits is
restarted once (the requests of a generate call or of agent turns it broke are sent again; a weight sync goes to
each replica, not through it), a second exit is one error naming its log.

Every response carries the version of the weights that generated it (``policy_version`` per row of ``generate``,
``TurnResult.version`` per turn): the number of weight syncs this fleet has taken, which every replica the router
reaches holds (:meth:`~hybridflow.runtime.servers.ServerFleet.serving_version`). A row whose prompt plus
``max_new_tokens`` exceeds the servers' ``max_model_len`` is refused before it is sent (vLLM would silently cut
its budget to what fits).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from hybridflow.backends.common.hybrid import HybridEngine
from hybridflow.backends.vllm.engine import VllmBackend, VllmOptions, sample_seed
from hybridflow.backends.vllm.rollout import (
    VLLM_DTYPES,
    materialize_model,
    pack_responses,
    prompt_token_lists,
    sampling_knobs,
)
from hybridflow.backends.vllm.server_replica import (
    ContextLimit,
    check_vllm_server,
    gpu_env,
    reload_replica,
    served_model,
    server_command,
    server_env,
)
from hybridflow.backends.vllm.weights import write_adapter, write_snapshot

from hybridflow.agents.protocols import TurnRequest, TurnResult
from hybridflow.graph import RoleKind
from hybridflow.planner import LayoutSupport, RoleLayout
from hybridflow.planner.fleet import check_replicas
from hybridflow.planner.lora_costs import SYNC_MODES
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import (
    AdapterSpec,
    Engine,
    GenerateBatch,
    RoleSpec,
    SamplingParams,
    WorkerContext,
    parse_options,
)
from hybridflow.runtime.servers import (
    AttachedServer,
    Completion,
    CompletionRequest,
    CompletionsClient,
    FleetConfig,
    ServerFleet,
    ServerProcess,
    ServerRequestError,
)
from hybridflow.runtime.weights import WeightSyncStats

logger = logging.getLogger(__name__)

AFFINITY_TOKENS = 32  # the session key hashes this many leading token ids: a trajectory's prompt, usually


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """``roles.<policy>.rollout_options`` of ``rollout: server``; any other key is refused.

    ``replicas``: vLLM server processes per rank, behind one router; unset, the plan's (the rollout layout's
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
    alone (vLLM's runtime LoRA loading, ``/v1/load_lora_adapter``) or merged whole weights. The rest as the
    ``vllm`` rollout's."""

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

    @classmethod
    def parse(cls, options: Mapping[str, Any], role: str) -> ServerOptions:
        parsed = parse_options(cls, options, role=role, owner="server")
        if parsed.lora_sync is not None and parsed.lora_sync not in SYNC_MODES:
            raise ValueError(f"role {role!r}: server option lora_sync={parsed.lora_sync!r} must be one of "
                             f"{list(SYNC_MODES)} or unset")
        if parsed.rollout_dtype is not None and parsed.rollout_dtype not in VLLM_DTYPES:
            raise ValueError(f"role {role!r}: server option rollout_dtype={parsed.rollout_dtype!r} must be one of "
                             f"{sorted(VLLM_DTYPES)} or unset")
        if isinstance(parsed.threads, bool) or not isinstance(parsed.threads, int) or parsed.threads < 1:
            raise ValueError(f"role {role!r}: server option threads={parsed.threads!r} must be an integer >= 1")
        try:
            parsed.fleet()
        except ValueError as err:
            raise ValueError(f"role {role!r}: server option {err}") from err
        return parsed

    def takes_adapter(self, role: str, lora: AdapterSpec | None) -> bool:
        """Whether a policy training ``lora`` syncs its servers with the adapter alone (the ``vllm`` rollout's rule;
        attached servers, whose flags are their owner's, take merged weights unless ``lora_sync`` says adapter)."""
        if self.attach and self.lora_sync is None and lora is not None:
            return False
        return VllmOptions(lora_sync=self.lora_sync).takes_adapter(role, lora)

    def fleet(self) -> FleetConfig:
        return FleetConfig(replicas=1 if self.replicas is None else self.replicas, port_base=self.port_base,
                           start_timeout_s=self.start_timeout_s, router_policy=self.router_policy,
                           log_dir=self.log_dir, attach=tuple(self.attach))


class ServerTurns:
    """The ``generate_batch`` of a server rollout's turn session: each :class:`TurnRequest` one completions request.

    Its session key (``X-Session-ID``) is the request's own (the agent loop gives every turn of a trajectory its
    trajectory's key), so a trajectory's later turns reach the replica that cached its earlier ones; a request
    without one is keyed by the hash of its first ``AFFINITY_TOKENS`` token ids. ``complete`` sends them (the rollout's
    :meth:`ServerRollout.complete`: turns a lost router broke are sent again once it is back)."""

    accepts_concurrent_calls = True

    def __init__(self, complete: Callable[[Sequence[CompletionRequest]], list[Completion]], sampling: SamplingParams,
                 *, eos_id: int, version: int, limit: ContextLimit) -> None:
        self.complete, self.sampling, self.eos_id, self.version, self.limit = complete, sampling, eos_id, version, limit

    def __call__(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        for index, request in enumerate(requests):
            self.limit.check(index, len(request.token_ids), request.max_tokens, what="turn")
        done = self.complete([
            CompletionRequest(prompt=request.token_ids, max_tokens=request.max_tokens, seed=request.seed,
                              sampling=sampling_knobs(self.sampling),
                              session=request.session or session_key(request.token_ids))
            for request in requests])
        return [TurnResult.cut(c.token_ids, c.logprobs, eos=self.eos_id, version=self.version) for c in done]


def session_key(token_ids: Sequence[int]) -> str:
    """The router's session key (``X-Session-ID``) of a prompt or trajectory: a hash of its first token ids."""
    return hashlib.sha1(str(list(token_ids[:AFFINITY_TOKENS])).encode()).hexdigest()[:16]


class ServerRollout:
    """A fleet of vLLM servers as a rollout engine: a :class:`Generator` and :class:`WeightSink` (with
    ``lora_rank``, an :class:`AdapterSink`: the servers start with LoRA enabled and each sync replaces the adapter,
    named ``<role>-lora``, over the base they loaded once)."""

    def __init__(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext, options: ServerOptions, *,
                 lora_rank: int | None = None) -> None:
        if not options.attach:
            check_vllm_server()
        self.spec, self.rank, self.options = spec, context.rank, options
        self.model_dir, self._model_holder = materialize_model(spec.model, seed=spec.seed)
        config = json.loads((Path(self.model_dir) / "config.json").read_text())
        self.pad_id = int(config.get("pad_token_id") or 0)
        self.eos_id = int(config["eos_token_id"])
        self.weights_version = 0
        self.last_sync: WeightSyncStats | None = None
        self._sync_bytes = 0  # the last snapshot's files, headers included
        self.adapter = f"{spec.name}-lora" if lora_rank is not None else None
        shm = Path("/dev/shm")
        self._snapshot = Path(tempfile.mkdtemp(prefix="hybridflow-weights-", dir=shm if shm.is_dir() else None))
        command = server_command(model_dir=self.model_dir, name=spec.name, seed=spec.seed + context.rank,
                                 dtype=options.rollout_dtype or layout.dtype, options=options,
                                 max_num_seqs=layout.rollout_batch_size or None, lora_rank=lora_rank,
                                 tensor_parallel=layout.rollout_tp)
        try:
            self.fleet = ServerFleet(options.fleet(), command, env=server_env(options),
                                     replica_env=gpu_env(context.device, layout.rollout_tp))
        except BaseException:
            shutil.rmtree(self._snapshot, ignore_errors=True)
            raise
        try:
            model, max_model_len = served_model(self.fleet.endpoints[0].url)
        except BaseException:
            self.fleet.close()
            shutil.rmtree(self._snapshot, ignore_errors=True)
            raise
        self.limit = ContextLimit(spec.name, max_model_len)
        self.client = CompletionsClient(self.fleet.url, model if options.attach else spec.name,
                                        timeout_s=options.request_timeout_s)
        self._recovering = threading.Lock()  # one thread restarts a lost router; the others wait, then resend

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """``prompts``/``prompt_mask`` -> ``responses``/``response_mask`` (and ``rollout_logprobs``), one request
        per row through the router."""
        prompts = prompt_token_lists(batch)
        for row, prompt in enumerate(prompts):
            self.limit.check(row, len(prompt), sampling.max_new_tokens)
        base = sample_seed(sampling, self.rank)
        requests = [CompletionRequest(prompt=prompt, max_tokens=sampling.max_new_tokens, seed=base + i,
                                      sampling=sampling_knobs(sampling), logprobs=sampling.logprobs,
                                      session=session_key(prompt))
                    for i, prompt in enumerate(prompts)]
        with self._healing():
            version = self.fleet.serving_version()
            done = self.complete(requests)
        out = pack_responses([c.token_ids for c in done], [c.logprobs for c in done] if sampling.logprobs else None,
                             pad_id=self.pad_id)
        return out.union(Batch({"policy_version": torch.full((len(done),), version, dtype=torch.long)}))

    @contextlib.contextmanager
    def turn_session(self, sampling: SamplingParams) -> Iterator[GenerateBatch]:
        """Agent turns (:class:`~hybridflow.runtime.protocols.TurnGenerator`) through the router, safe to call from
        many threads at once (each turn is its own HTTP request); results carry the fleet's weights version."""
        with self._healing():
            yield ServerTurns(self.complete, sampling, eos_id=self.eos_id, version=self.fleet.serving_version(),
                              limit=self.limit)

    def complete(self, requests: Sequence[CompletionRequest]) -> list[Completion]:
        """Send ``requests`` through the router; those that failed because the router was lost meanwhile are sent
        again (same seeds) once it is back (:meth:`_router_back`), the others' results kept. Safe from many
        threads at once (an agent loop's turns)."""
        router = self.fleet.router
        done = self.client.complete_each(requests)
        failed = [i for i, result in enumerate(done) if isinstance(result, ServerRequestError)]
        if failed:
            first = done[failed[0]]
            assert isinstance(first, ServerRequestError)
            if not self._router_back(router):
                raise first
            for i, result in zip(failed, self.client.complete_all([requests[i] for i in failed]), strict=True):
                done[i] = result
        return [result for result in done if isinstance(result, Completion)]

    def _router_back(self, router: ServerProcess | None) -> bool:
        """Whether ``router`` (the one requests were sent through) was lost and a router is up again: started again
        here (once per fleet; a second loss is :class:`~hybridflow.runtime.servers.RouterDownError`) or by another
        thread meanwhile."""
        with self._recovering:
            if router is None or (self.fleet.router is router and router.alive):
                return False  # the router is fine: the failure is the request's own
            self._heal()
            return True

    @contextlib.contextmanager
    def _healing(self) -> Iterator[None]:
        """Restart dead replicas before and after the requests; a failed request with every replica dead is one
        error naming their logs (:class:`~hybridflow.runtime.servers.FleetDownError`)."""
        self._heal()
        try:
            yield
        except ServerRequestError:
            self.fleet.check_router()  # a router lost for the second time: one line naming its log
            self.fleet.check_alive()
            raise
        self._heal()

    def _heal(self) -> None:
        self.fleet.heal(self._resync)
        self.client.base_url = self.fleet.url  # a restarted router may have had to take another port

    def _resync(self, replica: ServerProcess) -> None:
        """A restarted replica loads the last weights sent (it started from the initial ones) before it is routed to."""
        if self.weights_version:
            reload_replica(replica, self._snapshot, adapter=self.adapter)
            self.fleet.loaded(replica, self.weights_version)

    def rollout_metrics(self) -> dict[str, float]:
        """Replicas and routers restarted and requests sent again since this fleet started, and the last weight
        sync's seconds, snapshot bytes (its files' size, what each replica reads) and replicas (a generate node's
        metrics; the controller logs the planner's estimate of the same sync beside them, ``sync_s_planned``...)."""
        metrics = {"rollout/replica_restarts": float(self.fleet.restarts),
                   "rollout/router_restarts": float(self.fleet.router_restarts),
                   "rollout/requests_retried": float(self.client.retried)}
        if self.last_sync is not None:
            metrics.update({"rollout/sync_s": self.last_sync.seconds, "rollout/sync_bytes": float(self._sync_bytes),
                            "rollout/sync_replicas": float(len(self.fleet.endpoints))})
        return metrics

    @property
    def takes_adapters(self) -> bool:
        return self.adapter is not None

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the weights once, then have every replica reload them, paused around it."""
        if self.adapter is not None:
            raise RuntimeError(f"role {self.spec.name!r}: these servers were started for LoRA adapter syncs "
                               "(load_adapter); whole weights would be overridden by the adapter's base")
        start = time.perf_counter()
        self._heal()  # a replica lost since the last step must not fail the sync
        self._sync_all(write_snapshot(named, self._snapshot), start)

    def load_adapter(self, named: Iterable[tuple[str, torch.Tensor]], config: Mapping[str, Any]) -> None:
        """A new version of the LoRA adapter (peft names and config), written once and loaded by every replica in
        place of the last (``/v1/load_lora_adapter``), paused around it; requests then name the adapter."""
        if self.adapter is None:
            raise RuntimeError(f"role {self.spec.name!r}: these servers were started without LoRA: they take merged "
                               "weights (load_weights), not adapters")
        start = time.perf_counter()
        self._heal()
        self._sync_all(write_adapter(named, config, self._snapshot), start)
        self.client.model = self.adapter

    def _sync_all(self, written: WeightSyncStats, start: float) -> None:
        """Every replica loads what was written; one that fails is restarted and synced again, the others keep
        serving the new version."""
        self._sync_bytes = sum(path.stat().st_size for path in self._snapshot.glob("*.safetensors"))
        endpoints = self.fleet.endpoints
        with ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
            failures = list(pool.map(self._try_reload, endpoints))
        self.weights_version += 1
        for endpoint, failure in zip(endpoints, failures, strict=True):
            if failure is None:
                self.fleet.loaded(endpoint, self.weights_version)
            elif isinstance(endpoint, ServerProcess):  # restarted on the new weights; the others keep serving
                logger.warning("%s; restarting it and loading the weights again", failure)
                self.fleet.replace(endpoint, self._resync)
            else:
                raise failure  # an attached server is its owner's to restart
        self.last_sync = WeightSyncStats(seconds=time.perf_counter() - start, bytes=written.bytes,
                                         tensors=written.tensors, largest_tensor_bytes=written.largest_tensor_bytes)

    def _try_reload(self, endpoint: ServerProcess | AttachedServer) -> RuntimeError | None:
        try:
            reload_replica(endpoint, self._snapshot, adapter=self.adapter)
        except RuntimeError as failure:
            return failure
        return None

    def close(self) -> None:
        self.client.close()
        self.fleet.close()
        shutil.rmtree(self._snapshot, ignore_errors=True)
        if self._model_holder is not None:
            self._model_holder.cleanup()


class ServerRolloutFactory:
    """``rollout: server``: standalone (a detached rollout is the fleet alone); a trainable policy's trainer is
    wrapped in a :class:`HybridEngine` whose rollout is the fleet: merged whole weights after each update, or a
    LoRA policy's adapter alone (:meth:`ServerOptions.takes_adapter`)."""

    standalone = True
    # A replica of rollout_tp > 1 runs (``--tensor-parallel-size``, each on its own GPUs) where one rank holds them
    # all; every executor gives a rank one GPU, so plans keep rollout_tp 1 until ranks pool GPUs for a replica.
    max_rollout_tp = 1
    support = LayoutSupport(backend="vllm-server", max_rollout_tp=1, rollout_batch_size=True, served=True,
                            notes={**VllmBackend.support.notes,
                                   "rollout_tp": "a server replica is started by one rank of one GPU; replicas "
                                                 "spanning ranks (tensor-parallel replicas in a plan): not yet"})

    def build(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext, *,
              trainer: Engine | None) -> Engine:
        options = ServerOptions.parse(spec.rollout_options, spec.name)
        if not options.attach:  # the plan sizes the fleet; attached servers are the user's own
            logical = context.device.split(":")[0] == "cpu"
            replicas = check_replicas(options.replicas, layout, world_size=context.world_size, logical=logical,
                                      role=spec.name)
            options = replace(options, replicas=replicas)
        if trainer is None:
            adapter = spec.serves_adapter
            lora_rank = adapter.rank if adapter is not None and options.takes_adapter(spec.name, adapter) else None
            return ServerRollout(spec, layout, context, options, lora_rank=lora_rank)
        if spec.kind is not RoleKind.POLICY:
            raise ValueError(f"role {spec.name!r} is a {spec.kind.value}: rollout: server applies to policies")
        trains_adapters = spec.lora is not None and getattr(trainer, "has_adapters", False)
        adapter_sync = options.takes_adapter(spec.name, spec.lora if trains_adapters else None)
        rollout = ServerRollout(spec, layout, context, options,
                                lora_rank=spec.lora.rank if adapter_sync and spec.lora is not None else None)
        return HybridEngine(trainer, rollout, weight_dtype=options.rollout_dtype or layout.dtype,
                            adapter_sync=adapter_sync)


ROLLOUT = ServerRolloutFactory()
