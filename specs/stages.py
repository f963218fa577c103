"""The stage specs: every field of a stage's spec is part of that stage's artifact key.

These pydantic models are the bottom layer of a2d: every other layer reads them, none is read by
them. The same models are Prefect flow parameters (the UI renders them as forms).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Form labels a person reads (the Prefect UI shows a field's title): names whose plain
# capitalisation reads wrong ("Lr", "Vfm Steps", "R Min Start"); the rest are capitalised as words.
TITLES = {
    "lr": "Learning rate",
    "lora_lr": "LoRA learning rate",
    "eps": "Smallest mask ratio (t)",
    "r_max": "Largest mask ratio",
    "r_min_start": "Smallest mask ratio at the start",
    "r_min_end": "Smallest mask ratio at the end",
    "vfm_steps": "VFM refinement steps",
    "tau": "Temperature τ of the VFM CE",
    "beta": "KL weight β",
    "beta_warmup": "KL weight warmup steps",
    "top_p": "Top-p",
    "rslora": "rsLoRA scaling",
    "lm_eval_tasks": "lm-eval tasks",
    "lm_eval_limit": "lm-eval documents per task",
    "lm_eval_decoder": "lm-eval decoder",
    "hub_id": "Hub dataset ID",
    "hub_revision": "Hub dataset revision",
    "repo_id": "Hub repository ID",
    "head_key": "Head artifact key",
    "gamma": "Position-weight decay γ",
    "target_layers": "Target layers read (output of layer k)",
    "feature_layers": "Target layers read (count, spread)",
    "blocks_per_sample": "Blocks per sequence per step",
}
ACRONYMS = {
    "lora": "LoRA",
    "vfm": "VFM",
    "kl": "KL",
    "lm": "LM",
    "nf4": "NF4",
    "align": "alignment",
    "len": "length",
    "dtype": "data type",
    "lr": "learning rate",
    "grad": "gradient",
    "accum": "accumulation",
    "seq": "sequence",
    "num": "number of",
    "wandb": "W&B",
    "id": "ID",
    "repo": "repository",
}


def field_title(name: str, _info: Any = None) -> str:
    """The form label of a spec field."""
    if name in TITLES:
        return TITLES[name]
    words = [ACRONYMS.get(w, w) for w in name.split("_")]
    return " ".join([words[0][:1].upper() + words[0][1:], *words[1:]])


class Spec(BaseModel):
    """Base for specs and options: frozen, and a typo'd field is an error rather than ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, field_title_generator=field_title)


class LoadSpec(Spec):
    """How the teacher is loaded for a forward pass; part of the keys of stages that run it."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Compute dtype for the teacher forward (bfloat16 on GPU, float32 on CPU)"
    )
    quantization: Literal["none", "nf4"] = Field(
        "none", description="Load linear layers in 4-bit NF4 through bitsandbytes"
    )


class TeacherSpec(Spec):
    """Where the teacher comes from; every field is part of the teacher's artifact key."""

    source: Literal["random", "local", "hub", "smollm2"] = Field(
        "random",
        description="random config, local HF directory, hub id + revision, or the packaged SmolLM2 GGUF",
    )
    architecture: Literal["qwen3_5", "llama"] = Field("qwen3_5", description="random: architecture family")
    layers: int = Field(64, ge=1, le=256, description="random: decoder layers")
    hidden: int = Field(
        64,
        ge=16,
        le=16384,
        description="random: hidden width (multiple of 16)",
        json_schema_extra={"multipleOf": 16},  # the form refuses 20 before a run exists
    )
    seed: int = Field(0, ge=0, description="random: weight initialisation seed")
    path: str | None = Field(None, description="local: directory with config.json, weights and tokenizer")
    repo_id: str | None = Field(None, description="hub: repository id, e.g. Qwen/Qwen3.6-27B")
    revision: str | None = Field(None, description="hub: pinned commit sha (required for a reproducible key)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the materialised weights")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the checkpoint")
    load: LoadSpec = Field(default_factory=LoadSpec, description="How stages that run the teacher load it")

    @field_validator("hidden")
    @classmethod
    def _hidden_multiple(cls, v: int) -> int:
        if v % 16:
            raise ValueError(f"hidden={v} must be a multiple of 16 (heads are 16 wide)")
        return v

    @model_validator(mode="after")
    def _source_fields(self) -> TeacherSpec:
        if self.source == "local" and not self.path:
            raise ValueError("teacher.source=local needs teacher.path (a directory with config.json)")
        if self.source == "hub" and not (self.repo_id and self.revision):
            raise ValueError("teacher.source=hub needs teacher.repo_id and a pinned teacher.revision")
        return self

    def key_fields(self) -> dict[str, Any]:
        """Only the fields that determine the materialised weights (load options do not)."""
        data = self.model_dump(mode="json", exclude={"load"})
        if self.source != "random":
            for f in ("architecture", "layers", "hidden", "seed"):
                data.pop(f)
        return data


