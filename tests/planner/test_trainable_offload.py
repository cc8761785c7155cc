"""A trainable role's offload priced as hybridflow runs it (``Framework.trainable_offload="per_unshard"``: FSDP2
``CPUOffloadPolicy``, ZeRO-Offload) against verl's per-phase swap, by hand on a made-up device with round numbers,
and on the ROCm record of the published verl runs."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from hybridflow.graph import NodeLoad, Op, RoleKind
from hybridflow.planner import DEVICES, ModelSpec, RoleLayout, Sharding
from hybridflow.planner.calibration import Calibration, Constants
from hybridflow.planner.costs import Shape, forward_cost, offloaded_bytes, static_bytes, trainer_shard, update_cost
from hybridflow.planner.devices import GB, GIB, TFLOPS, DeviceSpec
from hybridflow.planner.offload import HOST_OPTIMIZER_BYTES_S, host_optimizer_seconds, host_seconds, update_traffic
from hybridflow.planner.published import case_from_record
from hybridflow.planner.settings import Framework, Offload, RunSettings, settings_from_dict
from hybridflow.planner.weight_moves import engine_switch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# Collectives block the rank on this device (as on a CPU with gloo), so every copy adds and can be read off.
ROUND = DeviceSpec(name="ROUND", memory_bytes=100 * GIB, hbm_bandwidth=1000 * GB, flops=(("bf16", 100 * TFLOPS),),
                   link="NVLink", link_bandwidth=100 * GB, host_bandwidth=10 * GB, overlaps_collectives=False)
PLAIN = Constants(train_mfu=0.5, eff_half_tokens=1000, hbm_efficiency=0.5, decode_mfu=0.5, prefill_mfu=0.5,
                  host_efficiency=0.5, decode_step_overhead_s=0.0, phase_overhead_s=0.0)
HOST_LINK = 10e9 * 0.5
N = 1_000_000_000
MODEL = ModelSpec(name="round", params=N, layers=10, hidden=1000, heads=10, kv_heads=10, vocab=1000)
EVERYTHING = Offload(params=True, grads=True, optimizer=True)
UPDATE = NodeLoad("n", Op.UPDATE, 64, 64 * 100, 64 * 900)


def shape(offload: Offload | None = None, rule: str = "per_unshard", gpus: int = 2,
          device: DeviceSpec = ROUND) -> Shape:
    run = RunSettings(offload={"actor": offload} if offload else {}, framework=Framework(trainable_offload=rule))
    return Shape(device, (gpus,), 25e9, run=run, constants=PLAIN)


def full_shard(micro_batch_size: int = 8) -> RoleLayout:
    return RoleLayout(role="actor", dp=2, micro_batch_size=micro_batch_size, sharding=Sharding.FULL_SHARD)


def offload_seconds(layout: RoleLayout, rule: str, offload: Offload = EVERYTHING) -> float:
    moved = update_cost(MODEL, RoleKind.POLICY, UPDATE, layout, shape(offload, rule)).seconds
    return moved - update_cost(MODEL, RoleKind.POLICY, UPDATE, layout, shape()).seconds


def test_an_fsdp2_offloaded_update_copies_shards_in_per_unshard_gradients_out_and_steps_on_the_host():
    """FULL_SHARD on 2 GPUs, 32 rows a rank in 4 micro batches of 8, one optimizer step: 8 unshards copy the fp32
    master shard in (4 bytes x N/2), 4 reduce-scatters copy the fp32 gradient shard out, the fused AdamW reads and
    writes 32 bytes a parameter of its N/2 on the host, and the device optimizer step is gone."""
    unshards, reductions = 2 * 4, 4
    copies = (unshards * 4 * N / 2 + reductions * 4 * N / 2) / HOST_LINK
    host_step = 32 * N / 2 / HOST_OPTIMIZER_BYTES_S
    device_step = 2 * 16 * N / 2 / (1000e9 * 0.5)  # bf16 weights and gradients, fp32 master and moments
    assert offload_seconds(full_shard(), "per_unshard") == pytest.approx(copies + host_step - device_step, rel=1e-9)
    # verl's rule: the 16 bytes a parameter of the shard come in for the phase and leave after it.
    assert offload_seconds(full_shard(), "per_phase") == pytest.approx(2 * 16 * N / 2 / HOST_LINK, rel=1e-9)


def test_per_unshard_copies_scale_with_micro_batches_and_per_phase_does_not():
    """Halving the micro batch doubles the unshards and reductions: 4 more micro batches, each 2 shards in and one
    gradient shard out. verl's swap is once a phase whatever the micro batches."""
    extra = 4 * (2 * 4 * N / 2 + 4 * N / 2) / HOST_LINK
    assert (offload_seconds(full_shard(4), "per_unshard") - offload_seconds(full_shard(8), "per_unshard")
            == pytest.approx(extra, rel=1e-9))
    assert offload_seconds(full_shard(4), "per_phase") == pytest.approx(offload_seconds(full_shard(8), "per_phase"),
                                                                        rel=1e-12)


