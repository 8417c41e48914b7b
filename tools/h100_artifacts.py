"""Cut the multi-GPU artifacts down to what lesson 06 § 6 draws (files under notebooks/data/).

    python tools/h100_artifacts.py trim TRACE.json notebooks/data/h100x4_pp2_tp2_sp_step.json
    python tools/h100_artifacts.py overlap PROFILE.json.gz notebooks/data/h100x4.json

* ``trim``: a Chrome trace written by ``python -m minipar train ... --trace FILE`` (or
  ``engine.train(trace=...)``; ``minipar.trace``) keeps its metadata and the events of
  its last step only: from the first compute action of that step (any rank) to the end.
  Times are shifted to start at 0 and rounded to 0.1 us; the result is still a Chrome
  trace (Perfetto opens it), with ``otherData`` saying where it came from.
* ``overlap``: a torch.profiler Chrome trace of one step on one rank (the gzipped file
  ``benchmarks/multigpu.py --sections overlap`` writes for rank 0 of dp N ZeRO-2)
  becomes two lanes of device intervals in ms, written under ``overlap.picture`` of the
  data JSON (every other key is kept): "compute" (kernels launched by the forward,
  by the autograd thread = backward, and after the backward = optimizer step; copies and
  memsets left out, as benchmarks/mg_overlap.py does) and "NCCL" (kernels whose name
  contains "nccl", by collective). Intervals of one kind closer than ``--gap-us`` are
  merged so the file stays small; ``stats`` holds the hidden share computed from the raw
  kernels with mg_overlap's interval arithmetic, so the merged picture can be checked
  against it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NCCL_KINDS = (("AllGather", "all-gather"), ("ReduceScatter", "reduce-scatter"),
              ("AllReduce", "all-reduce"), ("Broadcast", "broadcast"))


def trim_trace(trace: dict, source: str = "") -> dict:
    """Metadata plus the last step's events of a ``minipar.trace`` Chrome trace."""
    events = trace["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X"]
    last = max(e["args"].get("step", 0) for e in xs if e.get("tid") == 0)
    t0 = min(e["ts"] for e in xs if e.get("tid") == 0 and e["args"].get("step") == last)
    kept = [{**e, "ts": round(e["ts"] - t0, 1), "dur": round(e["dur"], 1)}
            for e in xs if e["ts"] >= t0]
    meta = [e for e in events if e.get("ph") == "M"]
    return {"traceEvents": meta + sorted(kept, key=lambda e: (e["pid"], e["tid"], e["ts"])),
            "displayTimeUnit": "ms",
            "otherData": {"source": source, "step": last, "offset_us": round(t0, 1),
                          "trimmed_by": "tools/h100_artifacts.py trim"}}


def merge(spans: list[tuple[float, float]], gap: float) -> list[list[float]]:
    """Sorted spans with the holes shorter than ``gap`` closed."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def kernel_kind(e: dict, launched: dict, first_backward: float, autograd: set) -> str | None:
    name = e["name"]
    if "nccl" in name.lower():
        return next((k for key, k in NCCL_KINDS if key in name), "comm")
    if e.get("cat") != "kernel":
        return None  # copies and memsets: device work, not compute
    rt = launched.get(e["args"].get("correlation"))
    if rt is None:
        return "forward"
    if rt["tid"] in autograd:
        return "backward"
    return "optimizer" if rt["ts"] > first_backward else "forward"


def overlap_picture(profile: dict, gap_us: float = 5.0, source: str = "") -> dict:
    """Two lanes of one profiled step on one device: compute and NCCL, in ms."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from mg_overlap import overlap_stats

    events = profile["traceEvents"]
    launched = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    autograd = {e["tid"] for e in events if e.get("ph") == "M" and
                e.get("name") == "thread_name" and "autograd" in str(e["args"]["name"])}
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    t0 = min(e["ts"] for e in device)
    backward = [launched[c]["ts"] for e in device
                if (c := e["args"].get("correlation")) in launched
                and launched[c]["tid"] in autograd]
    first_backward = min(backward, default=float("inf"))
    spans: dict[str, list] = {}
    for e in device:
        kind = kernel_kind(e, launched, first_backward, autograd)
        if kind is not None:
            spans.setdefault(kind, []).append((e["ts"] - t0, e["ts"] + e["dur"] - t0))
    lanes = {"compute": [], "NCCL": []}
    for kind, s in sorted(spans.items()):
        lane = "compute" if kind in ("forward", "backward", "optimizer") else "NCCL"
        lanes[lane] += [[round(a / 1e3, 3), round(b / 1e3, 3), kind] for a, b in merge(s, gap_us)]
    for lane in lanes.values():
        lane.sort()
    kernels = [(e["name"], (e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6,
                e["args"].get("stream", e["tid"])) for e in device]
    raw = overlap_stats(kernels)
    return {"source": source, "rank": profile.get("distributedInfo", {}).get("rank", 0),
            "merged_gap_us": gap_us, "lanes": lanes,
            "stats": {"nccl_ms": round(raw["comm_s"] * 1e3, 2),
                      "hidden_share": round(raw["hidden_share"], 4),
                      "step_ms": round(max(b for _, _, b, _ in kernels) * 1e3, 2)}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trim", help="keep the last step of a minipar trace")
    t.add_argument("src")
    t.add_argument("dst")
    o = sub.add_parser("overlap", help="compute / NCCL lanes of a profiler trace")
    o.add_argument("src")
    o.add_argument("dst", help="the data JSON; only overlap.picture is rewritten")
    o.add_argument("--gap-us", type=float, default=5.0)
    a = ap.parse_args(argv)
    opener = gzip.open if a.src.endswith(".gz") else open
    with opener(a.src, "rt") as f:
        src = json.load(f)
    if a.cmd == "trim":
        out = trim_trace(src, Path(a.src).name)
    else:
        out = json.loads(Path(a.dst).read_text()) if Path(a.dst).exists() else {}
        out.setdefault("overlap", {})["picture"] = overlap_picture(src, a.gap_us,
                                                                   Path(a.src).name)
    Path(a.dst).write_text(json.dumps(out, separators=(",", ":")) if a.cmd == "trim"
                           else json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.dst} ({Path(a.dst).stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