class MixturePart(Spec):
    """One source of a prompt mixture and how many of its rows to take."""

    source: Literal["bundled", "stdlib_code", "python_docs"] = Field(
        description="bundled checkable prompts; functions of the standard library's source to complete; "
        "passages of the interpreter's own documentation (pydoc_data.topics)"
    )
    rows: int = Field(ge=1, le=100_000, description="Rows taken from this source (train and held out)")
    eval_fraction: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="Share held out: whole modules (code) or topics (docs) are held out, bundled rows by id",
    )


class PromptSpec(Spec):
    """Which prompts, tokenised how; every field is part of the prompts key (with the file hashes)."""

    source: Literal["bundled", "files", "hub", "mixture"] = Field(
        "bundled",
        description="Bundled checkable prompts, local files, a hub dataset, or a mixture of offline sources",
    )
    mixture: tuple[MixturePart, ...] = Field(
        (),
        description="mixture: the parts (source and rows each); the bundled part uses bundled_seed and "
        "bundled_style",
    )
    bundled_rows: int = Field(240, ge=1, le=100_000, description="bundled: number of generated prompts")
    bundled_seed: int = Field(0, ge=0, description="bundled: generator seed")
    bundled_style: Literal["answer", "steps"] = Field(
        "answer",
        description="bundled: ask for just the answer, or for the steps and then the answer (longer responses)",
    )
    files: tuple[str, ...] = Field((), description="files: local .jsonl/.json/.parquet/.csv paths")
    hub_id: str | None = Field(None, description="hub: dataset id")
    hub_revision: str | None = Field(None, description="hub: pinned dataset revision")
    split: str = Field("train", description="Dataset split to read")
    prompt_column: str = Field(
        "prompt", description="Column with the user prompt (or a list of chat messages)"
    )
    response_column: str | None = Field("response", description="Column with a reference response (optional)")
    answer_column: str | None = Field("answer", description="Column with a checkable answer (optional)")
    kind_column: str | None = Field(
        "kind", description="Column naming the answer kind for checking (optional)"
    )
    chat_template: bool = Field(True, description="Wrap prompts with the tokenizer's chat template")
    system_prompt: str | None = Field(None, description="Optional system message for the chat template")
    max_prompt_tokens: int = Field(256, ge=4, le=131_072, description="Longer prompts are rejected (counted)")
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Share of rows held out for evaluation")
    rows_per_shard: int = Field(128, ge=1, le=1_000_000, description="Rows per Parquet shard")

    @model_validator(mode="after")
    def _source_fields(self) -> PromptSpec:
        if self.source == "files" and not self.files:
            raise ValueError("prompts.source=files needs prompts.files (one or more local paths)")
        if self.source == "hub" and not self.hub_id:
            raise ValueError("prompts.source=hub needs prompts.hub_id")
        if self.source == "mixture" and not self.mixture:
            raise ValueError(
                "prompts.source=mixture needs prompts.mixture, e.g. [{source: stdlib_code, rows: 200}]"
            )
        if self.mixture and self.source != "mixture":
            raise ValueError(
                f"prompts.mixture is set but prompts.source={self.source!r}: set source: mixture"
            )
        return self


class ResponseSpec(Spec):
    """How teacher responses are made; part of the responses key."""

    source: Literal["teacher", "dataset"] = Field(
        "teacher", description="Generate with the teacher, or use the dataset's reference responses"
    )
    max_new_tokens: int = Field(64, ge=1, le=32_768, description="Generation budget per response")
    do_sample: bool = Field(False, description="Sample instead of greedy decoding")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass")
    seed: int = Field(0, ge=0, description="Sampling seed")


