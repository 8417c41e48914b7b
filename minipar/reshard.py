"""Reading a checkpoint per shard: each rank opens only the files it needs.

A checkpoint is one file per rank of data-parallel replica 0, holding that rank's
pipeline stage's tensors in its tensor-parallel shapes (``checkpoint.save``). A rank of
another layout needs, for each of its parameters, its own tp slice: ``ShardReader``
finds the stage that holds a name from the saved layout alone (``partition_layers``),
opens only the files of that stage whose tp shards overlap this rank's, memory-mapped
(``torch.load(mmap=True, weights_only=True)``: a tensor is read when sliced, and a
checkpoint cannot run code), and cuts the slice (``materialize.reshard``). No rank
assembles a full model; ZeRO then takes its dp shard of each weight and optimizer state,
one bucket or unit at a time (``load_optimizer_state``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from minipar.checkpoint import DIGEST, CheckpointError, inspect, load_shard
from minipar.mesh import RankMesh
from minipar.parallel.materialize import overlapping, reshard
from minipar.parallel.pp import partition_layers
from minipar.parallel.schedules import rank_of
from minipar.parallel.tp import tp_split


class ShardReader:
    """A rank's view of a checkpoint: reads only the files and tensors it needs.

    ``local(name, key=None)`` is this rank's tp shard (for a run with ``tp`` ranks) of
    weight ``name`` or of its optimizer state ``key``. The files holding it are found
    from ``meta.json`` alone (a name's pipeline stage follows from the saved layout:
    ``partition_layers``), only the saved tp shards that overlap this rank's are opened
    (memory-mapped: a file's tensors are read when sliced), and the slice is cut from
    them (``materialize.reshard``): no rank assembles a full model. ``opened`` lists the
    files read so far.
    """

    def __init__(self, directory: str, cfg, tp_rank: int = 0, tp: int = 1) -> None:
        self.meta = inspect(directory)
        self.cfg, self.tp_rank, self.tp, self.step = cfg, tp_rank, tp, self.meta["step"]
        self.saved_tp, self.saved_pp = int(self.meta["tp"]), int(self.meta.get("pp", 1))
        saved = self.meta["config"]
        virtual = int(saved.get("virtual", 1) or 1)
        chunks = partition_layers(cfg.n_layer, self.saved_pp * virtual,
                                  int(saved.get("head_layers", 0) or 0))
        self._layer_stage = {i: rank_of(c, self.saved_pp) for c, r in enumerate(chunks)
                             for i in r}
        self._files = {(int(i["pp_rank"]), int(i["tp_rank"])): f
                       for f, i in self.meta["files"].items()}
        self._blobs: dict[str, dict] = {}
        self.opened: list[str] = []

    def _stage(self, name: str) -> int:
        parts = name.split(".")
        if parts[0] == "blocks":
            return self._layer_stage[int(parts[1])]
        return 0 if parts[0] in ("tok_emb", "pos_emb", "drop") else self.saved_pp - 1

    def _blob(self, pp_rank: int, tp_rank: int) -> dict:
        fname = self._files[(pp_rank, tp_rank)]
        if fname not in self._blobs:
            self._blobs[fname] = load_shard(  # its digest checked first
                os.path.join(self.meta["path"], fname), mmap=True,
                digest=self.meta["files"][fname].get(DIGEST))
            self.opened.append(fname)
        return self._blobs[fname]

    def _pieces(self, name: str, key: str | None) -> dict[int, torch.Tensor] | None:
        stage = self._stage(name)
        wanted = overlapping(self.saved_tp, self.tp_rank, self.tp) \
            if tp_split(name).dim is not None else [0]  # as the tp plan splits it
        pieces = {}
        for s in wanted:
            blob = self._blob(stage, s)
            t = blob["weights"].get(name) if key is None else \
                blob["states"].get(name, {}).get(key)
            if t is None:
                return None
            pieces[s] = t
        return pieces

    def _names(self, name: str) -> list[str]:
        """``name``, then its tied twin (pp = 1 saves the shared weight once)."""
        twins = {"head.weight": "tok_emb.weight", "tok_emb.weight": "head.weight"}
        return [name, twins[name]] if self.cfg.tie_embeddings and name in twins else [name]

    def local(self, name: str, key: str | None = None) -> torch.Tensor:
        for n in self._names(name):
            pieces = self._pieces(n, key)
            if pieces is not None:
                return reshard(n, pieces, self.saved_tp, self.tp_rank, self.tp)
        raise CheckpointError(f"{self.meta['path']} holds no {key or 'weight'} of {name}")

    def state_keys(self, name: str) -> list[str]:
        """The optimizer state keys saved for ``name`` (none for plain SGD)."""
        for n in self._names(name):
            blob = self._blob(self._stage(n), 0)
            if n in blob["states"]:
                return list(blob["states"][n])
        return []

    def values(self, device: torch.device | str | None = None):
        """``values(name, p)`` for ``model.materialize`` and ``Zero3``: the fp32 slice."""
        return lambda name, p: self.local(name).to(device=device, dtype=torch.float32)

    def close(self) -> None:
        self._blobs.clear()


class _ByName(Mapping):
    """A read-only mapping whose values are made when asked for (one at a time)."""

    def __init__(self, names: list[str], make) -> None:
        self._names, self._make = names, make

    def __getitem__(self, name: str):
        if name not in self._names:
            raise KeyError(name)
        return self._make(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def load_optimizer_state(rm: RankMesh, parts, reader: ShardReader) -> None:
    """Put the saved optimizer states into this rank's optimizer, resharded: each
    weight's tp shard read from the checkpoint when ZeRO asks for it (one bucket or
    unit at a time), and the fp32 masters with it."""
    names = [n for n in parts.names]
    weights = _ByName(names, lambda n: reader.local(n).float())
    states = _ByName(names, lambda n: {k: reader.local(n, k).clone()
                                       for k in reader.state_keys(n)})
    parts.data_parallel.load_full_state_by_name(states, weights, parts.optimizer)
