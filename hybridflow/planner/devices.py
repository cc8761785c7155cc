"""The device catalogue: memory, bandwidth and dense throughput of the accelerators the planner knows.

Figures are the vendors' datasheet numbers (dense, no sparsity); ``link_bandwidth`` is one direction
of one GPU's intra-node link. Sources are cited per entry and in ``docs/planner.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
GB = 10**9
TFLOPS = 10**12

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

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.hbm_bandwidth <= 0 or self.link_bandwidth <= 0:
            raise ValueError(f"DeviceSpec({self.name}): memory and bandwidths must be positive")
        for dtype, value in self.flops:
            if dtype not in DTYPE_BYTES or value <= 0:
                raise ValueError(f"DeviceSpec({self.name}).flops: {dtype}={value} needs a known dtype and FLOP/s > 0")

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

    @property
    def preferred_dtype(self) -> str:
        """The half-precision dtype the planner trains and serves in (bf16 where the device has it)."""
        return self.dtypes[0]


def _device(name: str, memory_gb: float, hbm_gbs: float, bf16: float | None, fp16: float, fp32: float,
            link: str, link_gbs: float, source: str) -> DeviceSpec:
    flops = ([("bf16", bf16 * TFLOPS)] if bf16 else []) + [("fp16", fp16 * TFLOPS), ("fp32", fp32 * TFLOPS)]
    return DeviceSpec(name=name, memory_bytes=int(memory_gb * GIB), hbm_bandwidth=hbm_gbs * GB,
                      flops=tuple(flops), link=link, link_bandwidth=link_gbs * GB, source=source)


# fp32 is the TF32 tensor-core rate where one exists (PyTorch's default for matmuls with allow_tf32).
# NVLink figures are the datasheet's bidirectional total halved; PCIe is x16 one direction.
_CATALOGUE = (
    _device("A100-40G", 40, 1555, 312, 312, 156, "NVLink", 300, "NVIDIA A100 datasheet (SXM4 40GB)"),
    _device("A100-80G", 80, 2039, 312, 312, 156, "NVLink", 300, "NVIDIA A100 datasheet (SXM4 80GB)"),
    _device("H100-80G", 80, 3350, 989, 989, 495, "NVLink", 450, "NVIDIA H100 datasheet (SXM5)"),
    _device("H200", 141, 4800, 989, 989, 495, "NVLink", 450, "NVIDIA H200 datasheet (SXM)"),
    _device("L40S", 48, 864, 362, 362, 183, "PCIe", 32, "NVIDIA L40S datasheet (PCIe Gen4 x16)"),
    _device("A10G", 24, 600, 125, 125, 62.5, "PCIe", 32, "NVIDIA A10 datasheet; AWS A10G has the A10's memory"),
    _device("T4", 16, 320, None, 65, 8.1, "PCIe", 16, "NVIDIA T4 datasheet (Turing: no bf16; PCIe Gen3)"),
    _device("V100-32G", 32, 900, None, 125, 15.7, "NVLink", 150, "NVIDIA V100 datasheet (SXM2; Volta: no bf16)"),
    _device("RTX-4090", 24, 1008, 165, 165, 82.6, "PCIe", 32, "NVIDIA Ada whitepaper (fp32 accumulate rate)"),
    _device("MI300X", 192, 5300, 1307, 1307, 654, "Infinity Fabric", 448, "AMD Instinct MI300X datasheet"),
    # Logical GPUs for CPU runs of tiny models: nominal figures, fp32 only (bf16 matmuls on CPU are slow).
    DeviceSpec(name="CPU", memory_bytes=16 * GIB, hbm_bandwidth=50 * GB, flops=(("fp32", 1 * TFLOPS),),
               link="host", link_bandwidth=10 * GB, source="nominal: one logical GPU per CPU worker"),
)

DEVICES: dict[str, DeviceSpec] = {device.name: device for device in _CATALOGUE}

# Short names users type; each maps to a catalogue entry.
ALIASES = {"A100": "A100-80G", "H100": "H100-80G", "V100": "V100-32G", "RTX4090": "RTX-4090", "4090": "RTX-4090",
           "A10": "A10G", "H200-141G": "H200", "MI300": "MI300X"}


def get_device(name: str) -> DeviceSpec:
    """The catalogue entry for ``name`` (case-insensitive; aliases such as ``H100`` accepted)."""
    by_upper = {key.upper(): key for key in DEVICES} | {key.upper(): value for key, value in ALIASES.items()}
    key = by_upper.get(name.strip().upper())
    if key is None:
        raise ValueError(f"unknown device {name!r}; known devices: {sorted(DEVICES)} (aliases: {sorted(ALIASES)})")
    return DEVICES[key]
