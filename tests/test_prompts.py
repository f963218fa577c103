"""prompts stage: rejected rows counted by reason, held-out split, content-hashed files."""

import json

import pytest

from a2d.flows.prompts import prompts_flow
from a2d.flows.teacher import teacher_flow
from a2d.specs import PromptSpec
from a2d.stores.artifacts import ArtifactStore
from a2d.stores.readers import read_prompts
from a2d.tasks.prompts import key_inputs, split_of
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("prompt-store"))
    cfg = tiny_config(store)
    return store, cfg, teacher_flow(cfg.teacher, store)


def _mixed_file(path):
    lines = [
        json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}).encode(),
        json.dumps({"prompt": "   ", "answer": "x"}).encode(),  # empty
        b'{"prompt": "caf\xe9 au lait?", "answer": "no"}',  # not UTF-8
        json.dumps({"question": "wrong column"}).encode(),  # missing column
        json.dumps({"prompt": "word " * 400}).encode(),  # too long
        json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}).encode(),
        json.dumps({"prompt": "what is  2 + 2? ", "answer": "4"}).encode(),  # a duplicate, normalised
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_bad_rows_are_counted_by_reason(teacher, tmp_path):
    store, cfg, tref = teacher
    data = tmp_path / "mixed.jsonl"
    _mixed_file(data)
    spec = PromptSpec(source="files", files=(str(data),), max_prompt_tokens=200, response_column=None)
    ref = prompts_flow(tref, spec, cfg.teacher, store)
    manifest = ArtifactStore(store).manifest(ref)
    assert manifest["metrics"]["rejected"] == {
        "empty": 1,
        "too_long": 1,
        "undecodable": 1,
        "missing_column": 1,
        "duplicate": 1,
    }
    table = read_prompts(ArtifactStore(store), ref)
    assert table.num_rows == 2
    assert table.column("answer").to_pylist() == ["2", "4"]
    assert all("<|im_start|>user" in t for t in table.column("prompt_text").to_pylist())


def test_zero_usable_rows_is_an_error(teacher, tmp_path):
    store, cfg, tref = teacher
    data = tmp_path / "empty.jsonl"
    data.write_text(json.dumps({"prompt": ""}) + "\n" + json.dumps({"prompt": " "}) + "\n")
    spec = PromptSpec(source="files", files=(str(data),))
    with pytest.raises(ValueError, match="zero usable rows.*'empty': 2"):
        prompts_flow(tref, spec, cfg.teacher, store)


def test_file_content_not_name_decides_the_key(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a"}) + "\n")
    spec = PromptSpec(source="files", files=(str(data),))
    k1 = key_inputs(spec, "t" * 16).key
    data.write_text(json.dumps({"prompt": "b"}) + "\n")
    assert key_inputs(spec, "t" * 16).key != k1
    with pytest.raises(ValueError, match="does not exist"):
        key_inputs(PromptSpec(source="files", files=(str(tmp_path / "missing.jsonl"),)), "t" * 16)
    with pytest.raises(ValueError, match="unsupported extension"):
        key_inputs(PromptSpec(source="files", files=(str(tmp_path / "x.txt"),)), "t" * 16)


def test_wrong_prompt_column_names_the_columns(teacher, tmp_path):
    store, cfg, tref = teacher
    data = tmp_path / "q.csv"
    data.write_text("question,answer\nWhat is 3+3?,6\n")
    with pytest.raises(ValueError, match=r"prompt_column='prompt' is not a column.*\['answer', 'question'\]"):
        prompts_flow(tref, PromptSpec(source="files", files=(str(data),)), cfg.teacher, store)
    ref = prompts_flow(
        tref, PromptSpec(source="files", files=(str(data),), prompt_column="question"), cfg.teacher, store
    )
    assert read_prompts(ArtifactStore(store), ref).num_rows == 1


def test_held_out_split_is_stable_and_near_the_fraction(tiny_store):
    ids = [f"bundled-0-{i}" for i in range(2000)]
    share = sum(split_of(i, 0.15) == "eval" for i in ids) / len(ids)
    assert 0.12 < share < 0.18
    assert [split_of(i, 0.15) for i in ids[:50]] == [split_of(i, 0.15) for i in ids[:50]]
    cfg = tiny_config(tiny_store)
    ref = ArtifactStore(tiny_store).find("prompts/")
    table = read_prompts(ArtifactStore(tiny_store), ref, split="eval")
    assert table.num_rows >= 1 and set(table.column("split").to_pylist()) == {"eval"}
    assert cfg.prompts.eval_fraction == 0.15


def test_prompts_are_deduplicated_before_the_split(teacher):
    """The demo's 240 bundled prompts hold 5 repeats; none may sit in both splits (or twice anywhere)."""
    from a2d.tasks.prompts import normalised_prompt

    store, cfg, tref = teacher
    spec = cfg.prompts.model_copy(update={"bundled_rows": 240, "rows_per_shard": 60, "eval_fraction": 0.3})
    ref = prompts_flow(tref, spec, cfg.teacher, store)
    assert ArtifactStore(store).manifest(ref)["metrics"]["rejected"]["duplicate"] == 5
    table = read_prompts(ArtifactStore(store), ref).to_pylist()
    texts = {
        split: [normalised_prompt(r["prompt_text"]) for r in table if r["split"] == split]
        for split in ("train", "eval")
    }
    assert len(table) == 235 and len(set(texts["train"] + texts["eval"])) == 235
    assert not set(texts["eval"]) & set(texts["train"]) and texts["eval"]