@pytest.mark.parametrize("micro_batches, more", [(1, False), (2, False), (3, True), (8, True)])
def test_per_unshard_moves_more_over_the_host_link_than_a_phase_swap_from_three_micro_batches(micro_batches, more):
    """A fully offloaded FULL_SHARD update: per micro batch two fp32 shards in and one fp32 gradient shard out (12
    bytes a parameter of the shard) against a phase's 16 bytes in and out (32): per-unshard moves more from 3 micro
    batches on."""
    layout = full_shard(32 // micro_batches)
    place = shape(EVERYTHING)
    traffic = update_traffic(EVERYTHING, trainer_shard(MODEL, layout, place), unshards=2 * micro_batches,
                             reductions=micro_batches, reductions_beside=True, steps=1, shape=place)
    phase = 2 * host_seconds(offloaded_bytes(MODEL, RoleKind.POLICY, layout, place), place)
    assert traffic.beside == pytest.approx(micro_batches * 12 * N / 2 / HOST_LINK, rel=1e-9)
    assert phase == pytest.approx(32 * N / 2 / HOST_LINK, rel=1e-9)
    assert (traffic.beside > phase) is more


def test_zero_offload_steps_on_the_host_and_copies_the_updated_partition_back():
    """ZeRO-2 with optimizer states and gradients offloaded, parameters resident: the bf16 gradient partition out
    once a step (ZeRO-1/2 reduce once a step), the host step over N/2, the updated bf16 partition back in."""
    layout = dataclasses.replace(full_shard(), sharding=Sharding.ZERO2)
    offload = Offload(grads=True, optimizer=True)
    copies = (2 * N / 2 + 2 * N / 2) / HOST_LINK
    host_step = host_optimizer_seconds(N / 2)
    device_step = 2 * (2 * N + 2 * N / 2 + 12 * N / 2) / (1000e9 * 0.5)  # ZeRO-2 keeps whole weights
    assert offload_seconds(layout, "per_unshard", offload) == pytest.approx(copies + host_step - device_step,
                                                                            rel=1e-9)


def test_offloaded_state_never_comes_back_whole_per_unshard():
    """The device holds two units' incoming shards and one unit's outgoing gradients beside the passes' peak; verl's
    swap brings everything back. Both keep the same resident bytes."""
    kept = update_cost(MODEL, RoleKind.POLICY, UPDATE, full_shard(), shape())
    ours = update_cost(MODEL, RoleKind.POLICY, UPDATE, full_shard(), shape(EVERYTHING))
    verls = update_cost(MODEL, RoleKind.POLICY, UPDATE, full_shard(), shape(EVERYTHING, "per_phase"))
    per_unit = (2 * 4 * N / 2 + 4 * N / 2) / MODEL.layers
    assert ours.transient_bytes == pytest.approx(kept.transient_bytes + per_unit, abs=1)
    assert verls.transient_bytes > ours.transient_bytes
    assert (static_bytes(MODEL, RoleKind.POLICY, full_shard(), shape(EVERYTHING))
            == static_bytes(MODEL, RoleKind.POLICY, full_shard(), shape(EVERYTHING, "per_phase")))


def test_forward_passes_and_the_engine_refresh_copy_the_shard_in_and_write_nothing_back():
    forward = NodeLoad("n", Op.LOGPROB, 64, 64 * 100, 64 * 900)
    layout = dataclasses.replace(full_shard(), forward_micro_batch_size=8)  # 4 micro batches a rank
    kept = forward_cost(MODEL, RoleKind.POLICY, forward, layout, shape()).seconds
    ours = forward_cost(MODEL, RoleKind.POLICY, forward, layout, shape(EVERYTHING)).seconds
    verls = forward_cost(MODEL, RoleKind.POLICY, forward, layout, shape(EVERYTHING, "per_phase")).seconds
    assert ours - kept == pytest.approx(4 * 4 * N / 2 / HOST_LINK, rel=1e-9)
    assert verls - kept == pytest.approx(2 * 2 * N / 2 / HOST_LINK, rel=1e-9)  # bf16 weights in and out
    assert engine_switch(MODEL, RoleKind.POLICY, layout, shape(EVERYTHING)) == pytest.approx(4 * N / 2 / HOST_LINK)


def test_on_a_cpu_device_offload_moves_nothing():
    """hybridflow's fsdp backend applies no CPUOffloadPolicy on a CPU device: its tensors are in host memory."""
    cpu = DEVICES["CPU"]
    layout = dataclasses.replace(full_shard(), dtype="fp32")
    for cost in (update_cost, forward_cost):
        load = UPDATE if cost is update_cost else dataclasses.replace(UPDATE, op=Op.LOGPROB)
        kept = cost(MODEL, RoleKind.POLICY, load, layout, shape(device=cpu))
        moved = cost(MODEL, RoleKind.POLICY, load, layout, shape(EVERYTHING, device=cpu))
        assert moved.seconds == kept.seconds
    assert engine_switch(MODEL, RoleKind.POLICY, layout, shape(EVERYTHING, device=cpu)) == 0.0


def published_cases() -> list:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from published_runs import load_cases
    finally:
        sys.path.pop(0)
    return load_cases()


def test_verl_records_keep_verls_rule_and_hybridflows_plans_default_to_per_unshard():
    assert {case.settings.framework.trainable_offload for case in published_cases()} == {"per_phase"}
    record = json.loads((BENCHMARKS / "data" / "published_runs.json").read_text())[-1]
    assert case_from_record({**record, "framework": "OpenRLHF"}).settings.framework.trainable_offload == "per_unshard"
    assert RunSettings().framework.trainable_offload == "per_unshard"
    verls = settings_from_dict({"trainable_offload": "per_phase"}, mean_response_len=100)
    assert verls.framework.trainable_offload == "per_phase"
    with pytest.raises(ValueError, match=r"Framework.trainable_offload='swap' must be one of \['per_unshard', "
                                         r"'per_phase'\]"):
        RunSettings(framework=Framework(trainable_offload="swap"))
    with pytest.raises(ValueError, match=r"plan.trainable_offload='swap' must be one of"):
        settings_from_dict({"trainable_offload": "swap"}, mean_response_len=100, where="plan")


def test_the_rocm_record_with_its_actor_offloaded_costs_the_host_optimizer_as_hybridflow_runs_it():
    """The ROCm blog's PPO run (Qwen2-7B, 8 H100s, FULL_SHARD, 4 mini-batches of 256 rows, 16 rows a micro batch)
    with the actor's parameters, gradients and optimizer offloaded, on the shipped calibration: verl's swap costs
    the update 8.0 s; hybridflow's offload 11.6 s. The difference is the host AdamW (4 steps over N/8, 1.2 s each)
    less the swap and the device step it replaces; the per-unshard copies (16 shards in, 8 gradient shards out)
    hide beside the passes but for the first unit's share."""
    case = next(case for case in published_cases() if case.id.startswith("rocm_blog"))
    offload = (*case.settings.offload, ("actor", EVERYTHING))
    shipped = Calibration.load("verl-published")
    seconds = {}
    for rule in ("per_phase", "per_unshard"):
        run = dataclasses.replace(case.settings, offload=tuple(sorted(offload)),
                                  framework=Framework(trainable_offload=rule))
        plan = dataclasses.replace(case, settings=run).plan(shipped)
        seconds[rule] = {node.node: node.seconds for node in plan.nodes}
    n = ModelSpec.preset("qwen2-7b").params
    link = DEVICES["H100-80G"].host_bandwidth * shipped.default.host_efficiency
    host_step = 4 * host_optimizer_seconds(n / 8)
    swap = 2 * 16 * n / 8 / link
    device_step = 4 * 2 * 16 * n / 8 / (DEVICES["H100-80G"].hbm_bandwidth * shipped.default.hbm_efficiency)
    copies = (16 + 8) * 4 * n / 8 / link
    difference = seconds["per_unshard"]["actor_update"] - seconds["per_phase"]["actor_update"]
    assert host_step - swap - device_step <= difference <= host_step - swap + copies / 28
    assert round(seconds["per_phase"]["actor_update"], 1) == 8.0
    assert round(seconds["per_unshard"]["actor_update"], 1) == 11.6
