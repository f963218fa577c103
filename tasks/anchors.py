"""anchors stage: one teacher forward per sample; every selected layer's residual stream to Zarr."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from prefect import task
from tqdm import tqdm

from a2d.models.capture import capture_layers, resolve_layers, token_confidence
from a2d.models.generate import GeneratedStates
from a2d.models.quant import bf16_bits, from_bf16_bits, quantize_int8
from a2d.models.teacher import autocast as autocast_context
from a2d.models.teacher import decoder_layers, native_bf16, resolve_device
from a2d.specs import AnchorSpec, LoadSpec, RunOptions, TeacherSpec
from a2d.stores import anchors as anchor_store
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, Timer, hash_local_tree
from a2d.stores.keys import KeyInputs, sha256_tree
from a2d.stores.parquet import read_shard
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.concurrency import gpu_slot
from a2d.tasks.report import Progress

STAGE = "anchors"
# 2: each shard records the checksum of the responses shard it was captured from
# 3: teacher confidence and entropy at response positions only (prompt positions of `tokens: all`
#    hold NaN): the LM head over the prompt positions was a sixth of the capture's time for nothing
FORMAT_VERSION = 3


def capture_autocast(spec: AnchorSpec, device: str) -> str:
    """The capture forward's precision on `device` ("none" or "bf16"): `native` resolved here."""
    if spec.source == "generation":
        return "none"  # the generation's own forwards, and the forward of shards it did not capture
    if spec.autocast != "native":
        return spec.autocast
    return "bf16" if native_bf16(resolve_device(device)) else "none"


def key_inputs(
    spec: AnchorSpec, load: LoadSpec, responses_key: str, teacher_key: str, device: str = "auto"
) -> KeyInputs:
    """The anchors key: what is captured and stored, and how the teacher is loaded for the forward
    (`autocast: native` keys as the precision it resolves to on `device`: the bytes differ)."""
    data = spec.model_dump(mode="json")
    if spec.dtype != "int8":
        data.pop("outlier_channels")
    data["autocast"] = capture_autocast(spec, device)
    if data["autocast"] == "none":
        data.pop("autocast")  # the forward every anchors key before the option named
    if spec.source == "forward":
        data.pop("source")  # as every anchors key before the option
    data["load"] = load.model_dump(mode="json")  # NF4 and bf16 teachers give different anchors
    return KeyInputs(STAGE, FORMAT_VERSION, data, {"responses": responses_key, "teacher": teacher_key})


def teacher_layer_count(store: ArtifactStore, teacher: ArtifactRef) -> int:
    """Decoder layers of a materialised teacher, as recorded in its marker (no model load)."""
    return int(store.manifest(teacher)["shards"][teacher_stage.SHARD]["architecture"]["layers"])


def check_layers(spec: AnchorSpec, num_layers: int) -> list[int]:
    """The layers `spec` selects of a `num_layers`-layer teacher; a clear error when they do not fit,
    raised before any stage runs the teacher."""
    try:
        return resolve_layers(spec.layers, num_layers)
    except ValueError:
        raise ValueError(
            f"anchors.layers={list(spec.layers)} does not fit the teacher's {num_layers} decoder layers: "
            f"use indices 0..{num_layers - 1}, -1..-{num_layers} from the end, or 'all'"
        ) from None


@dataclass
class Captured:
    """One shard's anchors in memory, before encoding."""

    bits: np.ndarray  # uint16 (T, L, H) bf16 bits
    offsets: np.ndarray  # int64 (S + 1,)
    positions: np.ndarray  # int32 (T,)
    confidence: np.ndarray  # float32 (T,), NaN at prompt tokens and where no prediction exists (position 0)
    entropy: np.ndarray  # float32 (T,), NaN where confidence is


def selected_positions(prompt_len: int, response_len: int, tokens: str) -> np.ndarray:
    start = prompt_len if tokens == "response" else 0
    return np.arange(start, prompt_len + response_len, dtype=np.int64)


