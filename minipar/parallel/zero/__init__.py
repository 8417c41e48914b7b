"""Data parallelism and ZeRO, stages 0-3, with or without ZeRO-Offload.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC20, arXiv 1910.02054) removes data parallelism's redundant copies
of the optimizer state, gradients and weights; ZeRO-Offload (Ren et al. 2021, arXiv
2101.06840) moves the optimizer to the host. Read in this order:

1. ``buckets.py``: data parallelism's gradient buckets and the order they are reduced in;
2. ``shards.py``: the flat, sharded buffers, and ``Shards``, the helper both wrappers hold;
3. ``offload.py``: where the fp32 masters live and step, ``OnDevice`` or ``OnHost``;
4. ``optimizer.py``: ``ZeroOptimizer``, stages 0 (data parallelism itself), 1 and 2
   (``param_gather.py``: its weight gathers hidden behind the next forward);
5. ``units.py`` and ``stage3.py``: ``Zero3``, the weights sharded too (``gather.py``:
   what its all-gathers carry, the compute dtype or float8);
6. ``protocol.py``: ``GradientSync``, what the training step asks of any of them.

The names below are the package's public interface, imported from here.
"""

from minipar.parallel.zero.offload import OnDevice, OnHost
from minipar.parallel.zero.optimizer import ZeroOptimizer
from minipar.parallel.zero.protocol import GradientSync
from minipar.parallel.zero.stage3 import Zero3

__all__ = ["GradientSync", "OnDevice", "OnHost", "Zero3", "ZeroOptimizer"]
