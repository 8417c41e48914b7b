"""Data parallelism (ZeRO stage 0: naive, bucketed, overlapped) against one process.

The test is parity: after a few optimizer steps every rank's parameters must equal those
of one process that trained on the same global batch. Tolerances (fp32): plain SGD
max |difference| <= 1e-5; AdamW divides by sqrt(v) + eps, which turns the rounding noise
of near-zero gradients into visible differences, so max |difference| <= 1e-4 and the
difference relative to the whole update (L2) <= 1e-4. bf16 (fp32 masters): relative
update difference <= 1e-2 with SGD, <= 5e-2 with AdamW (16-bit gradients summed in
another order; bf16 training itself differs from fp32 training by about 5e-2 here,
and a run that forgets to synchronise by far more).

The edge-case model has every awkward feature at once: sizes divisible by neither 2 nor
4, a frozen layer, a tied embedding/head, and a branch some ranks skip on some steps
(and no rank on others): a parameter no rank used gets a zero gradient (one flat bucket
cannot hold "None" for part of itself), and the reference does the same. The helpers
here are shared with ``test_zero.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minipar.comm import Comm, CommLog
from minipar.data import MarkovData, split_batch
from minipar.launch import launch
from minipar.meter import HeldPeaks
from minipar.model import GPT, GPTConfig
from minipar.parallel.precision import MixedPrecision
from minipar.parallel.zero import ZeroOptimizer
from minipar.parallel.zero.buckets import Reducer, bucket_params

GPT_CFG = GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=32,
                    tie_embeddings=True)
BATCH, STEPS = 8, 3


# --- models, data and the single-process reference (shared with test_zero.py) --------------
class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l2 = nn.Linear(13, 7)
        self.extra = nn.Linear(7, 7)  # used only when the flag says so

    def forward(self, h: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.l2(h)
        return h + torch.tanh(self.extra(h)) if use_extra else h


class Edge(nn.Module):
    """Odd sizes (77, 104, 98, 56 elements), a frozen layer, tied embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 7)
        self.l1 = nn.Linear(7, 13)
        self.frozen = nn.Linear(13, 13).requires_grad_(False)
        self.body = Body()
        self.head = nn.Linear(7, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.frozen(F.gelu(self.l1(self.emb(x))))
        return F.cross_entropy(self.head(self.body(h, use_extra)).flatten(0, 1), y.flatten())


def uses_extra(step: int, rank: int) -> bool:
    """Two ranks: step 0 rank 0 only, step 1 nobody, step 2 rank 1 only."""
    return (step + rank) % 3 == 0


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPT_CFG) if name == "gpt" else Edge()


def global_batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "gpt":
        return MarkovData(GPT_CFG.vocab_size, GPT_CFG.seq_len).batch(step, BATCH)
    g = torch.Generator().manual_seed(step)
    x = torch.randint(11, (BATCH, 5), generator=g)
    return x, torch.randint(11, (BATCH, 5), generator=g)


def shard_loss(model, name: str, step: int, rank: int, world: int, micro: int = 1,
               index: int = 0) -> torch.Tensor:
    """Mean loss of micro-batch ``index`` of dp rank ``rank``'s shard of the global batch."""
    x, y = split_batch(*global_batch(name, step), rank, world, micro)[index]
    return model(x, y) if name == "gpt" else model(x, y, uses_extra(step, rank))


def make_optimizer(opt: str, params) -> torch.optim.Optimizer:
    if opt == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def optimizer_kwargs(opt: str) -> tuple[type, dict]:
    if opt == "sgd":
        return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 1e-2}


