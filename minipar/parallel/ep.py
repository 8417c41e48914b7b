"""Expert parallelism: each MoE layer's experts split over the ep ranks of data parallelism.

With E experts and ep ranks, rank j of an ep group (``Mesh.ep_ranks``) holds experts
[j E/ep, (j+1) E/ep) of every MoE layer; each rank still routes its own tokens (its dp
rows). The expert MLPs (``model.Experts``) are replaced by ``ExpertParallel``, which is
called exactly as they are, with this rank's rows sorted by expert, and:

1. ``dispatch``: exchanges the row counts (all-to-all of E integers: how many rows each
   rank will send to each of my experts), sends the rows (those of experts on rank j
   to rank j), and regroups what arrived (by source rank, then expert) by expert;
2. runs its experts on them (one grouped GEMM);
3. ``combine``: undoes the regrouping, and the reverse all-to-all brings each result
   back to its token's rank.

The backward of an all-to-all is the all-to-all of the gradients with the split sizes
swapped. Every exchange goes through ``Comm.all_to_all`` (counted). This is the
placement of GShard (Lepikhin et al. 2020, arXiv 2006.16668), Megatron-Core and
torchtitan: experts sharded over ep, replicated over dp/ep. So dense weights keep their
reduction over dp x cp while an expert's gradient is summed over its own replicas, the
*edp group* (``ExpertDataParallel``: two ZeRO wrappers, one per group, at any stage and
with offload; each shards its weights' states, ZeRO-3 the weights too, over its ranks).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from minipar.comm import Comm
from minipar.model import Experts, GPTConfig, MoE


def is_expert(name: str) -> bool:
    """Whether parameter ``name`` belongs to an MoE layer's experts (split by ep)."""
    return ".experts." in f".{name}"


def split_experts(model: nn.Module) -> tuple[list[str], list[str]]:
    """The names of ``model``'s trainable weights: (dense ones, expert ones)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [n for n in names if not is_expert(n)], [n for n in names if is_expert(n)]


# the train flags that only a mixture-of-experts model reads
MOE_SETTINGS = ("moe_top_k", "moe_every", "capacity_factor", "aux_loss_coef", "z_loss_coef")


def check_ep(cfg, model: GPTConfig) -> None:
    """One line for each MoE setting or expert-parallel layout that cannot run (each
    number's own range: ``GPTConfig``, for every command that builds a model)."""
    if model.n_expert and model.n_moe_layers == 0:
        raise ValueError(f"--moe-every {model.moe_every} leaves no MoE block in "
                         f"{model.n_layer} layers")
    routing = [f"--{name.replace('_', '-')} {value}" for name in MOE_SETTINGS
               if (value := getattr(cfg, name, None)) is not None]
    if routing and not model.n_expert:
        raise ValueError(f"{' '.join(routing)} set{'s' if len(routing) == 1 else ''} how "
                         f"a mixture of experts routes, and {cfg.model} has none: add "
                         "--moe-experts E or take a moe-* preset")
    if cfg.ep == 1:
        return
    if not model.n_expert:
        raise ValueError(f"--ep {cfg.ep} needs a mixture-of-experts model (--moe-experts E "
                         "or a moe-* preset)")
    if cfg.dp % cfg.ep:
        raise ValueError(f"--ep {cfg.ep} must divide --dp {cfg.dp} (experts are split over "
                         "ranks of the data-parallel group)")
    if model.n_expert % cfg.ep:
        raise ValueError(f"--ep {cfg.ep} must divide the number of experts "
                         f"({model.n_expert})")


class _AllToAll(torch.autograd.Function):
    """``Comm.all_to_all`` with its backward: the gradients go back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, send: list[int], recv: list[int]):
        ctx.comm, ctx.send, ctx.recv = comm, send, recv
        return comm.all_to_all(x, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_to_all(grad, ctx.recv, ctx.send), None, None, None


def all_to_all(x: torch.Tensor, comm: Comm, send: list[int], recv: list[int]) -> torch.Tensor:
    """Rows of ``x`` to each rank of ``comm`` (``send[j]`` rows to rank j, in order),
    returning the ``recv[j]`` rows from each rank j, rank 0's first
    (``all_to_all_single`` with split sizes, counted); differentiable: the backward
    sends the gradients back with the split sizes swapped."""
    return _AllToAll.apply(x, comm, send, recv)


def dispatch(x: torch.Tensor, counts: torch.Tensor, comm: Comm) -> tuple:
    """Send this rank's rows to the ranks holding their experts.

    ``x``: this rank's rows sorted by (global) expert, ``counts`` [E] rows per expert;
    rank j of ``comm`` holds experts [j E/ep, (j+1) E/ep). Returns (``rows``: every
    rank's rows for my experts, sorted by my expert (then by source rank),
    ``local_counts`` [E/ep], ``plan``: what ``combine`` needs to send the results back).
    """
    ep, local = comm.size, counts.numel() // comm.size
    # [source rank, my expert]: rows each rank sends to each of my experts
    got = comm.all_to_all(counts.view(ep, local), [1] * ep, [1] * ep)
    send = counts.view(ep, local).sum(1).tolist()
    recv = got.sum(1).tolist()
    rows = all_to_all(x, comm, send, recv)
    # arrived by (source, expert); my experts want them by (expert, source)
    arange = torch.arange(max(ep, local), device=x.device)
    key = arange[:local] * ep + arange[:ep, None]  # [source, expert] -> expert-major
    order = torch.sort(key.flatten().repeat_interleave(
        got.flatten(), output_size=rows.shape[0]), stable=True)[1]
    return rows[order], got.sum(0), (order, send, recv)


def combine(y: torch.Tensor, plan: tuple, comm: Comm) -> torch.Tensor:
    """The inverse of ``dispatch``: ``y`` (one result per row ``dispatch`` returned, in
    its order) back to the rows' own ranks, in the order ``dispatch`` was given them."""
    order, send, recv = plan
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=y.device)
    return all_to_all(y[back], comm, recv, send)


