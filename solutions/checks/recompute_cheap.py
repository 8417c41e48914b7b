"""Cases for the cheap-recomputation exercise (lesson 07).

In one process: one block of the tiny GPT (fp32, where the byte count is exact), the
learner's ``recipe_hooks`` in ``minipar.parallel.recompute`` (what
``CheaplyRecomputedBlock`` calls), against a copy of the block keeping everything. Every
gradient must be equal; a failure names the parameter, the worst element, the value
expected and the value got. The packed values are inspected: three recipes a forward (two
layer norms, one GELU) and none holding an output (it would keep the very bytes the
recipe is for). The bytes the block keeps, counted by hooks around it, against
``minipar.theory.memory``. ``pack`` and ``unpack`` alone: a transposed view of a noted
output comes back element for element, with its strides; a tensor at a noted output's
address that is not the whole of it (longer, or another dtype) stays as it is.

Then two processes (data parallelism by hand: half the batch each, gradients averaged by
an all-reduce, plain SGD) train the two-layer tiny GPT with the learner's hooks in every
block, against one process keeping everything: the same losses and final weights.
"""

from __future__ import annotations

import copy
import importlib

import torch
from torch import nn

from minipar.comm import Comm
from minipar.data import MarkovData, split_batch
from minipar.model import GPT, Block, get_config
from minipar.parallel import recompute
from minipar.theory.memory import layer_activations

from ..check import CheckFailure, expect, launch_case

DP_TOL = 1e-5  # two ranks' averaged gradients against one process's: summation order


def _tensors(value: object, depth: int = 0) -> list[torch.Tensor]:
    """The tensors a packed value holds (through tuples, lists, dicts, attributes)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 3 or isinstance(value, (nn.Module, str, bytes, int, float, torch.Size)):
        return []
    if isinstance(value, dict):
        value = list(value.values())
    elif hasattr(value, "__dict__") and not isinstance(value, (tuple, list)):
        value = list(vars(value).values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v, depth + 1)]
    return []


def _one_block(impl: str) -> int:
    """The learner's hooks in one fp32 block against the block keeping everything; the
    bytes it keeps."""
    hooks = importlib.import_module(f"{impl}.recompute_cheap").recipe_hooks
    recipes: list[tuple[object, set]] = []  # each recipe, and the outputs noted then

    def recording(noted: dict):
        pack, unpack = hooks(noted)

        def pack_and_note(t: torch.Tensor) -> object:
            value = pack(t)
            if value is not t:
                recipes.append((value, {out.data_ptr() for _, out, _ in noted.values()}))
            return value
        return pack_and_note, unpack

    cfg = get_config("tiny").with_(dropout=0.0)
    torch.manual_seed(0)
    plain = Block(cfg)
    twin = recompute.CheaplyRecomputedBlock(copy.deepcopy(plain))
    weights = {p.untyped_storage().data_ptr() for p in twin.parameters()}
    kept: dict[int, int] = {}

    def count(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, cfg.seq_len, cfg.d_model, generator=g)
    dy = torch.randn(1, cfg.seq_len, cfg.d_model, generator=g)
    plain(x.clone().requires_grad_()).backward(dy)
    original, recompute.recipe_hooks = recompute.recipe_hooks, recording
    try:
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            y = twin(x.clone().requires_grad_())
        y.backward(dy)
    except (CheckFailure, NotImplementedError):  # (a blank: the checker says TODO)
        raise
    except Exception as e:
        raise CheckFailure(f"the block with your hooks raised {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}",
                           "unpack must return the saved tensor itself: the same shape, "
                           "strides and dtype") from None
    finally:
        recompute.recipe_hooks = original
    expect(len(recipes) == 3,
           f"one forward made {len(recipes)} recipes; expected 3 (the two layer norms' "
           "outputs and GELU's, each saved by the linear that follows)",
           "compare the saved tensor's data address with the noted ones, and accept a view "
           "of the whole output (a linear may save its input reshaped)")
    for value, outputs in recipes:
        expect(not any(t.data_ptr() in outputs for t in _tensors(value)),
               "a recipe holds a noted output itself: it keeps the very bytes it is meant "
               "to free", "keep what makes the output (the module and its input), not it")
    for (name, p), q in zip(twin.named_parameters(), plain.parameters()):
        err = (p.grad - q.grad).abs()
        if err.max() > 0:
            where = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
            raise CheckFailure(
                f"gradient of {name}{list(where)}: expected {q.grad[where].item():.9g} "
                f"(the block keeping everything), got {p.grad[where].item():.9g} (off by "
                f"{err.max().item():.3g})",
                "unpack must make the very tensor that was saved: the module's forward on "
                "its input, seen with the saved tensor's size, stride and offset")
    held = sum(n for ptr, n in kept.items() if ptr not in weights)
    want = sum(layer_activations(cfg, 1, recompute="cheap", dtype="fp32",
                                 accounting="fused").values())
    expect(held == want, f"the block keeps {held:,} bytes; expected {int(want):,} "
           "(minipar.theory.memory with cheap recomputation)",
           "what pack returns for a tensor it does not turn into a recipe is kept as it is")
    return held


def _pack_alone(impl: str) -> None:
    """``pack`` and ``unpack`` on single tensors at a noted output's address. A view of
    the whole output with other strides (its transpose) becomes a recipe that ``unpack``
    makes again element for element, with those strides. A tensor that is not the whole
    of an output stays as it is: one longer than the output (the output is its first
    part, as q is of a fused qkv: a recipe would make too few elements), and the
    output's bytes seen as another dtype (a recipe would make floats)."""
    gelu = nn.GELU()
    source = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    buffer = torch.empty(2 * source.numel())
    out = buffer[: source.numel()].view_as(source)  # the output: the buffer's first half
    out.copy_(gelu(source))
    pack, unpack = importlib.import_module(f"{impl}.recompute_cheap").recipe_hooks(
        {out.data_ptr(): (gelu, out, source)})
    t = out.t()
    what = (f"a transposed view of a noted output (shape {tuple(t.shape)}, strides "
            f"{t.stride()})")
    value = pack(t)
    expect(value is not t, f"pack(t) for {what}: expected a recipe, got t itself back",
           "a view of the whole of a noted output (the same address, as many elements, the "
           "same dtype) becomes a recipe, whatever its strides")
    made = unpack(value)
    if made.shape == t.shape and not torch.equal(made, t):
        at = tuple(int(i) for i in torch.nonzero(made != t)[0])
        raise CheckFailure(f"unpack(pack(t)) for {what}: element {list(at)} expected "
                           f"{t[at].item():.6g}, got {made[at].item():.6g}",
                           "make the tensor with the saved size, stride and offset "
                           "(Tensor.as_strided): a view's elements are not in the output's "
                           "order")
    expect(made.shape == t.shape and made.stride() == t.stride(),
           f"unpack(pack(t)) for {what}: expected shape {tuple(t.shape)} and strides "
           f"{t.stride()}, got shape {tuple(made.shape)} and strides {made.stride()}",
           "make the tensor with the saved size, stride and offset (Tensor.as_strided)")
    cases = [(f"a tensor that starts at a noted output's address and is longer "
              f"({buffer.numel()} elements; the output is its first {out.numel()}, as q is "
              "of a fused qkv)", buffer),
             ("a noted output's bytes seen as int32 (the same address, as many elements)",
              out.view(torch.int32))]
    for what, t in cases:
        value = pack(t)
        if value is t:
            continue
        try:
            made = unpack(value)
            got = (f"unpack then made {made.dtype} of shape {tuple(made.shape)} where t is "
                   f"{t.dtype} of shape {tuple(t.shape)}")
        except Exception as e:
            got = f"unpack then raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        raise CheckFailure(f"pack(t) for {what}: expected t itself back, got a recipe; {got}",
                           "only a view of the whole of a noted output becomes a recipe: "
                           "the same address, as many elements, the same dtype")


