"""ZeRO-Offload in numbers: host-device traffic per step and where the model states live.

For ``minipar.parallel.zero.offload`` (Ren et al. 2021, "ZeRO-Offload", arXiv 2101.06840,
Sec. 4): the device keeps the 16-bit parameters (and each gradient only until it is
copied out); the host keeps the fp32 master weights, the fp32 gradient accumulator and
the optimizer states, and runs the step. Per step, for N parameters on this rank:

* to the host: every gradient, once per micro-batch, in the device dtype: N g m bytes
  (m micro-batches; the host accumulates them in fp32);
* to the device: every updated parameter, in the device dtype: N p bytes.

With 16-bit parameters and gradients that is 2N m + 2N: 4N bytes per step for m = 1,
the paper's "4M" of traffic for M parameters. With ZeRO stage 2 or 3 under data
parallelism each rank offloads only its 1/dp shard of the gradients and of the update.

``train --offload`` composes it with ZeRO (``zero_offload_traffic``, ``zero_offload_memory``):
the gradients are reduced on the device in fp32 first, so what crosses is this rank's
fp32 gradient shard, once per step, and its 16-bit parameter shard back. For gpt-1.3b
(1.32e9 parameters, tied embedding) at dp 4, bf16, ZeRO 1 or 2: 1.32 GB to the host and
0.66 GB back per rank and step, where an fp32 shard came back before (1.32 GB).
"""

from __future__ import annotations

from minipar.theory.rates import stepped_params

# ZeRO-Offload's two costs (``offload``), measured on GPU hosts (docs/benchmarks.md):
# the host step of ``train --offload`` (torch's fused CPU AdamW, 16 threads per rank,
# plus the host's landing, norm and cast passes) in parameters a second per rank, as
# gpt-1.3b dp 2 ZeRO-1 ran it on a 2 x H100 host (torch's default per-tensor AdamW is
# about three times slower); a GPU's copies to and from pinned host memory at PCIe
# Gen5's effective bandwidth a direction.
HOST_ADAM_PARAMS_PER_S = 1.3e9
PCIE_BANDWIDTH = 25e9


def offload_traffic(n_params: int, param_bytes: int = 2, grad_bytes: int | None = None,
                    microbatches: int = 1, dp: int = 1, zero: int = 0) -> dict[str, int]:
    """Host-device bytes of one rank per training step: ``{"to_host", "to_device"}``."""
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    n = n_params // dp if zero >= 2 else n_params  # ZeRO-2/3: this rank's shard only
    return {"to_host": n * grad_bytes * microbatches, "to_device": n * param_bytes}


def zero_offload_traffic(n_params: int, dp: int = 1, zero: int = 0,
                         param_bytes: int = 2) -> dict[str, int]:
    """Host-device bytes of one rank per step as ``train --offload`` composes offload with
    ZeRO (``parallel/zero/``, ``OnHost``): the gradient is reduced on the device
    in fp32 (all-reduce at stage 0, reduce-scatter at 1-2), accumulated there over the
    micro-batches, and this rank's fp32 shard goes to the host once per step, as its
    bucket's reduction completes; the updated master shard is cast on the host and
    comes back in the compute dtype (``param_bytes``: 2 for bf16, 4 for fp32), into
    this rank's slot of the weights, which the device then all-gathers.
    ``{"to_host": 4 S, "to_device": p S}``, S = n / dp (padded) at stages 1-3, n at 0.
    ZeRO-3 reduce-scatters each unit in every micro-batch's backward; the shards add up
    on the device (its fp32 gradient shard, which ZeRO-3 without offload keeps there
    too) and cross once, during the last micro-batch's backward: 4 S whatever m (each
    crossing also cost the host a pass to add it, not hidden by the backward); the
    16-bit shard comes back into the device shard the gathers read. The paper's stream
    (16-bit, per micro-batch: ``offload_traffic``) moves half the gradient bytes per
    element but every micro-batch; this one trades that for the device-side reduction
    in fp32 (Sec. 4's argument, minimal traffic, holds per step rather than per
    micro-batch).
    """
    shard = stepped_params(n_params, dp, zero)
    return {"to_host": 4 * shard, "to_device": param_bytes * shard}


def offload_memory(n_params: int, param_bytes: int = 2, optimizer_state_bytes: int = 8,
                   dp: int = 1, zero: int = 0) -> dict[str, int]:
    """Model-state bytes per rank on the device and on the host, with offload.

    Device: the parameters only (p bytes each; gradients leave as they are made).
    Host: fp32 master (4), fp32 gradient accumulator (4), optimizer states (8 for Adam,
    0 for plain SGD) and two landing buffers in the device dtype (pinned, 2 p), for
    this rank's shard under ZeRO (stage 1 and up shard the optimizer's part; stage 3
    also shards the device parameters).
    """
    shard = n_params // dp if zero >= 1 else n_params
    device_params = n_params // dp if zero >= 3 else n_params
    return {"device": device_params * param_bytes,
            "host": shard * (4 + 4 + optimizer_state_bytes + 2 * param_bytes)}


def zero_offload_memory(n_params: int, param_bytes: int = 2, optimizer_state_bytes: int = 8,
                        dp: int = 1, zero: int = 0, grad_bytes: int = 4,
                        upload: bool = True) -> dict[str, int]:
    """Model-state bytes per rank as ``train --offload`` composes offload with ZeRO 0-3
    (``zero.offload.OnHost``). Device: the weights in the compute dtype only (no fp32
    master; ZeRO-3: this rank's 16-bit shard; gradient buffers: ``theory.memory``).
    Host, per element of this rank's shard (n / dp at stages 1-3, n at 0): the fp32
    master (4) and its gradient (4), the optimizer states, and the pinned buffer the
    16-bit weights are cast into on their way back (p; ``upload``: a GPU's, a CPU run
    casts straight into its weights). The engine's reduced gradient shard lands once a
    step, straight in the fp32 gradient; only a 16-bit one (``grad_bytes`` 2,
    ``--grad-dtype bf16``) lands in a buffer of its own first."""
    shard = -(-n_params // dp) if zero >= 1 else n_params
    landing = grad_bytes if grad_bytes != 4 else 0
    return {"device": (shard if zero == 3 else n_params) * param_bytes,
            "host": shard * (4 + 4 + optimizer_state_bytes + landing
                             + (param_bytes if upload else 0))}


def offload_seconds(n_params: int, shards: int, zero: int, dtype: str, m: int,
                     compute: float, host_rate: float = 0.0) -> float:
    """ZeRO-Offload's exposed time (Ren et al. 2021, Sec. 4): the host step over this
    rank's shard (at ``host_rate`` parameters a second, when the host was measured), the
    16-bit weights' way back, and the gradients' way down beyond what the last
    micro-batch's backward hides (``zero_offload_traffic``)."""
    traffic = zero_offload_traffic(n_params, shards, zero, 2 if dtype == "bf16" else 4)
    shard = stepped_params(n_params, shards, zero)
    down = max(0.0, traffic["to_host"] / PCIE_BANDWIDTH - compute * 2 / 3 / m)
    rate = host_rate or HOST_ADAM_PARAMS_PER_S
    return shard / rate + traffic["to_device"] / PCIE_BANDWIDTH + down
