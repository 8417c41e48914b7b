"""Cases for the attention-merge exercise (lesson 08).

In one process: two partial results (``minipar.parallel.cp.block_forward`` over two
disjoint key sets) merged by the learner's function, against attention over the union,
for ordinary scores, for large ones (log-sum-exps in the hundreds: a merge that
exponentiates them overflows), and for a part with no keys at all (lse = -inf). Each
failure names the worst element with the value expected and the value got, and
recognises the usual mistakes (averaging, adding, a sum of logs, a max).

Then the real thing: ``RingAttention`` on 2 and 4 ranks (zig-zag) with the learner's
merge in place of the engine's, forward and backward, against one device's causal
attention. The backward recomputes the probabilities from the merged log-sum-exp, so a
wrong lse shows up in the gradients even where the output looks right.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from minipar.comm import Comm
from minipar.parallel import cp as cpmod

from ..check import CheckFailure, expect, launch_case

TOL = 1e-5  # fp32; the reference merge is off by about 1e-6 on these cases
RING_TOL = 3e-6  # outputs and gradients of the ring against one device (tests/test_cp.py)
WORLDS = (2, 4)
B, H, T, HD = 2, 2, 5, 4  # t != hd, so a weight that is not unsqueezed fails loudly


def _parts(scale_q: float, seed: int, empty_b: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, HD, generator=g) * scale_q
    k, v = torch.randn(B, H, 10, HD, generator=g), torch.randn(B, H, 10, HD, generator=g)
    idx = torch.randperm(10, generator=g)
    a, b = (idx, idx[:0]) if empty_b else (idx[:4], idx[4:])
    scale = HD ** -0.5
    out, lse = cpmod.block_forward(q, k, v, scale, causal=False)
    out_a, lse_a = cpmod.block_forward(q, k[:, :, a], v[:, :, a], scale, causal=False)
    if empty_b:
        out_b, lse_b = torch.zeros_like(out_a), torch.full_like(lse_a, float("-inf"))
    else:
        out_b, lse_b = cpmod.block_forward(q, k[:, :, b], v[:, :, b], scale, causal=False)
    return {"inputs": (out_a, lse_a, out_b, lse_b), "out": out, "lse": lse}


def _where(index: torch.Tensor) -> str:
    return "[" + ", ".join(str(int(i)) for i in index) + "]"


def _worst(got: torch.Tensor, want: torch.Tensor) -> tuple[float, str, float, float]:
    """Largest difference, where it is, and the two values there."""
    diff = (got - want).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    flat = int(diff.argmax())
    index = torch.tensor(torch.unravel_index(torch.tensor(flat), diff.shape))
    return (float(diff.max()), _where(index), float(want.reshape(-1)[flat]),
            float(got.reshape(-1)[flat]))


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and bool(torch.isfinite(x).all()) \
        and float((x - y).abs().max()) < 1e-4


def _diagnose_out(got, out_a, lse_a, out_b, lse_b) -> str:
    if _close(got, (out_a + out_b) / 2):
        return ("you averaged the two parts: each must be weighted by its share of the "
                "softmax mass, e^(lse_a - lse) and e^(lse_b - lse)")
    if _close(got, out_a + out_b):
        return ("you added the two parts: each is normalised over its own keys only; "
                "weight them by e^(lse_x - lse) so the weights sum to 1")
    if _close(got, lse_a.exp().unsqueeze(-1) * out_a + lse_b.exp().unsqueeze(-1) * out_b):
        return "you weighted by e^lse_x: divide by the total mass, e^(lse_x - lse)"
    return "out = e^(lse_a - lse) * out_a + e^(lse_b - lse) * out_b, the weights unsqueezed"


def _diagnose_lse(got, lse_a, lse_b) -> str:
    if _close(got, lse_a + lse_b):
        return ("your lse is lse_a + lse_b: the log of a sum is not the sum of the logs; "
                "lse = log(e^lse_a + e^lse_b)")
    if _close(got, torch.maximum(lse_a, lse_b)):
        return ("your lse is max(lse_a, lse_b): that is only the larger part's mass; "
                "lse = log(e^lse_a + e^lse_b) (torch.logaddexp)")
    return "lse = log(e^lse_a + e^lse_b), computed stably with torch.logaddexp"


def _one_case(merge, name: str, case: dict) -> None:
    out_a, lse_a, out_b, lse_b = case["inputs"]
    try:
        res = merge(*(t.clone() for t in case["inputs"]))
    except RuntimeError as exc:
        if "must match the size" not in str(exc):
            raise
        raise CheckFailure(
            f"on {name}: merge_attention raised RuntimeError: {exc}; out_a has shape "
            f"{tuple(out_a.shape)} and lse_a {tuple(lse_a.shape)}",
            "a weight e^(lse_x - lse) has shape (..., t) and an output (..., t, hd): "
            ".unsqueeze(-1) the weight so it multiplies every feature of its query") \
            from exc
    expect(isinstance(res, tuple) and len(res) == 2
           and all(isinstance(t, torch.Tensor) for t in res),
           f"merge_attention returned {type(res).__name__}; expected a tuple (out, lse) "
           "of two tensors", "return w_a * out_a + w_b * out_b, lse")
    out, lse = res
    for label, got, want in (("out", out, case["out"]), ("lse", lse, case["lse"])):
        expect(tuple(got.shape) == tuple(want.shape),
               f"on {name}: {label} has shape {tuple(got.shape)}; expected "
               f"{tuple(want.shape)}",
               "the weights e^(lse_x - lse) have shape (..., t): .unsqueeze(-1) them "
               "before multiplying the (..., t, hd) outputs; lse keeps shape (..., t)")
    big = float(case["lse"].abs().max())
    for label, got in (("lse", lse), ("out", out)):
        expect(bool(torch.isfinite(got).all()),
               f"on {name} (log-sum-exps up to {big:.0f}): your {label} holds inf or nan; "
               f"expected finite values such as {float(case[label].reshape(-1)[0]):.5f}",
               "e^lse overflows fp32 once lse > 88: exponentiate only differences, "
               "e^(lse_a - lse), and get lse itself from torch.logaddexp(lse_a, lse_b)")
    err, where, want, got = _worst(lse, case["lse"])
    if err > TOL:
        raise CheckFailure(f"on {name}: lse{where} expected {want:.5f}, got {got:.5f}",
                           _diagnose_lse(lse, lse_a, lse_b))
    err, where, want, got = _worst(out, case["out"])
    if err > TOL:
        raise CheckFailure(f"on {name}: out{where} expected {want:.5f}, got {got:.5f} "
                           f"(attention over both key sets)",
                           _diagnose_out(out, out_a, lse_a, out_b, lse_b))


# --- the ring with the learner's merge ---------------------------------------------
S = 32  # cuts into 2 * cp chunks for cp = 2 and 4


def _full_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    return tuple(torch.randn(1, 2, S, 8, generator=g) for _ in range(4))  # q k v dout


def _ring_rank(impl: str) -> dict:
    mod = importlib.import_module(f"{impl}.attention_merge")
    cpmod.merge_attention = mod.merge_attention  # this rank's process only (forked)
    comm = Comm(dim="cp")
    q, k, v, dout = (cpmod.shard_sequence(t, comm.rank, comm.size, dim=2)
                     for t in _full_inputs())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = cpmod.RingAttention(comm)(q, k, v)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _ring(impl: str, n: int, timeout: float) -> None:
    res = launch_case(_ring_rank, n, args=(impl,), timeout=timeout)
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_full_inputs()))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref.backward(dout)
    want = {"out": ref.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for key in ("out", "dq", "dk", "dv"):
        got = cpmod.unshard_sequence([r[key] for r in res], dim=2)
        err, where, w, g = _worst(got, want[key])
        if err > RING_TOL:
            token = where.strip("[]").split(", ")[2]
            raise CheckFailure(
                f"ring attention on {n} ranks with your merge: {key}{where} (token {token})"
                f" expected {w:.5f} (one device), got {g:.5f}",
                "the backward recomputes probabilities from the merged lse, so a wrong lse "
                "shows in dq, dk, dv" if key != "out" else
                "the single-process cases passed: look at what differs in the ring, where "
                "the parts arrive in ring order and one may be a causal diagonal")


def run(impl: str, timeout: float) -> str:
    merge = importlib.import_module(f"{impl}.attention_merge").merge_attention
    cases = {"two key sets of 4 and 6 keys": _parts(1.0, 0),
             "large scores": _parts(60.0, 1),
             "a part with no keys (lse = -inf)": _parts(1.0, 2, empty_b=True)}
    for name, case in cases.items():
        _one_case(merge, name, case)
    for n in WORLDS:
        _ring(impl, n, timeout)
    return (f"{len(cases)} merges equal attention over both key sets; ring attention on "
            f"{' and '.join(map(str, WORLDS))} ranks with your merge equals one device "
            "(output and gradients)")
