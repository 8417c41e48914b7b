"""Measure how far each layout drifts from the single-device reference.

The parity tests' tolerances come from this table: for every covering layout of
``tests/test_engine.py`` (and its bf16 twin), the worst loss difference, the worst
relative gradient-norm difference and the worst final-parameter difference against
``train_reference``, grouped by family. A tolerance is set at about 3x the family's
worst observed drift, so a real bug (a factor of 2 at least) cannot hide under it.

    .venv/bin/python benchmarks/parity_drift.py [--dtype fp32|bf16|both] [--json FILE]
        [--set engine|cp]

``--set cp``: the context-parallel and offload layouts of ``tests/test_cp_engine.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import tempfile

from minipar.config import TrainConfig
from minipar.engine import train, train_reference
from minipar.parity import compare, final_parameters

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _test_engine(name: str = "test_engine"):
    import sys

    sys.path.insert(0, str(ROOT / "tests"))  # test_cp_engine imports test_engine
    spec = importlib.util.spec_from_file_location(name, ROOT / f"tests/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def covering() -> list[dict]:
    """The engine tests' covering layouts, their plain-SGD set, dropout and tied models."""
    t = _test_engine()
    tied = {"overrides": {"tie_embeddings": True}}
    return ([dict(d) for d in t.COVERING]
            + [{**d, **t.SGD} for d in t.SGD_COVERING]
            + [{**d, "dropout": 0.1} for d in (dict(dp=2), dict(microbatches=2),
                                              dict(pp=2, microbatches=2), dict(tp=2),
                                              dict(tp=2, sp=True))]
            + [{**d, **tied} for d in (dict(pp=2, microbatches=2),
                                       dict(pp=2, schedule="zb", microbatches=2),
                                       dict(pp=2, tp=2, schedule="interleaved", virtual=2,
                                            microbatches=4),
                                       dict(schedule="zb", microbatches=2))])


def cp_covering() -> list[dict]:
    """``tests/test_cp_engine.py``'s layouts: cp alone and composed, SGD, offload."""
    t = _test_engine("test_cp_engine")
    sgd = [dict(cp=2), dict(cp=2, dp=2, zero=2, microbatches=2),
           dict(cp=2, tp=2, pp=2, microbatches=2)]
    offload_sgd = [dict(offload=True, dp=2, zero=1), dict(offload=True, dp=2, zero=2)]
    return ([dict(d) for d in t.CP_COVERING] + [{**d, **t.SGD} for d in sgd]
            + [dict(d) for d in t.OFFLOAD] + [{**d, **t.SGD} for d in offload_sgd])


def cp_bf16() -> list[dict]:
    return [dict(cp=2, dp=2, zero=1), dict(offload=True, dp=2, zero=1),
            dict(offload=True, dp=2, zero=2)]


def family(layout: dict) -> str:
    axes = [k for k in ("dp", "pp", "tp", "cp") if layout.get(k, 1) > 1]
    axes += ["offload"] if layout.get("offload") else []
    name = " x ".join(axes) or "1"
    if layout.get("zero"):
        name += f" zero{layout['zero']}"
    for knob, word in (("optimizer", "sgd"), ("dropout", "dropout"), ("overrides", "tied")):
        if layout.get(knob) not in (None, "adamw", 0, 0.0):
            name += " " + word
    return name


REFERENCE_KNOBS = ("optimizer", "grad_clip", "lr", "warmup", "dropout", "overrides")


def drift(layout: dict, dtype: str, steps: int = 5) -> dict:
    knobs = {k: layout.pop(k) for k in REFERENCE_KNOBS if k in layout}
    with tempfile.TemporaryDirectory() as save:
        cfg = TrainConfig(steps=steps, dtype=dtype, save=save, **layout, **knobs)
        run = train(cfg)
        params = final_parameters(save)
    ref = train_reference(TrainConfig(steps=steps, **knobs))
    ref_params = {k: v.detach().float() for k, v in ref["model"].state_dict().items()}
    p = compare(run, ref, params, ref_params)
    return {"loss": p.loss_diff, "grad_rel": p.grad_norm_rel, "param": p.param_diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="both", choices=("fp32", "bf16", "both"))
    ap.add_argument("--json")
    ap.add_argument("--set", default="engine", choices=("engine", "cp"))
    args = ap.parse_args()
    dtypes = ("fp32", "bf16") if args.dtype == "both" else (args.dtype,)
    rows = []
    for dtype in dtypes:
        if args.set == "cp":
            layouts = cp_covering() if dtype == "fp32" else cp_bf16()
        else:
            layouts = covering() if dtype == "fp32" else _test_engine().COVERING
        for layout in layouts:
            name = " ".join(f"{k}={v}" for k, v in layout.items())
            d = drift(dict(layout), dtype)
            rows.append({"dtype": dtype, "layout": name, "family": family(layout), **d})
            print(f"{dtype}  {name:<70} loss {d['loss']:.1e}  grad {d['grad_rel']:.1e}  "
                  f"param {d['param']:.1e}", flush=True)
    print("\nworst per family")
    worst: dict = {}
    for r in rows:
        w = worst.setdefault((r["dtype"], r["family"]), {"loss": 0, "grad_rel": 0, "param": 0})
        for k in w:
            w[k] = max(w[k], r[k])
    for (dtype, fam), w in sorted(worst.items()):
        print(f"{dtype}  {fam:<24} loss {w['loss']:.1e}  grad {w['grad_rel']:.1e}  "
              f"param {w['param']:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
