# Your copy of this exercise, generated from solutions/recompute_cheap.py by tools/make_exercises.py.
# Fill in the blanks (each raises NotImplementedError), then check your work with
#     from exercises.check import check; check("recompute_cheap")
"""Lesson 07 exercise: keep a recipe, not a tensor (cheap recomputation).

A linear layer y = x Wᵀ keeps its input x for its weight gradient dW = dyᵀ x. In a
transformer block that input is a layer norm's output (before the attention's q|k|v
product and before the MLP) or GELU's (before the MLP's second product). Those outputs
are cheap to make again: a pass over memory from an input their own backward keeps
anyway. So instead of the tensor, the block can keep a *recipe* for it.

PyTorch lets you decide what autograd keeps: inside
``with torch.autograd.graph.saved_tensors_hooks(pack, unpack):`` every tensor an operation
saves for the backward goes through ``pack(t)``, and whatever ``pack`` returns is kept in
its place; when the backward needs the tensor it calls ``unpack(what_pack_returned)``.
``minipar.parallel.recompute.CheaplyRecomputedBlock`` runs a block's forward under hooks
that you write here. It notes, as the block runs, each output its two layer norms and its
GELU make: ``noted`` maps the output's data address (``out.data_ptr()``) to ``(module,
out, source)``, the module that made it, the output, and the input the module was called
on.

You write ``recipe_hooks(noted)``, which returns ``(pack, unpack)``:

* ``pack(t)``: if ``t`` is a noted output, or a view of the whole of one (the same data
  address, as many elements, the same dtype: a linear may save its input reshaped), return
  a recipe: something that holds what is needed to make ``t`` again *without holding the
  output itself*. Any other tensor: return ``t`` itself, unchanged.
* ``unpack(recipe)``: the tensor again, equal to the one that was saved, element for
  element, with its shape and strides (``Tensor.as_strided`` takes a size, a stride and a
  storage offset). It runs in the backward: nothing of it needs a gradient.

What the check tests: one block of the tiny GPT with your hooks against the same block
keeping everything: every gradient equal (your recomputation runs the very kernels of
the forward, so equal to the last bit), three recipes a forward (two layer norms, one
GELU), no recipe holding an output, and the bytes the block keeps (about 40 a token and
hidden unit in fp32 against 64, exactly what ``minipar.theory.memory`` predicts); your
``pack`` and ``unpack`` alone: a transposed view of a noted output made again with its
strides, and tensors at a noted output's address that are not the whole of it (a longer
one, the same bytes as another dtype), which must come back as they are; then
two processes training the two-layer tiny GPT with data parallelism and your hooks in
every block, against one process keeping everything: the same losses and weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def recipe_hooks(noted: dict) -> tuple[Callable, Callable]:
    """``(pack, unpack)`` for one block's forward, given ``noted``: data address ->
    (module, output, input) of each output a layer norm or GELU made in it."""
    # YOUR CODE HERE
    raise NotImplementedError(
        'recipe_hooks in exercises/recompute_cheap.py is not implemented yet. '
        "Hint: ask for one with hint('recompute_cheap', 1) (a nudge), 2 (the "
        'method) or 3 (the answer), from exercises.course')
