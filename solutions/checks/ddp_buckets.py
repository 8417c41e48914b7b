"""Cases for the bucketed, overlapped data-parallel exercise (lesson 01).

``bucket_params`` is checked in this process against a direct recount. Then two ranks
each train a two-layer GPT on half of a batch through the learner's ``BucketedDDP``;
every rank also computes the whole batch's gradient alone (the reference), so it can
compare. The communication log says how many all-reduces ran, of what size, in which
order, and whether they started before ``backward()`` returned (overlap).
"""

from __future__ import annotations

import importlib
import math
import time

import torch

from minipar.comm import Comm
from minipar.data import MarkovData, split_batch
from minipar.model import GPT, get_config

from ..check import expect, launch_case

WORLD = 2
BUCKET_BYTES = 40_000  # several buckets for the two-layer tiny GPT (about 0.5 MB)
TOL = 1e-5


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(get_config("tiny").with_(n_layer=2))


def _expected_buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """Bucket member indices (into the original order) by the rule in the docstring."""
    out: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i in reversed(range(len(sizes))):
        if current and total + sizes[i] > cap:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += sizes[i]
    return out + ([current] if current else [])


def _check_bucketing(mod) -> None:
    for numels, cap in (([10, 20, 30, 40], 200), ([100, 1, 1, 100], 400), ([5] * 7, 40),
                        ([1000, 2, 3], 100)):
        params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
        got = mod.bucket_params(params, cap)
        expect(isinstance(got, list) and all(isinstance(b, list) and b for b in got),
               f"bucket_params returned {type(got).__name__}; expected a list of non-empty "
               "lists of parameters", "return buckets as lists, never an empty bucket")
        ids = [[next(i for i, p in enumerate(params) if p is q) for q in b] for b in got]
        want = _expected_buckets([n * 4 for n in numels], cap)
        expect(ids == want,
               f"bucket_params({numels} float32 elements, {cap} bytes) gave parameter "
               f"indices {ids}; expected {want}",
               "walk reversed(params); close a bucket when the next parameter would "
               "push it over bucket_bytes; a too-large parameter sits alone")


class _Pending:
    def wait(self) -> None:
        pass


class _RecordingComm:
    """A stand-in for ``Comm`` on 2 ranks that records which tensors were all-reduced,
    in order, and reduces nothing (so hooks can be fired by hand, in any order)."""

    size, rank = 2, 0

    def __init__(self) -> None:
        self.launched: list[torch.Tensor] = []

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        pass

    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False):
        self.launched.append(t.clone())
        return _Pending() if async_op else t


def _bucket_launched(flat: torch.Tensor, buckets, params) -> int | str:
    """Which bucket an all-reduced tensor holds, read from its values: parameter i's
    gradient is i + 1 everywhere, so a bucket is known by the ratios of its values,
    whatever scale it was sent at (a gradient may be divided by comm.size before the
    all-reduce); "?" when no bucket matches."""
    top = float(flat.abs().max()) if flat.numel() else 0.0
    for b, members in enumerate(buckets):
        index = [next(i for i, p in enumerate(params) if p is q) for q in members]
        want = torch.cat([torch.full((10,), i + 1.0) for i in index])
        if top and flat.shape == want.shape and torch.allclose(
                (flat.reshape(-1) / top).sort()[0], (want / want.max()).sort()[0],
                rtol=1e-4):
            return b
    return "?"


def _check_hook_order(mod) -> None:
    """Hooks that fire out of bucket order must not change the order of the all-reduces.

    Six parameters of 40 bytes, buckets of 80: bucket 0 = params 5, 4; bucket 1 = 3, 2;
    bucket 2 = 1, 0. The hooks fire for 3, 2 first (bucket 1 complete before bucket 0),
    as they can when autograd finishes a later layer first on one rank only.
    """
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(10)) for _ in range(6))
    comm = _RecordingComm()
    ddp = mod.BucketedDDP(params, comm, bucket_bytes=80, overlap=True)
    fired = [3, 2, 5, 4, 1, 0]
    for i in fired:
        params[i].grad = torch.full((10,), float(i + 1))
        ddp._on_grad(params[i])
    ddp.finish_gradient_sync()
    order = [_bucket_launched(t, ddp.buckets, params) for t in comm.launched]
    ddp.remove()
    expect(order == [0, 1, 2],
           f"hooks fired for parameters {fired} (bucket 1 was complete before bucket 0); "
           f"expected all-reduces of buckets [0, 1, 2], got {order}",
           "launch strictly in bucket order: another rank's hooks may fire in another "
           "order, and two ranks that issue their all-reduces in different orders sum "
           "different buckets together (or hang)")


