"""Sharded checkpoints that reshard: save at one layout, resume at any other.

**What is saved.** Logically a checkpoint is the *full* training state, by parameter
name, as one device would hold it: the fp32 weights and, per weight, the optimizer's
state (AdamW's step, exp_avg, exp_avg_sq). Physically it is stored in shards: each rank
of data-parallel replica 0 writes the tensor-parallel shards of the parameters of its
pipeline stage (ZeRO shards are gathered over dp first), one file per rank, plus a
``meta.json`` saying who wrote what.

**Resharding** then needs no special case: ``load`` reassembles full tensors from the
shards (``tp.unshard`` knows the fused q|k|v layout), and the engine builds the new
layout from the full state exactly as it builds one from a fresh model. Every rank reads
every file: simple and fine at the sizes minipar trains; a production system (torch
DCP) reads only the byte ranges it needs.

**Atomic.** Files go to ``step-N.tmp/``; once every rank has written, rank 0 renames it
to ``step-N/`` and then replaces the ``latest`` pointer (``os.replace`` is atomic). A run
killed mid-save leaves ``latest`` on the previous complete checkpoint.
Loading uses ``torch.load(weights_only=True)``: a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from minipar.mesh import RankMesh

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def local_state(rm: RankMesh, parts) -> tuple[dict, dict]:
    """This rank's fp32 weights and optimizer states by name, in tp-shard shapes."""
    # ZeRO 0-3 keep them sharded over dp: gathered here (collective over dp)
    weights, states = parts.data_parallel.full_state_by_name(parts.optimizer)
    return weights, {n: {k: v for k, v in st.items() if k in STATE_KEYS}
                     for n, st in states.items()}


def save(directory: str, step: int, cfg, rm: RankMesh, parts) -> str:
    """Collective: every rank calls it. Returns the path of the new checkpoint."""
    weights, states = local_state(rm, parts)  # collective under ZeRO (gathers over dp)
    final = os.path.join(directory, f"step-{step:06d}")
    tmp = final + ".tmp"
    if rm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    rm.world.barrier()
    if rm.coords.dp == 0:
        torch.save({"weights": weights, "states": states},
                   os.path.join(tmp, f"rank-{rm.rank:05d}.pt"))
    rm.world.barrier()
    if rm.rank == 0:
        files = {}
        for r in range(rm.mesh.world_size):
            c = rm.mesh.coords(r)
            if c.dp == 0:
                files[f"rank-{r:05d}.pt"] = {"tp_rank": c.tp, "pp_rank": c.pp}
        meta = {"step": step, "tp": rm.mesh.tp, "pp": rm.mesh.pp, "dp": rm.mesh.dp,
                "files": files, "config": cfg.to_dict()}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = os.path.join(directory, "latest")
        with open(pointer + ".tmp", "w") as f:
            f.write(os.path.basename(final))
        os.replace(pointer + ".tmp", pointer)
    rm.world.barrier()
    return final


def resolve(directory: str) -> str:
    """The checkpoint a directory means: its ``latest``, or the directory itself."""
    pointer = os.path.join(directory, "latest")
    if os.path.exists(pointer):
        with open(pointer) as f:
            return os.path.join(directory, f.read().strip())
    if os.path.exists(os.path.join(directory, "meta.json")):
        return directory
    raise FileNotFoundError(f"no checkpoint in {directory} (no 'latest' and no meta.json)")


def load(directory: str) -> tuple[dict, int]:
    """Full state by name from a (possibly differently sharded) checkpoint.

    Returns ({"model": state_dict for GPT.load_state_dict, "optimizer": {name: {key:
    full tensor}}}, step).
    """
    from minipar.parallel.tp import unshard

    path = resolve(directory)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    shards: dict[str, dict[int, torch.Tensor]] = {}
    opt_shards: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for fname, info in meta["files"].items():
        blob = torch.load(os.path.join(path, fname), weights_only=True)
        for name, t in blob["weights"].items():
            shards.setdefault(name, {})[info["tp_rank"]] = t
        for name, st in blob["states"].items():
            for key, t in st.items():
                opt_shards.setdefault(name, {}).setdefault(key, {})[info["tp_rank"]] = t

    def full(name: str, parts: dict[int, torch.Tensor]) -> torch.Tensor:
        ordered = [parts[r] for r in sorted(parts)]
        if len(ordered) == 1 or ordered[0].dim() == 0:
            return ordered[0]
        return unshard(name, ordered) if len(ordered) == meta["tp"] else ordered[0]

    model = {name: full(name, parts) for name, parts in shards.items()}
    optimizer = {name: {k: full(name, v) for k, v in st.items()}
                 for name, st in opt_shards.items()}
    cfg = meta["config"]
    from minipar.model import get_config

    mcfg = get_config(cfg["model"]).with_(**cfg.get("overrides", {}))
    if mcfg.tie_embeddings and "head.weight" not in model:
        model["head.weight"] = model["tok_emb.weight"]
    return {"model": model, "optimizer": optimizer}, meta["step"]


def load_optimizer_state(rm: RankMesh, parts, full: dict, weights: dict) -> None:
    """Put full optimizer states (by name) into this rank's optimizer, resharded.
    ``weights``: the full fp32 weights, which ZeRO's masters are loaded from."""
    from minipar.parallel.tp import shard_tensor, tp_shard_dim

    def mine(name: str, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or tp_shard_dim(name) is None or rm.mesh.tp == 1:
            return t.clone()
        return shard_tensor(name, t, rm.coords.tp, rm.mesh.tp).clone()

    # ZeRO 0-3 keep their shard of it
    parts.data_parallel.load_full_state_by_name(
        {n: {k: mine(n, v) for k, v in full[n].items()} for n in parts.names if n in full},
        {n: mine(n, weights[n]).float() for n in parts.names if n in weights},
        parts.optimizer)
