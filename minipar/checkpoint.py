"""Sharded checkpoints that reshard: save at one layout, resume at any other.

**What is saved.** Logically a checkpoint is the *full* training state, by parameter
name, as one device would hold it: the fp32 weights and, per weight, the optimizer's
state (AdamW's step, exp_avg, exp_avg_sq). Physically it is stored in shards: each rank
of data-parallel replica 0 writes the tensor-parallel shards of the parameters of its
pipeline stage (ZeRO shards are gathered over dp first), one file per rank, plus a
``meta.json`` saying who wrote what (and the model as built: its sizes flags,
vocabulary and ``--init-from`` directory's shape are not in the preset's name).

**Resharding, per shard.** A resuming rank reads only what it needs
(``reshard.ShardReader``): a name's pipeline stage follows from the saved layout, so only the
files of that stage whose tp shards overlap this rank's are opened, memory-mapped (a
file's tensors are read when sliced), and this rank's tp slice is cut from them
(``materialize.reshard``; the fused q|k|v layout included). The engine materialises its
parameters from these slices exactly as it does from the initialisation, and ZeRO takes
its dp shard of each, one bucket or unit at a time. ``load`` still reassembles the whole
state (tests, the parity tools); ``export`` writes it as one safetensors file.

**Atomic and durable.** Files go to ``step-N.tmp/`` and are fsynced; once every rank has
written, rank 0 renames it to ``step-N/`` and then replaces the ``latest`` pointer
(``os.replace`` is atomic; the directory is fsynced after each rename). At every instant
``latest`` names a complete checkpoint, re-saving the same step included (``_publish``):
a run killed mid-save leaves the previous one. A save that fails (a full disk, weights
that are not finite) fails on every rank alike (``SaveError``, one all-reduce per phase
says whether any rank failed) and leaves no ``step-N.tmp`` behind.

**Checked before use.** ``check_resume`` reads ``meta.json`` and each shard's zip
directory before a rank starts (a wrong model, a damaged file: one line naming it).
``meta.json`` records each shard's SHA-256, hashed as it is written; whoever reads a
shard (a resuming rank, ``export``, ``sample``) checks it first (``load_shard``), so a
file changed on disk is named, never trained on. ``check_save`` refuses a directory
holding another run's checkpoints, and ``locked`` holds a ``--save`` directory for one
run at a time. Loading uses ``torch.load(weights_only=True)``: a checkpoint cannot run
code.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import zipfile
from contextlib import contextmanager, suppress

import torch
import torch.distributed as dist

from minipar.mesh import RankMesh
from minipar.model import GPTConfig, get_config
from minipar.parallel.tp import unshard
from minipar.rank import heartbeat

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")
DIGEST = "sha256"  # of each shard's bytes, recorded in meta.json
STEP_DIR = re.compile(r"step-(\d{6,})")  # a checkpoint's directory name, exactly
SHARD = re.compile(r"rank-\d{5,}\.pt")  # a shard's file name
RUN_CARD = "run.json"  # beside the shards: what ``sample`` needs (``write_run_card``)
TOKENIZER = "tokenizer.json"  # the run's tokenizer, copied beside the shards


class SaveError(RuntimeError):
    """A checkpoint could not be written; raised on every rank alike. ``own``: whether
    this rank's own failure (the message says what), or another rank's."""

    def __init__(self, message: str, own: bool):
        super().__init__(message)
        self.own = own


def local_state(rm: RankMesh, parts) -> tuple[dict, dict]:
    """This rank's fp32 weights and optimizer states by name, in tp-shard shapes."""
    # ZeRO 0-3 keep them sharded over dp: gathered here (collective over dp)
    weights, states = parts.data_parallel.full_state_by_name(parts.optimizer)
    return weights, {n: {k: v for k, v in st.items() if k in STATE_KEYS}
                     for n, st in states.items()}


