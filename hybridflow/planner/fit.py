"""Fitting the cost model's constants to measured seconds (``hybridflow calibrate``).

The loss is the mean squared log ratio of predicted to measured seconds over every measured phase
and step: a run twice too slow weighs as much as one twice too fast, and a long phase does not drown
a short one. Few constants are fitted (``FITTED``), shared by every case (or per device class), never
one per run. The search is Nelder-Mead over unbounded coordinates, each mapped logistically into the
constant's physical range (``calibration.RANGES``); it needs no gradient and no SciPy.

A constant the measurements cannot constrain is not fitted but *held* at its starting value (the prior
unless ``--start`` says otherwise): a fit left free on such a constant moves it to absorb whatever the
model misses elsewhere, and the constant then mis-prices the plans where it does bind. The held names are
recorded in the calibration (``Calibration.held``) and printed by ``hybridflow calibrate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, fields, replace

from hybridflow.planner.calibration import DEFAULT_CONSTANTS, RANGES, Calibration, Constants

# What ``hybridflow calibrate`` may fit: one efficiency per kind of work and the fixed overheads.
FITTED = ("train_mfu", "decode_mfu", "hbm_efficiency", "moe_efficiency", "decode_step_overhead_s",
          "phase_overhead_s", "controller_gbs")
# Held at their priors by default. The criterion: a constant is held when the usual calibration runs cannot
# tell its term apart from another one, so a free fit would move it to absorb that other term's error.
# decode_mfu prices compute-bound decode steps, an engine near its full concurrency. Colocated runs, what
# calibrations are usually fitted on, spread the batch over every GPU (a few hundred sequences an engine)
# and their generation time is mostly the drain to the longest response, bound by weight/KV reads and the
# per-step overhead; fitted there, decode_mfu fell to 0.27 to stand in for a dearer drain and made a small
# rollout pool at full concurrency 2x too slow (docs/benchmarks.md, "Split pools, one step off").
HELD = ("decode_mfu",)
Predict = Callable[[Calibration], Mapping[str, float]]
Case = tuple[Predict, Mapping[str, float]]


def loss(cases: Sequence[Case], calibration: Calibration) -> float:
    """Mean squared log ratio of predicted to measured seconds."""
    total, count = 0.0, 0
    for predict, measured in cases:
        predicted = predict(calibration)
        for key, seconds in measured.items():
            value = predicted.get(key, 0.0)
            if value <= 0 or seconds <= 0:
                total, count = total + 25.0, count + 1  # a phase the model misses entirely: a big fixed penalty
                continue
            total, count = total + math.log(value / seconds) ** 2, count + 1
    return total / max(count, 1)


def _to_free(name: str, value: float) -> float:
    """A constant in its physical range (``RANGES``) as an unbounded coordinate (logistic map)."""
    low, high = RANGES[name]
    fraction = min(max((value - low) / (high - low), 1e-4), 1 - 1e-4)
    return math.log(fraction / (1 - fraction))


def _from_free(name: str, free: float) -> float:
    low, high = RANGES[name]
    return low + (high - low) / (1 + math.exp(-max(min(free, 50.0), -50.0)))


def _constants(start: Constants, names: Sequence[str], point: Sequence[float]) -> Constants:
    return replace(start, **{name: _from_free(name, x) for name, x in zip(names, point, strict=True)})


def nelder_mead(objective: Callable[[list[float]], float], start: list[float], *, step: float = 0.5,
                iterations: int = 400, tolerance: float = 1e-10) -> list[float]:
    """Minimise ``objective`` from ``start`` (standard reflection/expansion/contraction/shrink)."""
    simplex = [list(start)] + [[x + (step if i == j else 0.0) for j, x in enumerate(start)] for i in range(len(start))]
    values = [objective(p) for p in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / (len(simplex) - 1) for j in range(len(start))]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centroid, worst, strict=True)]
        value = objective(reflected)
        if value < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centroid, worst, strict=True)]
            expanded_value = objective(expanded)
            simplex[-1], values[-1] = (expanded, expanded_value) if expanded_value < value else (reflected, value)
        elif value < values[-2]:
            simplex[-1], values[-1] = reflected, value
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centroid, worst, strict=True)]
            contracted_value = objective(contracted)
            if contracted_value < values[-1]:
                simplex[-1], values[-1] = contracted, contracted_value
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, p, strict=True)] for p in simplex[1:]]
                values = [values[0]] + [objective(p) for p in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def fit_constants(cases: Sequence[Case], *, names: Sequence[str] = FITTED, start: Constants = DEFAULT_CONSTANTS,
                  restarts: int = 2) -> Constants:
    """The constants (``names`` fitted, the rest from ``start``) with the least :func:`loss` on ``cases``."""
    known = {item.name for item in fields(Constants)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"cannot fit unknown constants {unknown}; known: {sorted(known)}")
    if not cases:
        raise ValueError("no measurements to calibrate on")

    def objective(point: list[float]) -> float:
        return loss(cases, Calibration(default=_constants(start, names, point)))

    point = [_to_free(name, getattr(start, name)) for name in names]
    for _ in range(restarts + 1):  # restarting from the optimum escapes a collapsed simplex
        point = nelder_mead(objective, point)
    return _constants(start, names, point)


def fit_calibration(cases: Sequence[Case], *, names: Sequence[str] = FITTED, held: Sequence[str] = (),
                    start: Constants = DEFAULT_CONSTANTS, devices: Sequence[str] | None = None,
                    min_cases_per_device: int = 3, source: str = "hybridflow calibrate") -> Calibration:
    """One set of constants for every case; with ``devices`` (one per case), also one per device class
    that has at least ``min_cases_per_device`` cases. ``names`` less ``held`` are fitted; ``held`` stay at
    ``start`` and are recorded as held in the calibration."""
    known = {item.name for item in fields(Constants)}
    unknown = sorted(set(held) - known)
    if unknown:
        raise ValueError(f"cannot hold unknown constants {unknown}; known: {sorted(known)}")
    names = [name for name in names if name not in held]
    shared = fit_constants(cases, names=names, start=start)
    calibration = Calibration(default=shared, source=source, held=tuple(held))
    if devices is not None:
        if len(devices) != len(cases):
            raise ValueError(f"devices has {len(devices)} entries for {len(cases)} cases")
        for device in sorted(set(devices)):
            mine = [case for case, name in zip(cases, devices, strict=True) if name == device]
            if len(mine) >= min_cases_per_device:
                calibration = calibration.with_device(device, fit_constants(mine, names=names, start=shared))
    return calibration


def describe(constants: Constants, names: Sequence[str] = FITTED) -> str:
    values = asdict(constants)
    return ", ".join(f"{name}={values[name]:.4g}" for name in names)
