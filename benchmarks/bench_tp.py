"""minipar's tensor parallelism against PyTorch's DTensor tensor parallelism, in one run.

The peer is ``torch.distributed.tensor.parallel``: ``parallelize_module`` on a
``DeviceMesh`` with ``ColwiseParallel`` / ``RowwiseParallel`` (and ``SequenceParallel``
plus ``PrepareModuleInput`` for sequence parallelism, the torchtitan recipe), its
vocabulary-parallel loss (``loss_parallel``), on the same GPT with the same weights.
For DTensor the fused qkv rows are reordered so that each rank's contiguous block holds
whole heads, and each attention module is told its local head count (as torchtitan does).

Every rank runs all four variants round-robin, one step each in turn, so background
load hits them alike; we report the median step time (forward, backward, AdamW step),
the ratio minipar / DTensor (target <= 1.0), and the bytes each moves per step: payload
and ring wire bytes per rank, from minipar's CommLog and from a dispatch mode that
records DTensor's functional collectives. The losses of the first step must agree
(same weights): that is the check that the peer is set up right.

    python benchmarks/bench_tp.py                # 2 and 4 ranks, model "small"
    python benchmarks/bench_tp.py --ranks 2 --steps 10 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from peers import dtensor_tp  # benchmarks/peers.py: the PyTorch-native peers
from torch.utils._python_dispatch import TorchDispatchMode

from minipar.comm import Comm, wire_bytes
from minipar.data import MarkovData
from minipar.launch import launch
from minipar.meter import saved_tensor_elements
from minipar.model import GPT, get_config
from minipar.parallel.tp import (
    apply_tensor_parallel,
    sync_sequence_parallel_grads,
)
from minipar.theory.activations import activation_elements_per_layer

VARIANTS = ("minipar", "minipar+sp", "dtensor", "dtensor+sp")


class CollectiveBytes(TorchDispatchMode):
    """Records (op, payload bytes) of every functional collective DTensor issues."""

    OPS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if DTensor in types:  # let DTensor desugar first, then see its collectives
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if "c10d" in packet.__module__ + str(packet) and packet.__name__ in self.OPS:
            op = self.OPS[packet.__name__]
            # payload: the input of an all-reduce / reduce-scatter, the gathered output
            t = out if op == "all_gather" else args[0]
            self.records.append((op, t.numel() * t.element_size()))
        return out


def dtensor_model(ref: GPT, ws: int, sp: bool) -> GPT:
    return dtensor_tp(ref, ws, sp, "cpu")


def _rank(model_name: str, batch: int, steps: int, warmup: int) -> dict:
    from torch.distributed.tensor.parallel import loss_parallel

    comm = Comm()
    cfg = get_config(model_name)
    torch.manual_seed(0)
    ref = GPT(cfg)
    models = {
        "minipar": apply_tensor_parallel(copy.deepcopy(ref), comm, False),
        "minipar+sp": apply_tensor_parallel(copy.deepcopy(ref), comm, True),
        "dtensor": dtensor_model(ref, comm.size, False),
        "dtensor+sp": dtensor_model(ref, comm.size, True),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    data = MarkovData(cfg.vocab_size, cfg.seq_len, seed=0)

    def step(name: str, x, y) -> float:
        model = models[name]
        if name.startswith("dtensor"):
            with loss_parallel():
                loss = model(x, y)
                loss.backward()
        else:
            loss = model(x, y)
            loss.backward()
            sync_sequence_parallel_grads(model, comm)
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return loss.item()

    out = {k: {"times": []} for k in VARIANTS}
    for s in range(warmup + steps):
        x, y = data.batch(s, batch)
        for name in VARIANTS:
            counter = CollectiveBytes() if s == 0 and name.startswith("dtensor") else None
            comm.log.clear()
            t0 = time.perf_counter()
            if counter is None:
                loss = step(name, x, y)
            else:
                with counter:
                    loss = step(name, x, y)
            elapsed = time.perf_counter() - t0
            if s == 0:
                recs = (counter.records if counter is not None
                        else [(r.op, r.nbytes) for r in comm.log.records])
                out[name].update(loss=loss, calls=len(recs),
                                 bytes=sum(n for _, n in recs),
                                 wire=sum(wire_bytes(op, n, comm.size) for op, n in recs))
            elif s >= warmup:
                out[name]["times"].append(elapsed)
    # Activations one layer keeps for backward (elements), measured on one block.
    for name, sp in (("minipar", False), ("minipar+sp", True)):
        block = models[name].blocks[0]
        h = torch.randn(batch, cfg.seq_len // (comm.size if sp else 1), cfg.d_model,
                        requires_grad=True)
        out[name]["saved"] = saved_tensor_elements(lambda b=block, h=h: b(h),
                                                   models[name].parameters())
    return out


def paper_activation_bytes(cfg, batch: int, tp: int, sp: bool) -> float:
    """Korthikanti et al. 2022, eqs. 2 and 4: one layer's activations in fp16 bytes."""
    s, b, h, a = cfg.seq_len, batch, cfg.d_model, cfg.n_head
    return s * b * h * ((34 if sp else 10 * tp + 24) / tp + 5 * a * s / (h * tp))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = {}
    for ws in args.ranks:
        res = launch(_rank, ws, args=(args.model, args.batch, args.steps, args.warmup),
                     timeout=1800)
        # A step ends when its slowest rank ends: take each step's max over ranks.
        row = {}
        for name in VARIANTS:
            per_step = [max(r[name]["times"][i] for r in res) for i in range(args.steps)]
            row[name] = {**{k: v for k, v in res[0][name].items() if k != "times"},
                         "median_ms": 1e3 * statistics.median(per_step)}
        report[ws] = row
        print(f"\n{ws} ranks, model {args.model}, batch {args.batch}, "
              f"{args.steps} timed steps (median of per-step max over ranks)")
        print(f"{'variant':<12} {'step ms':>9} {'loss(step 0)':>13} {'calls':>6} "
              f"{'payload MB':>11} {'wire MB':>8}")
        for name, r in row.items():
            print(f"{name:<12} {r['median_ms']:>9.2f} {r['loss']:>13.6f} {r['calls']:>6} "
                  f"{r['bytes'] / 1e6:>11.3f} {r['wire'] / 1e6:>8.3f}")
        for mine, peer in (("minipar", "dtensor"), ("minipar+sp", "dtensor+sp")):
            print(f"ratio {mine} / {peer}: time "
                  f"{row[mine]['median_ms'] / row[peer]['median_ms']:.3f}, wire bytes "
                  f"{row[mine]['wire'] / row[peer]['wire']:.3f}, loss diff "
                  f"{abs(row[mine]['loss'] - row[peer]['loss']):.1e}")
        cfg = get_config(args.model)
        nosp, sp = row["minipar"]["saved"], row["minipar+sp"]["saved"]
        derived = [activation_elements_per_layer(cfg, args.batch, ws, x) for x in (0, 1)]
        paper = [paper_activation_bytes(cfg, args.batch, ws, x) for x in (False, True)]
        print(f"activations per layer per rank (elements): no SP {nosp}, SP {sp}, "
              f"measured ratio {nosp / sp:.3f}; derived {derived[0]} / {derived[1]} = "
              f"{derived[0] / derived[1]:.3f}; paper (fp16 bytes, with masks and s x s "
              f"scores) {paper[0] / paper[1]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
