"""The device catalogue: memory, bandwidth and dense throughput of the accelerators the planner knows.

Figures are the vendors' datasheet numbers (dense, no sparsity); ``link_bandwidth`` is one direction
of one GPU's intra-node link. Sources are cited per entry and in ``docs/planner.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GIB = 1024**3
GB = 10**9
TFLOPS = 10**12
GFLOPS = 10**9

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator type. ``dtypes`` lists the compute dtypes it runs fast, best first."""

    name: str
    memory_bytes: int
    hbm_bandwidth: float  # bytes/s
    flops: tuple[tuple[str, float], ...]  # dtype -> dense FLOP/s
    link: str  # "NVLink", "PCIe", "Infinity Fabric" or "host"
    link_bandwidth: float  # bytes/s, one direction, per GPU
    source: str = ""
    host_bandwidth: float = 25 * 10**9  # bytes/s, one direction, GPU <-> host memory (PCIe; CPU offload)
    # Attention over padded rows skips what a token cannot see (flash-attention's causal kernels); on CPU,
    # transformers' masked sdpa computes every query against every key of its row. Packed rows attend per
    # sequence on both (planner.costs.attention_tokens).
    varlen_attention: bool = True
    # The best dense GEMM rate measured on the device over its datasheet peak (sources above ``_CATALOGUE``): every
    # compute-bound term runs on ``peak_flops * matmul_fraction``; 1.0 where no measurement was found.
    matmul_fraction: float = 1.0
    # Collectives and host copies run on their own streams beside the compute (CUDA/HIP streams: FSDP prefetches a
    # unit's all-gather while the one before computes); on a CPU with gloo they block the rank.
    overlaps_collectives: bool = True

    def __post_init__(self) -> None:
        for field_name in ("memory_bytes", "hbm_bandwidth", "link_bandwidth", "host_bandwidth"):
            value = getattr(self, field_name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"DeviceSpec({self.name}).{field_name}={value!r} must be a positive number")
        for dtype, value in self.flops:
            if dtype not in DTYPE_BYTES or value <= 0:
                raise ValueError(f"DeviceSpec({self.name}).flops: {dtype}={value} needs a known dtype and FLOP/s > 0")
        if not 0 < self.matmul_fraction <= 1:
            raise ValueError(f"DeviceSpec({self.name}).matmul_fraction={self.matmul_fraction!r} must be a fraction in "
                             "(0, 1]: the measured best GEMM rate over the datasheet peak")

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(dtype for dtype, _ in self.flops)

    def supports(self, dtype: str) -> bool:
        return dtype in self.dtypes

    def peak_flops(self, dtype: str) -> float:
        for name, value in self.flops:
            if name == dtype:
                return value
        raise ValueError(f"device {self.name} does not run {dtype}; it runs {list(self.dtypes)}")

    def matmul_flops(self, dtype: str) -> float:
        """The dense FLOP/s a large, well-shaped GEMM reaches in ``dtype``: the datasheet peak times the measured
        ceiling (``matmul_fraction``). Training, prefill and compute-bound decode efficiencies are fractions of it."""
        return self.peak_flops(dtype) * self.matmul_fraction

    @property
    def preferred_dtype(self) -> str:
        """The half-precision dtype the planner trains and serves in (bf16 where the device has it)."""
        return self.dtypes[0]


def _device(name: str, memory_gb: float, hbm_gbs: float, bf16: float | None, fp16: float, fp32: float,
            link: str, link_gbs: float, source: str, host_gbs: float = 25, matmul: float = 1.0) -> DeviceSpec:
    flops = ([("bf16", bf16 * TFLOPS)] if bf16 else []) + [("fp16", fp16 * TFLOPS), ("fp32", fp32 * TFLOPS)]
    return DeviceSpec(name=name, memory_bytes=int(memory_gb * GIB), hbm_bandwidth=hbm_gbs * GB,
                      flops=tuple(flops), link=link, link_bandwidth=link_gbs * GB, source=source,
                      host_bandwidth=host_gbs * GB, matmul_fraction=matmul)


