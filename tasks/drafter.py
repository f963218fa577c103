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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prefect import task

from a2d.models.capture import resolve_layers
from a2d.models.drafter import DFlashDraftModel, DrafterConfig, pick_mask_token, spread_layers
from a2d.models.generate import eos_ids
from a2d.models.objectives.drafter import DrafterObjective, Sequence, frozen_parts, train_vocab
from a2d.specs import AnchorSpec, DrafterSpec, TrainOptions
from a2d.stores import checkpoints
from a2d.stores.anchors import AnchorMismatchError, AnchorReader
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.keys import KeyInputs
from a2d.stores.readers import read_responses
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.runtime import logger
from a2d.tasks.students import DRAFTER_PROVENANCE, DRAFTER_SHARD
from a2d.tasks.train import TrainJob
from a2d.tasks.train import train as train_in_process
from a2d.tasks.training import run_trainer, stage_job

# the teacher's top tokens kept per position for drafter.distill (the demo's: 95 % of the mass in 8)
SOFT_TOP_K = 16
STAGE = "drafter"
SHARD = DRAFTER_SHARD  # the layout the reader (tasks/students.py) reads
# 2: config.json carries rope_theta at the top level beside rope_parameters (4.x readers)
FORMAT_VERSION = 2
PROVENANCE = DRAFTER_PROVENANCE


def key_inputs(spec: DrafterSpec, teacher_key: str, responses_key: str, anchors_key: str) -> KeyInputs:
    """The drafter key: its spec and the teacher, responses and anchors it is trained from."""
    data = spec.model_dump(mode="json")
    if not spec.distill:
        data.pop("distill")  # the objective every drafter key before the option named
    return KeyInputs(
        STAGE,
        FORMAT_VERSION,
        data,
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
    if spec.distill:
        require_last_layer(num_layers - 1, stored)
    return layers


def require_last_layer(last: int, held: list[int]) -> None:
    """drafter.distill's soft targets come from the teacher's last layer: the anchors must hold it
    (checked on the config before any stage runs, and on the artifact the stage reads)."""
    if last not in held:
        raise ValueError(
            f"drafter.distill reads the teacher's last layer ({last}) from the anchors, which hold "
            f"{list(held)}; add {last} to anchors.layers or set drafter.distill: 0"
        )


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


def add_soft_targets(
    reader: AnchorReader, seqs: list[Sequence], model, frozen_head: torch.Tensor, k: int = SOFT_TOP_K
) -> None:
    """Each training sequence's soft targets: the teacher's own next-token distribution after every
    position (only the response's are ever a block target), recomputed from the anchors' last layer
    (final norm, then the draft head's rows), kept as its top `k` renormalised. Its argmax matched
    the stored greedy token at 99 % of the demo's response positions (int8 anchors)."""
    last = model.config.get_text_config().num_hidden_layers - 1
    require_last_layer(last, reader.layers)
    norm = model.get_decoder().norm
    head_t = frozen_head.float().T  # (H, V'), cast once for every sequence
    feats = reader.samples([s.sample_id for s in seqs], [last])
    with torch.no_grad():
        for s, f in zip(seqs, feats, strict=True):
            logits = norm(f[:, 0].float()) @ head_t  # (T, V')
            top = logits.topk(min(k, logits.shape[1]), -1)
            s.soft_rows = top.indices
            s.soft_p = top.values.softmax(-1)  # renormalised over the k: the rest is the tail's mass


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


def objective(store: ArtifactStore, job: TrainJob, device: torch.device, precision: str) -> DrafterObjective:
    """The drafter's objective from what it reads: the teacher's frozen embedding and head, its
    states at every position from the anchors (checked), the training and held-out responses."""
    spec, refs, dev = job.spec, job.inputs, str(device)
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
    if job.max_train_rows is not None and job.max_train_rows < len(train_rows):
        keep = set(
            np.random.default_rng(spec.seed).choice(len(train_rows), job.max_train_rows, replace=False)
        )
        train_rows = [r for i, r in enumerate(train_rows) if i in keep]
    store_dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    seqs = load_sequences(reader, train_rows, layers, store_dtype)
    held = load_sequences(reader, [r for r in rows if r["split"] == "eval"], layers, store_dtype)
    if not seqs:
        raise ValueError("no training responses with 2 or more tokens: raise responses.max_new_tokens")
    vocab = train_vocab(train_rows, eos_ids(model, tok)) if spec.vocab == "train" else None
    frozen = frozen_parts(model, vocab, dev)
    if spec.distill:
        add_soft_targets(reader, seqs, model, frozen.head.cpu())  # on the CPU, as the features
    mask_id = pick_mask_token(tok, frozen.embed.shape[0])
    del model
    drafter = DFlashDraftModel(build_config(spec, text, layers, mask_id))
    drafter.draft_vocab = vocab
    dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
    drafter.to(device=dev, dtype=dtype)
    frozen.embed, frozen.head = frozen.embed.to(dtype), frozen.head.to(dtype)
    logger().info(
        "drafter: %d train / %d held-out responses, teacher layers %s, %d draft layer(s), block %d, vocab %s",
        len(seqs),
        len(held),
        layers,
        spec.layers,
        spec.block_size,
        "full" if vocab is None else len(vocab),
    )
    return DrafterObjective(spec, drafter, frozen, seqs, held, layers, dev, precision)


def train_drafter(
    store: ArtifactStore,
    refs: dict[str, ArtifactRef],
    spec: DrafterSpec,
    train: TrainOptions,
    work: Path,
    device: str = "cpu",
    stop_after: int | None = None,
    max_train_rows: int | None = None,
) -> dict[str, Any]:
    """Train the drafter in this process (tests, benchmarks); checkpoints under `work/checkpoints`.

    `max_train_rows` trains on that many training responses drawn by the seed (every prompt set in
    its share): the benchmark's τ-against-data curve; the stage trains on all of them."""
    ref = store.ref(
        STAGE, key_inputs(spec, refs["teacher"].key, refs["responses"].key, refs["anchors"].key).key
    )
    job = TrainJob(
        store_uri=store.root.uri,
        ref=ref,
        inputs=refs,
        spec=spec,
        train=train,
        device=device,
        workdir=str(work),
        stop_after=stop_after,
        max_train_rows=max_train_rows,
    )
    return train_in_process(job)


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
    result, last = run_trainer(store, stage_job(store, ref, refs, spec, train, device))
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
