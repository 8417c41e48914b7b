"""Theory as pure functions: parameters and FLOPs, memory, communication, bubbles, plans.

Each module cites the paper its formulas come from, and the tests check them against
the papers' own numbers and against what a real minipar run holds and sends:

* ``layout``       ``Layout``: the sizes, ZeRO stage, batch split and precision of a run
* ``params``       parameter counts (exact for ``minipar.model.GPT``), FLOPs, MFU
* ``memory``       model states (ZeRO, 1910.02054) and activations (2205.05198)
* ``comm_volume``  bytes per step per mesh dimension, shaped like ``CommLog.summary()``
* ``bubble``       pipeline bubble formulas and simulated timelines
* ``clusters``     GPU and cluster presets; ``planner`` ranks layouts on them
* ``models``       model configs by name (presets plus Llama-like ones)
* ``examples``     four worked layouts and the GPT-3 memory claims
* ``tables``       text renderers for the command line
"""

from minipar.theory.clusters import CLUSTERS, GPUS, Cluster, cluster, get_cluster
from minipar.theory.comm_volume import comm_volume
from minipar.theory.examples import EXAMPLES
from minipar.theory.layout import Layout
from minipar.theory.memory import memory_breakdown, memory_per_stage
from minipar.theory.models import MODELS, get_model
from minipar.theory.params import (
    hardware_flops_per_token,
    mfu,
    model_flops_per_token,
    param_count,
    stage_params,
)
from minipar.theory.planner import Estimate, Plan, evaluate, explain, plan
from minipar.theory.tables import render_comm, render_memory, render_plan

__all__ = [
    "CLUSTERS", "GPUS", "Cluster", "cluster", "get_cluster", "comm_volume", "EXAMPLES",
    "MODELS", "get_model", "memory_breakdown", "memory_per_stage",
    "hardware_flops_per_token", "mfu", "model_flops_per_token", "param_count",
    "stage_params", "Layout", "Estimate", "Plan", "evaluate", "explain", "plan",
    "render_comm", "render_memory", "render_plan",
]
