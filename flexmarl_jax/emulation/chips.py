"""The accelerators an emulated run can pretend to have: each one's published peak figures.

Every number is the vendor's public spec-sheet figure for one chip (dense, no sparsity), with the page it
comes from beside it. Where a page states a figure in more than one way, the comment says which one is used
and why. Pure Python (no JAX): the config and the benches resolve chips before anything heavy starts.

Units: FLOP/s, bytes/s and bytes, in SI (1 GB = 1e9 bytes), as the spec sheets print them.

Interconnect figures are the spec sheets' *bidirectional* bandwidth per chip (all of a chip's links, both
directions together). One direction of that is half: a ring collective or a point-to-point copy sends over
each link one way at a time, so the cost model uses `interconnect_one_way_bytes_per_s`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's published peaks.

    name: the key `--emulate CHIP:MODEL` takes.
    title: the product name.
    peak_bf16_flops: dense bf16 matmul peak, FLOP/s.
    hbm_bytes_per_s: HBM bandwidth, bytes/s.
    hbm_bytes: HBM capacity, bytes.
    interconnect: the chip-to-chip link's name (ICI, NVLink).
    interconnect_bytes_per_s: its bidirectional bandwidth per chip, bytes/s.
    source: the spec page the figures come from.
    call_overhead_s: fixed seconds every device call (a prefill, a decode step, a training micro-batch, an
      apply) takes on top of its roofline: dispatch and launch. Spec sheets publish none, and next to a 14B
      model's milliseconds it is small, so the spec-sheet chips leave it 0; a measured chip (this host,
      `emulation/host_probe.py`) carries what was measured, where a tiny model's calls are mostly this.
    one_device: every emulated device of a run is this same machine (this host: the fake XLA CPU devices of a
      run share its two cores), so the engines' calls queue on one timeline and the trainers' calls (and
      weight syncs) on another. Why two: a tiny model's engine call is mostly the rollout loop's Python, which
      holds the interpreter lock, so instances do not overlap each other; a training micro-batch is one XLA
      program, which runs beside the loop on the other core. The two timelines still share the cores: while
      both have work, each runs slower, by the two factors below. False for real chips.
    engine_slowdown_beside_training: on a `one_device` chip, how many times longer an engine call takes while
      a training call runs beside it (measured: `host_probe.probe_programs`); 1 = no contention.
    training_slowdown_beside_engines: likewise for a training call (or weight sync) while engines decode.
    """

    name: str
    title: str
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    interconnect: str
    interconnect_bytes_per_s: float
    source: str
    call_overhead_s: float = 0.0
    one_device: bool = False
    engine_slowdown_beside_training: float = 1.0
    training_slowdown_beside_engines: float = 1.0

    def __post_init__(self):
        for field in ("engine_slowdown_beside_training", "training_slowdown_beside_engines"):
            value = getattr(self, field)
            if not value >= 1.0:
                raise ValueError(f"chip {self.name!r}: {field}={value!r} must be >= 1 (1 = no contention)")
            if value > 1.0 and not self.one_device:
                raise ValueError(f"chip {self.name!r}: {field}={value!r} applies only to a one_device chip")

    @property
    def interconnect_one_way_bytes_per_s(self) -> float:
        """What one direction of the chip's links carries: half the published bidirectional figure."""
        return self.interconnect_bytes_per_s / 2


@dataclasses.dataclass(frozen=True)
class Link:
    """A data path between meshes or hosts, one direction: `bytes_per_s` after `latency_s` per transfer."""

    name: str
    bytes_per_s: float
    latency_s: float = 0.0


def _spec_sheet_chip(name: str, title: str, *, bf16_tflops: float, hbm_gb_per_s: float, hbm_gb: float,
                     interconnect: str, interconnect_gb_per_s: float, source: str) -> Chip:
    """A `Chip` from its spec sheet's figures in the units the sheets print them (TFLOP/s, GB/s, GB)."""
    return Chip(name=name, title=title, peak_bf16_flops=bf16_tflops * 1e12, hbm_bytes_per_s=hbm_gb_per_s * 1e9,
                hbm_bytes=hbm_gb * 1e9, interconnect=interconnect,
                interconnect_bytes_per_s=interconnect_gb_per_s * 1e9, source=source)


