"""Cases for the 1F1B exercise (lesson 05).

Pure cases first (pp 2..4, then pp 1, where 1F1B and GPipe differ least; m 1..7): the
compute order holds each F and B once on the right rank and equals the library's 1F1B
(compared before the sends and receives are inserted, so that an order that deadlocks
is named by its first wrong action, with its case), the runnable lists pass
``schedules.validate``, the simulated bubble equals the closed form and the library's
1F1B, and the peak in-flight count is 1F1B's min(m, p - r), not GPipe's m. Then the
lists drive the real executor on 2 ranks and the loss and gradients must equal one
process on the whole batch.
"""

from __future__ import annotations

import importlib

import torch

from minipar.comm import Comm
from minipar.data import MarkovData, split_batch
from minipar.model import GPT, get_config
from minipar.parallel.pp import PipelineExecutor, build_stage
from minipar.parallel.schedules import ScheduleError, make_schedule, validate
from minipar.theory import bubble

from ..check import CheckFailure, expect, launch_case

CFG = get_config("tiny").with_(n_layer=4)
BATCH, M = 12, 3


def _diff(got, want) -> str | None:
    """The first position where two per-rank compute orders differ, in words."""
    for r, (g, w) in enumerate(zip(got, want)):
        for k in range(max(len(g), len(w))):
            a = g[k].short() if k < len(g) else "nothing"
            b = w[k].short() if k < len(w) else "nothing"
            if a != b:
                return (f"rank {r}, position {k}: expected {b}, got {a} (rank {r} runs "
                        f"{' '.join(x.short() for x in g)}; 1F1B runs "
                        f"{' '.join(x.short() for x in w)})")
    return None


def _compute(name: str, p: int, m: int) -> list:
    """The library's compute order (no sends or receives) for ``name``."""
    return [[a for a in acts if a.kind in ("F", "B")] for acts in make_schedule(name, p, m)]


def _forwards_before_first_b(acts) -> int:
    """How many F a rank's list runs before its first B (all of them if it has none)."""
    kinds = [a.kind for a in acts]
    return kinds.index("B") if "B" in kinds else kinds.count("F")


def _is_gpipe(mod, p: int) -> bool:
    """Whether the learner's order is GPipe's for every m at this pp (so the GPipe hint
    fits; an order that matches GPipe only where m is small is some other mistake)."""
    try:
        return all(mod.one_f_one_b_compute(p, m) == _compute("gpipe", p, m)
                   for m in range(2, 8))
    except Exception:
        return False


def _order_hint(mod, compute, reference, p: int, m: int) -> str:
    """What to look at, for the first rank whose order differs from 1F1B's."""
    if _is_gpipe(mod, p):
        return "that is GPipe's order: all forwards first holds m micro-batches"
    r = next(r for r, (g, w) in enumerate(zip(compute, reference)) if g != w)
    want, got = _forwards_before_first_b(reference[r]), _forwards_before_first_b(compute[r])
    if got != want:
        return (f"rank r runs pp - r - 1 warm-up forwards, then one F and one B in turn: "
                f"min(pp - r, m) forwards before its first B. Rank {r} of pp={p}, m={m} "
                f"runs {want}; yours runs {got}")
    return "hint('pipeline_1f1b', 2) describes the three phases"


