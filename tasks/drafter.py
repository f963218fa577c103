"""drafter stage: a DFlash block-diffusion drafter trained from the anchors (no teacher forward in the loop).

Inputs: the teacher (its frozen input embedding and output head, and its shape), the responses
(the teacher's greedy answers: the targets) and the anchors, captured with `tokens: all` so that
every prompt and response position has the teacher's layer outputs. A training block is exactly a
decode step's: the block starting at position s is `[token s, MASK x (B-1)]` at positions s..s+B-1,
it sees the fused layer outputs of positions < s (the tokens a verify forward has committed) and
itself, and block offset k predicts token s+k. Many random starts per response share one forward
(`a2d.models.drafter.block_mask`). The loss is CE weighted exp(-(k-1)/γ) along the block.

The artifact's one shard `drafter/` is a DFlash checkpoint directory (config.json,
model.safetensors, and a2d's draft_vocab.safetensors) plus `drafter_spec.json` (provenance: the
teacher, anchors and layers it was trained from, checked again by every consumer).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from prefect import task
from tqdm import tqdm

from a2d.models.capture import resolve_layers
from a2d.models.drafter import (
    DFlashDraftModel,
    DrafterConfig,
    block_mask,
    pick_mask_token,
    position_weights,
    spread_layers,
)
from a2d.models.generate import eos_ids
from a2d.models.teacher import autocast, resolve_device, resolve_precision
from a2d.specs import AnchorSpec, DrafterSpec, TrainOptions
from a2d.stores import checkpoints
from a2d.stores.anchors import AnchorMismatchError, AnchorReader
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.keys import KeyInputs
from a2d.stores.readers import read_responses
from a2d.stores.uri import Location
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.interrupt import StopFlag, on_sigterm
from a2d.tasks.report import Progress
from a2d.tasks.runtime import logger
from a2d.tasks.tracking import Tracker
from a2d.tasks.training import lr_lambda, run_trainer

STAGE = "drafter"
SHARD = "drafter"
# 2: config.json carries rope_theta at the top level beside rope_parameters (4.x readers)
FORMAT_VERSION = 2
PROVENANCE = "drafter_spec.json"
CURVE_POINTS = (0.25, 0.5, 1.0)  # shares of the steps at which held-out τ is measured


def key_inputs(spec: DrafterSpec, teacher_key: str, responses_key: str, anchors_key: str) -> KeyInputs:
    """The drafter key: its spec and the teacher, responses and anchors it is trained from."""
    return KeyInputs(
        STAGE,
        FORMAT_VERSION,
        spec.model_dump(mode="json"),
        {"teacher": teacher_key, "responses": responses_key, "anchors": anchors_key},
    )


def target_layers(spec: DrafterSpec, num_layers: int) -> list[int]:
    """The teacher layers the drafter reads; a clear error when they do not fit the teacher."""
    layers = (
        list(spec.target_layers) if spec.target_layers else spread_layers(num_layers, spec.feature_layers)
    )
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad or not layers:
        raise ValueError(
            f"drafter.target_layers={layers} does not fit the teacher's {num_layers} decoder layers: "
            f"use indices 0..{num_layers - 1}, or unset it to spread drafter.feature_layers over the depth"
        )
    return sorted(set(layers))


def check_config(spec: DrafterSpec, anchors: AnchorSpec, num_layers: int) -> list[int]:
    """Before any stage runs: the drafter's layers fit the teacher, and the anchors will hold them at
    every position (the drafter's context is prompt and response)."""
    layers = target_layers(spec, num_layers)
    if anchors.tokens != "all":
        raise ValueError(
            f"the drafter stage reads the teacher's states at prompt and response positions, but "
            f"anchors.tokens={anchors.tokens!r} stores response tokens only; set anchors.tokens: all"
        )
    stored = resolve_layers(anchors.layers, num_layers)
    missing = [i for i in layers if i not in stored]
    if missing:
        raise ValueError(
            f"drafter.target_layers {layers} are not all in anchors.layers (missing {missing}); "
            "add them to anchors.layers or change drafter.target_layers"
        )
    return layers


def check_anchors(reader: AnchorReader, teacher: ArtifactRef, layers: list[int]) -> None:
    """The anchors must be this teacher's residual stream at every position and hold `layers`."""
    reader.check(teacher_key=teacher.key, capture="residual")
    if reader.meta.get("tokens") != "all":
        raise AnchorMismatchError(
            f"the drafter reads the teacher's states of prompt and response tokens, but the anchors at "
            f"{reader.loc.uri} hold tokens={reader.meta.get('tokens')!r}; set anchors.tokens: all"
        )
    missing = [i for i in layers if i not in reader.layers]
    if missing:
        raise AnchorMismatchError(
            f"the drafter reads teacher layers {layers}, but the anchors at {reader.loc.uri} hold "
            f"{reader.layers} (missing {missing}); widen anchors.layers or change drafter.target_layers"
        )


@dataclass
class Sequence:
    """One response as the drafter trains on it: tokens, where the response starts, the fused
    input features (T, K*H) of every position."""

    sample_id: str
    tokens: torch.Tensor  # (T,) long
    prompt_len: int
    features: torch.Tensor  # (T, K*H), stored dtype

    @property
    def starts(self) -> np.ndarray:
        """Block starts s with at least one target: s in [prompt_len, T - 2]."""
        return np.arange(self.prompt_len, len(self.tokens) - 1)


def load_sequences(
    reader: AnchorReader, rows: list[dict], layers: list[int], dtype: torch.dtype
) -> list[Sequence]:
    out = []
    for r, feats in zip(rows, reader.samples([r["sample_id"] for r in rows], layers), strict=True):
        tokens = list(r["prompt_ids"]) + list(r["response_ids"])  # feats: (T, K, H)
        if feats.shape[0] != len(tokens):
            raise AnchorMismatchError(
                f"anchors of {r['sample_id']} hold {feats.shape[0]} positions, its prompt+response has "
                f"{len(tokens)}: the anchors were captured from other rows; rebuild them"
            )
        if len(r["response_ids"]) < 2:
            continue  # no block start with a target
        out.append(
            Sequence(r["sample_id"], torch.tensor(tokens), len(r["prompt_ids"]), feats.flatten(1).to(dtype))
        )
    return out


@dataclass
class Frozen:
    """What the drafter borrows from the teacher: embedding, output head (restricted to the draft
    vocabulary when it has one), and the map from token id to head row."""

    embed: torch.Tensor  # (V, H)
    head: torch.Tensor  # (V', H)
    vocab: torch.Tensor | None  # (V',) token ids, or None for the whole vocabulary
    row_of: torch.Tensor | None  # (V,) head row of each token id, -1 outside the vocabulary


def frozen_parts(model, vocab: torch.Tensor | None, device: str) -> Frozen:
    embed = model.get_input_embeddings().weight.detach().to(device)
    head = model.get_output_embeddings().weight.detach().to(device)
    row_of = None
    if vocab is not None:
        head = head[vocab.to(device)]
        row_of = torch.full((embed.shape[0],), -1, dtype=torch.long, device=device)
        row_of[vocab.to(device)] = torch.arange(len(vocab), device=device)
    return Frozen(embed, head, vocab, row_of)


def train_vocab(rows: list[dict], eos: list[int]) -> torch.Tensor:
    ids = {t for r in rows for t in list(r["prompt_ids"]) + list(r["response_ids"])} | set(eos)
    return torch.tensor(sorted(ids), dtype=torch.long)


def make_batch(seqs: list[Sequence], spec: DrafterSpec, rng: np.random.Generator, mask_id: int, device: str):
    """Features (b, W, K*H), context lengths, starts (b, M), block ids (b, M, B) and targets (b, M, B-1)."""
    b, m, block = len(seqs), spec.blocks_per_sample, spec.block_size
    width = max(len(s.tokens) for s in seqs)
    feats = torch.zeros((b, width, seqs[0].features.shape[1]), dtype=seqs[0].features.dtype)
    ctx_len = torch.tensor([len(s.tokens) for s in seqs])
    starts = torch.zeros((b, m), dtype=torch.long)
    ids = torch.full((b, m, block), mask_id, dtype=torch.long)
    targets = torch.full((b, m, block - 1), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        feats[i, : len(s.tokens)] = s.features
        cands = s.starts
        chosen = np.sort(rng.choice(cands, m, replace=len(cands) < m))
        starts[i] = torch.from_numpy(chosen)
        for j, st in enumerate(chosen.tolist()):
            ids[i, j, 0] = s.tokens[st]
            tail = s.tokens[st + 1 : st + block]
            targets[i, j, : len(tail)] = tail
    return feats.to(device), ctx_len.to(device), starts.to(device), ids.to(device), targets.to(device)


def block_states(drafter: DFlashDraftModel, frozen: Frozen, feats, ctx_len, starts, ids) -> torch.Tensor:
    """The drafter's states of every block offset >= 1: (b, M, B-1, H)."""
    b, m, block = ids.shape
    width = feats.shape[1]
    positions = torch.arange(width, device=feats.device)[None].expand(b, -1)
    kv = drafter.context_kv(drafter.fuse(feats), positions)
    block_pos = (starts[..., None] + torch.arange(block, device=feats.device)).reshape(b, -1)
    mask = block_mask(starts, ctx_len, width, block)
    states = drafter(frozen.embed[ids.reshape(b, -1)], block_pos, kv, mask)
    return states.reshape(b, m, block, -1)[:, :, 1:]


def head_targets(frozen: Frozen, targets: torch.Tensor) -> torch.Tensor:
    if frozen.row_of is None:
        return targets
    rows = frozen.row_of[targets.clamp_min(0)]
    return torch.where(targets < 0, targets, rows)


def drafter_loss(drafter, frozen: Frozen, batch, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE, per-offset top-1 accuracy (B-1,)) of one batch."""
    feats, ctx_len, starts, ids, targets = batch
    states = block_states(drafter, frozen, feats, ctx_len, starts, ids)  # (b, M, B-1, H)
    logits = (states @ frozen.head.T.to(states.dtype)).float()  # (b, M, B-1, V')
    tgt = head_targets(frozen, targets)
    ce = F.cross_entropy(logits.flatten(0, 2), tgt.flatten(), ignore_index=-100, reduction="none").view(
        tgt.shape
    )
    valid = (tgt >= 0).float()
    w = weights.to(ce.device)[None, None] * valid
    loss = (ce * w).sum() / w.sum().clamp_min(1e-8)
    with torch.no_grad():
        hit = (logits.argmax(-1) == tgt).float() * valid
        acc = hit.sum((0, 1)) / valid.sum((0, 1)).clamp_min(1)
    return loss, acc


def decode_chain(accepted_at: dict[int, int], first: int) -> list[int]:
    """The accepted-draft counts of the blocks a greedy decode meets: the first block starts at
    `first`; after n accepted drafts the verify's own token lands too, so the next starts n + 1 on."""
    out, start = [], first
    while start in accepted_at:
        out.append(accepted_at[start])
        start += accepted_at[start] + 1
    return out


@torch.no_grad()
def teacher_forced(
    drafter, frozen: Frozen, seqs: list[Sequence], block: int, mask_id: int, device: str
) -> dict:
    """Held-out acceptance with the teacher's own continuation: from every block start, how many
    leading drafts equal the teacher's tokens. τ = 1 + mean accepted (the verify's own token included).

    `tau_decode_chain` is τ over the block starts a greedy decode meets: the first block starts at
    the first response token, each next one where the last stopped (after n accepted drafts, at
    start + n + 1). A decode's blocks start right after its rejections, where drafting is harder than
    at a random position, so this is what a lossless decode's τ comes to, and it sits below `tau`."""
    accepted: list[int] = []
    chain: list[int] = []
    by_offset = np.zeros(block - 1)
    reach = np.zeros(block - 1)
    for s in seqs:
        starts = s.starts
        at: dict[int, int] = {}  # block start -> drafts accepted there
        for lo in range(0, len(starts), 64):
            chunk = torch.from_numpy(starts[lo : lo + 64])[None].to(device)
            ids = torch.full((1, chunk.shape[1], block), mask_id, dtype=torch.long, device=device)
            ids[0, :, 0] = s.tokens.to(device)[chunk[0]]
            states = block_states(
                drafter,
                frozen,
                s.features[None].to(device),
                torch.tensor([len(s.tokens)], device=device),
                chunk,
                ids,
            )[0]
            best = (states @ frozen.head.T.to(states.dtype)).argmax(-1)  # (M, B-1)
            drafts = best if frozen.vocab is None else frozen.vocab.to(device)[best]
            for j, st in enumerate(chunk[0].tolist()):
                truth = s.tokens[st + 1 : st + block].tolist()
                n = 0
                while n < len(truth) and drafts[j, n].item() == truth[n]:
                    n += 1
                accepted.append(n)
                at[st] = n
                reach[: len(truth)] += 1
                by_offset[:n] += 1
        chain += decode_chain(at, s.prompt_len)
    mean = float(np.mean(accepted)) if accepted else 0.0
    return {
        "starts": len(accepted),
        "tau": round(1.0 + mean, 4),
        "tau_decode_chain": round(1.0 + float(np.mean(chain)), 4) if chain else None,
        "chain_starts": len(chain),
        "accept_by_offset": [
            round(float(a / r), 4) if r else None for a, r in zip(by_offset, reach, strict=True)
        ],
    }


def build_config(spec: DrafterSpec, text_config, layers: list[int], mask_id: int) -> DrafterConfig:
    heads = text_config.num_attention_heads
    rope = getattr(text_config, "rope_parameters", None) or {}
    return DrafterConfig(
        hidden_size=text_config.hidden_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
        intermediate_size=spec.intermediate_size or text_config.intermediate_size,
        vocab_size=text_config.vocab_size,
        block_size=spec.block_size,
        target_layer_ids=tuple(layers),
        num_target_layers=text_config.num_hidden_layers,
        mask_token_id=mask_id,
        rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", getattr(text_config, "rope_theta", 1_000_000.0))),
        max_position_embeddings=getattr(text_config, "max_position_embeddings", 32768),
    )


def train_drafter(
    store: ArtifactStore,
    refs: dict[str, ArtifactRef],
    spec: DrafterSpec,
    train: TrainOptions,
    work: Path,
    device: str = "cpu",
    stop_after: int | None = None,
    remote: Location | None = None,
    max_train_rows: int | None = None,
) -> dict[str, Any]:
    """Train the drafter; checkpoints (weights, optimizer, scheduler, RNG, step) under `work/checkpoints`.

    `max_train_rows` trains on that many training responses drawn by the seed (every prompt set in
    its share): the benchmark's τ-against-data curve; the stage trains on all of them."""
    log = logger()
    torch.manual_seed(spec.seed)
    teacher_dir = teacher_stage.local_dir(store, refs["teacher"])
    remote_code = teacher_stage.trusts_remote_code(store, refs["teacher"])
    with store.reading(refs["teacher"]):
        model, tok = teacher_stage.tm.load_teacher(  # only its embedding, head and shape: no packed kernels
            teacher_dir, device="cpu", trust_remote_code=remote_code, packed=False
        )
    text = model.config.get_text_config()
    layers = target_layers(spec, text.num_hidden_layers)
    reader = AnchorReader(store, refs["anchors"])
    check_anchors(reader, refs["teacher"], layers)
    reader.check_responses(store, refs["responses"])
    rows = sorted(read_responses(store, refs["responses"]).to_pylist(), key=lambda r: r["sample_id"])
    train_rows = [r for r in rows if r["split"] == "train"]
    if max_train_rows is not None and max_train_rows < len(train_rows):
        keep = set(np.random.default_rng(spec.seed).choice(len(train_rows), max_train_rows, replace=False))
        train_rows = [r for i, r in enumerate(train_rows) if i in keep]
    store_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    seqs = load_sequences(reader, train_rows, layers, store_dtype)
    held = load_sequences(reader, [r for r in rows if r["split"] == "eval"], layers, store_dtype)
    if not seqs:
        raise ValueError("no training responses with 2 or more tokens: raise responses.max_new_tokens")
    eos = eos_ids(model, tok)
    vocab = train_vocab(train_rows, eos) if spec.vocab == "train" else None
    frozen = frozen_parts(model, vocab, device)
    mask_id = pick_mask_token(tok, frozen.embed.shape[0])
    del model
    drafter = DFlashDraftModel(build_config(spec, text, layers, mask_id))
    drafter.draft_vocab = vocab
    dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
    drafter.to(device=device, dtype=dtype)
    frozen.embed, frozen.head = frozen.embed.to(dtype), frozen.head.to(dtype)
    params = [p for p in drafter.parameters()]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))
    root = work / "checkpoints"
    step, curve = 0, []
    last = checkpoints.latest(root)
    if last is not None:
        from safetensors.torch import load_file

        state, _ = checkpoints.load(last, optimizer, scheduler)
        drafter.load_state_dict(load_file(last / "adapter" / "model.safetensors"))
        step, curve = state["step"], state.get("curve", [])
        log.info("drafter: resumed from %s", last.name)
    weights = position_weights(spec.block_size, spec.gamma)
    marks = sorted({max(1, round(f * spec.steps)) for f in CURVE_POINTS})
    log.info(
        "drafter: %d train / %d held-out responses, teacher layers %s, %d draft layer(s), block %d, vocab %s",
        len(seqs),
        len(held),
        layers,
        spec.layers,
        spec.block_size,
        "full" if vocab is None else len(vocab),
    )
    history: list[dict[str, Any]] = []
    progress = Progress(spec.steps, "drafter")
    bar = tqdm(total=spec.steps, initial=step, desc="drafter", leave=False)
    stop = StopFlag()
    precision = resolve_precision(train.mixed_precision, torch.device(device))
    tracker = Tracker(
        train.wandb_project,
        "drafter",
        work.name,
        {"drafter": spec.model_dump(mode="json"), "train": train.model_dump(mode="json"), "layers": layers},
        work,
    )
    tracker.publish_link()
    started = time.perf_counter()
    with on_sigterm(stop), tracker:
        drafter.train()
        while step < spec.steps:
            rng = np.random.default_rng(np.random.SeedSequence([spec.seed, step]))
            picked = [
                seqs[i] for i in rng.choice(len(seqs), min(spec.micro_batch_size, len(seqs)), replace=False)
            ]
            batch = make_batch(picked, spec, rng, mask_id, device)
            with autocast(torch.device(device), precision):
                loss, acc = drafter_loss(drafter, frozen, batch, weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            history.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 6),
                    "acc_1": round(acc[0].item(), 4),
                    "acc_last": round(acc[-1].item(), 4),
                    "grad_norm": round(float(grad_norm), 4),
                    "lr": scheduler.get_last_lr()[0],
                }
            )
            tracker.log(history[-1], step)
            bar.update(1)
            progress.advance(1)
            if step % train.log_every == 0:
                log.info(
                    "drafter step %d/%d loss %.4f acc@1 %.3f", step, spec.steps, loss.item(), acc[0].item()
                )
            if step in marks and held:
                drafter.eval()
                point = {
                    "step": step,
                    **teacher_forced(drafter, frozen, held, spec.block_size, mask_id, device),
                }
                drafter.train()
                curve.append(point)
                log.info("drafter step %d: held-out teacher-forced tau %.3f", step, point["tau"])
            if step % train.checkpoint_every == 0 or step in (spec.steps, stop_after) or stop.set:
                checkpoints.publish(
                    root,
                    step,
                    train.keep_checkpoints,
                    drafter,
                    {},
                    optimizer,
                    scheduler,
                    step * spec.micro_batch_size,
                    {"curve": curve},
                    remote=remote,
                )
            if step == stop_after or stop.set:
                break
    bar.close()
    return {
        "step": step,
        "history": history,
        "curve": curve,
        "stopped": stop.set,
        "layers": layers,
        "train_seconds": round(time.perf_counter() - started, 3),
        "rows": len(seqs),
        "tokens": int(sum(len(s.tokens) - s.prompt_len for s in seqs)),
    }


