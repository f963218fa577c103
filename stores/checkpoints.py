"""Training checkpoints without pickle: tensors in safetensors, everything else in JSON.

A checkpoint folder `checkpoints/step-NNNNNNNN/` holds:

    adapter/                  PEFT adapter (adapter_config.json + adapter_model.safetensors)
    extras.safetensors        mask embedding and other trained non-LoRA tensors
    optimizer.safetensors     every optimizer state tensor, keyed "<param index>.<name>"
    rng.safetensors           torch CPU (and CUDA) RNG states
    state.json                step, data cursor, optimizer param groups, scheduler state, file hashes

state.json is written last (and flushed to disk); a checkpoint without it, with one that does not
parse, or whose files do not match its hashes, is passed over on resume for the one before it.

Training always writes to local disk. When the artifact store is remote (s3://…), each published
checkpoint is also mirrored to `<artifact>/checkpoints/` in the store (state.json uploaded last),
so a retry on another machine or pod resumes from it: `restore` brings the newest one back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.uri import Location

STATE = "state.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def step_of(ckpt: Path) -> int:
    """The step a checkpoint folder `step-NNNNNNNN` holds."""
    return int(ckpt.name.split("-", 1)[1])


def read_state(ckpt: Path) -> dict[str, Any] | None:
    """A checkpoint's state.json, or None when it is missing, truncated, or not a state object."""
    try:
        state = json.loads((ckpt / STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    ok = (
        isinstance(state, dict)
        and isinstance(state.get("files"), dict)
        and isinstance(state.get("step"), int)
    )
    return state if ok else None


def _write_durable(path: Path, text: str) -> None:
    """Write `path` through a temporary file, fsynced, renamed into place, its folder fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _restore_optimizer(
    opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for key, value in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def rng_state() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    return out


def restore_rng(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["torch_cpu"])
    cuda = [states[k] for k in sorted(states) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def save(
    out: Path,
    model: Any,
    extras: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int,
    cursor: int,
    info: dict[str, Any],
) -> None:
    """Write a complete checkpoint into `out` (a fresh local folder); state.json last."""
    out.mkdir(parents=True, exist_ok=True)
    # A PEFT model saves only its adapters: embedding rows added for the mask token are rebuilt
    # identically from the base (see models.student.mask_token_id), so the full embedding matrix
    # (PEFT's default after a resize) would only multiply the checkpoint size.
    extra = {"save_embedding_layers": False} if hasattr(model, "peft_config") else {}
    model.save_pretrained(out / "adapter", safe_serialization=True, **extra)
    save_file({k: v.detach().cpu().contiguous() for k, v in extras.items()}, out / "extras.safetensors")
    tensors, meta = _optimizer_tensors(optimizer)
    save_file(tensors, out / "optimizer.safetensors")
    save_file(rng_state(), out / "rng.safetensors")
    files = hash_local_tree(out)
    state = {
        "step": step,
        "cursor": cursor,
        "optimizer": meta,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "files": files,
        **info,
    }
    _write_durable(out / STATE, json.dumps(state, indent=2, sort_keys=True, default=str))


def publish(
    root: Path,
    step: int,
    keep: int,
    model: Any,
    extras: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    cursor: int,
    info: dict[str, Any],
    remote: Location | None = None,
) -> Path:
    """Save `step-N` under `root` via a `.tmp` folder renamed into place, then keep the newest `keep`;
    with `remote`, mirror it there too and keep the newest `keep` there."""
    final = step_dir(root, step)
    tmp = final.with_suffix(".tmp")
    clean_scratch(root)  # a save or download cut short by a kill left these; one trainer per folder
    save(tmp, model, extras, optimizer, scheduler, step, cursor, info)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(root)
    prune(root, keep)
    if remote is not None:
        mirror(final, remote)
        prune_remote(remote, keep)
    return final


def clean_scratch(root: Path) -> None:
    """Remove `step-N.tmp` (a save) and `step-N.download` (a restore) folders a killed process left."""
    if root.is_dir():
        for p in root.iterdir():
            if p.suffix in (".tmp", ".download") and _STEP_DIR.match(p.stem):
                shutil.rmtree(p, ignore_errors=True)


def _verified(ckpt: Path) -> bool:
    state = read_state(ckpt)
    return (
        state is not None and {k: v for k, v in hash_local_tree(ckpt).items() if k != STATE} == state["files"]
    )


def latest(root: Path) -> Path | None:
    """The newest checkpoint under `root` whose state.json parses and whose files verify.

    A damaged newest checkpoint (a truncated state.json after a crash, a corrupted tensor file) is
    passed over for the one before it, so it never blocks a resume.
    """
    if not root.is_dir():
        return None
    for d in sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name)), reverse=True):
        if _verified(d):
            return d
    return None


def load(
    ckpt: Path, optimizer: torch.optim.Optimizer, scheduler: Any
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore optimizer, scheduler and RNG from `ckpt`; returns (state.json, extras tensors)."""
    state = json.loads((ckpt / STATE).read_text())
    _restore_optimizer(optimizer, load_file(ckpt / "optimizer.safetensors"), state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    restore_rng(load_file(ckpt / "rng.safetensors"))
    return state, load_file(ckpt / "extras.safetensors")


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints whose state.json parses; delete older ones and damaged ones
    older than those (a damaged checkpoint neither counts as kept nor stays behind)."""
    steps = sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name))
    kept = [p for p in steps if read_state(p) is not None][-keep:]
    for old in steps:
        if kept and old not in kept and old < kept[-1]:
            shutil.rmtree(old, ignore_errors=True)


def remote_root(store: ArtifactStore, ref: ArtifactRef) -> Location | None:
    """Where a training artifact's checkpoints are mirrored: `<artifact>/checkpoints` in a remote
    store; None on local disk, where training already writes into that folder."""
    loc = store.loc(ref)
    return None if loc.is_local else loc.join("checkpoints")


def _remote_steps(remote: Location) -> list[str]:
    """Names of the remote checkpoints whose state.json was uploaded (complete uploads), oldest first."""
    return [n for n in remote.listdir() if _STEP_DIR.match(n) and remote.exists(f"{n}/{STATE}")]


def newest_step(store: ArtifactStore, ref: ArtifactRef, work: Path) -> int:
    """The step a training stage would resume from: its newest checkpoint in `work/checkpoints` or
    mirrored into the store (0: none, it starts over)."""
    local = latest(work / "checkpoints")
    steps = [step_of(local)] if local is not None else []
    remote = remote_root(store, ref)
    if remote is not None and remote.exists():
        steps += [_step(n) for n in _remote_steps(remote)]
    return max(steps, default=0)


def mirror(ckpt: Path, remote: Location) -> None:
    """Upload a local checkpoint folder to `remote/<step-N>/`, state.json last.

    A crash mid-upload leaves a folder without state.json, which `restore` ignores; a step uploaded
    again (a resumed run re-saving it) is replaced file by file before its state.json is rewritten.
    """
    target = remote.join(ckpt.name)
    target.remove_file(STATE)
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != STATE):
        rel = path.relative_to(ckpt).as_posix()
        target.put_file(path, rel)
    target.write_bytes(STATE, (ckpt / STATE).read_bytes())


def prune_remote(remote: Location, keep: int) -> None:
    for old in _remote_steps(remote)[:-keep]:
        remote.remove(old)


def _step(name: str) -> int:
    return int(name.split("-", 1)[1])


def restore(remote: Location, root: Path) -> Path | None:
    """Make the newest checkpoint known to either side available locally under `root`.

    Remote checkpoints newer than the local latest are downloaded (newest first) and kept only
    when every file matches the hashes in their state.json; returns the checkpoint to resume from.
    """
    local = latest(root)
    have = _step(local.name) if local is not None else -1
    for name in reversed(_remote_steps(remote)):
        if _step(name) <= have:
            break
        src = remote.join(name)
        tmp = root / f"{name}.download"
        shutil.rmtree(tmp, ignore_errors=True)
        for rel in src.files():
            src.get_file(rel, tmp / rel)
        # state.json is gone if another writer pruned this step while we listed it
        if not _verified(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            continue  # a corrupted remote checkpoint: fall back to an older one
        final = step_dir(root, _step(name))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final
    return local