def _rank_cases(impl: str, overlap: bool) -> dict:
    mod = importlib.import_module(f"{impl}.ddp_buckets")
    comm = Comm()
    cfg = get_config("tiny").with_(n_layer=2)
    data = MarkovData(cfg.vocab_size, cfg.seq_len, seed=0)
    ref, model = _model(), _model()
    ddp = mod.BucketedDDP(model, comm, bucket_bytes=BUCKET_BYTES, overlap=overlap)
    n_buckets = len(ddp.buckets)
    facts = {"n_buckets": n_buckets, "steps": []}
    for step in range(2):  # twice: the second backward must start from a clean state
        x, y = data.batch(step, 8)
        ref.zero_grad(set_to_none=True)
        ref(x, y).backward()
        model.zero_grad(set_to_none=True)
        [(mx, my)] = split_batch(x, y, comm.rank, comm.size, 1)
        comm.log.clear()
        ddp(mx, my).backward()
        backward_end = time.time()
        ddp.finish_gradient_sync()
        records = [r for r in comm.log.records]
        worst = max(float((p.grad - q.grad).abs().max()) if p.grad is not None else
                    float("inf") for p, q in zip(model.parameters(), ref.parameters()))
        bucket_numels = [sum(p.numel() for p in b) for b in ddp.buckets]
        norm = [sum(float(p.grad.double().pow(2).sum()) for p in m.parameters()
                    if p.grad is not None) ** 0.5 for m in (model, ref)]
        facts["steps"].append({
            "worst": worst, "ratio": norm[0] / norm[1] if norm[1] else float("nan"),
            "ops": [r.op for r in records],
            "numels": [r.nbytes // 4 for r in records if r.op == "all_reduce"],
            "bucket_numels": bucket_numels,
            "early": sum(1 for r in records if r.start <= backward_end),
            "unwaited": sum(1 for r in records if math.isnan(r.end)),
        })
        with torch.no_grad():  # a step, so the weights of step 2 differ from step 1
            for p, q in zip(model.parameters(), ref.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    ddp.remove()
    return facts


def _judge(rank: int, overlap: bool, f: dict) -> None:
    where = f"on rank {rank} with overlap={overlap}"
    expect(f["n_buckets"] > 2, f"only {f['n_buckets']} bucket(s) for a 0.5 MB model with "
           f"bucket_bytes={BUCKET_BYTES} {where}", "check bucket_params")
    for step, s in enumerate(f["steps"]):
        at = f"{where}, step {step}"
        ratio = s["ratio"]
        scale = (f"your gradients are exactly {ratio:.1f}x the whole-batch gradient "
                 f"= world size ({WORLD}): " if abs(ratio - WORLD) < 1e-3 else
                 f"your gradients are exactly {ratio:.1f}x the whole-batch gradient "
                 f"= 1 / world size ({WORLD}), divided once too often: "
                 if abs(ratio - 1 / WORLD) < 1e-3 else
                 f"your gradient norm is {ratio:.3g}x the whole-batch gradient's; ")
        expect(not s["unwaited"],
               f"finish_gradient_sync returned {at} with {s['unwaited']} of "
               f"{len(s['numels'])} all-reduces never waited for: their buckets may not "
               "hold the sum yet",
               "comm.all_reduce(..., async_op=True) returns at once: call .wait() on "
               "each bucket's Pending before reading its flat tensor")
        # (before the gradients: a second step that launched nothing left the first
        # step's gradients in place, off for a reason the count names)
        expect(len(s["numels"]) == f["n_buckets"],
               f"{len(s['numels'])} all-reduces for {f['n_buckets']} buckets {at}; expected "
               f"{f['n_buckets']}, one per bucket",
               "one all-reduce per bucket and step: launch each bucket exactly once, and "
               "reset the bookkeeping at the end of finish_gradient_sync")
        expect(s["worst"] < TOL,
               f"{scale}gradients differ from the whole-batch gradient by up to "
               f"{s['worst']:.3g} {at}",
               "after waiting, divide each bucket's sum by comm.size and copy its slices "
               "back in the bucket's parameter order (the order of self.buckets[i])")
        others = sorted(set(s["ops"]) - {"all_reduce"})
        expect(not others, f"used {others} {at}; only all_reduce is needed",
               "one comm.all_reduce(flat, async_op=True) per bucket")
        expect(s["numels"] == s["bucket_numels"],
               f"all-reduce sizes {s['numels']} (elements) {at}; the buckets, in order, "
               f"hold {s['bucket_numels']}",
               "launch the buckets strictly in index order, each as one flat tensor")
        if overlap:
            expect(s["early"] == f["n_buckets"],
                   f"only {s['early']} of {f['n_buckets']} all-reduces started during "
                   f"backward {at}",
                   "in _on_grad, launch bucket self.next_to_launch as soon as all its "
                   "parameters are ready, and keep going while the next one is too")
        else:
            expect(s["early"] == 0, f"{s['early']} all-reduces started during backward "
                   f"although overlap=False {at}", "with overlap=False only record readiness")


def run(impl: str, timeout: float) -> str:
    """Bucketing rules here, then gradients and the log on 2 ranks, overlap on and off."""
    _check_bucketing(importlib.import_module(f"{impl}.ddp_buckets"))
    _check_hook_order(importlib.import_module(f"{impl}.ddp_buckets"))
    for overlap in (True, False):
        for rank, facts in enumerate(launch_case(_rank_cases, WORLD, args=(impl, overlap),
                                                 timeout=timeout)):
            _judge(rank, overlap, facts)
    return ("bucketing rule ok; on 2 ranks gradients equal the whole batch's, one "
            "all-reduce per bucket in order, all started during backward when overlapping")
