"""In and out of the Hugging Face ecosystem: GPT-2 directories ``transformers`` loads.

minipar's GPT is GPT-2's architecture (Radford et al. 2019): learned positions,
pre-norm LayerNorm (eps 1e-5), a tanh-approximated GELU MLP, biases everywhere but the
head, a head tied to the embedding or not. Only names and three conventions differ:

* GPT-2's linear layers are ``Conv1D``: weights stored (in, out), ``nn.Linear``'s
  (out, in) transposed;
* ``c_attn`` packs q|k|v along its output columns, whole heads inside each, which is
  exactly the layout of minipar's ``qkv`` rows (transposed);
* a tied head is not stored (``lm_head`` is ``wte``).

``save_hf`` writes ``config.json``, ``model.safetensors`` and the tokenizer's files (the
``activation_function`` is ``gelu_pytorch_tanh``: the very ``F.gelu`` call minipar
makes). ``HFCheckpoint`` reads such a directory back one tensor *slice* at a time
(safetensors' ``get_slice``): a rank reads only its tp shard of its stage's weights.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator

import torch

from minipar.checks import require
from minipar.corpus import EOT
from minipar.model import GPT, GPTConfig
from minipar.parallel.materialize import full_shape
from minipar.parallel.tp import tp_split

TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # one function, three names
CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
# minipar's name -> GPT-2's (without the "transformer." prefix), per block and outside
_BLOCK = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
          "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_TOP = {"tok_emb.weight": "wte.weight", "pos_emb.weight": "wpe.weight",
        "ln_f.weight": "ln_f.weight", "ln_f.bias": "ln_f.bias"}


def hf_name(name: str) -> tuple[str, bool]:
    """GPT-2's name of minipar parameter ``name``, and whether it is a transposed
    ``Conv1D`` weight. ``head.weight`` is ``lm_head.weight`` (untied models only)."""
    if name == "head.weight":
        return "lm_head.weight", False
    if name in _TOP:
        return "transformer." + _TOP[name], False
    _, i, rest = name.split(".", 2)  # blocks.I.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    conv = module.startswith(("attn", "mlp"))
    return f"transformer.h.{i}.{_BLOCK[module]}.{kind}", conv and kind == "weight"


def hf_config(cfg: GPTConfig, eos_id: int | None = None) -> dict:
    """``config.json`` of ``GPT2LMHeadModel`` for a model of ``cfg``'s sizes."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.d_model,
            "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.d_ff,
            "activation_function": TANH_GELU[0], "layer_norm_epsilon": 1e-5,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "scale_attn_weights": True,
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": eos_id,
            "eos_token_id": eos_id, "dtype": "float32", "use_cache": True}


def check_dense(cfg: GPTConfig, where: str) -> None:
    """``ValueError`` (one line) for a mixture-of-experts model: GPT-2 has no router and
    no experts, so neither direction of the round trip has a place for their weights."""
    if cfg.n_expert:
        raise ValueError(f"{where}: GPT-2's architecture has no mixture of experts, and "
                         f"this model has {cfg.n_expert} experts in {cfg.n_moe_layers} "
                         "blocks (a dense model only)")


