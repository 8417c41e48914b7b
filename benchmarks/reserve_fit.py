"""The caching allocator's reserve over the live tensors, fitted to the cards: the
constants of ``minipar.theory.card.RESERVE_FITS``.

Reads every row ``benchmarks/card_memory.py`` recorded on H100 80GB or H200 cards, four
or one (``results/card-memory-*xH100-*.json``, ``*xH200-*``; the reserve is the
allocator's, the same on both cards while a run stays away from the capacity), rebuilds
each row's
layout from its own command through the command line's parser, with the optimizer
kernel it ran, and predicts its live-tensor peak (``memory_per_stage``: of the first and
last stages, the one with the most live bytes, before the reserve this fit makes). Then,
per optimizer kernel, it fits

    reserve = factor x live + bytes (ZeRO 0-2)  or  zero3_factor x live + zero3_bytes
              + zero1_share x gradient buffer (ZeRO-1) + pipeline_share x it (pp > 1)
              + loss_share x loss workspace

by least squares on the relative error, over the rows whose measured reserve stayed
6 GiB under their card's capacity (nearer, the allocator frees its cache and retries:
those rows say what fits, not what is reserved). It prints the constants and each row's
error, and the live-tensor peak's error over every row.

    PYTHONPATH=. python benchmarks/reserve_fit.py
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minipar.__main__ import build_parser, train_config
from minipar.theory import clusters
from minipar.theory.card import FIT_OF_KERNEL, ReserveFit
from minipar.theory.layout import Layout
from minipar.theory.memory import memory_per_stage

RESULTS = Path(__file__).resolve().parent / "results"
PATTERNS = ("card-memory-*xH100-*.json", "card-memory-*xH200-*.json")
GiB = 2**30
# The allocator's domain: a reserve this far under the card's capacity was not squeezed.
HEADROOM = 6 * GiB


@dataclass
class Row:
    """One recorded run: its file's card, the row as written, and what it predicts."""
    card: str
    capacity: int
    row: dict
    model: str
    layout: Layout
    live: int  # the predicted live-tensor peak of the busiest stage
    grads: int  # that stage's gradient buffer
    loss: int  # that stage's loss workspace (the logits over the vocabulary)
    reserved: int  # measured: the largest peak reserve over the ranks
    allocated: int  # measured: the largest live-tensor peak over the ranks

    @property
    def in_domain(self) -> bool:
        return self.reserved < self.capacity - HEADROOM


def layout_of(row: dict) -> tuple[str, Layout]:
    """The model and layout of a recorded row's command, as ``train`` parses it, with
    the optimizer kernel it stepped with (rows before ``--no-fused`` ran the
    multi-tensor kernel without the flag) and its blocks compiled or eager as they ran
    (rows before ``--compile`` existed ran eager)."""
    words = row["command"].split()[3:]  # after "python -m minipar"
    cfg = train_config(build_parser().parse_args(words))
    return cfg.model, cfg.layout("cuda").with_(optimizer_kernel=row["optimizer_kernel"],
                                               compiled=bool(row.get("compiled")))


def _held_module_outputs(path: Path, row: dict) -> bool:
    """A ZB-H1 row recorded before its split backward kept graph nodes instead of module
    outputs (2026-12-06): that engine held 2 sbh bytes more a block and micro-batch in
    flight, which the model no longer counts (rehearsal-1xH100-2026-12-06r2-zb.json
    measures the engine as it is)."""
    date = re.search(r"20\d\d-\d\d-\d\d", path.name)
    return "--schedule zb" in row.get("command", "") and bool(date) and date[0] < "2026-12-06"


def recorded_rows(results: Path = RESULTS) -> list[Row]:
    """Every run that finished, the latest of each (card, command, kernel, compiled)."""
    rows, seen = [], set()
    paths = sorted((p for pattern in PATTERNS for p in results.glob(pattern)), reverse=True)
    for path in paths:
        report = json.loads(path.read_text())
        gpu = clusters.GPUS[clusters.gpu_for_device(report["meta"].get("device", ""))]
        card = gpu.name.split("-")[0]  # H100, H200
        capacity = report["meta"].get("capacity") or gpu.memory
        for row in report["rows"]:
            key = (card, row.get("command"), row.get("optimizer_kernel"), row.get("compiled"))
            if row.get("status") != "ok" or key in seen or _held_module_outputs(path, row):
                continue
            seen.add(key)
            model, lay = layout_of(row)
            stages = memory_per_stage(model, lay, accounting="fused",
                                      stages=sorted({0, lay.pp - 1}))
            busiest = max(stages, key=lambda r: r["total"])
            reserved = max(r["device_memory"]["peak_reserved"] for r in row["ranks"])
            allocated = max(r["device_memory"]["peak_allocated"] for r in row["ranks"])
            rows.append(Row(card, capacity, row, model, lay, busiest["total"],
                            busiest["grads"], busiest.get("loss_workspace", 0), reserved,
                            allocated))
    return rows


def _terms(r: Row) -> list[float]:
    zero3, zero = r.layout.zero == 3, r.layout.zero
    return [r.live * (not zero3), float(not zero3), r.live * zero3, float(zero3),
            r.grads * (zero == 1), r.grads * (r.layout.pp > 1 and not zero3), r.loss]


def fit(rows: list[Row]) -> dict[str, ReserveFit]:
    """The least-squares fit (relative error) of each kernel's rows in the domain."""
    out = {}
    for name in sorted(set(FIT_OF_KERNEL.values())):
        mine = [r for r in rows if r.in_domain
                and FIT_OF_KERNEL[r.layout.optimizer_kernel] == name]
        a = np.array([[t / r.reserved for t in _terms(r)] for r in mine])
        c, *_ = np.linalg.lstsq(a, np.ones(len(mine)), rcond=None)
        out[name] = ReserveFit(factor=round(c[0], 3), extra=round(c[1] / GiB, 3) * GiB,
                               zero3_factor=round(c[2], 3),
                               zero3_extra=round(c[3] / GiB, 3) * GiB,
                               zero1_share=round(c[4], 3), pipeline_share=round(c[5], 3),
                               loss_share=round(c[6], 3))
    return out


def main() -> int:
    rows = recorded_rows()
    fits = fit(rows)
    for name, f in fits.items():
        print(f"{name}: ReserveFit({f.factor}, {f.extra / GiB:.3f} * 2**30, {f.zero3_factor}, "
              f"{f.zero3_extra / GiB:.3f} * 2**30, {f.zero1_share}, {f.pipeline_share}, "
              f"{f.loss_share})")
    for name, f in fits.items():
        errors = []
        for r in rows:
            if FIT_OF_KERNEL[r.layout.optimizer_kernel] != name:
                continue
            e = f.reserved(r.live, r.grads, r.layout.zero, r.layout.pp, r.loss) / r.reserved - 1
            errors += [abs(e)] if r.in_domain else []
            print(f"  {name:<7} {r.card} {r.model:<8} {r.layout.label():<66} "
                  f"{r.reserved / GiB:5.1f} GiB {e:+.3f}{'' if r.in_domain else ' (outside)'}")
        print(f"{name}: {len(errors)} rows, largest error {max(errors):.3f}, "
              f"median {float(np.median(errors)):.3f}")
    # before any fit: the memory model's live peak against the measured one
    live = sorted(r.live / r.allocated - 1 for r in rows)
    print(f"live peak, every row ({len(live)}): {live[0]:+.3f} .. {live[-1]:+.3f}, median "
          f"|error| {float(np.median(np.abs(live))):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