CHIPS: dict[str, Chip] = {chip.name: chip for chip in (
    # Cloud TPU v5e page, "System architecture" table: 197 TFLOPs bf16 per chip; HBM2 16 GB at 819 GBps;
    # bidirectional ICI bandwidth 400 GBps per chip. (An older version of the page gave the ICI figure as
    # "1600 Gbps" = 200 GB/s; the current table's 400 GBps bidirectional is used.)
    _spec_sheet_chip("v5e", "Cloud TPU v5e", bf16_tflops=197, hbm_gb_per_s=819, hbm_gb=16, interconnect="ICI",
                     interconnect_gb_per_s=400, source="https://cloud.google.com/tpu/docs/v5e"),
    # Cloud TPU v5p page, key specifications: 459 TFLOPs bf16 per chip; HBM2e 95 GB at 2765 GBps;
    # bidirectional ICI bandwidth 1200 GBps per chip (older wording: "4800 Gbps").
    _spec_sheet_chip("v5p", "Cloud TPU v5p", bf16_tflops=459, hbm_gb_per_s=2765, hbm_gb=95, interconnect="ICI",
                     interconnect_gb_per_s=1200, source="https://cloud.google.com/tpu/docs/v5p"),
    # Cloud TPU v6e (Trillium) page, "System architecture" table: 918 TFLOPs bf16 per chip; HBM 32 GB at
    # 1638 GBps; bidirectional ICI bandwidth 800 GBps per chip.
    _spec_sheet_chip("v6e", "Cloud TPU v6e (Trillium)", bf16_tflops=918, hbm_gb_per_s=1638, hbm_gb=32,
                     interconnect="ICI", interconnect_gb_per_s=800, source="https://cloud.google.com/tpu/docs/v6e"),
    # NVIDIA H100 product page / datasheet, SXM column: BF16 Tensor Core 1,979 TFLOPS "with sparsity", so
    # 989.5 TFLOPS dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s (bidirectional per GPU).
    _spec_sheet_chip("h100", "NVIDIA H100 SXM", bf16_tflops=989.5, hbm_gb_per_s=3350, hbm_gb=80,
                     interconnect="NVLink", interconnect_gb_per_s=900,
                     source="https://www.nvidia.com/en-us/data-center/h100/"),
    # NVIDIA H200 product page / datasheet, SXM column: BF16 Tensor Core 1,979 TFLOPS with sparsity (989.5
    # dense, the same Hopper die as H100); 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
    _spec_sheet_chip("h200", "NVIDIA H200 SXM", bf16_tflops=989.5, hbm_gb_per_s=4800, hbm_gb=141,
                     interconnect="NVLink", interconnect_gb_per_s=900,
                     source="https://www.nvidia.com/en-us/data-center/h200/"),
)}

# Links between meshes that are not one chip's interconnect, one direction each.
LINKS: dict[str, Link] = {
    # PCIe 5.0 x16: 32 GT/s x 16 lanes with 128b/130b encoding ~ 63 GB/s per direction (PCI-SIG's PCIe 5.0
    # base specification; NVIDIA's H100/H200 pages print it as "PCIe Gen5: 128 GB/s", both directions).
    "pcie5": Link("pcie5", 63e9),
    # PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b ~ 31.5 GB/s per direction (PCI-SIG's PCIe 4.0 spec).
    "pcie4": Link("pcie4", 31.5e9),
    # A 100 Gbit/s data-center NIC (TPU v5e hosts have two: the v5e page's "2 x 100 Gbps NIC" per host).
    "dcn100": Link("dcn100", 12.5e9),
}


def register_chip(chip: Chip) -> Chip:
    """Adds a measured chip (this host's, `emulation/host_probe.py`) to `CHIPS` for this process, so that
    `--emulate NAME:MODEL` can name it; a spec-sheet chip's name is refused."""
    if chip.name in CHIPS and CHIPS[chip.name].source.startswith("https://"):
        raise ValueError(f"chip name {chip.name!r} is a spec-sheet chip's; a measured chip needs another name")
    CHIPS[chip.name] = chip
    return chip


def get_chip(name: str) -> Chip:
    """The chip called `name` (case-insensitive); ValueError naming the value and the choices otherwise."""
    chip = CHIPS.get(str(name).strip().lower())
    if chip is None:
        raise ValueError(f"unknown chip {name!r}; choices: {', '.join(sorted(CHIPS))}")
    return chip


def interconnect_link(chip: Chip) -> Link:
    """A chip's own interconnect as a `Link` (one direction): weight copies between meshes of one slice."""
    return Link(f"{chip.name}-{chip.interconnect.lower()}", chip.interconnect_one_way_bytes_per_s)


def get_link(name: str, chip: Chip | None = None) -> Link:
    """A link by name: one of `LINKS`, or "ici"/"nvlink" for `chip`'s interconnect; ValueError otherwise."""
    key = str(name).strip().lower()
    if chip is not None and key == chip.interconnect.lower():
        return interconnect_link(chip)
    if key in LINKS:
        return LINKS[key]
    own = [chip.interconnect.lower()] if chip is not None else []
    raise ValueError(f"unknown link {name!r}; choices: {', '.join(own + sorted(LINKS))}")
