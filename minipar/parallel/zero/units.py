"""ZeRO-3's units: which weights are gathered together, and by which module's call.

``stage3.Zero3`` gathers a unit's weights just before one of its modules runs and frees
them after. This file decides the units, on the module tree alone (no values, no
communication): a weight is gathered by the innermost given unit around the module that
registers it or, outside every unit, by that module itself; a weight registered by
several modules (a tied embedding and head) by each of them (FSDP's wrapping policy does
the same job: Zhao et al. 2023, arXiv 2304.11277, Sec. 3.2).
"""

from __future__ import annotations

from torch import nn

from minipar.comm import Pending
from minipar.parallel.zero.shards import FlatParams


class Unit:
    """Weights gathered and freed together, when one of ``modules`` runs."""

    def __init__(self, modules: list[nn.Module], flats: list[FlatParams], replicated: bool):
        self.modules, self.flats, self.replicated = modules, flats, replicated
        self.leaves = [t for f in flats for t in f.params]
        self.state = "gathered" if replicated else "free"  # free / gathering / gathered
        self.pending: list[Pending] = []
        self.in_backward, self.dirty = False, False
        self.waiting: set[int] = set()  # weights whose gradient this backward awaits


def default_units(module: nn.Module) -> list[nn.Module]:
    """Every module held in an ``nn.ModuleList`` (a GPT's blocks)."""
    return [m for ml in module.modules() if isinstance(ml, nn.ModuleList) for m in ml]


def who_gathers(module: nn.Module, named: dict[str, nn.Parameter], given: set
                ) -> tuple[dict[int, list[nn.Module]], list[tuple], list[nn.Module]]:
    """(weight id -> the modules whose call gathers it, (module, local name, weight) of
    every registration, the gathering modules in the order they are first met)."""
    trainable = {id(p) for p in named.values()}
    triggers: dict[int, list[nn.Module]] = {}
    owners: list[tuple[nn.Module, str, nn.Parameter]] = []
    order: list[nn.Module] = []
    seen: set[int] = set()

    def walk(m: nn.Module, unit: nn.Module | None) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        unit = m if m in given else unit
        for local, p in m.named_parameters(recurse=False):
            if id(p) not in trainable:
                continue
            owners.append((m, local, p))
            t = unit if unit is not None else m
            if all(t is not x for x in triggers.setdefault(id(p), [])):
                triggers[id(p)].append(t)
                if all(t is not x for x in order):
                    order.append(t)
        for child in m.children():
            walk(child, unit)

    walk(module, None)
    return triggers, owners, order


def group_weights(named: dict[str, nn.Parameter], triggers: dict[int, list[nn.Module]],
                  replicate: tuple[type, ...]) -> dict[tuple, list[nn.Parameter]]:
    """Weights with the same gathering modules form one unit; replicated (not sharded)
    when one of those modules is of a ``replicate`` type (small norms)."""
    by_set: dict[tuple, list[nn.Parameter]] = {}
    for p in named.values():
        mods = triggers[id(p)]
        replicated = any(isinstance(m, replicate) for m in mods) if replicate else False
        by_set.setdefault((tuple(sorted(map(id, mods))), replicated), []).append(p)
    return by_set
