"""Artifact keys: golden values pin the hashing so that invalidation is always deliberate."""

from a2d.specs import PromptSpec, TeacherSpec
from a2d.stores.keys import artifact_key, canonical_json
from a2d.tasks import prompts, teacher


def test_golden_keys():
    assert artifact_key("teacher", 1, {"source": "random", "layers": 2}, {}) == "909132a3f82322c1"
    assert (
        artifact_key("prompts", 1, {"a": [1, 2], "b": None}, {"teacher": "0123456789abcdef"})
        == "077300002a22f6c2"
    )
    # A stage's real key, from its default spec: changing FORMAT_VERSION or a default changes it.
    assert teacher.key_inputs(TeacherSpec()).key == "5a50b7ae7f0c208e"
    assert prompts.key_inputs(PromptSpec(), "5a50b7ae7f0c208e").key == "8969d2148c1731de"


def test_the_eval_key_spells_a_renamed_decoder_as_it_was():
    """spec:lookup was ar:prompt-lookup: either name gives the eval key both gave before the rename."""
    from a2d.specs import EvalSpec
    from a2d.tasks import evaluate

    up = {"teacher": "t" * 16, "responses": "r" * 16, "head": "h" * 16}
    assert evaluate.key_inputs(EvalSpec(), up).key == "d1554fa68eda1e76"
    assert (
        evaluate.key_inputs(EvalSpec(), {**up, "vfm": "v" * 16, "drafter": "d" * 16}).key
        == "154bb08bf4d12b74"
    )
    for name in ("spec:lookup", "ar:prompt-lookup"):
        assert (
            evaluate.key_inputs(EvalSpec(decoders=(name, "head:k1")), up).key == "5b77ac049697936c"
        )  # the old name's key before the rename


def test_canonical_json_is_order_and_number_stable():
    assert canonical_json({"b": 1, "a": (1.0, 2)}) == canonical_json({"a": [1, 2], "b": 1.0})
    assert canonical_json({"x": 0.5}) != canonical_json({"x": 0.25})


def test_key_depends_on_every_input():
    base = artifact_key("s", 1, {"x": 1}, {"up": "k"})
    assert artifact_key("t", 1, {"x": 1}, {"up": "k"}) != base
    assert artifact_key("s", 2, {"x": 1}, {"up": "k"}) != base
    assert artifact_key("s", 1, {"x": 2}, {"up": "k"}) != base
    assert artifact_key("s", 1, {"x": 1}, {"up": "j"}) != base
    assert len(base) == 16 and int(base, 16) >= 0


def test_load_options_are_not_in_the_teacher_key():
    a = TeacherSpec()
    b = TeacherSpec.model_validate({"load": {"quantization": "nf4"}})
    assert teacher.key_inputs(a).key == teacher.key_inputs(b).key
    assert teacher.key_inputs(a).key != teacher.key_inputs(TeacherSpec(seed=1)).key


def test_unused_source_settings_stay_out_of_the_trajectories_key():
    from a2d.specs import TrajectorySpec
    from a2d.tasks import trajectories

    a = trajectories.key_inputs(TrajectorySpec(), "r" * 16, "a" * 16).key
    assert trajectories.key_inputs(TrajectorySpec(threshold=0.5), "r" * 16, "a" * 16).key == a
    assert trajectories.key_inputs(TrajectorySpec(steps_per_block=4), "r" * 16, "a" * 16).key != a
    decode = TrajectorySpec(source="diffusion-decode", head_key="h" * 16)
    assert (
        trajectories.key_inputs(decode, "r" * 16, "a" * 16).key
        != trajectories.key_inputs(decode.model_copy(update={"threshold": 0.5}), "r" * 16, "a" * 16).key
    )


# -- every spec field is in its stage's key; no run option is in any key --------------------------------
SPEC_STAGES = ("teacher", "prompts", "responses", "anchors", "drafter", "trajectories", "head", "vfm", "eval")
# Fields that count only in a context: (context overrides, then the field is changed).
CONTEXT = {
    "anchors.outlier_channels": {"anchors": {"dtype": "int8"}},  # int8 only
    "trajectories.head_key": {"trajectories": {"source": "diffusion-decode", "head_key": "0" * 16}},
    "trajectories.threshold": {"trajectories": {"source": "diffusion-decode", "head_key": "0" * 16}},
    "eval.lm_eval_limit": {"eval": {"lm_eval_tasks": ["a2d_bundled"]}},  # they matter only with tasks
    "eval.lm_eval_decoder": {"eval": {"lm_eval_tasks": ["a2d_bundled"]}},
    "prompts.mixture": {"prompts": {"source": "mixture", "mixture": [{"source": "bundled", "rows": 10}]}},
}
# Fields deliberately in other stages' keys: how a teacher is loaded changes what runs it produce.
ELSEWHERE = {"teacher.load": ("responses", "anchors")}
# Values that need companions to validate.
COMPANIONS = {
    ("teacher", "source", "hub"): {"repo_id": "org/model", "revision": "0" * 40},
    ("prompts", "source", "hub"): {"hub_id": "org/data"},
    ("trajectories", "source", "diffusion-decode"): {"head_key": "0" * 16},
}