def save(directory: str, step: int, cfg, rm: RankMesh, parts, then=None) -> str:
    """Collective: every rank calls it. Returns the path of the new checkpoint.

    ``then()`` runs on rank 0 once it is published (the run card, pruning). Raises
    ``SaveError`` on every rank if any rank could not do its part (nothing is written
    from weights that are not finite), after removing the partial ``step-N.tmp``.
    """
    weights, states = local_state(rm, parts)  # collective under ZeRO (gathers over dp)
    final = os.path.join(directory, f"step-{step:06d}")
    tmp = final + ".tmp"
    device = _agree_device(rm)
    bad = next((n for n, t in weights.items() if not bool(torch.isfinite(t).all())), None)
    error = (f"step {step} not saved: weight {bad} of rank {rm.rank} is not finite (the "
             "run diverged)") if bad else None
    if rm.rank == 0 and error is None:
        error = _attempt(lambda: _prepare(directory, tmp, final))
    _agree(rm, device, error, step, tmp)
    digest = b""
    # one writer per (pp, tp) shard: the weights and the gathered states are replicated
    # over dp and cp
    if rm.coords.dp == 0 and rm.coords.cp == 0:
        shard = os.path.join(tmp, f"rank-{rm.rank:05d}.pt")
        blob = {"weights": weights, "states": states}
        try:
            digest = bytes.fromhex(_write_durably(shard, lambda f: torch.save(blob, f)))
        except OSError as e:
            error = _why(e)
    digests = _agree(rm, device, error, step, tmp, digest)
    if rm.rank == 0:
        files = {}
        for r in range(rm.mesh.world_size):
            c = rm.mesh.coords(r)
            if c.dp == 0 and c.cp == 0:
                files[f"rank-{r:05d}.pt"] = {"tp_rank": c.tp, "pp_rank": c.pp,
                                             DIGEST: digests[r].hex()}
        meta = {"step": step, "tp": rm.mesh.tp, "pp": rm.mesh.pp, "dp": rm.mesh.dp,
                "files": files, "config": cfg.to_dict(), "model": parts.model.cfg.to_dict()}

        def publish() -> None:
            _write_durably(os.path.join(tmp, "meta.json"),
                           lambda f: f.write(json.dumps(meta, indent=1).encode()))
            _fsync_dir(tmp)
            _publish(directory, tmp, final)
            if then is not None:
                then()
        error = _attempt(publish)
    _agree(rm, device, error, step, tmp)
    return final


def _prepare(directory: str, tmp: str, final: str) -> None:
    """Rank 0, before a save: finish a re-save killed mid-way, then an empty ``tmp``."""
    if _latest_name(directory) == os.path.basename(tmp):  # a re-save killed mid-way:
        if os.path.isdir(tmp):  # finish it (tmp is complete), do not delete it below
            _publish(directory, tmp, final)
        else:  # killed after its last rename
            _point_latest(directory, os.path.basename(final))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)


def _attempt(work) -> str | None:
    """Run ``work()``; None, or the one line saying why it failed (a full disk)."""
    try:
        work()
        return None
    except OSError as e:
        return _why(e)


def _why(e: OSError) -> str:
    return f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e)


