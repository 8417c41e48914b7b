"""Readable text tables of the theory's results, for the command line and notebooks.

Each function takes the plain dicts and objects the theory returns and gives back one
string; nothing here computes anything new.
"""

from __future__ import annotations

from minipar.theory.planner import Plan

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "total")


def fmt_bytes(n: float) -> str:
    """Decimal units, as the papers and GPU data sheets quote memory: 1 GB = 1e9 bytes."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def render_memory(breakdown: dict, gpu_memory: float | None = None) -> str:
    """The five memory figures of ``memory_breakdown``, one per line, with shares."""
    total = breakdown["total"] or 1
    lines = [f"{'':<12} {'bytes':>12} {'share':>6}"]
    for k in MEMORY_KEYS:
        share = "" if k == "total" else f"{breakdown[k] / total:6.1%}"
        lines.append(f"{k:<12} {fmt_bytes(breakdown[k]):>12} {share:>6}")
    if "stage" in breakdown:
        lines.append(f"(pipeline stage {breakdown['stage']}, "
                     f"{breakdown.get('n_params', 0):,} parameters on this rank)")
    if gpu_memory:
        verdict = "fits" if breakdown["total"] <= gpu_memory else "does NOT fit"
        lines.append(f"{verdict} in {fmt_bytes(gpu_memory)}")
    return "\n".join(lines)


def render_comm(volume: dict) -> str:
    """A ``comm_volume`` prediction or a ``CommLog.summary()``: dim, op, calls, bytes."""
    lines = [f"{'dim':<6} {'op':<16} {'calls':>7} {'payload':>12} {'on the wire':>12}"]
    for dim in sorted(volume):
        for op, x in sorted(volume[dim].items()):
            lines.append(f"{dim:<6} {op:<16} {x['calls']:>7} {fmt_bytes(x['bytes']):>12} "
                         f"{fmt_bytes(x['wire_bytes']):>12}")
    return "\n".join(lines)


def render_plan(result: Plan, top: int = 10) -> str:
    """The ``top`` layouts of a plan as a table, then the explanation."""
    head = (f"{'#':>3} {'layout':<58} {'step s':>8} {'MFU':>5} {'memory':>10}  "
            + " ".join(f"{k:>7}" for k in result.time_keys))
    lines = [f"{result.model.n_layer}-layer model on {result.cluster.describe()}, "
             f"global batch {result.global_batch}", head]
    for i, est in enumerate(result.layouts[:top], 1):
        lines.append(f"{i:>3} {est.layout.label():<58} {est.step_time:>8.3g} {est.mfu:>5.0%} "
                     f"{fmt_bytes(est.memory['process']):>10}  "
                     + " ".join(f"{est.time[k]:>7.3g}" for k in result.time_keys))
    lines += ["", result.why()]
    return "\n".join(lines)
