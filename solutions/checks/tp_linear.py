"""Cases for the column- and row-parallel linear exercise (lesson 04).

On 2 and 4 ranks every rank builds the same full ``nn.Linear`` layers and input from a
seed, so it computes the single-device answer itself and compares its part of it:
a column-parallel layer alone (output slice, input gradient), a row-parallel layer alone
(whole output, input-slice gradient), and fc -> GELU -> proj as an MLP (output, input
gradient, every weight and bias gradient), with the number of all-reduces in forward and
backward read from the communication log. Then f and g alone: neither may change the
tensor it is handed (g's input, f's gradient), which autograd may still need.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from minipar.comm import Comm

from ..check import expect, launch_case

WORLDS = (2, 4)
H, FF = 8, 16
TOL = 1e-5


def _setup():
    torch.manual_seed(0)
    fc, proj = nn.Linear(H, FF), nn.Linear(FF, H)
    x = torch.randn(3, 5, H)
    return fc, proj, x


def _close(a: torch.Tensor | None, b: torch.Tensor) -> float:
    if a is None or a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max())


def _ops(comm: Comm) -> list[str]:
    ops = [r.op for r in comm.log.records]
    comm.log.clear()
    return ops


def _rank_cases(impl: str) -> dict:
    mod = importlib.import_module(f"{impl}.tp_linear")
    comm = Comm()
    n, r = comm.size, comm.rank
    fc, proj, x = _setup()
    facts: dict = {}

    # column-parallel alone: the input gradient needs f's all-reduce
    g = torch.randn(3, 5, FF, generator=torch.Generator().manual_seed(1))
    xr = x.clone().requires_grad_()
    (fc(xr) * g).sum().backward()
    col = mod.ColumnParallelLinear(fc, comm)
    xc = x.clone().requires_grad_()
    comm.log.clear()
    out = col(xc)
    fwd = _ops(comm)
    (out * g.chunk(n, -1)[r]).sum().backward()
    facts["col"] = {"out": _close(out, fc(x).detach().chunk(n, -1)[r]),
                    "grad_x": _close(xc.grad, xr.grad), "fwd": fwd, "bwd": _ops(comm),
                    "weight": tuple(col.weight.shape)}

    # row-parallel alone: input is this rank's slice of the features
    z = torch.randn(3, 5, FF, generator=torch.Generator().manual_seed(2))
    gz = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(3))
    zr = z.clone().requires_grad_()
    (proj(zr) * gz).sum().backward()
    row = mod.RowParallelLinear(proj, comm)
    zs = z.chunk(n, -1)[r].clone().requires_grad_()
    out = row(zs)
    fwd = _ops(comm)
    (out * gz).sum().backward()
    facts["row"] = {"out": _close(out, proj(z).detach()),
                    "grad_x": _close(zs.grad, zr.grad.chunk(n, -1)[r]), "fwd": fwd,
                    "bwd": _ops(comm), "weight": tuple(row.weight.shape)}

    # the MLP: fc (column) -> GELU -> proj (row)
    fc.zero_grad()
    proj.zero_grad()
    xr = x.clone().requires_grad_()
    ref = proj(F.gelu(fc(xr)))
    (ref * gz).sum().backward()
    mlp = mod.ParallelMLP(fc, proj, comm)
    xm = x.clone().requires_grad_()
    out = mlp(xm)
    fwd = _ops(comm)
    (out * gz).sum().backward()
    facts["mlp"] = {
        "out": _close(out, ref.detach()), "grad_x": _close(xm.grad, xr.grad),
        "fc.weight": _close(mlp.fc.weight.grad, fc.weight.grad.chunk(n, 0)[r]),
        "fc.bias": _close(mlp.fc.bias.grad, fc.bias.grad.chunk(n, 0)[r]),
        "proj.weight": _close(mlp.proj.weight.grad, proj.weight.grad.chunk(n, 1)[r]),
        "proj.bias": _close(mlp.proj.bias.grad, proj.bias.grad),
        "fwd": fwd, "bwd": _ops(comm)}

    # f and g alone, on tensors the case keeps: neither may change the one it is handed
    # (autograd may still need it: tanh keeps its output for its backward, and an add
    # hands one gradient tensor to both its inputs, a residual's too)
    partial = torch.tanh(torch.randn(3, 5, H, generator=torch.Generator().manual_seed(4))
                         .requires_grad_())
    given = partial.detach().clone()
    mod.ReduceFromTP.apply(partial, comm)
    facts["g_input"] = (given, partial.detach().clone())
    grad = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(5))
    given = grad.clone()
    mod.CopyToTP.apply(x.clone().requires_grad_(), comm).backward(grad)
    facts["f_grad"] = (given, grad.clone())
    comm.log.clear()
    return facts


def _changed(given: torch.Tensor, after: torch.Tensor) -> str:
    """Where a tensor handed to f or g changed: its first changed element, before and
    after ("" if unchanged)."""
    if torch.equal(given, after):
        return ""
    at = tuple(int(i) for i in torch.nonzero(given != after)[0])
    return (f"{list(at)} expected {given[at].item():.6g} (as it was handed over), got "
            f"{after[at].item():.6g}")


def _judge(n: int, rank: int, f: dict) -> None:
    where = f"on {n} ranks, rank {rank}"
    c, row, m = f["col"], f["row"], f["mlp"]
    expect(c["weight"] == (FF // n, H),
           f"ColumnParallelLinear weight has shape {c['weight']} {where}; expected "
           f"{(FF // n, H)} (its rows: output features)",
           "chunk the [out, in] weight along dim 0 and keep chunk comm.rank")
    expect(c["out"] < TOL, f"ColumnParallelLinear output is not this rank's slice of the "
           f"full layer's outputs {where} (off by {c['out']:.3g})",
           "F.linear(x, own weight rows, own bias slice)")
    expect(c["fwd"] == [], f"ColumnParallelLinear communicated {c['fwd']} in forward "
           f"{where}; it needs nothing", "f is the identity in forward")
    expect(c["grad_x"] < TOL and c["bwd"] == ["all_reduce"],
           f"ColumnParallelLinear: input gradient off by {c['grad_x']:.3g} with "
           f"{c['bwd']} in backward {where}; expected the full gradient after one all-reduce",
           "each rank only sees its outputs' share of dL/dx: CopyToTP.backward must "
           "all-reduce (sum) the gradient")
    expect(row["weight"] == (H, FF // n),
           f"RowParallelLinear weight has shape {row['weight']} {where}; expected "
           f"{(H, FF // n)} (its columns: input features)",
           "chunk the [out, in] weight along dim 1")
    expect(row["out"] < TOL and row["fwd"] == ["all_reduce"],
           f"RowParallelLinear output off by {row['out']:.3g} with {row['fwd']} in forward "
           f"{where}; expected the full output after one all-reduce",
           "all-reduce the partial sum x_r W_r^T through ReduceFromTP, then add the whole "
           "bias once (adding it before the sum counts it comm.size times)")
    expect(row["grad_x"] < TOL and row["bwd"] == [],
           f"RowParallelLinear: input-slice gradient off by {row['grad_x']:.3g} with "
           f"{row['bwd']} in backward {where}",
           "ReduceFromTP.backward is the identity: the output gradient is already whole")
    changed = _changed(*f["g_input"])
    expect(not changed, f"ReduceFromTP.forward changed its input in place {where}: x{changed}",
           "all-reduce a copy of x and return the copy: autograd may still need x itself "
           "(tanh, for one, keeps its output for its backward)")
    changed = _changed(*f["f_grad"])
    expect(not changed, f"CopyToTP.backward changed the gradient it was handed in place "
           f"{where}: grad{changed}",
           "all-reduce a copy of the gradient and return the copy: autograd may hand the "
           "same tensor to other nodes too (an add gives one gradient to both its inputs)")
    bad = [k for k in ("out", "grad_x", "fc.weight", "fc.bias", "proj.weight", "proj.bias")
           if m[k] >= TOL]
    expect(not bad, f"ParallelMLP differs from the full MLP in {bad} {where}",
           "check the layers alone first; the bias of proj must be the full bias")
    expect(m["fwd"] == ["all_reduce"] and m["bwd"] == ["all_reduce"],
           f"ParallelMLP communicated {m['fwd']} forward and {m['bwd']} backward {where}; "
           "Megatron's MLP needs exactly one all-reduce each way",
           "g after proj in forward, f before fc in backward, nothing else")


def run(impl: str, timeout: float) -> str:
    """Column alone, row alone and the MLP on 2 and 4 ranks against nn.Linear."""
    for n in WORLDS:
        for rank, facts in enumerate(launch_case(_rank_cases, n, args=(impl,), timeout=timeout)):
            _judge(n, rank, facts)
    return (f"on {' and '.join(map(str, WORLDS))} ranks: outputs and all gradients equal "
            "nn.Linear's; one all-reduce forward (g), one backward (f)")
