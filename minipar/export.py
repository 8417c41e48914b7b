"""The full model out of a checkpoint of any layout, as one safetensors file.

safetensors (Hugging Face) is the field's exchange format: a JSON header of names,
dtypes, shapes and byte offsets, then the raw tensors; no pickle, so loading runs no
code, and a reader can map one tensor without reading the rest. ``export`` writes the
single-device model's weights under their reference names (``blocks.5.mlp.fc.weight``;
a tied head once, as ``tok_emb.weight``) with the model's sizes in the header's
metadata; ``load_gpt(path)`` or ``load_safetensors(gpt, path)`` loads it. ``export_hf``
writes the same weights as a GPT-2 directory ``transformers`` loads (``minipar.hf``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator

import torch
from torch import nn

from minipar.checkpoint import require_directory
from minipar.checks import distinct, new_output_dir, output_file
from minipar.hf import parameter_names, save_hf
from minipar.model import GPT, GPTConfig, materialize
from minipar.reshard import ShardReader
from minipar.sample import check_finite, run_card


def export(directory: str, out: str) -> dict:
    """Write the checkpoint in ``directory`` (any dp/pp/tp/ZeRO layout) to ``out``.
    Returns ``{"path", "step", "tensors", "bytes"}``."""
    from safetensors.torch import save_file  # optional: only exports need it

    require_directory(directory)
    if not out.endswith(".safetensors"):
        raise ValueError(f"--out {out}: the file name must end in .safetensors")
    output_file("out", out, new=True)  # train's rules: an existing directory, no overwrite
    distinct({"out": out}, {"resume": directory})
    cfg, _ = run_card(directory)
    reader = ShardReader(directory, cfg)  # tp = 1: each tensor whole, from its shards
    tensors = {n: reader.local(n).to(torch.float32).contiguous().clone()
               for n in parameter_names(cfg)}
    check_finite(directory, tensors.items())
    meta = {"minipar_config": json.dumps(cfg.to_dict()), "step": str(reader.step)}
    tmp = f"{out}.{os.getpid()}.tmp"
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, out)  # never a half-written file under the final name
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return {"path": out, "step": reader.step, "tensors": len(tensors),
            "bytes": os.path.getsize(out)}


def load_safetensors(model: nn.Module, path: str,
                     device: torch.device | str | None = None) -> nn.Module:
    """Load a full model written by ``python -m minipar export`` (reference names) into
    ``model`` (a ``GPT``, possibly on the meta device), one tensor at a time."""
    from safetensors import safe_open  # optional: only exports need it

    with safe_open(path, "pt", device=str(device or "cpu")) as f:
        have = set(f.keys())
        named = dict(model.named_parameters())
        missing = sorted(n for n in named if n not in have)
        if missing:
            raise ValueError(f"{path} lacks {len(missing)} weights of this model "
                             f"({missing[0]}, ...)")
        for n, p in named.items():
            if tuple(f.get_slice(n).get_shape()) != tuple(p.shape):
                raise ValueError(f"{path}: {n} has shape {f.get_slice(n).get_shape()}, "
                                 f"the model's is {tuple(p.shape)}")
        materialize(model, lambda name, p: f.get_tensor(name).to(torch.float32))
    return model


def load_gpt(path: str, cfg=None, device: torch.device | str | None = None):
    """A ``GPT`` holding the weights of an exported file; the sizes are read from the
    file's metadata unless ``cfg`` is given."""
    from safetensors import safe_open  # optional: only exports need it

    if cfg is None:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        if "minipar_config" not in meta:
            raise ValueError(f"{path} carries no minipar model config: pass cfg")
        cfg = GPTConfig(**json.loads(meta["minipar_config"]))
    return load_safetensors(GPT(cfg, device="meta"), path, device)


def export_hf(directory: str, out: str) -> dict:
    """``python -m minipar export --format hf``: the checkpoint in ``directory`` (any
    layout) as a ``transformers`` GPT-2 directory ``out``, each weight assembled from
    its shards alone (``reshard.ShardReader``; no optimizer state is read). ``export``'s
    rules: ``out`` is new (or empty), never half-written (a temporary directory renamed
    at the end), and a diverged model is refused."""
    require_directory(directory)
    new_output_dir("out", out)
    distinct({"out": out}, {"resume": directory})
    cfg, tok = run_card(directory)
    reader = ShardReader(directory, cfg)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:  # each checked as it is read
        for name in parameter_names(cfg):
            t = reader.local(name)
            check_finite(directory, [(name, t)])
            yield name, t

    out = os.path.normpath(out)
    tmp = f"{out}.{os.getpid()}.tmp"
    try:
        written = save_hf(weights(), cfg, tmp, tok)
        os.replace(tmp, out)  # onto nothing, or onto an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
    return {**written, "path": out, "step": reader.step, "tokenizer": tok is not None}
