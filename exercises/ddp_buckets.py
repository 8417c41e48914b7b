# Your copy of this exercise, generated from solutions/ddp_buckets.py by tools/make_exercises.py.
# Fill in the blanks (each raises NotImplementedError), then check your work with
#     from exercises.check import check; check("ddp_buckets")
"""Lesson 01 exercise: data parallelism with gradient buckets and overlapped all-reduce.

Every rank holds the whole model and runs forward and backward on its own slice of the
batch. Their gradients differ; the mean of them is the gradient of the whole batch. So
after backward each rank all-reduces its gradients and divides by N, and the identical
optimizer step keeps the replicas identical.

Two ideas make that fast (Li et al., "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training", VLDB 2020, arXiv 2006.15704, section 3.2):

* Buckets. A model has hundreds of small parameters; one all-reduce each pays a fixed
  start-up cost hundreds of times. Instead we pack gradients into a few flat buffers of
  about ``bucket_bytes`` and all-reduce each buffer with one call.
* Overlap. Backward produces gradients from the last layer to the first. As soon as all
  gradients of a bucket are final, its all-reduce can start, asynchronously, while
  backward still works on earlier layers. So the buckets are filled in *reverse*
  parameter order: the first bucket to fill is the first one to send.

One rule keeps the ranks from deadlocking: every rank must start the same collectives
in the same order. We therefore start bucket i only after buckets 0 .. i-1 have
started, even if bucket i happened to be complete first.

You write ``bucket_params``, ``BucketedDDP._on_grad``, ``BucketedDDP._launch`` and
``BucketedDDP.finish_gradient_sync``. Communicate only through ``self.comm``. What the
check tests: the buckets against the rule of ``bucket_params``; your gradients on 2
ranks against the whole batch's gradient in one process (a wrong scale is named as a
multiple of the world size); the communication log: one all-reduce per bucket, in
bucket order, all started before ``backward()`` returned when ``overlap=True``; and,
with the hooks fired by hand out of bucket order, all-reduces still in bucket order.
"""

from __future__ import annotations

import torch
from torch import nn

from minipar.comm import Comm, Pending


def bucket_params(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group ``params`` into buckets, in *reverse* order, of at most ``bucket_bytes``.

    Walk the parameters from last to first, adding each to the current bucket; when
    adding one would make the bucket's gradient bytes exceed ``bucket_bytes``, close the
    bucket and start a new one. A parameter larger than ``bucket_bytes`` gets a bucket of
    its own (a bucket is never empty). Bytes of a parameter: ``p.numel() *
    p.element_size()``.
    """
    # YOUR CODE HERE
    raise NotImplementedError(
        'bucket_params in exercises/ddp_buckets.py is not implemented yet. Hint: '
        "ask for one with hint('ddp_buckets', 1) (a nudge), 2 (the method) or 3 "
        '(the answer), from exercises.course')


class BucketedDDP:
    """Wrap ``module``; after ``loss.backward()`` call ``finish_gradient_sync()``.

    Afterwards every parameter's ``.grad`` is the mean over the ranks of ``comm``.
    ``overlap=True`` starts each bucket's all-reduce from a gradient hook during
    backward; ``overlap=False`` starts them all in ``finish_gradient_sync``.
    """

    def __init__(self, module: nn.Module, comm: Comm | None = None,
                 bucket_bytes: int = 25 * 2**20, overlap: bool = True):
        self.module, self.comm, self.overlap = module, comm or Comm(), overlap
        self.params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():  # replicas must start identical: copy rank 0's weights
            for p in module.parameters():
                self.comm.broadcast(p.data, src=0)
        self.buckets = bucket_params(self.params, bucket_bytes)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.reset()
        # Called by autograd once p.grad holds this backward's final gradient.
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                      for p in self.params]

    def reset(self) -> None:
        """Forget the last backward: nothing ready, nothing started."""
        self.ready: list[set[int]] = [set() for _ in self.buckets]  # ids of final grads
        self.next_to_launch = 0  # buckets start strictly in index order
        self.flat: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.pending: list[Pending | None] = [None] * len(self.buckets)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad(self, p: nn.Parameter) -> None:
        """Hook: ``p.grad`` is final. Mark it; launch every bucket that may now start."""
        # YOUR CODE HERE
        raise NotImplementedError(
            'BucketedDDP._on_grad in exercises/ddp_buckets.py is not implemented yet.'
            " Hint: ask for one with hint('ddp_buckets', 1) (a nudge), 2 (the method)"
            ' or 3 (the answer), from exercises.course')

    def _launch(self, i: int) -> None:
        """Start the asynchronous all-reduce of bucket ``i``.

        Copy the bucket's gradients into one flat tensor (a parameter without a
        gradient contributes zeros), keep it in ``self.flat[i]``, and keep the
        ``Pending`` that ``comm.all_reduce(flat, async_op=True)`` returns in
        ``self.pending[i]``.
        """
        # YOUR CODE HERE
        raise NotImplementedError(
            'BucketedDDP._launch in exercises/ddp_buckets.py is not implemented yet. '
            "Hint: ask for one with hint('ddp_buckets', 1) (a nudge), 2 (the method) "
            'or 3 (the answer), from exercises.course')

    def finish_gradient_sync(self) -> None:
        """Launch the buckets not started yet (in order), wait for all, then write
        each bucket's sum divided by ``comm.size`` back into its parameters' ``.grad``."""
        # YOUR CODE HERE
        raise NotImplementedError(
            'BucketedDDP.finish_gradient_sync in exercises/ddp_buckets.py is not '
            "implemented yet. Hint: ask for one with hint('ddp_buckets', 1) (a "
            'nudge), 2 (the method) or 3 (the answer), from exercises.course')

    def remove(self) -> None:
        """Take the hooks off the module's parameters."""
        for h in self.hooks:
            h.remove()