# Measured GEMM ceilings (``matmul`` below): the Maximum Achievable Matmul FLOPS (MAMF: the best mean TFLOP/s of
# a bf16 torch.matmul over a brute-force sweep of shapes) over the datasheet peak, from the comparison table in
# stas00/ml-engineering compute/accelerator/README.md at 744d01e1 ("Maximum Achievable Matmul FLOPS comparison
# table", BF16): A100 SXM 271.2/312 (0.869), H100 SXM 794.5/989 (0.803, "H200 is the same"), B200 SXM 1745/2250
# (0.776), GB200 1822/2500 (0.729), MI325X 784.9/1300 (0.604); MI300X 781.9/1300 (0.601, ROCm 6.2, the higher of
# its two rows there; 668.4 with ROCm 6.3). A datasheet peak assumes the boost clock, which a fast chip cannot hold
# at its power limit under sustained tensor-core load (AMD, "Understanding Peak, Max-Achievable & Delivered FLOPs",
# rocm.blogs.amd.com, 2025-02-14; the same README at b9e29720: "the higher the TDP the more efficient the compute
# will be"): the ceiling falls as the peak per watt rises. The H20 (148 TFLOP/s, a seventh of an H100's) has no
# published MAMF; its attention kernels measure 129.1 TFLOP/s (cuDNN, forward, head dim 128, 2,048 tokens: 0.872 of
# its peak; FlashAttention-3 126.2; Dao-AILab/flash-attention#1310), and attention reaches at most 0.93 of the GEMM
# ceiling on an H100 (FlashAttention-3's best, 740 TFLOP/s, arXiv:2407.08608, over 794.5), so the H20's GEMM
# ceiling is at least 0.872 / 0.93 = 0.94 of its peak: 0.94, the bound. H800 and H200 are H100 SXM5 silicon at its
# clocks (NVLink or memory differ): 0.803. Devices without a measurement keep 1.0 (the datasheet); the CPU's
# logical GPU is calibrated on its own runs (benchmarks/planner_self.py).


