"""The full model out of a checkpoint of any layout, as one safetensors file.

safetensors (Hugging Face) is the field's exchange format: a JSON header of names,
dtypes, shapes and byte offsets, then the raw tensors; no pickle, so loading runs no
code, and a reader can map one tensor without reading the rest. ``export`` writes the
single-device model's weights under their reference names (``blocks.5.mlp.fc.weight``;
a tied head once, as ``tok_emb.weight``) with the model's sizes in the header's
metadata; ``GPT.from_safetensors(path)`` or ``model.load_safetensors(gpt, path)`` loads it.
"""

from __future__ import annotations

import json
import os

import torch


def export(directory: str, out: str) -> dict:
    """Write the checkpoint in ``directory`` (any dp/pp/tp/ZeRO layout) to ``out``.
    Returns ``{"path", "step", "tensors", "bytes"}``."""
    from safetensors.torch import save_file

    from minipar.checkpoint import ShardReader
    from minipar.model import GPT
    from minipar.sample import _run_card

    if not os.path.isdir(directory):
        raise ValueError(f"--resume {directory}: no such checkpoint directory")
    if not out.endswith(".safetensors"):
        raise ValueError(f"--out {out}: the file name must end in .safetensors")
    cfg, _ = _run_card(directory)
    reader = ShardReader(directory, cfg)  # tp = 1: each tensor whole, from its shards
    names = [n for n, _ in GPT(cfg, device="meta").named_parameters()]
    tensors = {n: reader.local(n).to(torch.float32).contiguous().clone() for n in names}
    meta = {"minipar_config": json.dumps(cfg.to_dict()), "step": str(reader.step)}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, out)  # never a half-written file under the final name
    return {"path": out, "step": reader.step, "tensors": len(tensors),
            "bytes": os.path.getsize(out)}
