"""Hardware presets for the planner: GPUs, and clusters built from them.

Numbers are from the vendors' data sheets, rounded; they are what the planner assumes,
not measurements:

* memory: what ``nvidia-smi`` reports, in MiB, as bytes: an "80 GB" A100 has 81920
  MiB, an H100 SXM 81559 MiB (80 GB of HBM3; a figure often quoted gives the H100
  141 GB, which is the H200's HBM3e: 143771 MiB), a B200 183359 MiB (sold as 192 GB,
  180 GB usable).
* peak_flops: dense bf16 tensor-core FLOP/s (the sparse figures are twice that).
* fp8_flops: dense float8 tensor-core FLOP/s (H100 SXM and H200 1,979 T, B200 4,500 T);
  0 for a GPU without float8 matmuls (A100: compute capability 8.0), on which
  ``--fp8`` is refused (``check_fp8_card``).
* nvlink: NVLink bandwidth per GPU *per direction* (the data sheets quote both
  directions together: A100 600 GB/s, H100/H200 900 GB/s, B200 1.8 TB/s). A ring
  collective's time is its wire bytes over this.
* network: inter-node bandwidth per GPU per direction, one InfiniBand NIC per GPU as in
  DGX systems (HDR 200 Gb/s for A100, NDR 400 Gb/s for H100 and later).
* memory_bandwidth: the data sheet's device-memory bandwidth (A100 40 GB 1.555 TB/s,
  80 GB 2.039, H100 SXM 3.35, H200 4.8, B200 8): what prices work that only moves
  bytes through a GPU's own memory.

``calibrated(cluster, calibration)`` swaps the data sheet for one machine's measured
rates (``benchmarks/multigpu.py --sections calibrate`` writes them; ``python -m minipar
plan --calibrate FILE`` reads them): the bf16 matmul rate, and per collective the
latency and bandwidth (wire bytes per second per GPU, as ``minipar.comm.wire_bytes``
counts them) inside one node; with newer files also each op's time per message size,
the transformer block's measured pace and sequence parallelism's extra cost per layer,
the head and loss's pace, and the optimizer step and gradient accumulation per
parameter (``minipar.theory.rates``). Files without these still load: the planner then
uses the matmul rate and the alpha-beta fits, and leaves the optimizer out.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from functools import cache

from minipar.model import did_you_mean

MiB = 2**20
GB = 10**9


@dataclass(frozen=True)
class GPU:
    """One accelerator's capacity, as the planner models it."""

    name: str
    memory: int          # bytes
    peak_flops: float    # dense bf16 FLOP/s
    nvlink: float        # bytes/s per GPU per direction, inside a node
    network: float       # bytes/s per GPU per direction, between nodes
    memory_bandwidth: float = 0.0  # bytes/s of its own memory, the spec (0: not known)
    fp8_flops: float = 0.0  # dense float8 FLOP/s (0: no float8 matmuls)


