"""The data plan: bytes each stage will store for a config, computed before any stage runs.

Pure arithmetic over the specs, the teacher's shape (`a2d.models.shapes`) and the sample lengths
(`Lengths`): no weights, no data written. Layouts follow the writers (`stores/anchors.py`, the
Parquet schemas of the stages); what zstd leaves of each kind of array is a measured constant below,
so a projection is an estimate (within ~10 % on the tiny pipeline, `tests/test_anchors.py`), while
`raw_bytes` is the exact uncompressed layout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from a2d.models.capture import resolve_layers
from a2d.models.drafter import spread_layers
from a2d.models.shapes import TeacherShape, drafter_params, noise_adapter_params
from a2d.specs import PipelineConfig

# What zstd (level 1 in Zarr, 3 in Parquet) leaves, as a share of the raw bytes. Measured:
# bf16 residuals 0.67 (tiny random qwen3_5, layers 0/31/63) to 0.79 (SmolLM2, all 30 layers,
# benchmarks/anchors.py); int8 codes 0.80 (tiny) and 0.81 (SmolLM2); bf16 outliers and fp16 scales
# 0.69-0.74 (tiny); per-token columns (positions, confidence, entropy) 0.14-0.81.
ZSTD = {"bf16": 0.72, "int8": 0.80, "side": 0.72, "token_columns": 0.45}
ZARR_ARRAY_META = 620  # zarr.json of one array (bytes)
ZARR_GROUP_META = 580
PARQUET_FILE = 400  # magic, footer length and schema of one Parquet shard
PARQUET_COLUMN = 300  # one column of one shard: chunk metadata with min/max statistics, page header
ROW_STRINGS = 28  # sample_id, split, finish reason, answer kind of one row after zstd
TEXT_PER_CHAR = 0.9  # UTF-8 text after zstd in small shards (English over 10k+ rows: ~0.35)
BYTE_TOKENIZER_CHARS = 1.3  # chars per token of the random teacher's byte tokenizer (special tokens are long)
BPE_CHARS = 4.0  # chars per token of a BPE tokenizer on English
EVAL_BYTES = 256_000  # metrics JSON, plots and the report: small whatever the scale
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "bf16": 2, "int8": 1}


@dataclass(frozen=True)
class Lengths:
    """How many rows and how long they are: measured from the data when it is at hand, else bounds."""

    rows: int  # prompt rows, every split
    prompt_tokens: float  # mean per row (templated)
    response_tokens: float  # mean per row
    chars_per_token: float
    reference_chars: float  # mean chars of a row's reference response and answer (0 when none)
    origin: str  # "measured ..." or "bounds ..." — shown by the plan


@dataclass(frozen=True)
class StagePlan:
    """One stage's projection: rows and tokens it records and the bytes its shard files take."""

    stage: str
    rows: int
    tokens: int
    bytes: int  # expected on disk, after zstd
    raw_bytes: int  # the uncompressed layout
    note: str


@dataclass(frozen=True)
class Plan:
    """Every stage a config runs, with the assumptions the figures rest on."""

    name: str
    stages: list[StagePlan]
    lengths: Lengths
    shape_origin: str

    @property
    def total(self) -> int:
        return sum(s.bytes for s in self.stages)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "stages": [asdict(s) for s in self.stages],
            "total_bytes": self.total,
            "total_raw_bytes": sum(s.raw_bytes for s in self.stages),
            "lengths": asdict(self.lengths),
            "shape": self.shape_origin,
        }


def count(n: float) -> str:
    """A parameter count in words: 2.9 M, 26.9 B."""
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n / 1e3:.1f} k"


def id_bytes(vocab: int) -> float:
    """Bytes zstd leaves of an int32 token id: about the bits the vocabulary needs."""
    return math.ceil(math.log2(max(vocab, 2))) / 8


def parquet_overhead(shards: int, columns: int) -> int:
    return shards * (PARQUET_FILE + columns * PARQUET_COLUMN)


def anchor_layers(config: PipelineConfig, shape: TeacherShape) -> list[int]:
    return resolve_layers(config.anchors.layers, shape.layers)


def anchor_bytes_per_token(config: PipelineConfig, shape: TeacherShape) -> tuple[float, int]:
    """(expected, raw) bytes one stored token takes in an anchors shard (hidden and its side arrays)."""
    spec, layers, width = config.anchors, len(anchor_layers(config, shape)), shape.hidden
    per_token_cols = 4 + 2 + 2  # positions int32, confidence fp16, entropy fp16
    if spec.dtype == "int8":
        k = min(spec.outlier_channels, width)
        side = layers * 2 + layers * k * 2  # fp16 scale + bf16 bits of the outlier channels
        raw = layers * width + side + per_token_cols
        expected = layers * width * ZSTD["int8"] + side * ZSTD["side"]
    else:
        raw = layers * width * 2 + per_token_cols
        expected = layers * width * 2 * ZSTD["bf16"]
    return expected + per_token_cols * ZSTD["token_columns"], raw


def stage_plan(stage: str, rows: int, tokens: float, expected: float, raw: float, note: str) -> StagePlan:
    """One stage's figures, rounded to whole tokens and bytes."""
    return StagePlan(stage, rows, round(tokens), round(expected), round(raw), note)