class ExpertParallel(Experts):
    """This rank's E/ep experts of one MoE layer, serving every ep rank's tokens.

    Called like ``Experts``: ``x`` this rank's rows sorted by (global) expert, ``counts``
    [E] rows per expert; returns their outputs in the same order. Its parameters keep
    the reference's names (``...experts.fc.weight``), holding experts
    [rank E/ep, (rank+1) E/ep) along dim 0.
    """

    def __init__(self, n_expert: int, d_model: int, d_ff: int, comm: Comm) -> None:
        super().__init__(n_expert // comm.size, d_model, d_ff)
        self.comm, self.n_expert = comm, n_expert

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rows, local_counts, plan = dispatch(x, counts, self.comm)
        return combine(super().forward(rows, local_counts), plan, self.comm)


def apply_expert_parallel(model: nn.Module, comm: Comm) -> nn.Module:
    """Replace the ``experts`` of every ``MoE`` in ``model`` (on the meta device) by
    ``ExpertParallel`` over the ep group ``comm``. Returns ``model``."""
    for m in model.modules():
        if isinstance(m, MoE):
            fc = m.experts.fc.weight
            with torch.device(fc.device):
                m.experts = ExpertParallel(m.n_expert, fc.shape[2], fc.shape[1], comm)
    return model


def expert_values(values, ep_rank: int, ep: int):
    """``values(name, p)`` (``parallel/materialize.py``) with each expert tensor cut to
    this ep rank's experts: the reference's value of the whole layer, sliced on dim 0."""
    def shard(name: str, p: nn.Parameter) -> torch.Tensor:
        if not is_expert(name):
            return values(name, p)
        whole = torch.empty((p.shape[0] * ep, *p.shape[1:]), device="meta")
        return values(name, whole).chunk(ep)[ep_rank].clone()
    return shard


class ExpertDataParallel:
    """The data-parallel layer when experts are split: two ZeRO wrappers of the same
    stage, ``dense`` over dp x cp and ``experts`` over the edp group, offered as one (the
    calls ``step.data_parallel`` documents). ZeRO 0-2: two ``ZeroOptimizer`` s, stepped
    together (an optimizer's ``param_groups`` / ``step``); ZeRO-3: two ``Zero3`` s, each
    sharding its own weights (``only``) under one torch optimizer (``parameters``).
    With ``--offload`` each keeps its masters on the host.

    Gradient norm: each rank owns its dense shard (once over dp) and its expert shard
    (once over edp; the ep ranks hold other experts), so the squared sums over dp, tp and
    pp count every element once. Checkpoints: expert tensors are gathered over ep.
    """

    def __init__(self, dense, experts, ep: Comm) -> None:
        self.dense, self.experts, self.ep = dense, experts, ep
        # ZeroOptimizer counts its whole module's weights; a Zero3 its own only
        self.counts_module = isinstance(dense, torch.optim.Optimizer)

    @property
    def parts(self) -> tuple:
        return self.dense, self.experts

    @property
    def flats(self) -> list:
        return [f for z in self.parts for f in z.flats]

    @property
    def param_groups(self) -> list[dict]:
        return [g for z in self.parts for g in z.param_groups]

    @property
    def last_traffic(self) -> dict[str, int]:
        """ZeRO-Offload's bytes each way of the last step, both parts' hosts together."""
        last = [z.place.last_traffic for z in self.parts]
        return {k: sum(t[k] for t in last) for k in last[0]}

    def parameters(self) -> Iterator[nn.Parameter]:
        """ZeRO-3: the master shards of both parts, for one torch optimizer."""
        for z in self.parts:
            yield from z.parameters()

    def publish_after(self, optimizer: torch.optim.Optimizer) -> None:
        for z in self.parts:
            z.publish_after(optimizer)

    @property
    def backwards_per_step(self) -> int:
        return self.dense.backwards_per_step

    @backwards_per_step.setter
    def backwards_per_step(self, m: int) -> None:
        for z in self.parts:
            z.backwards_per_step = m

    def step(self) -> None:
        for z in self.parts:
            z.step()

    def finish_gradient_sync(self) -> None:
        for z in self.parts:
            z.finish_gradient_sync()

    def finish_param_sync(self) -> None:
        for z in self.parts:
            z.finish_param_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for z in self.parts:
            z.zero_grad(set_to_none)

    def grad_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        for z in self.parts:
            yield from z.grad_shards()

    def scale_grads(self, factor) -> None:
        for z in self.parts:
            z.scale_grads(factor)

    def all_reduce_grads(self, params, comm: Comm) -> None:
        self.dense.all_reduce_grads(params, comm)  # (norms, tied embeddings: dense)

    def observe(self, observer) -> None:
        for z in self.parts:
            z.observe(observer)

    def fusable(self, linear: nn.Linear) -> bool:
        return self.dense.fusable(linear)  # (the experts are no nn.Linear)

    def accumulate_product(self, p, dy, x) -> None:
        self.dense.accumulate_product(p, dy, x)

    def memory_bytes(self, optimizer=None) -> dict[str, int]:
        """Both parts' bytes; ``optimizer`` (ZeRO-3's, over both) counted once."""
        dense = self.dense.memory_bytes(optimizer)
        experts = self.experts.memory_bytes(None)
        if self.counts_module:  # (each counts the whole module's weights: once)
            experts["params"] = 0
        return {k: v + experts.get(k, 0) for k, v in dense.items()}

    def load_full_state_by_name(self, states: Mapping, weights: Mapping | None = None,
                                optimizer=None) -> None:
        """Take whole states (and fp32 weights) by name, as a checkpoint holds them: each
        part its own, the experts' cut to this ep rank's (dim 0, as ``expert_values``)."""
        states = _ThisRanksExperts(states, self.ep.rank, self.ep.size)
        if weights is not None:
            weights = _ThisRanksExperts(weights, self.ep.rank, self.ep.size)
        for z in self.parts:
            z.load_full_state_by_name(states, weights, optimizer)

    def full_state_by_name(self, optimizer=None) -> tuple[dict, dict]:
        """(fp32 weights, optimizer states) by name, whole (collective over dp and ep)."""
        weights, states = self.dense.full_state_by_name(optimizer)
        ew, es = self.experts.full_state_by_name(optimizer)
        for name in ew:
            weights[name] = self.ep.all_gather(ew[name], dim=0)
            states[name] = {k: self.ep.all_gather(v, dim=0)
                            if isinstance(v, torch.Tensor) and v.dim() else v
                            for k, v in es[name].items()}
        return weights, states


class _ThisRanksExperts(Mapping):
    """A by-name mapping of whole tensors (or of dicts of them: optimizer states) whose
    expert entries read as this ep rank's experts only (dim 0); the rest as they are."""

    def __init__(self, whole: Mapping, ep_rank: int, ep: int) -> None:
        self.whole, self.ep_rank, self.ep = whole, ep_rank, ep

    def _cut(self, t):
        if isinstance(t, torch.Tensor) and t.dim():
            return t.chunk(self.ep)[self.ep_rank].clone()
        return t

    def __getitem__(self, name: str):
        value = self.whole[name]
        if not is_expert(name):
            return value
        if isinstance(value, dict):
            return {k: self._cut(v) for k, v in value.items()}
        return self._cut(value)

    def __iter__(self):
        return iter(self.whole)

    def __len__(self) -> int:
        return len(self.whole)
