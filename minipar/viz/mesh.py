"""The device mesh in 3-D: every rank at its (tp, dp, pp) coordinates, groups joined.

Each marker is a rank, placed at its coordinates and labelled with its global rank
number. The ranks of one group of the chosen dimension (``color_by``) share a colour and
are joined by a line, so "which ranks all-reduce together" is visible at a glance.
Hovering shows a rank's coordinates, its three groups and its node.

The coordinates are the same under every rank order; what changes is *which rank
number* sits where, and so which ranks share a node. ``mesh_figure`` draws the orders
side by side (Megatron's: tp fastest, then dp, pp outermost; and pp inside dp, as
picotron numbers them), from ``minipar.mesh.Mesh.table()``.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from minipar.mesh import DIMS, ORDERS, Mesh

PALETTE = qualitative.Plotly + qualitative.D3 + qualitative.Set3


def _group_key(row: dict, color_by: str, gpus_per_node: int | None) -> tuple:
    if color_by == "node":
        return (row["rank"] // gpus_per_node,)
    return tuple(row[f"{color_by}_group"])


def _hover(row: dict, gpus_per_node: int | None) -> str:
    lines = [f"rank {row['rank']}",
             f"dp={row['dp']} pp={row['pp']} tp={row['tp']} cp={row['cp']}"]
    lines += [f"{d} group {row[f'{d}_group']}" for d in DIMS]
    if gpus_per_node:
        lines.append(f"node {row['rank'] // gpus_per_node}")
    return "<br>".join(lines)


def mesh_traces(mesh: Mesh, color_by: str = "tp", gpus_per_node: int | None = None,
                scene: str = "scene", legend: bool = True) -> list[go.Scatter3d]:
    """One ``Scatter3d`` per group of ``color_by`` (or per node with ``"node"``)."""
    if color_by not in (*DIMS, "node"):
        raise ValueError(f"color_by must be one of {DIMS} or 'node', got {color_by!r}")
    if color_by == "node" and not gpus_per_node:
        raise ValueError("color_by='node' needs gpus_per_node")
    groups: dict[tuple, list[dict]] = {}
    for row in mesh.table():
        groups.setdefault(_group_key(row, color_by, gpus_per_node), []).append(row)
    traces = []
    for i, (key, rows) in enumerate(groups.items()):
        # order the members along the dimension that varies, so the line joins neighbours
        if color_by in DIMS:
            rows = sorted(rows, key=lambda r: r[color_by])
        name = f"node {key[0]}" if color_by == "node" else f"{color_by} group {list(key)}"
        colour = PALETTE[i % len(PALETTE)]
        traces.append(go.Scatter3d(
            # cp shares the x axis with tp: x = cp * tp_size + tp (tp fastest, then cp)
            x=[r["cp"] * mesh.tp + r["tp"] for r in rows], y=[r["dp"] for r in rows],
            z=[r["pp"] for r in rows],
            mode="lines+markers+text" if color_by in DIMS else "markers+text",
            text=[str(r["rank"]) for r in rows], textposition="top center",
            hovertext=[_hover(r, gpus_per_node) for r in rows], hoverinfo="text",
            marker={"size": 7, "color": colour}, line={"color": colour, "width": 4},
            name=name, legendgroup=name, showlegend=legend, scene=scene))
    return traces


def mesh_figure(dp: int | Mesh = 2, pp: int = 2, tp: int = 2, color_by: str = "tp",
                orders: tuple[str, ...] = tuple(ORDERS), gpus_per_node: int | None = None,
                height: int = 480, cp: int = 1) -> go.Figure:
    """The mesh once per rank order in ``orders``, side by side (one 3-D scene each).

    ``dp`` may be a ``Mesh``; then its own order is drawn unless ``orders`` is given.
    With context parallelism (``cp`` > 1) the x axis holds cp * tp positions: the tp
    groups of cp rank 0, then those of cp rank 1, ...; ``color_by="cp"`` draws the rings.
    """
    if isinstance(dp, Mesh):
        mesh, orders = dp, orders if orders != tuple(ORDERS) else (dp.order,)
        dp, pp, tp, cp = mesh.dp, mesh.pp, mesh.tp, mesh.cp
    fig = make_subplots(rows=1, cols=len(orders), specs=[[{"type": "scene"}] * len(orders)],
                        subplot_titles=[f"order: {o}" for o in orders])
    for i, order in enumerate(orders):
        scene = "scene" if i == 0 else f"scene{i + 1}"
        for trace in mesh_traces(Mesh(dp, pp, tp, order, cp=cp), color_by, gpus_per_node, scene,
                                 legend=i == 0):
            fig.add_trace(trace)
        x_title = "tp" if cp == 1 else "cp * tp_size + tp"
        axes = {f"{a}axis": {"title": t, "dtick": 1}
                for a, t in zip("xyz", (x_title, "dp", "pp"))}
        fig.update_layout({scene: {**axes, "aspectmode": "cube"}})
    cps = f" cp={cp}" if cp > 1 else ""
    fig.update_layout(title=f"mesh dp={dp} pp={pp} tp={tp}{cps}: {dp * pp * tp * cp} ranks, "
                            f"coloured by {color_by}", height=height,
                      margin={"l": 0, "r": 0, "t": 60, "b": 0}, uirevision="mesh")
    return fig