def _dp_rank(impl: str, steps: int = 3) -> dict:
    """One rank of two: the two-layer tiny GPT, every block cheaply recomputed with the
    learner's hooks, half the batch, gradients averaged by all-reduce, plain SGD."""
    recompute.recipe_hooks = importlib.import_module(f"{impl}.recompute_cheap").recipe_hooks
    comm = Comm()
    return _train(steps, comm.rank, comm.size, comm, cheap=True)


def _train(steps: int, rank: int, world: int, comm, cheap: bool) -> dict:
    cfg = get_config("tiny").with_(n_layer=2, dropout=0.0)
    model = GPT(cfg, seed=0)
    if cheap:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = recompute.CheaplyRecomputedBlock(block)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data, losses = MarkovData(cfg.vocab_size, cfg.seq_len, seed=0), []
    for step in range(steps):
        x, y = data.batch(step, 8)
        [(mx, my)] = split_batch(x, y, rank, world, 1)
        loss = model(mx, my)
        loss.backward()
        for p in model.parameters():
            if comm is not None:
                comm.all_reduce(p.grad)
                p.grad /= world
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def run(impl: str, timeout: float) -> str:
    kept = _one_block(impl)
    _pack_alone(impl)
    ranks = launch_case(_dp_rank, 2, args=(impl,), timeout=timeout)
    one = _train(3, 0, 1, None, cheap=False)
    for step, want in enumerate(one["losses"]):
        got = sum(r["losses"][step] for r in ranks) / 2
        expect(abs(got - want) < DP_TOL * max(1.0, abs(want)),
               f"two ranks with your hooks: the loss of step {step} expected {want:.6f} (one "
               f"process keeping everything), got {got:.6f}",
               "the one-block case passed: look at what differs with a whole model")
    for name, want in one["params"].items():
        err = float((ranks[0]["params"][name] - want).abs().max())
        expect(err < DP_TOL, f"two ranks with your hooks: {name} differs from one process's "
               f"by {err:.3g} after 3 steps", "the one-block case passed: look at what "
               "differs with a whole model")
    return (f"one block: equal gradients, 3 recipes, {kept:,} bytes kept as predicted; "
            "two ranks train as one process")
