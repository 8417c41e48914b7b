"""Cases for the sequence-parallel debugging lab (lesson 04): at tp = 2 with sp, every
parameter's gradient (gathered from its shards) must equal one process's, not only the
loss and the norm. A failure lists the parameters that differ and by how much (the
symptom), never what they have in common or where the fix goes."""

from __future__ import annotations

import importlib

from minipar.launch import launch

from ..check import expect


def run(impl: str, timeout: float) -> str:
    mod = importlib.import_module(f"{impl}.debug_sp")
    ref = mod.reference_step()
    out = launch(mod.sp_step, 2, timeout=timeout)[0]
    expect(abs(out["loss"] - ref["loss"]) < 1e-5,
           f"the loss is {out['loss']:.5f}, one process gives {ref['loss']:.5f}",
           "the loss should not change: compare the forward with one process's")
    off = mod.differing(out, ref)
    names = sorted(off)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    worst = max(names, key=off.get) if names else ""
    expect(not off,
           f"{len(off)} of {len(ref['grads'])} gradients differ from one process ({shown}); "
           f"worst {worst}: off by {off.get(worst, 0):.0%}",
           "gradient_audit() lists them all: compare them with the parameters whose "
           "gradients agree")
    return f"all {len(ref['grads'])} gradients equal one process's at tp = 2 with sp"