def _agree_device(rm: RankMesh) -> torch.device:
    """Where ``_agree``'s tensor lives: NCCL moves CUDA tensors only (this rank's GPU,
    set when it started), gloo host ones."""
    if dist.get_backend(rm.world.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(rm: RankMesh, device, error: str | None, step: int, tmp: str,
           digest: bytes = b"") -> list[bytes]:
    """One all-reduce over every rank: did any fail (then rank 0 removes ``tmp`` and
    every rank raises ``SaveError``), and each rank's shard digest (32 bytes a rank)."""
    size = hashlib.new(DIGEST).digest_size
    t = torch.zeros(rm.mesh.world_size, 1 + size, device=device)
    t[rm.rank, 0] = float(error is not None)
    if digest:
        t[rm.rank, 1:] = torch.tensor(list(digest), dtype=torch.float32)
    rm.world.all_reduce(t)
    t = t.cpu()
    if bool(t[:, 0].any()):
        if rm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise SaveError(error, own=True)
        raise SaveError(f"step {step} not saved: rank {int(t[:, 0].nonzero()[0])} could "
                        "not write its part", own=False)
    return [bytes(int(x) for x in row[1:]) for row in t]


def _publish(directory: str, tmp: str, final: str) -> None:
    """Rename the complete ``tmp`` to ``final`` and point ``latest`` at it, so that at
    every instant ``latest`` names a complete checkpoint (a kill may come anywhere).

    A re-save of the same step cannot rename over the old ``final`` (a directory is
    replaced only when empty), so ``latest`` first moves to the complete ``tmp``; the
    old copy goes; ``tmp`` becomes ``final``. Between that rename and the pointer's
    update ``latest`` names ``step-N.tmp``, which ``resolve`` then reads as ``step-N``.
    """
    if os.path.exists(final):
        _point_latest(directory, os.path.basename(tmp))
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)
    _fsync_dir(directory)
    _point_latest(directory, os.path.basename(final))


def _point_latest(directory: str, name: str) -> None:
    pointer = os.path.join(directory, "latest")
    _write_durably(pointer + ".tmp", lambda f: f.write(name.encode()))
    os.replace(pointer + ".tmp", pointer)
    _fsync_dir(directory)


class _Hashing:
    """A binary file that hashes what is written through it (and beats the launcher's
    heartbeat: writing a large shard is progress). It keeps a write's ``OSError`` (a full
    disk): torch's zip writer reports only that its position is off."""

    def __init__(self, f) -> None:
        self.f, self.hash, self.error = f, hashlib.new(DIGEST), None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.hash.update(memoryview(data)[:n])
        heartbeat()
        return n

    def flush(self) -> None:
        self.f.flush()


def _write_durably(path: str, write) -> str:
    """Write a file and force it to disk before anyone renames it: without the fsync a
    power cut after the rename can leave a published name on an empty file. Returns
    its hex digest; a write that failed raises its ``OSError``."""
    with open(path, "wb") as f:
        out = _Hashing(f)
        try:
            write(out)
        except Exception:
            if out.error is not None:  # with the file's name, which a write lacks
                raise OSError(out.error.errno, out.error.strerror, path) from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return out.hash.hexdigest()


def _fsync_dir(path: str) -> None:
    """Make a directory's entries (new names, renames) durable; a no-op where the OS
    cannot open a directory (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_text(path: str) -> str:
    """The text of a checkpoint's small file (``latest``, ``meta.json``, the run card);
    ``OSError`` unless it is a regular file: a FIFO put there would block a read forever."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return f.read().decode("utf-8", errors="replace")


def _latest_name(directory: str) -> str | None:
    try:
        return read_text(os.path.join(directory, "latest")).strip()
    except OSError:
        return None


def require_directory(directory: str) -> None:
    """One line unless ``directory`` exists as a directory: what ``--resume`` names is
    the directory ``train --save`` wrote (or one of its ``step-N``)."""
    if os.path.isdir(directory):
        return
    if os.path.exists(directory):
        raise ValueError(f"--resume {directory}: a file, not a checkpoint directory (give the "
                         "directory train --save wrote)")
    raise ValueError(f"--resume {directory}: no such checkpoint directory")


def resolve(directory: str) -> str:
    """The checkpoint a directory means: its ``latest``, or the directory itself."""
    pointer = os.path.join(directory, "latest")
    name = _latest_name(directory)
    if name is not None:
        path = os.path.join(directory, name)
        if not os.path.isdir(path) and name.endswith(".tmp"):
            path = path.removesuffix(".tmp")  # a re-save renamed it (see _publish)
        if not name or os.sep in name or not os.path.isdir(path):
            raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint "
                                  "directory next to it")
        return path
    if os.path.lexists(pointer):
        raise CheckpointError(f"{pointer} is not readable (a regular file naming the "
                              "checkpoint is needed)")
    if os.path.exists(os.path.join(directory, "meta.json")):
        return directory
    raise CheckpointError(f"no checkpoint in {directory} (no 'latest' and no meta.json)")