@task(name="drafter-train", task_run_name="drafter-{ref.key}", tags=["gpu"])
def drafter_train(
    store_uri: str,
    ref: ArtifactRef,
    spec: DrafterSpec,
    train: TrainOptions,
    refs: dict[str, ArtifactRef],
    device: str,
) -> dict:
    store = ArtifactStore(store_uri)
    dev = str(resolve_device(device))
    result, last = run_trainer(
        store,
        ref,
        spec.steps,
        lambda work, remote: train_drafter(store, refs, spec, train, work, dev, remote=remote),
    )
    provenance = {
        "teacher_key": refs["teacher"].key,
        "anchors_key": refs["anchors"].key,
        "responses_key": refs["responses"].key,
        "target_layer_ids": result["layers"],
        "capture": "residual",
        "spec": spec.model_dump(mode="json"),
    }
    with store.shard_output(ref, SHARD) as out:
        shutil.copytree(last / "adapter", out)
        (out / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True))
        files = {f"{SHARD}/{k}": v for k, v in hash_local_tree(out).items()}
    hist, curve = result["history"], json.loads((last / checkpoints.STATE).read_text()).get("curve", [])
    stats = {
        "rows": result["rows"],
        "tokens": result["tokens"],
        "first_loss": hist[0]["loss"] if hist else None,
        "final_loss": hist[-1]["loss"] if hist else None,
        "train_seconds": result["train_seconds"],
        "curve": curve,
        "history": hist[-50:],
    }
    return store.write_marker(ref, SHARD, files, stats)


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    m = markers[SHARD]
    curve = m.get("curve") or []
    return {
        "final_loss": m["final_loss"],
        "train_seconds": m["train_seconds"],
        "heldout_tau_teacher_forced": curve[-1]["tau"] if curve else None,
        "heldout_tau_decode_chain": curve[-1].get("tau_decode_chain") if curve else None,
        "tau_curve": [{"step": p["step"], "tau": p["tau"]} for p in curve],
    }
