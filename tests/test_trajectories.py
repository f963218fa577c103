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
    cfg = tiny_config(store, *SMALL, "anchors.layers=[0, -1]")
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