@torch.no_grad()
def capture_shard(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    layers: list[int],
    tokens: str,
    pad_id: int,
    batch_size: int,
    progress: Any = None,
    autocast: str = "none",
) -> Captured:
    """Teacher forward over prompt+response per sample; hooks copy each layer's selected tokens out."""
    device = next(model.parameters()).device
    sel = [selected_positions(len(p), len(r), tokens) for p, r in zip(prompts, responses, strict=True)]
    counts = np.array([len(s) for s in sel], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    total = int(offsets[-1])
    width = model.config.get_text_config().hidden_size
    bits = np.empty((total, len(layers), width), dtype=np.uint16)
    positions = np.concatenate(sel).astype(np.int32) if sel else np.zeros(0, np.int32)
    confidence = np.full(total, np.nan, dtype=np.float32)
    entropy = np.full(total, np.nan, dtype=np.float32)
    layer_pos = {layer: j for j, layer in enumerate(layers)}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model.base_model
    head = model.get_output_embeddings()
    # Batches of similar lengths (each is padded to its longest sequence: on the demo's shards 1.21x
    # the real tokens in row order, 1.12x sorted); every sample's rows land at its own offsets.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        seqs = [prompts[i] + responses[i] for i in idx]
        width_t = max(len(s) for s in seqs)
        # Right padding: causal attention and the causal linear-attention scan never let a pad
        # token influence an earlier real token, so captured states equal unpadded ones.
        ids = torch.full((len(idx), width_t), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width_t), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = 1
        b_idx = torch.cat([torch.full((len(sel[i]),), b, dtype=torch.long) for b, i in enumerate(idx)])
        t_idx = torch.cat([torch.from_numpy(sel[i]) for i in idx])
        p_len = torch.cat([torch.full((len(sel[i]),), len(prompts[i]), dtype=torch.long) for i in idx])
        dest = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx])  # their shard rows

        def on_layer(layer: int, hidden: torch.Tensor, b_idx=b_idx, t_idx=t_idx, dest=dest) -> None:
            # hidden (B, T, H) -> the selected tokens (n, H), as bf16 bits, straight into the shard buffer.
            bits[dest, layer_pos[layer]] = bf16_bits(hidden[b_idx.to(hidden.device), t_idx.to(hidden.device)])

        with capture_layers(model, layers, on_layer), autocast_context(device, autocast):
            out = base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        # Teacher confidence of each selected response token p comes from the logits at p-1; the LM
        # head runs on those rows only (prompt tokens are not the teacher's choices: NaN).
        has_pred = (t_idx >= p_len) & (t_idx > 0)
        last = out.last_hidden_state[b_idx[has_pred].to(device), (t_idx[has_pred] - 1).to(device)]  # (n, H)
        targets = ids[b_idx[has_pred], t_idx[has_pred]].to(device)
        conf, ent = token_confidence(head(last), targets)
        rows = dest[has_pred.numpy()]
        confidence[rows] = conf.float().cpu().numpy()
        entropy[rows] = ent.float().cpu().numpy()
        if progress is not None:
            progress(len(idx))
    return Captured(bits, offsets, positions, confidence, entropy)


def captured_in_generation(
    prompts: list[list[int]],
    responses: list[list[int]],
    batches: list[tuple[list[int], GeneratedStates]],
    tokens: str,
) -> Captured:
    """A shard's anchors from the states its generation kept (`generate_batch(capture=...)`):
    `batches` holds each batch's sample indices and states; the rows, offsets and NaNs are those
    `capture_shard` gives for the same samples."""
    sel = [selected_positions(len(p), len(r), tokens) for p, r in zip(prompts, responses, strict=True)]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sel])]).astype(np.int64)
    first = batches[0][1]
    bits = np.empty((int(offsets[-1]), len(first.layers), first.prefill.shape[-1]), dtype=np.uint16)
    confidence = np.full(int(offsets[-1]), np.nan, dtype=np.float32)
    entropy = np.full(int(offsets[-1]), np.nan, dtype=np.float32)
    for index, st in batches:
        for b, i in enumerate(index):
            p, r = len(prompts[i]), len(responses[i])
            states = torch.cat([st.prefill[:, b, st.width - p :], st.steps[:, b, :r]], dim=1)  # (L, p+r, H)
            rows = slice(int(offsets[i]), int(offsets[i + 1]))
            bits[rows] = bf16_bits(states.transpose(0, 1)[sel[i]])
            scored = sel[i] >= p  # response positions: the teacher chose them
            confidence[rows][scored] = st.confidence[b, sel[i][scored] - p].numpy()
            entropy[rows][scored] = st.entropy[b, sel[i][scored] - p].numpy()
    positions = np.concatenate(sel).astype(np.int32) if sel else np.zeros(0, np.int32)
    return Captured(bits, offsets, positions, confidence, entropy)


def teacher_attrs(store: ArtifactStore, teacher: ArtifactRef) -> dict[str, Any]:
    """Provenance a consumer checks: the teacher key and a hash of its tokenizer files."""
    marker = store.marker(teacher, teacher_stage.SHARD)
    tok_files = {
        k: v for k, v in marker["files"].items() if "token" in k.rsplit("/", 1)[-1] or k.endswith(".jinja")
    }
    return {"teacher_key": teacher.key, "tokenizer_sha256": sha256_tree(tok_files)}


