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
    assert teacher.key_inputs(TeacherSpec()).key == "cf6bebf674074c45"
    assert prompts.key_inputs(PromptSpec(), "cf6bebf674074c45").key == "70e630d4b7836f67"


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