FIXED = object()


def _candidates(value):
    """Other values to try for a field, most types covered; the first that validates is used."""
    out = []
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        out += [value + 1, value - 1, value * 2, 1, 2]
    if isinstance(value, float):
        out += [value / 2, value * 0.9, value + 0.05, 0.5, 1.0, 2.0]
    if isinstance(value, str):
        out += [value + "x", "x", "all", "threshold:0.5"]  # the last: a decoder name (eval.lm_eval_decoder)
    if isinstance(value, list | tuple):
        out += [[0], [1], [0.5], [1, 2], ["x.jsonl"], list(value)[:-1], [*value, value[-1] if value else 1]]
    out += [
        "x",
        1,
        0.5,
        [0],
        "0" * 16,
        64,
        ["spec:head"],
        "spec:head",
    ]  # whatever the field's type, one of these may fit
    return [c for c in out if c != value]


def _fields(data: dict, prefix: str):
    """(dotted path, value) of every leaf field of a config section, nested specs included."""
    for name, value in data.items():
        if isinstance(value, dict):
            yield from _fields(value, f"{prefix}.{name}")
        else:
            yield f"{prefix}.{name}", value


def _set(data: dict, path: str, value) -> dict:
    head, _, rest = path.partition(".")
    return {**data, head: _set(data[head], rest, value) if rest else value}


def _variant(base: dict, path: str):
    """The config with `path` changed to the first candidate (with literal choices and companions)
    that validates, or None."""
    from pydantic import ValidationError

    from a2d.specs import PipelineConfig

    section, *rest = path.split(".")
    value = base
    for part in path.split("."):
        value = value[part]
    model = PipelineConfig
    for part in path.split(".")[:-1]:
        model = model.model_fields[part].annotation
        if not hasattr(model, "model_fields"):  # an optional section (`drafter: DrafterSpec | None`)
            model = next(a for a in model.__args__ if hasattr(a, "model_fields"))
    field = model.model_fields[path.rsplit(".", 1)[1]]
    choices = list(getattr(field.annotation, "__args__", ())) if "Literal" in str(field.annotation) else []
    if choices == [value]:
        return FIXED  # a one-value Literal (anchors.capture, train.distributed): nothing to change
    for candidate in [c for c in choices if c != value] + _candidates(value):
        data = _set(base, path, candidate)
        extra = (
            COMPANIONS.get((section, rest[0] if rest else "", candidate), {})
            if isinstance(candidate, str)
            else {}
        )
        data = {**data, section: {**data[section], **extra}}
        try:
            return PipelineConfig.model_validate(data)
        except ValidationError:
            continue
    return None


def test_every_spec_field_changes_its_stage_key_and_no_run_option_changes_any(tmp_path):
    from a2d.flows.pipeline import plan
    from a2d.specs import PipelineConfig
    from tests.conftest import tiny_config

    base_config = tiny_config(str(tmp_path / "s"), "teacher.architecture=llama", "teacher.layers=2")

    def keys(config: PipelineConfig) -> dict[str, str]:
        return {stage: ref.key for stage, ref in plan(config).items()}

    unchanged, checked = [], 0
    for section in SPEC_STAGES:
        for path, _ in _fields(base_config.model_dump(mode="json")[section], section):
            base = base_config.model_dump(mode="json")
            for ctx_section, ctx in CONTEXT.get(path, {}).items():
                base[ctx_section] = {**base[ctx_section], **ctx}
            variant = _variant(base, path)
            assert variant is not None, f"{path}: no other valid value found to try"
            if variant is FIXED:
                continue
            before, after = keys(PipelineConfig.model_validate(base)), keys(variant)
            owner = next((v for k, v in ELSEWHERE.items() if path.startswith(k + ".")), (section,))
            checked += 1
            if any(before[s] == after[s] for s in owner):
                unchanged.append(path)
    assert not unchanged, f"spec fields missing from their stage's key: {unchanged}"
    assert checked > 80

    base = base_config.model_dump(mode="json")
    for section in ("run", "train"):
        for path, _ in _fields(base[section], section):
            variant = _variant(base, path)
            assert variant is not None, f"{path}: no other valid value found to try"
            if variant is FIXED:
                continue
            assert keys(variant) == keys(base_config), f"run option {path} changes an artifact key"
    assert keys(base_config.model_copy(update={"name": "other"})) == keys(base_config)
