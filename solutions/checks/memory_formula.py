"""Cases for the memory formula exercise (lesson 07): model states by ZeRO stage, the
micro-batches in flight per schedule, and whole devices on layouts of the worked-example
models, each against ``minipar.theory.memory``."""

from __future__ import annotations

import importlib

from minipar.model import get_config
from minipar.theory import memory
from minipar.theory.layout import Layout
from minipar.theory.params import stage_layers

from ..check import expect

LAYOUTS = [  # model, layout
    ("gpt-1.3b", dict(dp=8, pp=1, tp=1, zero=0, microbatches=4)),
    ("gpt-1.3b", dict(dp=8, pp=1, tp=1, zero=3, microbatches=4, dtype="fp32")),
    ("gpt-13b", dict(dp=4, pp=4, tp=4, zero=1, microbatches=8, sp=True,
                     recompute="selective")),
    ("gpt-13b", dict(dp=4, pp=4, tp=4, zero=0, microbatches=8, schedule="gpipe")),
    ("gpt3-175b", dict(dp=8, pp=16, tp=8, zero=1, microbatches=192, sp=True,
                       recompute="selective")),
    ("gpt3-175b", dict(dp=8, pp=16, tp=8, zero=0, microbatches=192, schedule="zb")),
    ("gpt-1t", dict(dp=8, pp=32, tp=16, zero=2, microbatches=48, recompute="full")),
    ("tiny", dict(dp=2, pp=2, tp=2, zero=0, microbatches=2, dtype="fp32")),
    ("tiny", dict(dp=1, pp=4, tp=1, zero=0, microbatches=3, dtype="fp32")),
    ("tiny", dict(dp=1, pp=3, tp=1, zero=0, microbatches=3, dtype="fp32")),  # 3 + 3 + 2
]


def run(impl: str, timeout: float) -> str:
    mod = importlib.import_module(f"{impl}.memory_formula")
    for n in (1000, 1001, 7):
        for dp in (1, 3, 8):
            for zero in range(4):
                for dtype in ("bf16", "fp32"):
                    got = mod.model_state_bytes(n, dp, zero, dtype)
                    want = memory.model_states(n, dp, zero, dtype)
                    expect(dict(got) == want,
                           f"model_state_bytes({n}, dp={dp}, zero={zero}, {dtype}) = {got}; "
                           f"expected {want}",
                           "ZeRO-1 shards the optimizer, 2 also the grads, 3 also the "
                           "weights; a shard is ceil(n / dp)")
    for sched in ("gpipe", "1f1b", "zb"):
        for p in (1, 2, 4, 8):
            for m in (1, 3, 8, 16):
                for s in range(p):
                    got = mod.in_flight(sched, p, m, s)
                    want = memory.inflight(sched, p, m, s)
                    expect(got == want, f"in_flight({sched!r}, pp={p}, m={m}, stage={s}) = "
                           f"{got}; expected {want}",
                           "gpipe m; 1f1b min(m, p - s); zb min(m, p)")
    for model, lay in LAYOUTS:
        want = memory.memory_breakdown(model, Layout(microbatch_size=1, **lay))
        got = mod.device_memory(model, **lay)
        keys = ("stage", "params", "grads", "optimizer", "activations", "total")
        for k in keys:
            expect(got.get(k) == want[k],
                   f"device_memory({model}, {lay}): {k} = {got.get(k)}; expected {want[k]}",
                   "activations = (per-layer bytes (+ the deferred W gradients under zb) x "
                   "layers of the stage + edge bytes) x "
                   "micro-batches in flight; the device is the first or the last stage"
                   + _uneven(model, lay["pp"]))
    return (f"ZeRO states, in-flight counts and {len(LAYOUTS)} layouts agree with "
            "minipar.theory.memory")


def _uneven(model: str, pp: int) -> str:
    """A hint's note on a pipeline whose stages hold different numbers of layers."""
    n = get_config(model).n_layer
    if n % pp == 0:
        return ""
    split = " + ".join(str(stage_layers(n, pp, s)) for s in range(pp))
    return (f"; {n} layers on {pp} stages are not {n // pp} each but {split} "
            "(stage_layers: the first stages take the rest)")
