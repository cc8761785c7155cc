"""The cost model's efficiency constants, and calibration files holding them per device class.

Every other number in the model is a datasheet figure or a count (FLOPs, bytes); these few say how
much of the datasheet a real stack achieves. Defaults are priors with a reason each; ``hybridflow
calibrate`` fits them to measurements (see :mod:`hybridflow.planner.fit`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

FORMAT = "hybridflow-calibration/1"


@dataclass(frozen=True, kw_only=True)
class Constants:
    """Achieved fractions and fixed overheads. Efficiencies are fractions of peak; overheads seconds."""

    train_mfu: float = 0.5  # share of the device's GEMM ceiling (DeviceSpec.matmul_flops) large training/forward
    # micro batches' matmuls reach (tuned FSDP/Megatron)
    eff_half_tokens: float = 512  # tokens per micro batch at which efficiency is half of train_mfu
    hbm_efficiency: float = 0.7  # achievable fraction of HBM bandwidth in memory-bound decode
    decode_mfu: float = 0.5  # fraction of the GEMM ceiling a compute-bound decode step reaches
    prefill_mfu: float = 0.5  # fraction of the GEMM ceiling of (chunked) prefill
    host_efficiency: float = 0.5  # fraction of the host link CPU offload achieves (pageable copies)
    decode_step_overhead_s: float = 0.002  # per engine step: scheduler, sampling, graph launch (vLLM ~1-3 ms)
    phase_overhead_s: float = 0.0  # per role phase: dispatch, data collation, cache clears
    micro_batch_overhead_s: float = 0.0  # per micro batch pass and optimizer step: launches, Python dispatch
    moe_efficiency: float = 0.5  # expert layers' share of the dense efficiency (small grouped GEMMs)
    controller_gbs: float = 1.0  # GB/s verl's controller ships padded batches at (overlays.ControllerOverlay only)
    # per request a served rollout sends (fleet.py): vllm-router's added p50 latency, 0.42 ms measured (benchmarks.md)
    router_request_s: float = 0.00042

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
                raise ValueError(f"Constants.{item.name}={value!r} must be a number")
            if item.name.endswith("_s"):
                if value < 0:
                    raise ValueError(f"Constants.{item.name}={value!r} must be >= 0 seconds")
            elif item.name in ("eff_half_tokens", "controller_gbs"):
                if value <= 0:
                    unit = "tokens" if item.name == "eff_half_tokens" else "GB/s"
                    raise ValueError(f"Constants.{item.name}={value!r} must be > 0 {unit}")
            elif not 0 < value <= 1:
                raise ValueError(f"Constants.{item.name}={value!r} must be a fraction in (0, 1]")

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "constants") -> Constants:
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(data) - known)
        if "step_overhead_s" in unknown:
            raise ValueError(f"{where}: step_overhead_s is no longer a constant: the step's reward, validation and "
                             "checkpoint terms are modelled (hybridflow.planner.step_terms); delete the key, or refit "
                             "with `hybridflow calibrate`")
        if unknown:
            raise ValueError(f"{where}: unknown constants {unknown}; known: {sorted(known)}")
        try:
            return cls(**{key: float(value) for key, value in data.items()})
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from err


DEFAULT_CONSTANTS = Constants()

# Physical ranges a fit may move each constant in: an efficiency above what any stack reaches, or an
# overhead of minutes per decode step, would mean the fit explains something else with this constant.
RANGES: dict[str, tuple[float, float]] = {
    "train_mfu": (0.1, 0.75), "eff_half_tokens": (64, 8192), "hbm_efficiency": (0.3, 0.95),
    "decode_mfu": (0.1, 0.8), "prefill_mfu": (0.1, 0.8), "host_efficiency": (0.1, 0.9),
    "decode_step_overhead_s": (0.0, 0.05), "phase_overhead_s": (0.0, 60.0),
    "micro_batch_overhead_s": (0.0, 1.0),
    "moe_efficiency": (0.1, 1.0), "controller_gbs": (0.1, 10.0),
}


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Constants for every device (``default``), overridden per device class where measured. ``held``
    names the constants the fit left at their starting values (the measurements did not constrain them)."""

    default: Constants = DEFAULT_CONSTANTS
    devices: tuple[tuple[str, Constants], ...] = ()
    source: str = "priors"
    held: tuple[str, ...] = ()

    def for_device(self, name: str) -> Constants:
        for device, constants in self.devices:
            if device == name:
                return constants
        return self.default

    def with_device(self, name: str, constants: Constants) -> Calibration:
        kept = tuple(item for item in self.devices if item[0] != name)
        return replace(self, devices=(*kept, (name, constants)))

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "source": self.source, "held": list(self.held), "default": asdict(self.default),
                "devices": {name: asdict(constants) for name, constants in self.devices}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "calibration") -> Calibration:
        if data.get("format") != FORMAT:
            raise ValueError(f"{where}: 'format' is {data.get('format')!r}, expected {FORMAT!r}; write the file with "
                             "`hybridflow calibrate`")
        default = Constants.from_dict(data.get("default", {}), where=f"{where}.default")
        devices = tuple((str(name), replace(default, **_floats(values, f"{where}.devices.{name}")))
                        for name, values in sorted((data.get("devices") or {}).items()))
        held = data.get("held") or []
        known = {item.name for item in fields(Constants)}
        if not isinstance(held, list) or any(name not in known for name in held):
            raise ValueError(f"{where}.held: {held!r} must be a list of constant names; known: {sorted(known)}")
        return cls(default=default, devices=devices, source=str(data.get("source", where)),
                   held=tuple(str(name) for name in held))

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """A calibration file, or a shipped calibration by name (``verl-published``)."""
        from hybridflow.planner.calibrations import BUILTIN

        if str(path) in BUILTIN:
            return cls.from_dict(BUILTIN[str(path)], where=str(path))
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"calibration file {file} not found; write one with `hybridflow calibrate` "
                                    f"or name a shipped one: {sorted(BUILTIN)}")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}: not JSON ({err}); write the file with `hybridflow calibrate`") from err
        return cls.from_dict(data, where=str(file))


def _floats(values: dict[str, Any], where: str) -> dict[str, float]:
    Constants.from_dict(values, where=where)  # validates names and ranges
    return {key: float(value) for key, value in values.items()}


DEFAULT_CALIBRATION = Calibration()
