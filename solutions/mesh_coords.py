"""Lesson 06 exercise: number the GPUs of a 3-D mesh, both ways.

A job of ``dp * pp * tp`` ranks is a grid: each rank has coordinates (dp, pp, tp). The
rank number is those coordinates read as the digits of a mixed-radix number, and the
two conventions disagree only on the order of the digits (slowest first):

* ``"megatron"`` (Megatron-LM, torchtitan): (pp, dp, tp). tp varies fastest, so tensor
  parallel partners are consecutive ranks, on one node; then dp; pp is outermost.
* ``"pp-inside-dp"`` (picotron and some tutorials): (dp, pp, tp). A whole pipeline
  replica (all its stages and their tp shards) is a block of consecutive ranks.

Example, dp = pp = tp = 2: rank 5 is 101 in binary. Megatron reads it as pp=1, dp=0,
tp=1; pp-inside-dp as dp=1, pp=0, tp=1. Same GPU, different role.

You write ``coords`` (rank -> (dp, pp, tp)), ``rank`` (the inverse) and ``group``
(the ranks that differ from a rank in one coordinate only: its process group for that
dimension). What the check tests: all three against ``minipar.mesh.Mesh`` on every
layout of up to 16 ranks, in both orders.
"""

from __future__ import annotations

ORDERS = {"megatron": ("pp", "dp", "tp"), "pp-inside-dp": ("dp", "pp", "tp")}


def coords(rank: int, dp: int, pp: int, tp: int, order: str = "megatron") -> tuple[int, int, int]:
    """(dp, pp, tp) coordinates of global ``rank`` under ``order``."""
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    ### BEGIN SOLUTION
    # HINT: peel digits off from the fastest dimension: for name in reversed(ORDERS[order]):
    # digit = rank % sizes[name]; rank //= sizes[name]. Return (dp, pp, tp) in that order.
    digits = {}
    for name in reversed(ORDERS[order]):
        digits[name] = rank % sizes[name]
        rank //= sizes[name]
    return digits["dp"], digits["pp"], digits["tp"]
    ### END SOLUTION


def rank(c: tuple[int, int, int], dp: int, pp: int, tp: int, order: str = "megatron") -> int:
    """The global rank at coordinates ``c = (dp, pp, tp)`` under ``order``."""
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    values = dict(zip(("dp", "pp", "tp"), c))
    ### BEGIN SOLUTION
    # HINT: Horner's rule over the slowest-first order: r = 0; for name in ORDERS[order]:
    # r = r * sizes[name] + values[name].
    r = 0
    for name in ORDERS[order]:
        r = r * sizes[name] + values[name]
    return r
    ### END SOLUTION


def group(dim: str, r: int, dp: int, pp: int, tp: int, order: str = "megatron") -> list[int]:
    """The ranks sharing every coordinate with rank ``r`` except ``dim`` (in order of
    that coordinate): the members of ``r``'s ``dim`` process group."""
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    ### BEGIN SOLUTION
    # HINT: take coords(r, ...), replace the coordinate of dim by 0, 1, ..., sizes[dim] - 1
    # and turn each back into a rank with rank(...).
    mine = dict(zip(("dp", "pp", "tp"), coords(r, dp, pp, tp, order)))
    out = []
    for i in range(sizes[dim]):
        c = {**mine, dim: i}
        out.append(rank((c["dp"], c["pp"], c["tp"]), dp, pp, tp, order))
    return out
    ### END SOLUTION