GPUS: dict[str, GPU] = {
    "A100-40GB": GPU("A100-40GB", 40960 * MiB, 312e12, 300 * GB, 25 * GB, 1555 * GB),
    "A100-80GB": GPU("A100-80GB", 81920 * MiB, 312e12, 300 * GB, 25 * GB, 2039 * GB),
    "H100-80GB": GPU("H100-80GB", 81559 * MiB, 989e12, 450 * GB, 50 * GB, 3350 * GB,
                     1979e12),
    "H200-141GB": GPU("H200-141GB", 143771 * MiB, 989e12, 450 * GB, 50 * GB, 4800 * GB,
                      1979e12),
    "B200": GPU("B200", 183359 * MiB, 2250e12, 900 * GB, 50 * GB, 8000 * GB, 4500e12),
}


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs of one kind, ``gpus_per_node`` per node (the NVLink domain).

    ``latency`` is a per-collective start-up cost in seconds (the alpha of the
    alpha-beta model); it matters for the many small tensor-parallel collectives.
    """

    name: str
    gpus: int
    gpu: GPU
    gpus_per_node: int = 8
    latency: float = 10e-6
    # measured (``calibrated``): the matmul FLOP/s one GPU reaches, and inside a node,
    # per collective op, (op, latency in s, wire bytes per s per GPU)
    matmul_flops: float | None = None
    links: tuple[tuple[str, float, float], ...] = ()
    # measured paces (``minipar.theory.rates`` reads them): per collective op (op,
    # payload bytes, bus bandwidth at each); the block (hidden, tokens, tp, FLOP/s)
    curves: tuple[tuple[str, tuple[float, ...], tuple[float, ...]], ...] = ()
    block_rates: tuple[tuple[int, int, int, float], ...] = ()
    # the head and loss's pace (hidden, tokens, tp, FLOP/s over 6 V h / tp per token);
    # seconds per parameter of the optimizer step (clip, AdamW, the 16-bit copy) and of
    # one micro-batch's gradient accumulation into the fp32 buffer (0: not measured)
    head_rates: tuple[tuple[int, int, int, float], ...] = ()
    step_s_per_param: float = 0.0
    accumulate_s_per_param: float = 0.0
    # the engine on this machine's host (0: not measured): the seconds its Python host
    # takes to launch one layer's forward and backward for one micro-batch
    host_s_per_layer: float = 0.0
    # ZeRO-Offload's host AdamW, parameters a second per rank (0: ``theory.offload``'s)
    host_adam_params_per_s: float = 0.0
    # bytes of host memory a node has, which ``--offload``'s states share (0: not known,
    # not checked): the DGX data sheets' for the named clusters, a calibration file's,
    # ``plan --host-memory``
    host_memory: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("a cluster needs at least one GPU and one GPU per node")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"{self.gpus} GPUs do not fill nodes of {self.gpus_per_node}")

    @property
    def gpu_memory(self) -> int:
        return self.gpu.memory

    @property
    def peak_flops(self) -> float:
        return self.gpu.peak_flops

    @property
    def intra_bw(self) -> float:
        return self.gpu.nvlink

    @property
    def inter_bw(self) -> float:
        return self.gpu.network

    @property
    def matmul_rate(self) -> float:
        """FLOP/s the step-time model divides by (before its efficiency factor): the
        measured matmul rate when calibrated, else the data sheet's peak."""
        return self.matmul_flops or self.gpu.peak_flops

    def link(self, op: str, spans_nodes: bool) -> tuple[float, float]:
        """(bandwidth, latency) of one ``op`` in a group inside a node or across nodes:
        the measured figures for ``op`` when calibrated, else the presets. An all-to-all
        not calibrated takes the all-gather's (each rank sends (n-1)/n of its payload)."""
        if spans_nodes:
            return self.inter_bw, self.latency
        measured = {name: (bw, lat) for name, lat, bw in self.links}
        op = "send" if op == "recv" else op
        if op == "all_to_all" and op not in measured:
            op = "all_gather"
        return measured.get(op, (self.intra_bw, self.latency))

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def with_(self, **changes) -> Cluster:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {**asdict(self), "gpu": asdict(self.gpu)}

    def describe(self) -> str:
        g = self.gpu
        return (f"{self.gpus} x {g.name} ({self.nodes} node(s) of {self.gpus_per_node}; "
                f"{g.memory / GB:.0f} GB, {g.peak_flops / 1e12:.0f} TFLOP/s bf16, "
                f"NVLink {g.nvlink / GB:.0f} GB/s, network {g.network / GB:.0f} GB/s "
                "per GPU and direction)")


# GPU kinds whose paces were measured (``benchmarks/multigpu.py --sections calibrate``):
# their preset clusters price a step at those paces (the block at each micro-batch size
# and tp share, each collective at its payload, the head, the optimizer), which the data
# sheet's peak times one efficiency cannot (it priced gpt-1.3b at micro-batch 1 three
# times too fast). The file ships with the package; ``--calibrate`` replaces it.
MEASURED_PACES = {"H100-80GB": "calibration-h100.json"}  # 4 x H100 80GB, torch 2.11


def cluster(gpus: int, gpu: str | GPU = "A100-80GB", gpus_per_node: int = 8,
            name: str | None = None, measured: bool = True, **kw) -> Cluster:
    """A cluster of ``gpus`` GPUs of a preset kind (see ``GPUS``), at the kind's measured
    paces when it has them (``MEASURED_PACES``) and ``measured`` is true."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    c = Cluster(name or f"{gpus}x{g.name}", gpus, g, min(gpus_per_node, gpus), **kw)
    if measured and g.name in MEASURED_PACES:
        paces = _measured_paces(MEASURED_PACES[g.name])
        c = replace(calibrated(c, paces), name=c.name, gpu=g)  # the card's own memory
    return c


@cache
def _measured_paces(filename: str) -> dict:
    with open(os.path.join(os.path.dirname(__file__), filename)) as f:
        return json.load(f)




CALIBRATED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf


def load_calibration(path: str) -> dict:
    """Read a calibration file and check it has what ``calibrated`` uses: ``matmul_tflops``
    and ``collectives`` {op: {``latency_s``, ``bus_bandwidth`` (bytes/s)}}."""
    if not os.path.isfile(path):  # a FIFO would block the read forever
        raise ValueError(f"--calibrate {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            calib = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--calibrate {path}: not a readable calibration JSON "
                         f"({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(calib, dict) or not isinstance(calib.get("collectives", {}), dict):
        raise ValueError(f"--calibrate {path}: a JSON object with matmul_tflops and "
                         "collectives is needed")
    if not _positive(calib.get("matmul_tflops")):
        raise ValueError(f"{path}: no matmul_tflops (a number, TFLOP/s) in the calibration")
    for op, row in calib.get("collectives", {}).items():
        if not isinstance(row, dict) or not all(_positive(row.get(k))
                                                for k in ("latency_s", "bus_bandwidth")):
            raise ValueError(f"{path}: collective {op!r} needs positive latency_s and "
                             "bus_bandwidth")
    return calib


def calibrated(base: Cluster, calib: dict) -> Cluster:
    """``base`` with one machine's measured rates (see ``load_calibration``): matmul rate,
    collective latencies and bandwidths inside a node, the memory one GPU has
    (``memory_bytes``, when measured) and the node's host memory (``host_memory_bytes``,
    in files written since it was recorded), and the engine's host (``engine``; else ``base``'s,
    as a file of collective and kernel rates does not measure it). The peak stays the
    data sheet's: MFU is over it."""
    links = tuple((op, float(row["latency_s"]), float(row["bus_bandwidth"]))
                  for op, row in sorted(calib.get("collectives", {}).items())
                  if op in CALIBRATED_OPS)
    curves = tuple((op, tuple(row["bytes"]), rising(row["bus_bandwidth_per_size"]))
                   for op, row in sorted(calib.get("collectives", {}).items())
                   if op in CALIBRATED_OPS and row.get("bus_bandwidth_per_size"))
    blocks, heads = (tuple((r["hidden"], r["tokens"], r["tp"], r["tflops"] * 1e12)
                           for r in calib.get(key, [])) for key in ("block_rates", "head_rates"))
    gpu, engine = base.gpu, calib.get("engine", {})
    if calib.get("memory_bytes"):
        gpu = replace(gpu, memory=int(calib["memory_bytes"]))
    host = int(calib.get("host_memory_bytes") or base.host_memory)  # (the node's, if read)
    return replace(base, gpu=gpu, matmul_flops=float(calib["matmul_tflops"]) * 1e12,
                   links=links, curves=curves, block_rates=blocks,
                   head_rates=heads,
                   step_s_per_param=_per_param(calib, "optimizer_step"),
                   accumulate_s_per_param=_per_param(calib, "grad_accumulate"),
                   host_s_per_layer=float(engine.get("host_s_per_layer",
                                                     base.host_s_per_layer)),
                   host_adam_params_per_s=float(engine.get("host_adam_params_per_s",
                                                           base.host_adam_params_per_s)),
                   host_memory=host, name=base.name + " (calibrated)")


