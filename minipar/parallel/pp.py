"""Pipeline parallelism: cut the GPT into stages, and run any schedule over them.

``build_stage`` gives rank ``r`` the chunks ``r, r + pp, ...`` of ``pp * virtual``
chunks of consecutive layers (Megatron's virtual stages, arXiv 2104.04473), each a
``PipelineStage`` that owns its layers under the reference model's names, so
checkpoints, tensor-parallel slicing and ZeRO find every parameter by the name it has
on one device. ``PipelineExecutor`` walks this rank's action list of a schedule
(``minipar.parallel.schedules``: schedules are data) and does what it says: forwards,
backwards (split in B and W for zero bubble, arXiv 2401.10241), and the point-to-point
sends and receives between stages, recording when each action ran and how long it
waited, from which ``minipar.theory.bubble`` measures the bubble.

Tied embeddings (Megatron's way, 1909.08053 section 3): with pp > 1 the first stage holds
the token embedding and the last the head, each a copy of the one shared weight; their
gradients are summed in the embedding group (``RankMesh.embed``) so both take one step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from minipar.comm import Comm, Pending
from minipar.model import GPT, embed_tokens
from minipar.parallel.schedules import (
    UNIT_COST,
    Action,
    Schedule,
    action_cost,
    rank_of,
    schedule_shape,
    validate,
)

__all__ = ["partition_layers", "split_report", "PipelineStage", "build_stage",
           "StageLayers", "tied_copy", "PipelineExecutor", "ActionRecord", "StepResult"]


# --- stages --------------------------------------------------------------------------


def partition_layers(n_layer: int, n_chunks: int, head_layers: int = 0) -> list[range]:
    """Consecutive layer ranges of ``n_chunks`` pipeline chunks; the first chunks take the
    rest. ``head_layers`` k: the last chunk's final norm, LM head and loss count as k
    layers, so the split is even over ``n_layer + k`` and the last chunk holds k fewer
    (Megatron's ``account_for_loss_in_pipeline_split``, torchtitan's output weight): a
    stage with the head is otherwise the pipeline's slowest."""
    return list(_partition(n_layer, n_chunks, head_layers))


@functools.cache  # (pure, and the planner asks it thousands of times a plan)
def _partition(n_layer: int, n_chunks: int, head_layers: int) -> tuple[range, ...]:
    if n_chunks < 1:
        raise ValueError(f"need at least one chunk, got {n_chunks}")
    base, extra = divmod(n_layer + head_layers, n_chunks)
    sizes = [base + (1 if i < extra else 0) for i in range(n_chunks)]
    sizes[-1] -= head_layers
    if head_layers < 0 or sizes[-1] < 0:
        raise ValueError(f"--head-layers {head_layers} must be 0 or more and leave the last "
                         f"of {n_chunks} chunks 0 or more of the {n_layer} layers")
    starts = [sum(sizes[:i]) for i in range(n_chunks)]
    return tuple(range(a, a + n) for a, n in zip(starts, sizes))


def split_report(n_layer: int, pp: int, virtual: int = 1, head_layers: int = 0) -> str:
    """Which layers each rank holds, e.g. ``rank 0: chunk 0 = embed + layers 0-2``."""
    ranges = partition_layers(n_layer, pp * virtual, head_layers)
    last = pp * virtual - 1
    lines = []
    for r in range(pp):
        parts = []
        for c in range(r, pp * virtual, pp):
            layers = ranges[c]
            what = [f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else
                    f"layer {layers.start}" if layers else "no layers"]
            if c == 0:
                what.insert(0, "embed")
            if c == last:
                what.append("head + loss")
            parts.append(f"chunk {c} = " + " + ".join(what))
        lines.append(f"rank {r}: " + ", ".join(parts))
    return "\n".join(lines)