# fp32 is the TF32 tensor-core rate where one exists (PyTorch's default for matmuls with allow_tf32).
# NVLink figures are the datasheet's bidirectional total halved; PCIe is x16 one direction, and the host
# link (CPU offload) is PCIe Gen4 x16 (25 GB/s) unless the platform has Gen5 (50 GB/s: Hopper, Blackwell, MI300).
_CATALOGUE = (
    _device("A100-40G", 40, 1555, 312, 312, 156, "NVLink", 300, "NVIDIA A100 datasheet (SXM4 40GB)",
            matmul=0.869),
    _device("A100-80G", 80, 2039, 312, 312, 156, "NVLink", 300, "NVIDIA A100 datasheet (SXM4 80GB)",
            matmul=0.869),
    _device("H100-80G", 80, 3350, 989, 989, 495, "NVLink", 450, "NVIDIA H100 datasheet (SXM5)", 50, 0.803),
    _device("H200", 141, 4800, 989, 989, 495, "NVLink", 450, "NVIDIA H200 datasheet (SXM)", 50, 0.803),
    _device("L40S", 48, 864, 362, 362, 183, "PCIe", 32, "NVIDIA L40S datasheet (PCIe Gen4 x16)"),
    _device("A10G", 24, 600, 125, 125, 62.5, "PCIe", 32, "NVIDIA A10 datasheet; AWS A10G has the A10's memory"),
    _device("T4", 16, 320, None, 65, 8.1, "PCIe", 16, "NVIDIA T4 datasheet (Turing: no bf16; PCIe Gen3)"),
    _device("V100-32G", 32, 900, None, 125, 15.7, "NVLink", 150, "NVIDIA V100 datasheet (SXM2; Volta: no bf16)"),
    _device("RTX-4090", 24, 1008, 165, 165, 82.6, "PCIe", 32, "NVIDIA Ada whitepaper (fp32 accumulate rate)"),
    _device("MI300X", 192, 5300, 1307, 1307, 654, "Infinity Fabric", 448, "AMD Instinct MI300X datasheet", 50,
            0.601),
    _device("MI325X", 256, 6000, 1307, 1307, 654, "Infinity Fabric", 448, "AMD Instinct MI325X datasheet", 50,
            0.604),
    # H20/H800: export variants of Hopper. H20 keeps 900 GB/s NVLink but has 148 TFLOP/s dense bf16.
    _device("H20", 96, 4000, 148, 148, 74, "NVLink", 450, "NVIDIA H20 product brief (96 GB HBM3)", 50, 0.94),
    _device("H20-141G", 141, 4800, 148, 148, 74, "NVLink", 450, "NVIDIA H20 141 GB HBM3e variant", 50, 0.94),
    _device("H800", 80, 3350, 989, 989, 495, "NVLink", 200, "NVIDIA H800 SXM (NVLink 400 GB/s)", 50, 0.803),
    _device("B200", 180, 8000, 2250, 2250, 1100, "NVLink", 900, "NVIDIA DGX/HGX B200 datasheet (per GPU)", 50,
            0.776),
    _device("GB200", 186, 8000, 2500, 2500, 1250, "NVLink", 900, "NVIDIA GB200 NVL72 datasheet (per GPU)", 50,
            0.729),
    # A logical GPU for CPU runs of tiny models is one worker process on one core (OMP_NUM_THREADS=1): one
    # core of an AVX-512 server CPU, fp32 only (bf16 matmuls on CPU are slow). Two 512-bit FMA pipes at
    # ~2.5 GHz: 160 GFLOP/s; one core streams ~35 GB/s. Measured on the project's 2-core AMD EPYC (Zen 5) VM:
    # 108 GFLOP/s in a 1-thread 1024^3 fp32 matmul, 35 GB/s in a 64 MiB copy.
    DeviceSpec(name="CPU", memory_bytes=16 * GIB, hbm_bandwidth=35 * GB, flops=(("fp32", 160 * GFLOPS),),
               link="host", link_bandwidth=10 * GB, source="one core of an AVX-512 server CPU per logical GPU",
               varlen_attention=False, overlaps_collectives=False),
)

DEVICES: dict[str, DeviceSpec] = {device.name: device for device in _CATALOGUE}

# Short names users type; each maps to a catalogue entry.
ALIASES = {"A100": "A100-80G", "H100": "H100-80G", "V100": "V100-32G", "RTX4090": "RTX-4090", "4090": "RTX-4090",
           "A10": "A10G", "H200-141G": "H200", "MI300": "MI300X",
           "H20-96G": "H20", "H20-96GB": "H20", "H20-141GB": "H20-141G", "MI325": "MI325X", "H800-80G": "H800",
           "B200-180G": "B200"}


def get_device(name: str, extra: Mapping[str, DeviceSpec] | None = None) -> DeviceSpec:
    """The catalogue entry for ``name`` (case-insensitive; aliases such as ``H100`` accepted).

    ``extra`` holds user-defined devices (cluster YAML ``devices:`` or ``--device``); they win over the catalogue.
    """
    known = {**DEVICES, **(extra or {})}
    by_upper = {key.upper(): key for key in known}
    by_upper |= {key.upper(): value for key, value in ALIASES.items() if key.upper() not in by_upper}
    key = by_upper.get(name.strip().upper())
    if key is None:
        raise ValueError(f"unknown device {name!r}; known devices: {sorted(known)} (aliases: {sorted(ALIASES)}); "
                         "define one with --device name=X,memory_gb=..,bf16_tflops=..,hbm_gbs=..,link_gbs=.. or a "
                         "'devices:' entry in the cluster YAML")
    return known[key]