def reference(name: str, opt: str, dtype: str, world: int, steps: int = STEPS,
              zero_unused: bool = False, clip: float | None = None) -> dict[str, torch.Tensor]:
    """One process, the global batch as the mean of the dp shards' losses. ``zero_unused``:
    a parameter no rank used gets a zero gradient (what ZeRO does) instead of staying
    None (skipped by the optimizer). ``clip``: by the global gradient norm (fp32 only).
    One thread, like the ranks, so that one rank reproduces it exactly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(name, opt, dtype, world, steps, zero_unused, clip)
    finally:
        torch.set_num_threads(threads)


def _reference(name: str, opt: str, dtype: str, world: int, steps: int,
               zero_unused: bool, clip: float | None) -> dict[str, torch.Tensor]:
    model = make_model(name)
    mp = MixedPrecision(model, torch.bfloat16) if dtype == "bf16" else None
    optimizer = make_optimizer(opt, mp.parameters() if mp else model.parameters())
    for step in range(steps):
        loss = sum(shard_loss(model, name, step, r, world) for r in range(world)) / world
        loss.backward()
        for p in model.parameters():
            if zero_unused and p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if mp:
            mp.step(optimizer)
            mp.zero_grad()
        else:
            optimizer.step()
            optimizer.zero_grad()
    return named_fp32(model, mp)


def references(keys: list[tuple]) -> dict[tuple, dict[str, torch.Tensor]]:
    """``reference(*key)`` for each key, computed in a launched child process. A test
    process must not run autograd itself: with a CUDA build of torch its autograd threads
    would not survive the fork of the ranks launched after it (torch's "autograd and
    fork" limitation). Keys: (model, optimizer, dtype, world[, zero_unused[, clip]])."""
    keys = list(dict.fromkeys(keys))
    return dict(zip(keys, launch(_references, 1, args=(keys,), timeout=120)[0]))


def _references(keys: list[tuple]) -> list[dict[str, torch.Tensor]]:
    return [reference(*key[:4], zero_unused=len(key) > 4 and key[4],
                      clip=key[5] if len(key) > 5 else None) for key in keys]


def named_fp32(model: nn.Module, mp: MixedPrecision | None) -> dict[str, torch.Tensor]:
    return {n: (mp.master(p) if mp else p).detach().float().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def initial(name: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in make_model(name).named_parameters()
            if p.requires_grad}


def assert_close(got: dict, ref: dict, start: dict, opt: str, dtype: str, what: str) -> None:
    """The tolerances stated in the module docstring."""
    assert got.keys() == ref.keys(), what
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    err = sum(((got[k] - ref[k]) ** 2).sum() for k in ref) ** 0.5
    update = sum(((ref[k] - start[k]) ** 2).sum() for k in ref) ** 0.5
    rel = (err / update).item()
    if dtype == "bf16":
        bound = 1e-2 if opt == "sgd" else 5e-2
        assert rel <= bound, f"{what}: relative update difference {rel:.2e}"
    elif opt == "sgd":
        assert diff <= 1e-5, f"{what}: max difference {diff:.2e}"
    else:
        assert diff <= 1e-4 and rel <= 1e-4, f"{what}: max {diff:.2e}, relative {rel:.2e}"


# --- what each rank runs ------------------------------------------------------------------
def train_ddp(spec: dict) -> dict:
    """Train with ZeroOptimizer stage 0 per ``spec``; the fp32 weights, comm and memory.
    Gradients are summed in the weights' own dtype, as PyTorch DDP does."""
    name, world, micro = spec["model"], spec["world"], spec.get("micro", 1)
    log = CommLog()
    comm = Comm(log=log)
    model = make_model(name)
    mp = MixedPrecision(model, torch.bfloat16) if spec["dtype"] == "bf16" else None
    cls, kwargs = optimizer_kwargs(spec["opt"])
    ddp = ZeroOptimizer(model, cls, stage=0, comm=comm, precision=mp, mode=spec["mode"],
                        bucket_mb=spec.get("bucket_mb", 0.002), grad_dtype=None,
                        average=spec.get("average", True),
                        reduce_dtype=spec.get("reduce_dtype"), **kwargs)
    peaks = HeldPeaks()
    ddp.observe(peaks)
    log.clear()  # the broadcast at wrapping is not part of a step
    memory = None
    for step in range(spec.get("steps", STEPS)):
        for i in range(micro):
            scale = 1.0 / micro if spec.get("average", True) else 1.0 / (micro * world)
            if i < micro - 1:
                with ddp.no_sync():
                    (shard_loss(model, name, step, comm.rank, world, micro, i) * scale
                     ).backward()
            else:
                (shard_loss(model, name, step, comm.rank, world, micro, i) * scale).backward()
        ddp.finish_gradient_sync()
        if step == 0:
            summary = log.summary()
        ddp.step()
        if step == 0:  # the step's peaks; Adam's states exist now
            memory = peaks.with_peaks(ddp.memory_bytes())
        ddp.zero_grad()
    return {"params": ddp.full_parameters(), "comm": summary, "memory": memory}


def run_all(fn, specs: list[dict]) -> list[dict]:
    """Every spec on this rank, in order (one launch amortises the process start)."""
    return [fn(spec) for spec in specs]


def check(specs: list[dict], results: list[list[dict]]) -> None:
    keys = [(s["model"], s["opt"], s["dtype"], s["world"], True) for s in specs]
    refs = references(keys)
    for spec, key, res in zip(specs, keys, results[0]):
        assert_close(res["params"], refs[key], initial(spec["model"]), spec["opt"],
                     spec["dtype"], str(spec))
    for i, spec in enumerate(specs):  # the replicas are identical on every rank
        for other in results[1:]:
            assert all(torch.equal(results[0][i]["params"][k], v)
                       for k, v in other[i]["params"].items()), spec


# --- tests ------------------------------------------------------------------------------
def test_parity_every_mode_two_ranks():
    specs = [dict(mode=mode, model=model, opt=opt, dtype="fp32", world=2)
             for mode in ("naive", "bucketed", "overlapped")
             for model, opt in (("gpt", "adamw"), ("edge", "sgd"), ("edge", "adamw"))]
    specs += [dict(mode="overlapped", model="gpt", opt="adamw", dtype="bf16", world=2,
                   reduce_dtype=torch.float32),
              dict(mode="bucketed", model="edge", opt="sgd", dtype="bf16", world=2)]
    check(specs, launch(run_all, 2, args=(train_ddp, specs), timeout=90))


def test_parity_four_ranks_and_one():
    gpt = dict(mode="overlapped", model="gpt", opt="sgd", dtype="fp32")
    edge = dict(mode="bucketed", model="edge", opt="adamw", dtype="fp32")
    for world, cases in ((4, (gpt, edge)), (1, (edge,))):
        specs = [dict(case, world=world) for case in cases]
        check(specs, launch(run_all, world, args=(train_ddp, specs), timeout=90))


def test_no_sync_accumulation_and_sum_reduction():
    """Two micro-batches per step, the first under no_sync; with average=False the loss
    carries 1/(dp * micro-batches) instead, as the engine does."""
    specs = [dict(mode=mode, model="gpt", opt="sgd", dtype="fp32", world=2, micro=2,
                  average=average)
             for mode, average in (("overlapped", True), ("bucketed", False), ("naive", False))]
    results = launch(run_all, 2, args=(train_ddp, specs), timeout=90)
    check(specs, results)
    for r in results:  # one all-reduce per bucket per step: no_sync sent nothing
        assert r[0]["comm"]["world"]["all_reduce"]["calls"] == r[1]["comm"]["world"][
            "all_reduce"]["calls"]


def test_communication_and_memory_match_theory():
    """All-reduce payload = the gradient bytes (tied weight once, frozen not at all);
    on the wire 2(N-1)/N of it. Memory: weights, gradients (the fp32 gradient the
    masters step on; bf16 buckets become it bucket by bucket, never all at once),
    Adam's two moments (and bf16's fp32 masters)."""
    world = 4
    specs = [dict(mode=m, model=name, opt="adamw", dtype=d, world=world)
             for m, name, d in (("naive", "gpt", "bf16"), ("overlapped", "gpt", "fp32"),
                                ("bucketed", "edge", "bf16"), ("overlapped", "edge", "fp32"))]
    results = launch(run_all, world, args=(train_ddp, specs), timeout=90)
    for spec, res in zip(specs, results[0]):
        model = make_model(spec["model"])
        n_all = sum(p.numel() for p in model.parameters())  # tied weight once
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        width = 2 if spec["dtype"] == "bf16" else 4
        ar = res["comm"]["world"]["all_reduce"]
        assert ar["bytes"] == n_train * width, spec
        assert abs(ar["wire_bytes"] - 2 * (world - 1) / world * ar["bytes"]) <= ar["calls"]
        master = 4 * n_train if spec["dtype"] == "bf16" else 0
        assert res["memory"] == {"params": n_all * width, "grads": n_train * 4,
                                 "optimizer": 8 * n_train + master}, spec


def _different_start(dtype: str) -> tuple[dict, list[torch.Tensor]]:
    torch.manual_seed(Comm().rank)  # every rank starts from other weights
    model = Edge()
    mp = MixedPrecision(model, torch.bfloat16) if dtype == "bf16" else None
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=0, comm=Comm(), precision=mp, lr=0.1)
    return opt.full_parameters(), [p.detach().clone() for p in model.parameters()]


def test_parameters_broadcast_from_rank_zero_when_wrapped():
    torch.manual_seed(0)
    rank0 = dict(Edge().named_parameters())
    for dtype in ("fp32", "bf16"):  # bf16: the fp32 masters are what is shared
        for masters, weights in launch(_different_start, 2, args=(dtype,), timeout=60):
            assert all(torch.equal(masters[n], rank0[n]) for n in masters)
            assert all(torch.equal(w, p.to(w.dtype))  # frozen too; bf16: rounded
                       for w, p in zip(weights, rank0.values()))


def test_buckets_are_reverse_order_and_capped():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 5, 5)]
    buckets = bucket_params(params, bucket_bytes=4 * 30)
    assert [[p.numel() for p in b] for b in buckets] == [[5, 5], [30], [20, 10]]
    assert [len(b) for b in bucket_params(params, 0)] == [1] * 5


