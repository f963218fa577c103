"""responses stage: seeded sampling that no thread, batch or repair can change; consumers check pairing."""

import pytest

from a2d.flows.pipeline import pipeline
from a2d.flows.trajectories import trajectories_flow
from a2d.stores.anchors import AnchorMismatchError
from a2d.stores.artifacts import ArtifactStore, hash_local_tree
from a2d.stores.parquet import read_shard, write_shard
from a2d.tasks.responses import SCHEMA
from tests.conftest import tiny_config

SAMPLED = [
    "teacher.architecture=llama",
    "teacher.layers=2",
    "prompts.bundled_rows=12",
    "prompts.rows_per_shard=4",
    "responses.max_new_tokens=8",
    "responses.do_sample=true",
    "responses.temperature=2.0",
    "anchors.layers=[0, 1]",
]


def _shas(store: str, ref) -> dict[str, str]:
    return {s: m["sha256"] for s, m in ArtifactStore(store).manifest(ref)["shards"].items()}


def test_sampled_responses_do_not_depend_on_threads_batches_or_repairs(tmp_path):
    """Two shards generating at once in threads, another batch size, one thread, and a repaired shard:
    every sample is the same (each draws from its own generator seeded by (seed, sample id))."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    refs = pipeline(tiny_config(a, *SAMPLED, "run.workers=3", "run.batch_size=4"), until="responses")
    other = pipeline(tiny_config(b, *SAMPLED, "run.workers=1", "run.batch_size=3"), until="responses")
    assert other["responses"].key == refs["responses"].key  # run options are not in the key
    assert _shas(b, other["responses"]) == _shas(a, refs["responses"])
    rows = read_shard(ArtifactStore(a).loc(refs["responses"]), "part-00000.parquet").to_pylist()
    assert len({tuple(r["response_ids"]) for r in rows}) == len(rows)  # samples differ from one another

    st = ArtifactStore(a)
    loc = st.loc(refs["responses"])
    loc.remove("_markers/part-00001.json")
    loc.remove("manifest.json")
    again = pipeline(tiny_config(a, *SAMPLED, "run.workers=3", "run.batch_size=2"), until="responses")
    assert _shas(a, again["responses"]) == _shas(b, other["responses"])  # the repaired shard is identical


def test_anchors_that_no_longer_describe_their_responses_are_refused(tmp_path):
    """A responses shard rebuilt with other tokens keeps its key; anchors record the checksum of the
    shard they were captured from, and the trajectories stage refuses the pair, naming the shard."""
    store = str(tmp_path / "s")
    cfg = tiny_config(store, *SAMPLED)
    refs = pipeline(cfg, until="anchors")
    st = ArtifactStore(store)
    loc = st.loc(refs["responses"])
    cols = read_shard(loc, "part-00001.parquet").to_pydict()
    cols["response_ids"][0] = [(t + 1) % 256 for t in cols["response_ids"][0]]
    with st.shard_output(refs["responses"], "part-00001.parquet") as out:  # as a repair could have
        write_shard(out, cols, SCHEMA)
        sha = hash_local_tree(out)[""]
    st.write_marker(refs["responses"], "part-00001", {"part-00001.parquet": sha}, {"rows": 4, "tokens": 0})
    st.commit(refs["responses"], st.manifest(refs["responses"])["metrics"])
    with pytest.raises(
        AnchorMismatchError, match="anchors shard part-00001 .* no longer describe the same rows"
    ):
        trajectories_flow(refs["responses"], refs["anchors"], cfg.trajectories, store)