@task(name="anchors-shard", task_run_name="anchors-{shard}", tags=["gpu"])
def anchors_shard(
    store_uri: str,
    ref: ArtifactRef,
    shard: str,
    spec: AnchorSpec,
    responses: ArtifactRef,
    teacher: ArtifactRef,
    teacher_spec: TeacherSpec,
    opts: RunOptions,
) -> dict:
    """Capture and write one shard `part-NNNNN.zarr` (whole, by this one worker) and its marker."""
    store = ArtifactStore(store_uri)
    timer = Timer()
    rows = read_shard(store.loc(responses), f"{shard}.parquet").to_pylist()
    precision = capture_autocast(spec, opts.device)
    with gpu_slot():  # held from model load to the end of the captures
        model, tok = teacher_stage.load(store, teacher, teacher_spec, teacher_spec.load, opts.device)
        layers = resolve_layers(spec.layers, len(decoder_layers(model)))
        tracker = Progress(len(rows), f"anchors {shard}", every=opts.batch_size)
        bar = tqdm(total=len(rows), desc=f"anchors {shard}", disable=not opts.progress, leave=False)

        def advance(n: int) -> None:
            bar.update(n)
            tracker.advance(n)

        cap = capture_shard(
            model,
            [r["prompt_ids"] for r in rows],
            [r["response_ids"] for r in rows],
            layers,
            spec.tokens,
            tok.pad_token_id,
            opts.batch_size,
            advance,
            precision,
        )
        bar.close()
    return write_anchor_shard(
        store,
        ref,
        shard,
        [r["sample_id"] for r in rows],
        cap,
        spec,
        layers,
        len(decoder_layers(model)),
        teacher,
        teacher_spec,
        responses.key,
        store.manifest(responses)["shards"][shard]["sha256"],
        precision=precision,
        captured_in="forward",
        forward_seconds=timer.seconds,
        timer=timer,
    )


def write_anchor_shard(
    store: ArtifactStore,
    ref: ArtifactRef,
    shard: str,
    sample_ids: list[str],
    cap: Captured,
    spec: AnchorSpec,
    layers: list[int],
    num_layers: int,
    teacher: ArtifactRef,
    teacher_spec: TeacherSpec,
    responses_key: str,
    responses_sha256: str,
    *,
    precision: str,
    captured_in: str,
    forward_seconds: float,
    timer: Timer,
) -> dict:
    """Encode `cap` as `spec` stores it, publish `part-NNNNN.zarr` and mark the shard finished.
    `precision`: the capture's; `captured_in`: "forward", or "generation" in the responses stage;
    `forward_seconds` of the capture forward; `timer`: the shard's, since it began."""
    hidden = cap.bits
    if spec.dtype == "int8":
        hidden = quantize_int8(from_bf16_bits(cap.bits), k=spec.outlier_channels)
    attrs = {
        **teacher_attrs(store, teacher),
        "responses_key": responses_key,
        "responses_sha256": responses_sha256,
        "layers": layers,
        "num_model_layers": num_layers,
        "hidden_size": int(cap.bits.shape[2]),
        "capture": spec.capture,
        "dtype": spec.dtype,
        "tokens": spec.tokens,
        "load": teacher_spec.load.model_dump(mode="json"),
        "autocast": precision,
    }
    name = f"{shard}.zarr"
    with store.shard_output(ref, name) as path:
        anchor_store.write_shard(
            path, hidden, cap.offsets, sample_ids, cap.positions, cap.confidence, cap.entropy, attrs
        )
        files = {f"{name}/{rel}": h for rel, h in hash_local_tree(path).items()}
    stats = {
        "rows": len(sample_ids),
        "tokens": int(cap.offsets[-1]),
        "raw_bf16_bytes": int(cap.bits.nbytes),
        "captured_in": captured_in,
        "forward_seconds": round(forward_seconds, 3),
        "seconds": round(timer.seconds, 3),
        "attrs": attrs,
    }
    return store.write_marker(ref, shard, files, stats)


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    tokens = sum(m["tokens"] for m in markers.values())
    stored = sum(m["bytes"] for m in markers.values())
    raw = sum(m["raw_bf16_bytes"] for m in markers.values())
    seconds = sum(m["seconds"] for m in markers.values())
    first = next(iter(markers.values()))
    return {
        "anchor_attrs": first["attrs"],
        "bytes_per_token": round(stored / max(tokens, 1), 1),
        "bytes_ratio_vs_bf16": round(stored / max(raw, 1), 4),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "shards_captured_in_generation": sum(m.get("captured_in") == "generation" for m in markers.values()),
    }