def rising(bandwidths: list[float]) -> tuple[float, ...]:
    """A per-size bus-bandwidth curve (sizes ascending) as its running maximum.

    A call of k x s bytes can always go as k calls of s, so its bus bandwidth is at
    least the one measured at s: a real curve does not fall as the message grows. A
    point that does fall was slowed by something else (a stall, another process, the
    clock) in its few timed iterations; noise only ever adds time. Read as measured,
    one such point on 4 x H200 (all_reduce at 67 MB: 49 GB/s between 258 and 326 GB/s)
    priced every all-reduce of a tp 4 layer 5x too slow (gpt-1.3b: 0.28 s predicted,
    0.13 s measured). The envelope keeps the fastest reading at or below each size; files
    written since ``benchmarks/multigpu.py`` took the median of repeated timings have
    fewer such points, older ones are read sanely too."""
    out, top = [], 0.0
    for bw in bandwidths:
        top = max(top, float(bw))
        out.append(top)
    return tuple(out)


def _per_param(calib: dict, key: str) -> float:
    return float(calib.get(key, {}).get("seconds_per_param", 0.0))


def gpu_for_device(name: str) -> str:
    """The GPU preset closest to a CUDA device name (``torch.cuda.get_device_name``)."""
    for key, preset in (("H200", "H200-141GB"), ("H100", "H100-80GB"), ("B200", "B200"),
                        ("A100", "A100-80GB")):
        if key in name.upper():
            return preset
    return "H100-80GB"


def check_fp8_card(cluster: Cluster) -> None:
    """Raise ValueError (one line) if ``cluster``'s GPU has no float8 matmuls to plan
    ``--fp8`` on."""
    if not cluster.gpu.fp8_flops:
        have = [name for name, g in GPUS.items() if g.fp8_flops]
        raise ValueError(f"--fp8 needs GPUs with float8 matmuls: {cluster.gpu.name} has none "
                         f"({', '.join(have)} have them); plan without --fp8")


def get_cluster(name_or_cluster: str | Cluster) -> Cluster:
    if isinstance(name_or_cluster, Cluster):
        return name_or_cluster
    try:
        return CLUSTERS[name_or_cluster]
    except KeyError:
        raise ValueError(f"unknown cluster {name_or_cluster!r}"
                         f"{did_you_mean(name_or_cluster, CLUSTERS)}; choose one of "
                         f"{sorted(CLUSTERS)} or build one with cluster(...)") from None


# Host memory per node, from the data sheets: DGX A100 (640 GB) and DGX H100/H200 2 TB.
DGX_HOST_MEMORY = 2 * 10**12

CLUSTERS: dict[str, Cluster] = {
    name: cluster(gpus, gpu, name=name, host_memory=DGX_HOST_MEMORY)
    for name, gpus, gpu in (("dgx-a100", 8, "A100-80GB"), ("a100x64", 64, "A100-80GB"),
                            ("a100x1024", 1024, "A100-80GB"), ("a100x4096", 4096, "A100-80GB"),
                            ("dgx-h100", 8, "H100-80GB"), ("h100x64", 64, "H100-80GB"),
                            ("h100x1024", 1024, "H100-80GB"), ("h200x8", 8, "H200-141GB"))
}
