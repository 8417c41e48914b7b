"""Cases for the pipeline debugging lab (lesson 05): the learner's 2-stage 1F1B run must
have the loss *and the gradient norm* of one process, at two micro-batch counts (a fix
that only works for one m, such as a constant 0.25, fails the other). A failure gives the
ratio and the size of the layout that explains it (the symptom), not the line."""

from __future__ import annotations

import importlib

from minipar.launch import launch
from minipar.parity import audit

from ..check import expect


def run(impl: str, timeout: float) -> str:
    mod = importlib.import_module(f"{impl}.debug_pipeline")
    ref = mod.reference_step()
    for m in (4, 2):
        out = launch(mod.pipeline_step, 2, args=(m,), timeout=timeout)[0]
        expect(abs(out["loss"] - ref["loss"]) < 1e-5,
               f"m={m}: the loss is {out['loss']:.5f}, one process gives {ref['loss']:.5f}",
               "the loss itself should not change: look at the gradient, not the loss")
        ratio = out["grad_norm"] / ref["grad_norm"]
        found = audit([ratio], {"microbatches": m, "pp": 2})
        why = found.split(";")[0] if found else "no simple factor explains it"
        expect(abs(ratio - 1) < 1e-4,
               f"m={m}: gradient norm expected {ref['grad_norm']:.5f} (one process), got "
               f"{out['grad_norm']:.5f}: {why}",
               "run gradient_audit(m) at a few m: what does the ratio follow? Then look "
               "for where the step lets that into the gradients, or into their measurement")
    return "loss and gradient norm equal one process at m = 4 and m = 2"