# Keys of a user-defined device (cluster YAML ``devices:`` entries and ``--device``), with what each means.
DEVICE_KEYS = {
    "name": "the name the cluster spec uses",
    "memory_gb": "device memory in GiB, e.g. 80",
    "bf16_tflops": "dense bf16 TFLOP/s (omit if the device has no bf16)",
    "fp16_tflops": "dense fp16 TFLOP/s (default: bf16_tflops)",
    "fp32_tflops": "fp32 (TF32) TFLOP/s (default: fp16_tflops / 2)",
    "hbm_gbs": "memory bandwidth in GB/s, e.g. 3350",
    "link_gbs": "intra-node GPU link, GB/s one direction, e.g. 450 (NVLink) or 32 (PCIe)",
    "host_gbs": "GPU <-> host link for CPU offload, GB/s (default 25)",
    "link": "link name (default NVLink)",
    "matmul_fraction": "measured best bf16 GEMM TFLOP/s over the datasheet peak, e.g. 0.8 (default 1: the datasheet)",
}


def _positive(data: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float | None:
    value = data.get(key, default)
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}.{key}={value!r} is not a number; give {DEVICE_KEYS[key]}") from err
    if not number > 0 or number != number or number == float("inf"):
        raise ValueError(f"{where}.{key}={value!r} must be a positive number: {DEVICE_KEYS[key]}")
    return number


def _fraction(data: Mapping[str, Any], key: str, where: str) -> float:
    number = _positive(data, key, where, 1.0) or 1.0
    if number > 1:
        raise ValueError(f"{where}.{key}={data[key]!r} must be a fraction in (0, 1]: {DEVICE_KEYS[key]}")
    return number


def device_from_mapping(data: Mapping[str, Any], *, where: str = "device") -> DeviceSpec:
    """A device from user keys (see :data:`DEVICE_KEYS`); errors name the bad key and the fix."""
    unknown = sorted(set(data) - set(DEVICE_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; a device takes {sorted(DEVICE_KEYS)}")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}.name={name!r} must be a non-empty string: {DEVICE_KEYS['name']}")
    where = f"{where}[{name}]"
    for key in ("memory_gb", "hbm_gbs", "link_gbs"):
        if key not in data:
            raise ValueError(f"{where}.{key} is missing: {DEVICE_KEYS[key]}")
    bf16 = _positive(data, "bf16_tflops", where)
    fp16 = _positive(data, "fp16_tflops", where, bf16)
    if fp16 is None:
        raise ValueError(f"{where}: give bf16_tflops or fp16_tflops (dense TFLOP/s of the device)")
    fp32 = _positive(data, "fp32_tflops", where, fp16 / 2)
    assert fp32 is not None
    flops = ([("bf16", bf16 * TFLOPS)] if bf16 else []) + [("fp16", fp16 * TFLOPS), ("fp32", fp32 * TFLOPS)]
    return DeviceSpec(name=name.strip(), memory_bytes=int((_positive(data, "memory_gb", where) or 0) * GIB),
                      hbm_bandwidth=(_positive(data, "hbm_gbs", where) or 0) * GB, flops=tuple(flops),
                      link=str(data.get("link", "NVLink")),
                      link_bandwidth=(_positive(data, "link_gbs", where) or 0) * GB,
                      host_bandwidth=(_positive(data, "host_gbs", where, 25) or 0) * GB,
                      matmul_fraction=_fraction(data, "matmul_fraction", where),
                      source=f"user-defined ({where})")


def parse_device(text: str) -> DeviceSpec:
    """``--device name=H20X,memory_gb=96,bf16_tflops=148,hbm_gbs=4000,link_gbs=450``."""
    data: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--device {text!r}: {item!r} is not KEY=VALUE; keys: {sorted(DEVICE_KEYS)}")
        data[key.strip()] = value.strip()
    return device_from_mapping(data, where="--device")