def project(config: PipelineConfig, shape: TeacherShape, lengths: Lengths, stages: tuple[str, ...]) -> Plan:
    """The bytes each of `stages` will store for `config`, a teacher of `shape` and rows of `lengths`."""
    shards = max(1, math.ceil(lengths.rows / config.prompts.rows_per_shard))
    every = [
        *source_plans(config, shape, lengths, shards),
        *anchor_plans(config, shape, lengths, shards),
        *training_plans(config, shape, lengths, shards),
    ]
    return Plan(config.name, [s for s in every if s.stage in stages], lengths, shape.origin)


def source_plans(
    config: PipelineConfig, shape: TeacherShape, lengths: Lengths, shards: int
) -> list[StagePlan]:
    """The teacher's weights, the prompts and the responses."""
    n, p, r = lengths.rows, lengths.prompt_tokens, lengths.response_tokens
    cpt, idb = lengths.chars_per_token, id_bytes(shape.vocab)
    weights = shape.params * DTYPE_BYTES[config.teacher.dtype]
    tokenizer = shape.vocab * 24  # tokenizer.json: about 24 bytes a vocabulary entry
    text = n * (p * cpt + lengths.reference_chars)
    return [
        stage_plan(
            "teacher",
            0,
            0,
            weights + tokenizer,
            weights + tokenizer,
            f"{count(shape.params)} params, {config.teacher.dtype}",
        ),
        stage_plan(
            "prompts",
            n,
            n * p,
            parquet_overhead(shards, 7) + n * p * idb + text * TEXT_PER_CHAR + n * ROW_STRINGS,
            parquet_overhead(shards, 7) + n * (p * 4 + ROW_STRINGS) + text,
            f"{p:.0f} tokens a prompt (mean)",
        ),
        stage_plan(
            "responses",
            n,
            n * r,
            parquet_overhead(shards, 8) + n * (p + r) * idb + n * r * cpt * TEXT_PER_CHAR + n * ROW_STRINGS,
            parquet_overhead(shards, 8) + n * ((p + r) * 4 + r * cpt + ROW_STRINGS),
            f"{config.responses.source}, up to {config.responses.max_new_tokens} new tokens",
        ),
    ]


def anchor_plans(
    config: PipelineConfig, shape: TeacherShape, lengths: Lengths, shards: int
) -> list[StagePlan]:
    """The anchors (hidden states of the stored tokens) and, when configured, the drafter trained on them."""
    n, p, r = lengths.rows, lengths.prompt_tokens, lengths.response_tokens
    layers = anchor_layers(config, shape)
    stored = n * (p + r) if config.anchors.tokens == "all" else n * r
    per_token, per_token_raw = anchor_bytes_per_token(config, shape)
    # hidden, offsets, sample_ids, positions, confidence, entropy
    arrays = 9 if config.anchors.dtype == "int8" else 6
    meta = shards * (arrays * ZARR_ARRAY_META + ZARR_GROUP_META) + n * 20  # offsets, sample ids
    plans = [
        stage_plan(
            "anchors",
            n,
            stored,
            stored * per_token + meta,
            stored * per_token_raw + meta,
            f"{len(layers)} of {shape.layers} layers x {shape.hidden} {config.anchors.dtype}, "
            f"{per_token_raw * 1024 / 1e6:.1f} MB raw per 1024 tokens",
        )
    ]
    if config.drafter is not None:
        spec = config.drafter
        targets = list(spec.target_layers or spread_layers(shape.layers, spec.feature_layers))
        params = drafter_params(shape, spec.layers, targets, spec.intermediate_size)
        size = params * DTYPE_BYTES[spec.dtype]
        note = f"{count(params)} params, {spec.dtype}; reads layers {targets}"
        plans.append(stage_plan("drafter", n, stored, size, size, note))
    return plans


def training_plans(
    config: PipelineConfig, shape: TeacherShape, lengths: Lengths, shards: int
) -> list[StagePlan]:
    """The trajectories, the head's adapter, the VFM's noise adapter and the eval's reports."""
    n, p, r = lengths.rows, lengths.prompt_tokens, lengths.response_tokens
    idb = id_bytes(shape.vocab)
    head = config.head
    dims = shape.lora_dims
    targeted = sum(v for k, v in dims.items() if not head.lora_targets or k in head.lora_targets)
    lora = head.lora_rank * targeted + shape.hidden  # LoRA A and B of every projection, the mask embedding
    vfm = config.vfm
    noise = noise_adapter_params(shape.hidden, vfm.max_len, vfm.width, vfm.layers, vfm.heads)
    vfm_params = noise + (lora if vfm.tune_lora else 0)
    evals = config.eval.max_samples or max(1, round(n * config.prompts.eval_fraction))
    return [
        stage_plan(
            "trajectories",
            n,
            n * r,
            parquet_overhead(shards, 8) + n * ((p + r) * idb + r + ROW_STRINGS),
            parquet_overhead(shards, 8) + n * ((p + r) * 4 + r * 2 + ROW_STRINGS),
            f"{config.trajectories.source}, unmask step per response token",
        ),
        stage_plan("head", n, n * (p + r), lora * 4, lora * 4, f"{count(lora)} adapter params, fp32"),
        stage_plan(
            "vfm",
            n,
            n * r,
            vfm_params * 4,
            vfm_params * 4,
            f"{count(noise)} noise-adapter params" + (" + the LoRA" if vfm.tune_lora else ""),
        ),
        stage_plan(
            "eval",
            evals,
            evals * config.eval.max_new_tokens,
            EVAL_BYTES,
            EVAL_BYTES,
            "metrics, plots, report",
        ),
    ]
