"""trajectories stage: records from the anchors' teacher confidence, exact snapshot rebuild, pairing checks."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from a2d.flows.pipeline import pipeline
from a2d.models.trajectory import confidence_trajectory, snapshot
from a2d.models.views import ViewSampler
from a2d.stores.anchors import AnchorReader
from a2d.stores.artifacts import ArtifactStore
from a2d.stores.readers import read_trajectories
from a2d.tasks.trajectories import response_confidence
from tests.conftest import tiny_config

SMALL = [
    "prompts.bundled_rows=12",
    "prompts.rows_per_shard=4",
    "responses.max_new_tokens=12",
    "trajectories.block_size=8",  # blocks larger than their steps: more than one token per step
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("traj"))
    cfg = tiny_config(store, *SMALL, "anchors.layers=[0, -1]", "drafter=null")  # two layers: no drafter
    return store, cfg, pipeline(cfg, until="trajectories")


def test_records_follow_teacher_confidence_block_by_block(built):
    store, cfg, refs = built
    st = ArtifactStore(store)
    recs = read_trajectories(st, refs["trajectories"])
    reader = AnchorReader(st, refs["anchors"])
    assert len(recs) == 12
    manifest = st.manifest(refs["trajectories"])
    assert manifest["upstream"] == {"responses": refs["responses"].key, "anchors": refs["anchors"].key}
    assert (
        manifest["metrics"]["samples"] == 12 and manifest["metrics"]["mean_tokens_per_step"] == 1.5
    )  # 8 tokens in 4 steps, then 4 in 4
    for sid, rec in recs.items():
        conf = response_confidence(reader, sid, len(rec["prompt_ids"]), len(rec["response_ids"]))
        want, snaps = confidence_trajectory(conf, 8, 4)
        assert np.array_equal(rec["unmask_step"], want)
        assert rec["num_steps"] == int(want.max()) and rec["source"] == "teacher-confidence"
        # Every step's snapshot rebuilt from the stored record equals the one seen while decoding.
        for k, committed in enumerate(snaps):
            rebuilt = snapshot(rec["response_ids"], rec["unmask_step"], k, mask_id=-1)
            assert np.array_equal(rebuilt != -1, committed)
            assert np.array_equal(rebuilt[committed], rec["response_ids"][committed])
    # stored as int16 lists
    table = pq.read_table(st.loc(refs["trajectories"]).local_path() / "part-00000.parquet")
    assert table.schema.field("unmask_step").type.value_type == pa.int16()


def test_sampler_refuses_a_trajectory_from_another_response(built):
    store, cfg, refs = built
    recs = read_trajectories(ArtifactStore(store), refs["trajectories"])
    a, b = list(recs.values())[:2]
    sampler = ViewSampler(seed=0, total_steps=10, block_size=8)

    def view(index, traj):
        return sampler.view(0, 0, index, a["sample_id"], a["response_ids"], 257, True, traj, max_blocks=4)

    assert view(0, b).source == "random" and sampler.fallbacks == {"sample_id_mismatch": 1}
    view(1, {**b, "sample_id": a["sample_id"]})
    assert sampler.fallbacks["ids_mismatch"] + sampler.fallbacks["length_mismatch"] == 1
    assert view(2, a).source == "trajectory"


def test_anchors_from_other_responses_are_refused(built, tmp_path):
    store, cfg, refs = built
    from a2d.tasks.trajectories import trajectories_shard

    other = refs["responses"].model_copy(update={"key": "0" * 16})
    with pytest.raises(ValueError, match="responses_key mismatch"):
        trajectories_shard.fn(
            store, refs["trajectories"], "part-00000", cfg.trajectories, other, refs["anchors"]
        )


def test_damaged_inputs_read_unverified_are_named_not_decoded(built, tmp_path):
    """With run.verify_reuse=false nothing re-hashes reused inputs: a deleted zarr chunk (which zarr
    would read as zeros), a corrupted zstd chunk and a truncated Parquet shard are each named by the
    consumer, and damaged anchors are demoted so the next run rebuilds exactly that shard."""
    import shutil

    from a2d.flows.pipeline import STEPS, plan
    from a2d.stores.artifacts import DamagedArtifactError

    store, cfg, refs = built
    copy = str(tmp_path / "store")
    shutil.copytree(store, copy)
    cfg = cfg.model_copy(
        update={
            "store": copy,
            "run": cfg.run.model_copy(update={"verify_reuse": False}),
            "trajectories": cfg.trajectories.model_copy(update={"steps_per_block": 2}),  # a new key
        }
    )
    st = ArtifactStore(copy)
    refs = plan(cfg, "trajectories")
    anchors = st.loc(refs["anchors"])
    chunks = sorted(r for r in anchors.files() if r.startswith("part-00001.zarr/hidden/c/"))
    anchors.remove(chunks[0])
    with pytest.raises(DamagedArtifactError, match="part-00001.zarr/hidden/c/[0-9/]+: missing"):
        STEPS["trajectories"].run(cfg, refs)
    assert anchors.read_json("_damaged.json")["shards"] == ["part-00001"]  # the next anchors run rebuilds it
    before = {s: st.marker(refs["anchors"], s) for s in ("part-00000", "part-00002")}
    assert STEPS["anchors"].run(cfg, refs) == refs["anchors"] and st.verify(refs["anchors"]) == []
    assert {s: st.marker(refs["anchors"], s) for s in before} == before

    chunk = next(r for r in anchors.files() if r.startswith("part-00002.zarr/confidence/c/"))
    data = bytearray(anchors.read_bytes(chunk))
    data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)  # zero the zstd frame's tail
    anchors.write_bytes(chunk, bytes(data))
    with pytest.raises(DamagedArtifactError, match=f"{chunk}: sha256 mismatch"):
        STEPS["trajectories"].run(cfg, refs)

    responses = st.loc(refs["responses"])  # the anchors shard to rebuild reads this one
    responses.write_bytes("part-00002.parquet", responses.read_bytes("part-00002.parquet")[:200])
    with pytest.raises(ValueError, match="part-00002.parquet is not readable Parquet"):
        STEPS["anchors"].run(cfg, refs)
