"""Thin ipywidgets dashboards over the figure functions: controls in, a figure out.

Each dashboard is a row of controls and an ``Output`` area. When a control changes
(sliders report only on release: ``continuous_update=False``) the figure function runs
again and the new figure is shown with ``fig.show()`` inside the ``Output``. Plain
``go.Figure`` objects, not ``FigureWidget``: a FigureWidget needs anywidget and stores a
random id, which would make saved notebooks differ on every run.

All the work is in the pure figure functions; a dashboard only collects arguments. Its
``figure()`` builds the current figure without displaying it (the tests use that), and
``last`` is the figure shown most recently.

``PredictBox`` is the learner's side of ``predict``: a number field and a Reveal button;
the answer is shown only once a number has been typed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import ipywidgets as W
import plotly.graph_objects as go

from minipar.parallel.schedules import SCHEDULES, VIRTUAL_STAGES, make_schedule
from minipar.theory.bubble import bubble_stats, peak_in_flight
from minipar.theory.clusters import CLUSTERS
from minipar.theory.layout import Layout
from minipar.theory.memory import memory_per_rank
from minipar.theory.models import MODELS, get_model
from minipar.theory.planner import plan
from minipar.viz.memory import memory_figure
from minipar.viz.mesh import mesh_figure
from minipar.viz.planner import plan_figure
from minipar.viz.timeline import schedule_timeline, timeline_figure

POW2 = [1, 2, 4, 8]


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (a page that can show widgets)."""
    try:  # optional: only a notebook has it
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
        if in_kernel():
            self.out.clear_output(wait=True)
            with self.out:
                fig.show()

    def _ipython_display_(self) -> None:
        from IPython.display import display  # optional: only a notebook calls this

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


def pipeline_text(schedule: str, pp: int, microbatches: int, virtual: int) -> str:
    """The numbers behind the pipeline dashboard's picture, as one line of HTML."""
    v = virtual if schedule in VIRTUAL_STAGES else 1
    st = bubble_stats(schedule_timeline(schedule, pp, microbatches, v))
    held = peak_in_flight(make_schedule(schedule, pp, microbatches, v))
    unit = "chunks of 1/v stage" if v > 1 else "micro-batches"
    return (f"step {st['step_time']:.2f} stage-forwards; bubble {st['bubble_fraction']:.1%} "
            f"of the step ({st['bubble_ratio']:.1%} of the work); peak held per rank "
            f"({unit}): {held}")


def pipeline_dashboard() -> Dashboard:
    """The theoretical timeline of a schedule; the bubble shows as grey. Every schedule
    is drawn in one unit (a whole stage's forward = 1), and the v slider shows only for
    the interleaved schedules, the ones it applies to."""
    def make(schedule, pp, microbatches, virtual):
        v = virtual if schedule in VIRTUAL_STAGES else 1
        return timeline_figure(schedule_timeline(schedule, pp, microbatches, v), v,
                               unit="time (one stage's forward = 1)")
    v = _slider("v", 2, 4, 2)
    pick = _pick("schedule", list(SCHEDULES), "1f1b")

    def show_v(_change=None) -> None:
        v.layout.display = None if pick.value in VIRTUAL_STAGES else "none"
    pick.observe(show_v, names="value")
    show_v()
    return Dashboard({"schedule": pick, "pp": _slider("pp", 2, 8, 4),
                      "microbatches": _slider("m", 1, 16, 8), "virtual": v},
                     make, pipeline_text)


def memory_text(model, dp, pp, tp, zero, dtype, recompute, sp, microbatches) -> str:
    """The numbers behind the memory dashboard: each term on the busiest rank."""
    rows = memory_per_rank(get_model(model), Layout(
        dp=dp, pp=pp, tp=tp, zero=zero, dtype=dtype, microbatches=microbatches, sp=sp,
        recompute=recompute))
    top = max(rows, key=lambda r: r["total"])
    big = top["total"] > 1e8
    scale, unit = (1e9, "GB") if big else (1e6, "MB")
    parts = ", ".join(f"{k} {top[k] / scale:.3g}" for k in
                      ("params", "grads", "optimizer", "activations"))
    return (f"busiest rank {top['rank']} (stage {top['stage']}): {parts}; total "
            f"{top['total'] / scale:.3g} {unit}")


def memory_dashboard(model: str = "tiny") -> Dashboard:
    """Per-rank memory of a model under a layout, by the theory."""
    def make(model, dp, pp, tp, zero, dtype, recompute, sp, microbatches):
        rows = memory_per_rank(get_model(model), Layout(
            dp=dp, pp=pp, tp=tp, zero=zero, dtype=dtype, microbatches=microbatches, sp=sp,
            recompute=recompute))
        return memory_figure(rows, unit="GB" if rows[0]["total"] > 1e8 else "MB",
                             title=f"{model}: memory per rank")
    return Dashboard({"model": _pick("model", sorted(MODELS), model),
                      "dp": _pick("dp", POW2, 2), "pp": _pick("pp", POW2, 2),
                      "tp": _pick("tp", POW2, 1), "zero": _pick("ZeRO", [0, 1, 2, 3], 0),
                      "dtype": _pick("dtype", ["fp32", "bf16"], "bf16"),
                      "recompute": _pick("recompute", ["none", "selective", "cheap", "full"],
                                         "none"),
                      "sp": W.Checkbox(value=False, description="sequence parallel"),
                      "microbatches": _slider("m", 1, 32, 4)}, make, memory_text)


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


class PredictBox:
    """A guess box for ``predict``: a number field, a Reveal button and an area that stays
    empty until the learner has typed a number and pressed Reveal; then ``reveal(guess)``
    gives the line to show (the answer beside the guess), and ``later`` (outputs captured
    by ``IPython.utils.capture``, if any) is shown under it. Pressing again with another
    number replaces the line (``reveal`` keeps the latest guess)."""

    def __init__(self, question: str, unit: str, reveal: Callable[[float], str]):
        self.reveal, self.later, self.shown = reveal, None, False
        self.field = W.Text(placeholder="your guess" + (f" ({unit})" if unit else ""),
                            description="guess", layout=W.Layout(width="260px"))
        self.button = W.Button(description="Reveal", button_style="info")
        self.result = W.HTML()
        self.out = W.Output()
        self.button.on_click(lambda _b: self.press())
        self.widget = W.VBox([W.HBox([self.field, self.button]), self.result, self.out])

    def press(self) -> None:
        try:
            guess = float(self.field.value.replace(",", "").strip())
        except ValueError:
            self.result.value = "<i>type a number first: the answer shows after your guess</i>"
            return
        self.result.value = f"<b>{self.reveal(guess)}</b>"
        if self.later is not None and not self.shown:
            self.shown = True
            with self.out:
                self.later.show()