def save_hf(tensors: Iterator[tuple[str, torch.Tensor]], cfg: GPTConfig, out: str,
            tokenizer=None) -> dict:
    """Write a directory ``GPT2LMHeadModel.from_pretrained(out)`` loads: ``tensors``
    (minipar names, full fp32 values, each once), its ``config.json`` and, for a
    ``corpus`` tokenizer, the files ``AutoTokenizer.from_pretrained(out)`` reads."""
    from safetensors.torch import save_file  # optional: only hf directories need it

    check_dense(cfg, "--format hf")
    state = {}
    for name, t in tensors:
        if name == "head.weight" and cfg.tie_embeddings:
            continue  # lm_head is wte
        key, conv = hf_name(name)
        state[key] = (t.t() if conv else t).to(torch.float32).contiguous()
    os.makedirs(out, exist_ok=True)
    eos = _save_tokenizer(tokenizer, cfg, out) if tokenizer is not None else None
    _atomic(os.path.join(out, WEIGHTS),
            lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    _atomic(os.path.join(out, CONFIG), lambda tmp: _write_json(tmp, hf_config(cfg, eos)))
    return {"path": out, "tensors": len(state),
            "bytes": os.path.getsize(os.path.join(out, WEIGHTS))}


def _atomic(path: str, write: Callable[[str], None]) -> None:
    write(path + ".tmp")
    os.replace(path + ".tmp", path)  # never a half-written file under the final name


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _save_tokenizer(tok, cfg: GPTConfig, out: str) -> int | None:
    """``tokenizer.json`` (Hugging Face ``tokenizers``) and ``tokenizer_config.json``.
    The byte tokenizer becomes byte-level BPE without merges: ids are UTF-8 bytes.
    Returns the end-of-text id (BPE's document separator), if any."""
    # optional: byte and Markov data run without it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if tok.kind == "byte":
        alphabet = _bytes_to_unicode()
        fast = Tokenizer(models.BPE({alphabet[b]: b for b in range(256)}, []))
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        fast.decoder = decoders.ByteLevel()
    else:
        fast = tok.tok
    eos = fast.token_to_id(EOT)
    _atomic(os.path.join(out, "tokenizer.json"), fast.save)
    special = {"eos_token": EOT, "bos_token": EOT} if eos is not None else {}
    _atomic(os.path.join(out, "tokenizer_config.json"), lambda tmp: _write_json(
        tmp, {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_len,
              **special}))
    return eos


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (``ByteLevel``'s alphabet, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


# --- reading a GPT-2 directory --------------------------------------------------------------

def _config_json(directory: str) -> dict:
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"--init-from {directory}: no {CONFIG} (a transformers model "
                         "directory, as minipar export --format hf writes)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        _gpt_config(config)  # its sizes are numbers
        return config
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--init-from {directory}: {path} is not a model config "
                         f"({type(e).__name__}: {str(e)[:100]})") from None


def _gpt_config(c: dict) -> GPTConfig:
    """minipar's sizes of a GPT-2 ``config.json`` (GPT-2's defaults where absent)."""
    d = int(c.get("n_embd", 768))
    return GPTConfig(vocab_size=int(c.get("vocab_size", 50257)),
                     seq_len=int(c.get("n_positions", 1024)), n_layer=int(c.get("n_layer", 12)),
                     n_head=int(c.get("n_head", 12)), d_model=d,
                     d_ff=int(c.get("n_inner") or 4 * d),
                     tie_embeddings=bool(c.get("tie_word_embeddings", True)))


def read_config(directory: str) -> GPTConfig:
    """The model sizes of the GPT-2 directory ``directory`` (``train --init-from``)."""
    return _gpt_config(_config_json(directory))


def default_tokenizer(init_from: str | None) -> str:
    """``--tokenizer`` when not given: ``init_from``'s ``tokenizer.json`` if it has one
    (the ids its weights were trained on), else ``byte``."""
    path = os.path.join(init_from, "tokenizer.json") if isinstance(init_from, str) else ""
    return path if path and os.path.isfile(path) else "byte"


def check_init_from(cfg, model: GPTConfig) -> None:
    """Before launch: ``--init-from`` names a GPT-2 directory whose architecture is
    ``model``'s (with ``--resume`` too, the weights then come from the checkpoint)."""
    HFCheckpoint(cfg.init_from).check(model)


class HFCheckpoint:
    """A GPT-2-architecture ``transformers`` directory, read one tensor slice at a time.

    ``model_config()`` gives minipar's sizes; ``check(cfg)`` says in one line what
    differs from a model of ``cfg``; ``values(tp_rank, tp)`` is ``model.materialize``'s
    function: this rank's tp shard of each weight, sliced in the file (``get_slice``),
    so a rank reads only its part of the weights its stage holds.
    """

    def __init__(self, directory: str) -> None:
        self.dir, self.config = directory, _config_json(directory)
        self._files = self._weight_files()
        self._open: dict[str, object] = {}
        # transformers saves "transformer.h.0..."; older GPT-2 files "h.0..."
        self.prefix = "transformer." if any(k.startswith("transformer.") for k in
                                            self._files) else ""

    def _weight_files(self) -> dict[str, str]:
        """Tensor name -> file, from the index of a sharded save, or the one file."""
        index = os.path.join(self.dir, INDEX)
        path = os.path.join(self.dir, WEIGHTS)
        if not os.path.isfile(index) and not os.path.isfile(path):
            raise ValueError(f"--init-from {self.dir}: no {WEIGHTS} (only safetensors "
                             "weights are read: they load without running code)")
        safetensors = require("safetensors", "--init-from")
        try:
            if os.path.isfile(index):
                path = index
                with open(index, encoding="utf-8") as f:
                    files = json.load(f)["weight_map"]
                if not all(isinstance(v, str) for v in files.values()):
                    raise ValueError("a weight_map of file names is needed")
                return files
            with safetensors.safe_open(path, "pt") as f:
                return dict.fromkeys(f.keys(), WEIGHTS)
        except Exception as e:  # json's, safetensors' (SafetensorError), a non-dict
            raise ValueError(f"--init-from {self.dir}: {path} is not readable "
                             f"({type(e).__name__}: {str(e)[:100]})") from None

    def model_config(self) -> GPTConfig:
        return _gpt_config(self.config)

    def check(self, cfg: GPTConfig) -> None:
        """``ValueError`` (one line) naming what differs between the directory's model
        and ``cfg`` (a shorter ``seq_len`` is fine: the first positions are read)."""
        c, where = self.config, f"--init-from {self.dir}"
        check_dense(cfg, where)
        if c.get("model_type", "gpt2") != "gpt2":
            raise ValueError(f"{where}: a {c.get('model_type')} model; minipar's GPT reads "
                             "GPT-2's architecture (model_type gpt2)")
        act = c.get("activation_function", "gelu_new")
        if act not in TANH_GELU:
            raise ValueError(f"{where}: activation {act}; minipar's MLP uses the tanh GELU "
                             f"({', '.join(TANH_GELU)})")
        eps = float(c.get("layer_norm_epsilon", 1e-5))
        if not math.isclose(eps, 1e-5):
            raise ValueError(f"{where}: layer_norm_epsilon {eps}; minipar's is 1e-05")
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx",
                                                         False), ("add_cross_attention", False)):
            if bool(c.get(key, want)) != want:
                raise ValueError(f"{where}: {key} is {c.get(key)}; minipar's GPT has {want}")
        have = self.model_config()
        for field, what in (("n_layer", "layers"), ("n_head", "heads"), ("d_model", "hidden"),
                            ("d_ff", "ffn"), ("vocab_size", "vocab")):
            if getattr(have, field) != getattr(cfg, field):
                raise ValueError(f"{where}: the checkpoint has {what} {getattr(have, field)}, "
                                 f"the model {getattr(cfg, field)}")
        if cfg.tie_embeddings and not have.tie_embeddings:  # (the other way: head <- wte)
            raise ValueError(f"{where}: the checkpoint's head is untied "
                             "(tie_word_embeddings false), the model ties it to wte")
        if cfg.seq_len > have.seq_len:
            raise ValueError(f"{where}: seq-len {cfg.seq_len} exceeds the checkpoint's "
                             f"{have.seq_len} positions")
        missing = [hf_name(n)[0] for n in parameter_names(cfg) if self._key(n) not in self._files]
        if missing:
            raise ValueError(f"{where}: lacks {len(missing)} weights of a GPT-2 "
                             f"({missing[0]}, ...)")

    def _key(self, name: str) -> str:
        """The file's tensor name of minipar weight ``name``. A directory whose config
        ties the head (``tie_word_embeddings``, true when absent, as in ``transformers``)
        stores no ``lm_head.weight``: ``head.weight`` is ``wte``, also for an untied
        model, whose head then starts as a copy of the embedding."""
        if name == "head.weight" and self.model_config().tie_embeddings:
            name = "tok_emb.weight"
        key, _ = hf_name(name)
        return key if key.startswith("lm_head") else self.prefix + key[len("transformer."):]

    def _slice(self, key: str):
        fname = self._files[key]
        if fname not in self._open:
            safetensors = require("safetensors", "--init-from")
            self._open[fname] = safetensors.safe_open(os.path.join(self.dir, fname), "pt")
        return self._open[fname].get_slice(key)

    def local(self, name: str, shape: tuple[int, ...], tp_rank: int = 0, tp: int = 1
              ) -> torch.Tensor:
        """Rank ``tp_rank`` of ``tp``'s shard of minipar weight ``name``, whose full
        shape is ``shape``: only those rows (q|k|v: of each third) are read."""
        key = self._key(name)
        conv = hf_name(name)[1]
        sl = self._slice(key)
        split = tp_split(name)
        dim = split.dim if tp > 1 else None
        ranges = [(0, n) for n in shape]  # minipar's dims; positions: the first seq_len
        pieces = []
        thirds = split.parts if dim is not None else 1
        for j in range(thirds if dim is not None else 1):
            r = list(ranges)
            if dim is not None:
                per = shape[dim] // thirds
                r[dim] = (j * per + tp_rank * per // tp, j * per + (tp_rank + 1) * per // tp)
            if conv:
                r = r[::-1]
            pieces.append(sl[tuple(slice(a, b) for a, b in r)])
        t = torch.cat(pieces, dim=(1 - dim if conv else dim)) if len(pieces) > 1 else pieces[0]
        # a copy: a slice views the file's memory map, which every read of the same
        # tensor shares (an untied head read from wte would train the embedding too)
        return (t.t() if conv else t).to(torch.float32).clone(
            memory_format=torch.contiguous_format)

    def values(self, tp_rank: int = 0, tp: int = 1,
               device: torch.device | str | None = None) -> Callable:
        """``values(name, p)`` for ``model.materialize`` and ``Zero3`` (fp32 slices)."""
        return lambda name, p: self.local(name, full_shape(name, p.shape, tp), tp_rank,
                                          tp).to(device)

    def close(self) -> None:
        self._open.clear()


def parameter_names(cfg: GPTConfig) -> list[str]:
    """The reference names of a ``GPT`` of ``cfg``'s weights (a tied head's once)."""
    return [n for n, _ in GPT(cfg, device="meta").named_parameters()]