def test_reducer_starts_buckets_in_order():
    """A bucket that is complete early still waits for the buckets before it."""
    started, done = [], []
    reducer = Reducer([2, 1, 1], lambda i: started.append(i) or _Done(),
                      done.append)
    reducer.mark_ready(2, 0)
    reducer.mark_ready(1, 0)
    assert started == []
    reducer.mark_ready(0, 0)
    reducer.mark_ready(0, 1)
    assert started == [0, 1, 2]
    reducer.flush()
    assert done == [0, 1, 2]


class _Done:
    def wait(self) -> None:
        pass


def _double_backward(_: None) -> str:
    model = make_model("gpt")
    ZeroOptimizer(model, torch.optim.SGD, stage=0, comm=Comm(), bucket_mb=0.01, lr=0.1)
    shard_loss(model, "gpt", 0, 0, 1).backward()
    try:
        shard_loss(model, "gpt", 0, 0, 1).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_second_synchronised_backward_is_refused():
    assert "finish_gradient_sync" in launch(_double_backward, 1, args=(None,), timeout=60)[0]


# --- the full cross product (run with --full) -----------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_full_matrix(world):
    specs = [dict(mode=mode, model=model, opt=opt, dtype=dtype, world=world)
             for mode in ("naive", "bucketed", "overlapped") for model in ("gpt", "edge")
             for opt in ("adamw", "sgd") for dtype in ("fp32", "bf16")]
    check(specs, launch(run_all, world, args=(train_ddp, specs), timeout=300))