class PipelineStage(nn.Module):
    """Chunk ``index`` of ``n_chunks``: its blocks, plus embedding (first) or final norm,
    head and loss (last), taken from ``model`` under the same names.

    ``forward(x, targets=None)``: token ids in for the first chunk, hidden states
    otherwise; the mean loss out of the last chunk, hidden states otherwise.
    """

    def __init__(self, model: GPT, index: int, n_chunks: int, layers: range) -> None:
        super().__init__()
        self.index, self.n_chunks, self.layers = index, n_chunks, layers
        self.is_first, self.is_last = index == 0, index == n_chunks - 1
        if self.is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if self.is_last:
            self.ln_f, self.head, self.loss_fn = model.ln_f, model.head, model.loss_fn

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = embed_tokens(self.tok_emb, self.pos_emb, self.drop, x) if self.is_first else x
        for block in self.blocks.values():
            h = block(h)
        if not self.is_last:
            return h
        if targets is None:
            raise ValueError("the last pipeline chunk needs the targets")
        return self.loss_fn(self.head(self.ln_f(h)), targets)

    def extra_repr(self) -> str:
        return f"chunk {self.index} of {self.n_chunks}, layers {list(self.layers)}"


def build_stage(model: GPT, pp_rank: int, pp: int, virtual: int = 1,
                head_layers: int = 0) -> list[PipelineStage]:
    """This rank's chunks (local order; ``head_layers``: see ``partition_layers``).
    ``model`` is left as it was: once the caller drops it, the layers no chunk took are
    freed."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} is outside 0..{pp - 1}")
    if virtual < 1:
        raise ValueError(f"virtual must be >= 1, got {virtual}")
    n_chunks = pp * virtual
    ranges = partition_layers(len(model.blocks), n_chunks, head_layers)
    return [PipelineStage(model, c, n_chunks, ranges[c])
            for c in range(n_chunks) if rank_of(c, pp) == pp_rank]


class StageLayers(nn.Module):
    """Every layer of this rank's chunks in one module, under the reference names: what
    the optimizer, checkpoints and the gradient norm see. The chunks are what runs."""

    def __init__(self, chunks: Sequence[PipelineStage], cfg) -> None:
        super().__init__()
        self.cfg = cfg
        for chunk in chunks:
            for name, child in chunk.named_children():
                if name != "blocks":
                    self.add_module(name, child)
                elif "blocks" in self._modules:
                    self.blocks.update(child)
                else:
                    self.blocks = nn.ModuleDict(child)


def tied_copy(name: str, cfg) -> bool:
    """Is parameter ``name`` the last stage's copy of a tied embedding? (Counted once
    in a gradient norm: under the first stage's name, ``tok_emb.weight``.)"""
    return bool(getattr(cfg, "tie_embeddings", False)) and name.split(".")[-2:] == [
        "head", "weight"]


# --- the executor ----------------------------------------------------------------------


class ActionRecord(NamedTuple):
    """When one action ran on one rank (``time.time()`` seconds) and how long the rank
    waited for its incoming data before starting it."""

    rank: int
    kind: str
    mb: int
    chunk: int
    start: float
    end: float
    wait: float


class StepResult(NamedTuple):
    loss: float | torch.Tensor | None  # mean micro-batch loss (last stage, or everywhere
    # if broadcast); a 0-dim tensor if asked for
    timeline: list[ActionRecord]
    peak_in_flight: int  # most (micro-batch, chunk) activations held at once


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 10  # dtype code, ndim, up to 8 sizes


