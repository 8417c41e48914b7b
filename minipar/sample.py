"""``python -m minipar sample``: text from a checkpoint of any layout.

``checkpoint.load`` reassembles the full model from any sharding (dp, pp, tp, ZeRO), so
sampling is a single-device affair: the plain ``GPT``, the tokenizer that trained it,
and autoregressive decoding with a temperature (0: always the likeliest token).

What a checkpoint directory needs for this, beside the shards, is written by the
training run (rank 0, after each save) as the *run card* ``run.json``: the model's
sizes (so a run with ``--layers`` or a data-set vocabulary rebuilds exactly), the data
source, and ``tokenizer.json``, a copy of the tokenizer, so sampling works even once
the token cache is gone. A run on the generated Markov corpus has no tokenizer: its
prompt and output are token ids.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from tqdm.auto import tqdm

from minipar.checkpoint import (
    RUN_CARD,
    STEP_DIR,
    TOKENIZER,
    inspect,
    read_text,
    require_directory,
    saved_model_config,
)
from minipar.checks import seed as check_seed
from minipar.corpus import load_tokenizer, prepare, tokenizer_path
from minipar.model import GPT, GPTConfig, materialize
from minipar.reshard import ShardReader

TOKENS_MAX = 100_000  # one token at a time on a CPU: minutes, not days


def write_run_card(directory: str, cfg, model_cfg: GPTConfig) -> None:
    """Record the model's sizes, the data and its tokenizer in ``directory``."""
    tok_file = None
    if cfg.data != "markov":
        source = prepare(cfg.data, cfg.tokenizer, model_cfg.vocab_size, cfg.data_cache,
                         text_field=cfg.text_field)
        found = tokenizer_path(source)
        if found and os.path.exists(found):
            tok_file = TOKENIZER
            target = os.path.join(directory, TOKENIZER)
            if not os.path.exists(target):
                shutil.copyfile(found, target + ".tmp")
                os.replace(target + ".tmp", target)
    card = {"model": model_cfg.to_dict(), "data": cfg.data, "tokenizer": cfg.tokenizer,
            "tokenizer_file": tok_file}
    with open(os.path.join(directory, RUN_CARD + ".tmp"), "w") as f:
        json.dump(card, f, indent=1)
    os.replace(os.path.join(directory, RUN_CARD + ".tmp"), os.path.join(directory, RUN_CARD))


def run_card(directory: str) -> tuple[GPTConfig, object | None]:
    """The model config and tokenizer of the run that wrote ``directory``: a ``--save``
    directory, or one of its checkpoints (``step-N``, beside which the card lies)."""
    beside, name = os.path.split(os.path.normpath(directory))
    if os.path.exists(os.path.join(directory, RUN_CARD)) or not STEP_DIR.fullmatch(name):
        beside = directory
    path = os.path.join(beside, RUN_CARD)
    if os.path.exists(path):
        try:
            card = json.loads(read_text(path))
            model = GPTConfig(**card["model"])
            tok_file = card.get("tokenizer_file")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path} is not a minipar run card ({type(e).__name__}: "
                             f"{str(e)[:100]})") from None
        tok = load_tokenizer(os.path.join(beside, tok_file)) if tok_file else None
        return model, tok
    return saved_model_config(inspect(directory)), None  # an older checkpoint: no run card


def load_model(directory: str) -> tuple[GPT, object | None]:
    """The full single-device model from a checkpoint of any layout, and its tokenizer."""
    require_directory(directory)
    model_cfg, tok = run_card(directory)
    model = GPT(model_cfg, device="meta")  # then each weight straight from its shards
    materialize(model, ShardReader(directory, model_cfg).values())
    check_finite(directory, model.named_parameters())
    return model.eval(), tok


def check_finite(directory: str, named) -> None:
    """One line if a weight is NaN or infinite (a run that diverged): such a model
    samples garbage or zeros, and exports nothing worth loading."""
    for name, t in named:
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"--resume {directory}: weight {name} is not finite (the run "
                             "diverged before this checkpoint); use an earlier one")


@torch.no_grad()
def generate(model: GPT, ids: list[int], tokens: int, temperature: float = 1.0,
             seed: int = 0, usable: int | None = None, progress: bool = False) -> list[int]:
    """``tokens`` new ids after ``ids``; the context is the last ``seq_len`` ids.
    ``usable``: ids at or above it are never drawn (padding past the tokenizer's).
    ``progress``: a bar on a terminal's stderr (the text is printed when all are drawn)."""
    g = torch.Generator().manual_seed(seed)
    out = list(ids)
    for _ in tqdm(range(tokens), desc="sample", unit="token", leave=False,
                  disable=None if progress else True):
        context = torch.tensor([out[-model.cfg.seq_len:]], dtype=torch.long)
        logits = model(context)[0, -1].float()
        if usable is not None and usable < logits.numel():
            logits[usable:] = -float("inf")
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=g))
        out.append(nxt)
    return out[len(ids):]


def sample(directory: str, prompt: str, tokens: int = 200, temperature: float = 0.8,
           seed: int = 0, progress: bool = False) -> str:
    """Text generated by the checkpoint in ``directory`` after ``prompt`` (``progress``:
    ``generate``'s bar)."""
    if not 1 <= tokens <= TOKENS_MAX:
        raise ValueError(f"--tokens must be a positive integer up to {TOKENS_MAX:,} (the text "
                         f"is printed when all are drawn), got {tokens}")
    if not 0 <= temperature < float("inf"):  # (NaN too)
        raise ValueError(f"--temperature must be a number >= 0, got {temperature}")
    check_seed(seed)
    model, tok = load_model(directory)
    if tok is None:  # token ids in, token ids out (the Markov corpus, a bare .bin)
        try:
            ids = [int(t) for t in prompt.split()] or [0]
        except ValueError:
            raise ValueError("this checkpoint has no tokenizer (generated or bare .bin "
                             "data): give the prompt as token ids, e.g. --prompt '3 14'"
                             ) from None
        if max(ids) >= model.cfg.vocab_size or min(ids) < 0:
            raise ValueError(f"token ids must be in 0..{model.cfg.vocab_size - 1}")
        return " ".join(map(str, generate(model, ids, tokens, temperature, seed,
                                          progress=progress)))
    ids = tok.encode(prompt) or [0]
    new = generate(model, ids, tokens, temperature, seed, usable=tok.vocab_size,
                   progress=progress)
    return prompt + tok.decode(new)