def _pure(mod) -> None:
    for p in (2, 3, 4, 1):
        for m in range(1, 8):
            where = f"(pp={p}, m={m})"
            compute = mod.one_f_one_b_compute(p, m)
            expect(isinstance(compute, list) and len(compute) == p,
                   f"one_f_one_b_compute{where[:-1]}) returned {type(compute).__name__} of "
                   f"length {len(compute) if hasattr(compute, '__len__') else '?'}; "
                   f"expected {p} lists", "one list of Actions per rank")
            for r, acts in enumerate(compute):
                want = {(k, i) for k in "FB" for i in range(m)}
                got = [(a.kind, a.mb) for a in acts]
                expect(sorted(got) == sorted(want),
                       f"rank {r} {where}: the compute order must hold F and B of every "
                       f"micro-batch once; got {' '.join(a.short() for a in acts)}",
                       "Action('F', i, r) and Action('B', i, r) for i in range(m), nothing "
                       "else")
                chunks = sorted({a.chunk for a in acts})
                expect(chunks == [r],  # short() names no chunk: say it here
                       f"rank {r} {where}: every action's chunk must be the rank's stage, "
                       f"{r}; got chunk {', '.join(map(str, chunks))}",
                       "Action(kind, i, r): the third field is the stage the rank runs")
            reference = _compute("1f1b", p, m)
            diff = _diff(compute, reference)
            if diff is not None:
                raise CheckFailure(f"your compute order differs from 1F1B at pp={p}, m={m}, "
                                   f"{diff}", _order_hint(mod, compute, reference, p, m))
            try:
                actions = mod.one_f_one_b(p, m)
                validate(actions)
            except ScheduleError as e:
                raise CheckFailure(f"the schedule {where} does not run: {e}",
                                   "one_f_one_b must return with_communication of your "
                                   "compute order") from None
            frac = bubble.bubble_stats(bubble.simulate(actions))["bubble_fraction"]
            ref = bubble.bubble_stats(bubble.simulate(make_schedule("1f1b", p, m)))
            expect(abs(frac - ref["bubble_fraction"]) < 1e-9,
                   f"simulated bubble {where} is {frac:.3f}; 1F1B's is "
                   f"{ref['bubble_fraction']:.3f}",
                   "a backward can only start after its forward and the next rank's "
                   "backward; start each backward as early as 1F1B allows")
            peaks = mod.peak_in_flight(actions)
            truth = bubble.peak_in_flight(actions)
            expect(list(peaks) == truth, f"peak_in_flight {where} gave {peaks}; counting "
                   f"F (+1) and B (-1) on these lists gives {truth}",
                   "skip the SEND/RECV actions; +1 at F, -1 at B, keep the maximum")
            want_peak = [min(m, p - r) for r in range(p)]
            expect(truth == want_peak, f"your schedule {where} holds {truth} micro-batches "
                   f"at most per rank; 1F1B holds {want_peak}",
                   "that is GPipe's memory: run only pp - r - 1 warm-up forwards, then "
                   "alternate one F and one B")
            f = mod.bubble_fraction(p, m)
            expect(abs(f - (p - 1) / (m + p - 1)) < 1e-12 and abs(f - frac) < 1e-9,
                   f"bubble_fraction({p}, {m}) = {f}; the simulation gives {frac:.4f}",
                   "(p - 1) / (m + p - 1)")


def _run_rank(impl: str) -> dict:
    mod = importlib.import_module(f"{impl}.pipeline_1f1b")
    comm = Comm()
    torch.manual_seed(0)
    model = GPT(CFG)
    chunks = build_stage(model, comm.rank, comm.size)
    x, y = MarkovData(CFG.vocab_size, CFG.seq_len).batch(0, BATCH)
    ex = PipelineExecutor(chunks, comm, mod.one_f_one_b(comm.size, M))
    res = ex.step(split_batch(x, y, 0, 1, M), broadcast_loss=True)
    return {"loss": res.loss, "peak": res.peak_in_flight,
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def run(impl: str, timeout: float) -> str:
    mod = importlib.import_module(f"{impl}.pipeline_1f1b")
    _pure(mod)
    torch.manual_seed(0)
    ref = GPT(CFG)
    loss = ref(*MarkovData(CFG.vocab_size, CFG.seq_len).batch(0, BATCH))
    loss.backward()
    per_rank = launch_case(_run_rank, 2, args=(impl,), timeout=timeout)
    for r, out in enumerate(per_rank):
        expect(abs(out["loss"] - loss.item()) < 1e-5,
               f"the pipeline's loss on rank {r} is {out['loss']:.6f}, one process gives "
               f"{loss.item():.6f}", "every micro-batch must run forward on both ranks")
        for n, g in out["grads"].items():
            expect(torch.allclose(g, dict(ref.named_parameters())[n].grad, rtol=1e-5,
                                  atol=1e-6),
                   f"gradient of {n} on rank {r} differs from one process",
                   "every micro-batch needs exactly one backward on every rank")
        expect(out["peak"] == min(M, 2 - r), f"rank {r} held {out['peak']} micro-batches",
               "1F1B holds min(m, pp - r)")
    return ("pp 1-4 x m 1-7: valid, 1F1B's bubble and memory; on 2 real ranks loss and "
            "gradients equal one process")
