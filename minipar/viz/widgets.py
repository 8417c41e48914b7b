"""Thin ipywidgets dashboards over the figure functions: controls in, a figure out.

Each dashboard is a row of controls and an ``Output`` area. When a control changes
(sliders report only on release: ``continuous_update=False``) the figure function runs
again and the new figure is shown with ``fig.show()`` inside the ``Output``. Plain
``go.Figure`` objects, not ``FigureWidget``: a FigureWidget needs anywidget and stores a
random id, which would make saved notebooks differ on every run.

All the work is in the pure figure functions; a dashboard only collects arguments. Its
``figure()`` builds the current figure without displaying it (the tests use that), and
``last`` is the figure shown most recently.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import ipywidgets as W
import plotly.graph_objects as go

from minipar.theory.clusters import CLUSTERS
from minipar.theory.memory import memory_per_rank
from minipar.theory.models import MODELS, get_model
from minipar.theory.planner import plan
from minipar.viz.memory import memory_figure
from minipar.viz.mesh import mesh_figure
from minipar.viz.planner import plan_figure
from minipar.viz.timeline import schedule_timeline, timeline_figure

POW2 = [1, 2, 4, 8]


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class Dashboard:
    """Controls plus an output area; redraws ``make(**values)`` when a control changes."""

    def __init__(self, controls: dict[str, W.ValueWidget],
                 make: Callable[..., go.Figure], text: Callable[..., str] | None = None):
        self.controls, self.make, self.text = controls, make, text
        self.out = W.Output()
        self.note = W.HTML()
        self.last: go.Figure | None = None
        for c in controls.values():
            c.observe(lambda _change: self.redraw(), names="value")
        self.widget = W.VBox([W.HBox(list(controls.values()),
                                     layout=W.Layout(flex_flow="row wrap")),
                              self.note, self.out])
        self.redraw()

    def values(self) -> dict:
        return {k: c.value for k, c in self.controls.items()}

    def figure(self) -> go.Figure:
        return self.make(**self.values())

    def redraw(self) -> None:
        try:
            fig = self.figure()
            note = self.text(**self.values()) if self.text else ""
        except ValueError as err:  # an impossible combination: say so, keep the old figure
            self.note.value = f"<b>{err}</b>"
            return
        self.last, self.note.value = fig, note
        if _in_kernel():
            self.out.clear_output(wait=True)
            with self.out:
                fig.show()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def _slider(label: str, lo: int, hi: int, value: int) -> W.IntSlider:
    return W.IntSlider(value=value, min=lo, max=hi, description=label,
                       continuous_update=False)


def _pick(label: str, options, value) -> W.Dropdown:
    return W.Dropdown(options=options, value=value, description=label)


def mesh_dashboard() -> Dashboard:
    """The 3-D mesh for any dp x pp x tp up to 8 each, in both rank orders."""
    return Dashboard({"dp": _pick("dp", POW2, 2), "pp": _pick("pp", POW2, 2),
                      "tp": _pick("tp", POW2, 2),
                      "color_by": _pick("colour by", ["tp", "dp", "pp"], "tp")},
                     lambda dp, pp, tp, color_by: mesh_figure(dp, pp, tp, color_by))


def pipeline_dashboard() -> Dashboard:
    """The theoretical timeline of a schedule; the bubble shows as grey."""
    def make(schedule, pp, microbatches, virtual):
        v = virtual if schedule == "interleaved" else 1
        return timeline_figure(schedule_timeline(schedule, pp, microbatches, v), v,
                               unit="time (forward = 1)")
    return Dashboard({"schedule": _pick("schedule", ["gpipe", "1f1b", "interleaved", "zb"],
                                        "1f1b"),
                      "pp": _slider("pp", 2, 8, 4), "microbatches": _slider("m", 1, 16, 8),
                      "virtual": _slider("v", 1, 4, 2)}, make)


def memory_dashboard(model: str = "tiny") -> Dashboard:
    """Per-rank memory of a model under a layout, by the theory."""
    def make(model, dp, pp, tp, zero, dtype, recompute, sp, microbatches):
        rows = memory_per_rank(get_model(model), dp, pp, tp, zero=zero, dtype=dtype,
                               microbatches=microbatches, sp=sp, recompute=recompute)
        return memory_figure(rows, unit="GB" if rows[0]["total"] > 1e8 else "MB",
                             title=f"{model}: memory per rank")
    return Dashboard({"model": _pick("model", sorted(MODELS), model),
                      "dp": _pick("dp", POW2, 2), "pp": _pick("pp", POW2, 2),
                      "tp": _pick("tp", POW2, 1), "zero": _pick("ZeRO", [0, 1, 2, 3], 0),
                      "dtype": _pick("dtype", ["fp32", "bf16"], "bf16"),
                      "recompute": _pick("recompute", ["none", "selective", "full"], "none"),
                      "sp": W.Checkbox(value=False, description="sequence parallel"),
                      "microbatches": _slider("m", 1, 32, 4)}, make)


def plan_dashboard(model: str = "gpt3-175b", cluster: str = "a100x1024") -> Dashboard:
    """The planner's top layouts for a model on a cluster, and why the first wins."""
    @lru_cache(maxsize=16)
    def planned(model, cluster, global_batch):
        return plan(get_model(model), CLUSTERS[cluster], global_batch)

    def make(model, cluster, global_batch):
        return plan_figure(planned(model, cluster, global_batch))

    def text(model, cluster, global_batch):
        why = planned(model, cluster, global_batch).why()
        return "<pre>" + why.replace("<", "&lt;") + "</pre>"
    return Dashboard({"model": _pick("model", sorted(MODELS), model),
                      "cluster": _pick("cluster", sorted(CLUSTERS), cluster),
                      "global_batch": _pick("batch", [64, 256, 512, 1024, 1536, 3072],
                                            1536)}, make, text)