class AnchorSpec(Spec):
    """What the anchors stage stores; every field is part of the anchors key."""

    layers: tuple[int, ...] | Literal["all"] = Field(
        "all", description="Decoder layers to capture (negative from the end)"
    )
    capture: Literal["residual"] = Field(
        "residual", description="Raw decoder-layer output, before the final norm"
    )
    dtype: Literal["bf16", "int8"] = Field(
        "bf16", description="bf16 bits, or int8 with exact outlier channels"
    )
    outlier_channels: int = Field(
        8, ge=0, le=1024, description="int8: channels per layer kept exactly in bf16"
    )
    tokens: Literal["response", "all"] = Field(
        "all",
        description="Store every token (the drafter's context needs the prompt's), or response tokens only",
    )
    autocast: Literal["none", "bf16", "native"] = Field(
        "none",
        description=(
            "bf16: the capture forward's matmuls under bf16 autocast (a CPU with AMX: ~3x faster, "
            "states ~0.5 % from fp32, the size of the int8 rounding; 5x slower on an AVX2-only CPU); "
            "native: bf16 where the device computes it in hardware, none elsewhere (the key holds "
            "the one that ran); the responses stay the fp32 teacher's"
        ),
    )
    source: Literal["forward", "generation"] = Field(
        "forward",
        description=(
            "forward: one teacher forward over each stored prompt + response; generation: the states "
            "the responses stage's own generation forwards computed, kept as it generates (no second "
            "forward: ~40 % of the teacher's time on the demo), at the teacher's precision; shards it "
            "did not capture (reused or dataset responses) get the forward"
        ),
    )

    @model_validator(mode="after")
    def _generation_precision(self) -> AnchorSpec:
        if self.source == "generation" and self.autocast == "bf16":
            raise ValueError(
                "anchors.source=generation keeps the states of the teacher's own generation, which runs "
                "at the teacher's precision: set anchors.autocast to none (or native), or anchors.source "
                "to forward for a bf16-autocast capture forward"
            )
        return self


class TrajectorySpec(Spec):
    """How pseudo-trajectories are made; part of the trajectories key."""

    source: Literal["teacher-confidence", "diffusion-decode"] = Field(
        "teacher-confidence",
        description="Order by the teacher's confidence (anchors stage), or by a trained head's threshold decode",
    )
    head_key: str | None = Field(
        None, description="diffusion-decode: key of a head artifact from an earlier run"
    )
    threshold: float = Field(0.9, gt=0.0, le=1.0, description="diffusion-decode: commit confidence threshold")
    block_size: int = Field(32, ge=1, le=32_768, description="Semi-AR block; >= response length means global")
    steps_per_block: int = Field(
        8, ge=1, le=32_768, description="Denoising steps per block (d3LLM teachers: = block_size)"
    )

    @model_validator(mode="after")
    def _source_fields(self) -> TrajectorySpec:
        if self.source == "diffusion-decode" and not self.head_key:
            raise ValueError(
                "trajectories.source=diffusion-decode needs trajectories.head_key (a trained head)"
            )
        return self


# Names the decoder registry (a2d.models.decoders) builds without extra resources; the form refuses others.
DECODER_NAME = (
    r"^(ar:greedy|ar:student-base|spec:lookup|ar:prompt-lookup|hf:prompt-lookup|spec:head|spec:head\+lookup|spec:vfm|"
    r"spec:drafter|spec:drafter\+lookup|head:k1|untrained:k1|threshold:[0-9]*\.?[0-9]+|entropy:[0-9]*\.?[0-9]+|vfm:k[1-9][0-9]*)$"
)


class EvalSpec(Spec):
    """What the eval stage measures on held-out prompts; part of the eval key."""

    max_samples: int | None = Field(
        None, ge=1, le=100_000, description="Held-out prompts evaluated (eval split only); unset = every one"
    )
    max_new_tokens: int = Field(32, ge=1, le=8192, description="Completion budget for every decoder")
    thresholds: tuple[float, ...] = Field(
        (0.9, 0.7, 0.5), description="Confidence thresholds of the threshold decoders (threshold:P)"
    )
    entropy_thresholds: tuple[float, ...] = Field((0.5, 1.5), description="d3LLM entropy thresholds (nats)")
    vfm_steps: tuple[int, ...] = Field((1, 2, 4), description="VFM refinement steps K")
    lm_eval_tasks: tuple[str, ...] = Field(
        (),
        description="lm-evaluation-harness tasks run on the head (e.g. a2d_bundled, gsm8k_cot); needs a2d-pipeline[eval]",
    )
    lm_eval_limit: int | None = Field(None, ge=1, description="lm-eval: documents per task (unset = all)")
    lm_eval_decoder: Annotated[str, Field(pattern=DECODER_NAME)] | None = Field(
        None,
        description="lm-eval: the a2d decoder that generates (a name from a2d.models.decoders); unset = the "
        "default lossless one (spec:drafter+lookup where a drafter exists, else spec:head+lookup)",
    )
    untrained_baseline: bool = Field(
        True,
        description="Also decode with the untrained student (same base, fresh adapter) one block per forward, like head:k1",
    )
    decoders: tuple[Annotated[str, Field(pattern=DECODER_NAME)], ...] | None = Field(
        None,
        description="Run only these decoders (a2d.models.decoders names; ar:greedy always runs, and ar:student-base when the base is not the teacher); "
        "unset = every decoder the fields above name",
    )
