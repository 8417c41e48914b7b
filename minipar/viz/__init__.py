"""Figures (pure functions returning ``plotly.graph_objects.Figure``) and thin dashboards.

* ``collectives_figure`` what each collective leaves where; ``ring_allreduce_figure``:
  the ring all-reduce step by step (a slider); ``allreduce_cost_figure``: its time
  against the rank count in the alpha-beta model
* ``dp``               data parallelism and ZeRO: bytes per rank, buckets overlapping the
  backward, model states by ZeRO stage, ZeRO-3's prefetch (``minipar.viz.dp``)
* ``mesh_figure``      the dp x pp x tp mesh in 3-D, both rank orders
* ``timeline_figure``  pipeline timelines, theory beside measurement, bubbles shaded
* ``memory_figure``    memory per rank by part, theory beside measurement
* ``comm_figure``      bytes per dimension and op, measured beside predicted
* ``fp8_speed_figure`` float8 against bf16: one matmul's rate, then training steps' speed
* ``plan_figure``      the planner's ranking: step-time terms and memory
* ``tp_shard_figure``  the tensor-parallel MLP shard by shard, with f and g
* ``ring_figure``      ring attention step by step (a slider); ``balance_figure``: work per rank
* ``router_figure``    tokens coloured by their expert, the load per expert;
  ``traffic_figure``: who sent what to whom by all-to-all
* ``widgets``          ipywidgets dashboards over these (import it in a notebook)

Figures are deterministic: the same arguments give the same JSON (no random ids), so
saved notebooks do not change between runs.
"""

from minipar.viz.collectives import collectives_figure, ring_allreduce_figure
from minipar.viz.comm import comm_figure
from minipar.viz.cp import balance_figure, ring_figure
from minipar.viz.fp8 import fp8_speed_figure
from minipar.viz.memory import memory_figure
from minipar.viz.mesh import mesh_figure, mesh_traces
from minipar.viz.moe import router_figure, traffic_figure
from minipar.viz.planner import plan_figure
from minipar.viz.timeline import (
    bubble_curve_figure,
    normalise,
    schedule_timeline,
    timeline_figure,
)
from minipar.viz.tp import tp_shard_figure

__all__ = ["balance_figure", "bubble_curve_figure", "collectives_figure", "comm_figure",
           "fp8_speed_figure", "memory_figure", "mesh_figure", "mesh_traces", "normalise",
           "plan_figure", "ring_allreduce_figure", "ring_figure", "router_figure",
           "schedule_timeline", "timeline_figure", "tp_shard_figure", "traffic_figure"]