def inspect(directory: str) -> dict:
    """Check a checkpoint before anything loads it; return its ``meta.json``.

    Cheap: it reads the metadata and each shard's size and zip directory (torch.save
    writes a zip, whose directory sits at the end: a truncated or foreign file fails
    here), not the tensors. Raises ``CheckpointError`` naming the file at fault.
    """
    path = resolve(directory)
    meta_path = os.path.join(path, "meta.json")
    try:
        meta = json.loads(read_text(meta_path))
        files, step, model = meta["files"], int(meta["step"]), meta["config"]["model"]
        if not files or not isinstance(files, dict) or not isinstance(model, str):
            raise ValueError("no shard files listed")
        held = {(int(info["pp_rank"]), int(info["tp_rank"])) for info in files.values()}
        grid = {(p, t) for p in range(int(meta.get("pp", 1))) for t in range(int(meta["tp"]))}
        if held != grid:
            raise ValueError(f"its shards cover (pp rank, tp rank) {sorted(held)}, not "
                             f"all of {sorted(grid)}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path} is not a minipar checkpoint's metadata "
                              f"({type(e).__name__}: {e})") from None
    for fname, info in files.items():
        shard = os.path.join(path, fname)
        if not isinstance(info.get(DIGEST, ""), str):
            raise CheckpointError(f"{meta_path} is not a minipar checkpoint's metadata "
                                  f"(the {DIGEST} of {fname} is not a string)")
        if os.sep in fname or not os.path.isfile(shard):
            raise CheckpointError(f"{shard} is missing (listed in {meta_path})")
        if not zipfile.is_zipfile(shard):
            raise CheckpointError(f"{shard} is damaged: truncated or not written by "
                                  "torch.save")
    meta["path"], meta["step"] = path, step
    return meta


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file."""


def load(directory: str) -> tuple[dict, int]:
    """Full state by name from a (possibly differently sharded) checkpoint.

    Returns ({"model": state_dict for GPT.load_state_dict, "optimizer": {name: {key:
    full tensor}}}, step).
    """
    meta = inspect(directory)
    path = meta["path"]
    shards: dict[str, dict[int, torch.Tensor]] = {}
    opt_shards: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for fname, info in meta["files"].items():
        blob = load_shard(os.path.join(path, fname), digest=info.get(DIGEST))
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
    # a tied weight: pp > 1 saves two copies, pp = 1 only one
    if saved_model_config(meta).tie_embeddings:
        model.setdefault("head.weight", model["tok_emb.weight"])
        if "tok_emb.weight" in optimizer:  # the last stage's copy steps like the first's
            optimizer.setdefault("head.weight", optimizer["tok_emb.weight"])
    return {"model": model, "optimizer": optimizer}, meta["step"]


def saved_model_config(meta: dict):
    """The ``GPTConfig`` of the run that wrote ``meta`` (its ``meta.json``): recorded
    as built (sizes flags, the data's vocabulary, ``--init-from``'s directory), or, in a
    checkpoint from before that record, the preset with its overrides."""
    try:
        if "model" in meta:
            return GPTConfig(**meta["model"])
        saved = meta["config"]
        return get_config(saved["model"]).with_(**saved.get("overrides", {}))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{meta.get('path', '')}/meta.json names a model this minipar "
                              f"does not know ({e})") from None


def verify(path: str, digest: str | None) -> None:
    """Raise ``CheckpointError`` unless the file's SHA-256 is ``digest`` (the one
    ``meta.json`` recorded when it was written; None: a checkpoint from before digests).
    Read in 8 MiB blocks: about 1.5 GB/s, once per shard a process reads."""
    if digest is None:
        return
    h = hashlib.new(DIGEST)
    with open(path, "rb") as f:
        while block := f.read(8 * 2**20):
            h.update(block)
            heartbeat()
    if h.hexdigest() != digest:
        raise CheckpointError(f"{path} is damaged: its {DIGEST} is not the one its "
                              "meta.json recorded at save (the file changed on disk)")


def load_shard(path: str, mmap: bool = False, digest: str | None = None) -> dict:
    """A rank's shard file (``{"weights", "states"}`` by name), its digest checked first;
    ``mmap``: a tensor is read when sliced."""
    verify(path, digest)
    try:
        blob = torch.load(path, weights_only=True, mmap=mmap)
        if not isinstance(blob, dict) or not {"weights", "states"} <= set(blob):
            raise ValueError("not a minipar shard")
        return blob
    except Exception as e:  # torch raises several kinds for a damaged zip or pickle
        raise CheckpointError(f"{path} is damaged or not a minipar shard "
                              f"({type(e).__name__})") from None


# --- checks before a run starts, and the lock of a --save directory ----------------------
LOCK = ".minipar.lock"
# what a --save directory holds of its own (no other output may take these names)
SAVE_NAMES = ("latest", LOCK, "step-", RUN_CARD, TOKENIZER)
SHAPE = ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff", "tie_embeddings",
         "n_expert")
# what shapes only the MoE blocks: which blocks they are and their experts' width (a dense
# model has neither, whatever its config records)
MOE_SHAPE = ("moe_every", "expert_d_ff")


def shape_changes(theirs, ours) -> list[str]:
    """The ``GPTConfig`` fields in which ``ours`` holds weights of other shapes than
    ``theirs`` (empty: a checkpoint of one fits the other)."""
    fields = SHAPE + (MOE_SHAPE if theirs.n_expert and ours.n_expert else ())
    return [k for k in fields if getattr(theirs, k) != getattr(ours, k)]


def check_resume(directory: str, cfg) -> None:
    """Raise ``CheckpointError`` (one line) unless ``cfg`` can resume from ``directory``."""
    meta = inspect(directory)
    saved = meta["config"]
    theirs = saved_model_config(meta)
    ours = cfg.model_config()
    changed = shape_changes(theirs, ours)
    if changed:
        raise CheckpointError(
            f"--resume {directory} holds model {saved['model']!r} ({_shape(theirs)}), not "
            f"this run's {cfg.model!r} ({_shape(ours)}): they differ in {', '.join(changed)}; "
            "pass the same --model, sizes and --moe-* flags")
    end = cfg.steps if cfg.stop_at is None else cfg.stop_at
    if meta["step"] >= end:
        raise CheckpointError(f"--resume {directory} is at step {meta['step']}, and this "
                              f"run ends at step {end}: nothing to train; raise --steps")


def resume_notes(directory: str, cfg) -> list[str]:
    """What resuming ``directory`` with ``cfg`` changes that it may not mean to, a line
    each: another optimizer, whose states (none of the saved ones) start fresh; other
    data (a fine-tune may mean it; a forgotten ``--data`` does not)."""
    config, notes = inspect(directory)["config"], []
    saved = config.get("optimizer", cfg.optimizer)
    if saved != cfg.optimizer:
        notes.append(f"--resume {directory} was trained with --optimizer {saved}: "
                     f"{cfg.optimizer}'s states start fresh (the weights and the step count "
                     "carry over)")
    data = config.get("data", cfg.data)
    if data != cfg.data and os.path.realpath(data) != os.path.realpath(cfg.data):
        notes.append(f"--resume {directory} was trained on --data {data}: this run reads "
                     f"--data {cfg.data} (pass --data {data} to go on with the same text)")
    return notes


def _shape(m) -> str:
    moe = (f", {m.n_expert} experts (moe_every {m.moe_every}, expert_d_ff {m.expert_d_ff})"
           if m.n_expert else "")
    return (f"{m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, "
            f"vocab {m.vocab_size}, seq_len {m.seq_len}{moe}")


def check_save(directory: str, resume: str | None) -> None:
    """Raise ``CheckpointError`` unless a run may save into ``directory``: not in use by
    another live run, and not holding another run's checkpoints (only a run resuming
    from ``directory`` itself continues there)."""
    if not os.path.isdir(directory):
        return  # created at launch (the path checks make sure it can be)
    owner = _lock_owner(directory)
    if owner is not None:
        raise _in_use(directory, owner)
    same = resume is not None and os.path.realpath(resume) == os.path.realpath(directory)
    theirs = sorted(n for n in os.listdir(directory)  # not a killed save's step-N.tmp,
                    if n == "latest" or _is_checkpoint(directory, n))  # nor a user's file
    if theirs and not same:
        raise CheckpointError(f"--save {directory} already holds another run's checkpoints "
                              f"({', '.join(theirs[:2])}); resume it with --resume "
                              f"{directory}, or save into an empty directory")


def _in_use(directory: str, pid: int) -> CheckpointError:
    return CheckpointError(f"--save {directory} is in use by another run (process {pid}); "
                           "wait for it, or save elsewhere")


def _lock_owner(directory: str) -> int | None:
    """The live process holding ``directory``'s lock, or None (no lock, or a stale one)."""
    try:
        pid = int(read_text(os.path.join(directory, LOCK)).strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0 or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # its run was killed without cleaning up
    except PermissionError:
        pass  # alive, another user's
    return pid


@contextmanager
def locked(directory: str):
    """Hold ``directory`` for this process while a run saves into it.

    The lock is a file created exclusively (``O_EXCL``: of two runs starting together
    exactly one wins) holding this process's id; a lock whose process is gone is stale
    and taken over.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            owner = _lock_owner(directory)
            if owner is not None:
                raise _in_use(directory, owner) from None
            with suppress(OSError):
                os.unlink(path)  # stale
    else:
        raise CheckpointError(f"--save {directory}: could not take its lock {path}")
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    try:
        _sweep_killed_saves(directory)
        yield
    finally:
        with suppress(OSError):
            os.unlink(path)


def _sweep_killed_saves(directory: str) -> None:
    """Remove the ``step-N.tmp`` of saves killed mid-way (no run holds the directory now:
    its lock is ours), unless ``latest`` names it (a re-save, finished by ``_prepare``);
    only directories holding nothing but shards and ``meta.json``: never a user's."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not (STEP_DIR.fullmatch(name.removesuffix(".tmp")) and name.endswith(".tmp")
                and os.path.isdir(path)) or name == _latest_name(directory):
            continue
        if all(SHARD.fullmatch(f) or f == "meta.json" for f in os.listdir(path)):
            shutil.rmtree(path, ignore_errors=True)


def _is_checkpoint(directory: str, name: str) -> bool:
    """Whether ``name`` is a checkpoint: ``step-N`` whose own ``meta.json`` says step N
    (a user's ``step-000002.keepme`` or a stray ``step-9`` is not)."""
    m = STEP_DIR.fullmatch(name)
    try:
        meta = json.loads(read_text(os.path.join(directory, name, "meta.json")))
        return m is not None and int(meta["step"]) == int(m.group(1))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prune(directory: str, keep: int) -> list[str]:
    """Delete all but the last ``keep`` checkpoints (``step-N``) in ``directory``; only
    what ``_is_checkpoint``, never the one ``latest`` names. Returns the paths deleted."""
    steps = sorted(d for d in os.listdir(directory) if _is_checkpoint(directory, d))
    try:
        current = os.path.basename(resolve(directory))
    except CheckpointError:
        current = None
    gone = []
    for d in steps[:max(0, len(steps) - keep)]:
        if d != current:
            shutil.rmtree(os.path.join(directory, d), ignore_errors=True)
            gone.append(os.path.join(directory, d))
    return gone