class PipelineExecutor:
    """Runs this rank's part of ``actions`` over ``chunks`` (local order, as
    ``build_stage`` returns them), talking to the other stages through ``comm``.

    ``step(microbatches)`` walks the rank's action list and does what it says:

    * ``RECV_*`` posts a non-blocking ``irecv``; the compute that needs the data waits for
      it (the wait is recorded). ``SEND_*`` posts an ``isend`` and moves on; sends are
      completed at the end of the step. The lists are valid under *blocking* sends and
      receives (``validate``), so this gentler execution cannot deadlock either.
    * ``F`` calls the chunk module (``__call__``: wrappers' hooks fire) and keeps its
      input and output for the backward.
    * ``B`` back-propagates the output gradient. If the list also has a ``W`` for that
      micro-batch and chunk (zero-bubble, arXiv 2401.10241), ``B`` computes only the input
      gradient and the gradients of every parameter-owning module's output; ``W`` later
      turns those into weight gradients (``autograd.backward`` with ``inputs=`` the
      parameters, so only the weight products run and gradient hooks fire). For that, each
      such module runs on *detached* inputs and ``_Stitch`` joins its output back to the
      chunk's graph: B's gradient crosses the stitch into the module's own graph (its input
      gradient), and W back-propagates every module's own graph in one engine call. The
      graphs share no node, so no gradient reaches a parameter twice (a weight two modules
      share, a tied embedding in one chunk, gets the sum of both), and the engine walks
      each graph once (with one graph per chunk, each module's W would walk everything
      upstream of it: a micro-batch cost quadratic in the modules).
    * The loss of each micro-batch is multiplied by ``loss_scale`` (default 1/m) before the
      backward, so the gradients equal those of the mean loss of the whole batch on one
      device. (Forgetting the 1/m scales the gradient by m; picotron has that bug.)

    Activation shapes are never assumed: the first time a boundary carries a new input
    shape, the sender sends a small header (dtype and shape) before the tensor. Gradient
    shapes are known (those of the rank's own outputs). So sequence parallelism's
    [b, s/tp, h] crosses stages like anything else. Only a rank rehearsed alone
    (``engine.rehearse``), whose neighbours are imagined and send nothing, is told what
    its boundaries carry instead: ``boundary(key)`` gives (shape, dtype) for a
    micro-batch of token ids of shape ``key``.

    ``sleep_per_unit`` adds ``cost * sleep_per_unit`` seconds of sleep to every compute
    action (F 1, B 2 or 1 + W 1): a stand-in for a bigger model, so that measured
    timelines are comparable with theory on a small, busy CPU.

    ``synchronize=True`` waits for the GPU after every compute action, and for each
    received tensor to arrive before the compute that needs it starts, so that each
    record's start and end are when the GPU ran it and its wait is the GPU's wait for
    the data (a true timeline; busy is compute only). Off by default:
    each wait stalls the host, which then cannot queue the next kernels while the GPU
    works, and costs a few per cent of a small model's step. Without it, on a GPU the
    records say when the host *queued* the work (the step's total stays true).
    """

    def __init__(self, chunks: Sequence[nn.Module], comm: Comm, actions: Schedule, *,
                 sleep_per_unit: float = 0.0, synchronize: bool = False,
                 device: torch.device | str | None = None,
                 boundary: Callable[[tuple], tuple[tuple, torch.dtype]] | None = None
                 ) -> None:
        if len(actions) != comm.size:
            raise ValueError(f"schedule is for pp={len(actions)}, the pipeline group has "
                             f"{comm.size} ranks")
        validate(actions, virtual=len(chunks))
        self.comm, self.pp, self.rank = comm, comm.size, comm.rank
        self.n_chunks = self.pp * len(chunks)
        self.chunks = {self.rank + k * self.pp: c for k, c in enumerate(chunks)}
        self.actions = list(actions[self.rank])
        self.microbatches = schedule_shape(actions)[1]
        self.split = {(a.mb, a.chunk) for a in self.actions if a.kind == "W"}
        self.sleep_per_unit = sleep_per_unit
        # (ZeRO-3 leaves a chunk no registered parameters: the caller names the device)
        params = [p for c in chunks for p in c.parameters()]
        self.device = torch.device(device) if device is not None else \
            params[0].device if params else torch.device("cpu")
        self.synchronize = synchronize and self.device.type == "cuda"
        self._shapes_sent: set = set()
        self._shapes_known: dict = {}
        self.boundary = boundary
        self._capture: list | None = None
        self._cuts: list = []  # (inputs, detached inputs) per module running: they nest
        self._hooks = []
        self._own: dict[nn.Module, list[nn.Parameter]] = {}  # module -> what W reaches
        if self.split:  # run each parameter-owning module on its own graph (_Stitch)
            for module in dict.fromkeys(m for c in chunks for m in c.modules()):
                own = list(module.parameters(recurse=False))
                if own:
                    self._own[module] = own
                    self._hooks += [
                        module.register_forward_pre_hook(self._cut_inputs, with_kwargs=True),
                        module.register_forward_hook(self._capture_output, with_kwargs=True)]

    def close(self) -> None:
        """Remove the forward hooks this executor put on the chunks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _cut_inputs(self, module: nn.Module, args: tuple, kwargs: dict):
        if self._capture is None:  # (also a recomputing forward inside a backward)
            return None
        originals = [t for t in (*args, *kwargs.values()) if _needs_grad(t)]
        if not originals:  # token ids in: the module's graph is its own already
            self._cuts.append(None)
            return None
        detached = {id(t): t.detach().requires_grad_() for t in originals}
        self._cuts.append((originals, list(detached.values())))
        cut = [detached.get(id(t), t) for t in args]
        return tuple(cut), {k: detached.get(id(t), t) for k, t in kwargs.items()}

    def _capture_output(self, module: nn.Module, args, kwargs, output):
        if self._capture is None:
            return None
        cut = self._cuts.pop()
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(module).__name__} returns {type(output).__name__}; the "
                            "split backward (W actions) needs modules that return a tensor")
        # Only graph nodes are kept, never the outputs themselves: a tensor no backward
        # saves (the attention's and the MLP's projections, added into the residual) is
        # freed in the forward, as without the split
        node = get_gradient_edge(output) if output.requires_grad else None
        joined = output if cut is None else _Stitch.apply((output, node, cut[1]), *cut[0])
        if node is not None:
            self._capture.append((module, node, get_gradient_edge(joined)))
        return joined

    # --- point to point, with a shape header the first time ----------------------
    def _send_activation(self, t: torch.Tensor, chunk: int, key: tuple) -> list[Pending]:
        peer, out = rank_of(chunk + 1, self.pp), []
        if (chunk + 1, key) not in self._shapes_sent:
            self._shapes_sent.add((chunk + 1, key))
            header = torch.zeros(_HEADER, dtype=torch.long, device=t.device)
            header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
            header[2:2 + t.dim()] = torch.tensor(t.shape)
            out.append(self.comm.isend(header, peer))
        out.append(self.comm.isend(t, peer))
        return out

    def _recv_activation(self, chunk: int, key: tuple) -> tuple[Pending, torch.Tensor]:
        peer = rank_of(chunk - 1, self.pp)
        if self.boundary is not None:  # told, not sent (a rehearsal's imagined peer)
            shape, dtype = self.boundary(key)
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            return self.comm.irecv(buf, peer), buf
        if (chunk, key) not in self._shapes_known:
            header = torch.empty(_HEADER, dtype=torch.long, device=self.device)
            self.comm.irecv(header, peer).wait()
            h = header.tolist()
            self._shapes_known[(chunk, key)] = (tuple(h[2:2 + h[1]]), _DTYPES[h[0]])
        shape, dtype = self._shapes_known[(chunk, key)]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return self.comm.irecv(buf, peer), buf

    # --- one training step ---------------------------------------------------------
    def step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             loss_scale: float | None = None, broadcast_loss: bool = False,
             loss_as_tensor: bool = False,
             before_compute: Callable[[int], None] | None = None) -> StepResult:
        """Forward and backward of every micro-batch; gradients accumulate in ``.grad``.

        Every rank passes the same list of (inputs, targets) micro-batches (only the
        first stage reads inputs, only the last reads targets). Each micro-batch's
        loss is multiplied by ``loss_scale`` before its backward: 1/m by default (the
        batch mean); pass 1/(dp*m) if data parallelism sums gradients instead of
        averaging them. Returns the mean micro-batch loss (unscaled) on the last stage,
        on every stage with ``broadcast_loss``; as a 0-dim tensor with
        ``loss_as_tensor`` (reading a float waits for the GPU to finish the backward,
        and the host could queue the optimizer step meanwhile). ``before_compute(mb)``
        runs before every F, B and W of micro-batch ``mb`` (the engine keys dropout
        there: a recomputing backward must draw the forward's masks).
        """
        m = len(microbatches)
        if m != self.microbatches:
            raise ValueError(f"schedule is for {self.microbatches} micro-batches, got {m}")
        st = _StepState(microbatches, 1.0 / m if loss_scale is None else loss_scale)
        run = {"F": self._forward, "B": self._backward, "W": self._weight_grad,
               "RECV_F": self._recv_f, "RECV_B": self._recv_b,
               "SEND_F": self._send_f, "SEND_B": self._send_b}
        records = []
        for a in self.actions:
            st.start = time.time()  # compute actions move it past their wait for inputs
            if before_compute is not None and a.kind in ("F", "B", "W"):
                before_compute(a.mb)
            wait = run[a.kind](a, st) or 0.0
            if a.kind in ("F", "B", "W"):
                self._pretend_compute(a)
            records.append(ActionRecord(self.rank, a.kind, a.mb, a.chunk, st.start,
                                        time.time(), wait))
            for s in [s for s in st.sends if s.is_completed()]:
                s.wait()  # stamps its end in the comm log
                st.sends.remove(s)
        for s in st.sends:
            s.wait()
        loss = torch.stack(st.losses).mean() if st.losses else None
        if broadcast_loss:
            loss = self.comm.broadcast(torch.zeros((), device=self.device) if loss is None
                                       else loss.to(self.device).float(),
                                       src=rank_of(self.n_chunks - 1, self.pp))
        if loss is not None and not loss_as_tensor:
            loss = float(loss)
        return StepResult(loss, records, st.peak)

    # each action: returns the seconds it waited for incoming data (or None)
    def _recv_f(self, a: Action, st: _StepState) -> None:
        st.inputs[(a.mb, a.chunk)] = self._recv_activation(a.chunk, st.shape_key(a.mb))

    def _recv_b(self, a: Action, st: _StepState) -> None:
        buf = torch.empty_like(st.saved[(a.mb, a.chunk)][1])
        st.out_grads[(a.mb, a.chunk)] = (self.comm.irecv(buf, rank_of(a.chunk + 1, self.pp)),
                                         buf)

    def _send_f(self, a: Action, st: _StepState) -> None:
        out = st.saved[(a.mb, a.chunk)][1].detach()
        st.sends += self._send_activation(out, a.chunk, st.shape_key(a.mb))

    def _send_b(self, a: Action, st: _StepState) -> None:
        grad = st.input_grads.pop((a.mb, a.chunk))
        st.sends.append(self.comm.isend(grad, rank_of(a.chunk - 1, self.pp)))

    def _forward(self, a: Action, st: _StepState) -> float:
        key, last = (a.mb, a.chunk), a.chunk == self.n_chunks - 1
        x, y = st.microbatches[a.mb]
        wait = 0.0
        if a.chunk > 0:
            x, wait = self._take(st.inputs, key)
            x = x.detach().requires_grad_(x.is_floating_point())
            st.start = time.time()
        self._capture = [] if key in self.split else None
        out = self.chunks[a.chunk](x, y) if last else self.chunks[a.chunk](x)
        if self._capture is not None:
            st.weight_work[key] = self._capture
        self._capture = None
        st.saved[key] = (x, out)
        if last:
            st.losses.append(out.detach())
        elif rank_of(a.chunk + 1, self.pp) == self.rank:  # the next chunk is here too
            st.inputs[(a.mb, a.chunk + 1)] = out.detach()
        st.peak = max(st.peak, len(st.saved.keys() | st.weight_work.keys()))
        return wait

    def _backward(self, a: Action, st: _StepState) -> float:
        """B: the input gradient; also the weight gradients unless a W will do them."""
        key, wait, grad = (a.mb, a.chunk), 0.0, None
        x, out = st.saved.pop(key)
        if a.chunk == self.n_chunks - 1:  # the output is the loss
            out = out * st.scale
        else:
            grad, wait = self._take(st.out_grads, key)
            st.start = time.time()
        needs_dx = a.chunk > 0 and x.requires_grad
        if key not in self.split:
            torch.autograd.backward(out, grad)
            dx = x.grad if needs_dx else None
        else:  # the input gradient, and each module's output gradient for W; the
            # graph is not kept: W needs only the modules' own graphs. (``grad`` hands
            # the gradients back: ``backward`` with non-leaf ``inputs=`` would
            # ``retain_grad`` each output, a copy into ``.grad`` per module)
            work = st.weight_work[key]
            wrt = ([x] if needs_dx else []) + [joined for _, _, joined in work]
            grads = list(torch.autograd.grad(out, wrt, grad, allow_unused=True))
            dx = grads.pop(0) if needs_dx else None
            st.weight_work[key] = [(mod, node, g) for (mod, node, _), g in zip(work, grads)]
        if dx is not None:
            if rank_of(a.chunk - 1, self.pp) == self.rank:  # the previous chunk is here
                st.out_grads[(a.mb, a.chunk - 1)] = dx
            else:
                st.input_grads[key] = dx
        return wait

    def _weight_grad(self, a: Action, st: _StepState) -> None:
        """W: every module's weight gradients from its saved output gradient, in one
        engine call (the modules' graphs are disjoint)."""
        work = [(mod, e, g) for mod, e, g in st.weight_work.pop((a.mb, a.chunk))
                if g is not None]
        params = list(dict.fromkeys(p for mod, _, _ in work for p in self._own[mod]
                                    if p.requires_grad))
        if params:
            torch.autograd.backward([e for _, e, _ in work], [g for _, _, g in work],
                                    inputs=params)

    def _take(self, store: dict, key) -> tuple[torch.Tensor, float]:
        """Pop a tensor; if it is still arriving, wait for it and report how long."""
        value = store.pop(key)
        if not isinstance(value, tuple):
            return value, 0.0
        t0 = time.time()
        value[0].wait()
        if self.synchronize:  # an NCCL wait only makes the stream wait for the data:
            # wait for the data itself, or the compute's record counts the GPU's wait
            # for it as busy (the measured bubble came out at half the simulated one)
            torch.cuda.current_stream(self.device).synchronize()
        return value[1], time.time() - t0

    def _pretend_compute(self, a: Action) -> None:
        if self.synchronize:
            torch.cuda.synchronize(self.device)
        if self.sleep_per_unit > 0:
            split = (a.mb, a.chunk) in self.split
            time.sleep(self.sleep_per_unit * action_cost(a.kind, split, UNIT_COST))


def _needs_grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


class _Stitch(torch.autograd.Function):
    """Joins a module's output, computed from detached inputs, to the chunk's graph.
    Its backward is the module's input gradient, from the module's own graph (kept for
    W: only the input products run here). ``inner`` is (output, its graph node, detached
    inputs); the node is kept, not the output (whose memory goes when the chunk is done
    with it)."""

    @staticmethod
    def forward(ctx, inner: tuple, *inputs: torch.Tensor) -> torch.Tensor:
        output, ctx.node, ctx.detached = inner
        return output.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, *torch.autograd.grad(ctx.node, ctx.detached, grad, retain_graph=True,
                                          allow_unused=True)


@dataclass
class _StepState:
    """What one step keeps between actions, keyed by (micro-batch, chunk)."""

    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    scale: float
    inputs: dict = field(default_factory=dict)  # chunk input, or (pending, buffer)
    out_grads: dict = field(default_factory=dict)  # grad of chunk output, likewise
    saved: dict = field(default_factory=dict)  # (input, output) until the backward
    weight_work: dict = field(default_factory=dict)  # [(module, node, joined's node)],
    # after B [(module, node, output gradient)]
    input_grads: dict = field(default_factory=dict)  # grad of chunk input, to send
    sends: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    peak: int = 0
    start: float = 0.0  # when the current action started (after its inputs arrived)

    def shape_key(self, mb: int) -> tuple:
        return tuple(self.microbatches[mb][0].shape)
