"""The store on local disk and memory://: plans, shards, markers, manifests, verify, listing, lineage."""

import json

import pyarrow as pa
import pytest
import torch

from a2d.stores.artifacts import ArtifactStore, IncompleteArtifactError, hash_local_tree
from a2d.stores.keys import KeyInputs
from a2d.stores.parquet import TOKENS, read_shard, write_shard
from a2d.stores.uri import Location, normalise_uri

SCHEMA = pa.schema([("sample_id", pa.string()), ("ids", TOKENS)])


def _write(store: ArtifactStore, ref, shard: str, n: int) -> None:
    name = f"{shard}.parquet"
    with store.shard_output(ref, name) as out:
        write_shard(
            out, {"sample_id": [f"s{i}" for i in range(n)], "ids": [[i, i + 1] for i in range(n)]}, SCHEMA
        )
        sha = hash_local_tree(out)[""]
    store.write_marker(ref, shard, {name: sha}, {"rows": n, "tokens": 2 * n})


def _planned(store: ArtifactStore, inputs: KeyInputs, shards: list[str]):
    ref = store.ref_for(inputs)
    store.write_plan(ref, inputs, shards)
    return ref


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        return ArtifactStore(str(tmp_path / "store"))
    return ArtifactStore(f"memory://a2d-test-{tmp_path.name}")


def test_uri_normalisation(tmp_path):
    assert normalise_uri(str(tmp_path)) == f"file://{tmp_path}"
    assert normalise_uri(f"file://{tmp_path}/") == f"file://{tmp_path}"
    assert normalise_uri("s3://bucket/prefix/") == "s3://bucket/prefix"
    assert normalise_uri("memory://x/y") == "memory:///x/y"
    with pytest.raises(ValueError, match="unsupported store protocol"):
        normalise_uri("ftp://host/x")
    with pytest.raises(ValueError, match="names no bucket"):
        normalise_uri("s3://")
    with pytest.raises(ValueError, match="stay inside"):
        Location.of(str(tmp_path)).join("../escape")


def test_shards_manifest_verify_and_listing(store):
    inputs = KeyInputs("prompts", 1, {"x": 1}, {"teacher": "fedcba9876543210"})
    ref = store.ref_for(inputs)
    store.write_plan(ref, inputs, ["part-00000", "part-00001"])
    _write(store, ref, "part-00000", 3)
    assert not store.is_complete(ref)
    row = store.describe(ref)
    assert (row["complete"], row["shards_done"], row["shards_total"]) == (False, 1, 2)
    with pytest.raises(RuntimeError, match="part-00001 is not finished"):
        store.commit(ref)
    with pytest.raises(IncompleteArtifactError, match="partial"):
        store.manifest(ref)
    _write(store, ref, "part-00001", 2)
    manifest = store.commit(ref, {"note": "ok"})
    assert store.is_complete(ref)
    assert (manifest["rows"], manifest["tokens"]) == (5, 10)
    assert manifest["upstream"] == {"teacher": "fedcba9876543210"}
    assert store.verify(ref) == []
    table = read_shard(store.loc(ref), "part-00001.parquet")
    assert table.schema.field("ids").type == pa.list_(pa.int32())
    assert table.column("sample_id").to_pylist() == ["s0", "s1"]
    assert [r.key for r in store.iter_refs()] == [ref.key]


def test_corruption_is_named_and_only_that_shard_is_redone(store):
    ref = _planned(store, KeyInputs("prompts", 1, {}, {}), ["part-00000", "part-00001"])
    _write(store, ref, "part-00000", 3)
    _write(store, ref, "part-00001", 3)
    store.commit(ref)
    loc = store.loc(ref)
    data = bytearray(loc.read_bytes("part-00001.parquet"))
    data[len(data) // 2] ^= 0xFF
    loc.write_bytes("part-00001.parquet", bytes(data))
    problems = store.verify(ref)
    assert len(problems) == 1 and "part-00001.parquet" in problems[0] and "sha256 mismatch" in problems[0]
    assert store.finished_shard(ref, "part-00000") is not None
    assert store.finished_shard(ref, "part-00001") is None


def test_lineage_and_find(store):
    up = _planned(store, KeyInputs("teacher", 1, {}, {}), [])
    store.commit(up)
    down = _planned(store, KeyInputs("prompts", 1, {}, {"teacher": up.key}), [])
    store.commit(down)
    assert store.lineage(up) == {"upstream": [], "downstream": [f"prompts/{down.key}"]}
    assert store.lineage(down)["upstream"] == [f"teacher/{up.key}"]
    assert store.find(down.key[:6]) == down
    with pytest.raises(KeyError, match="no artifact"):
        store.find("zzzz")


def test_manifest_is_written_atomically(tmp_path):
    loc = Location.of(str(tmp_path))
    loc.write_json("a/manifest.json", {"ok": True})
    assert json.loads((tmp_path / "a" / "manifest.json").read_text()) == {"ok": True}
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["manifest.json"]  # no temp file left behind


class _Adapter(torch.nn.Linear):
    """Stands in for a PEFT model: `save_pretrained` writes its weights as safetensors."""

    def save_pretrained(self, out, safe_serialization=True):
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, out / "w.safetensors")


def test_checkpoints_mirrored_to_a_remote_store_resume_on_another_machine(tmp_path):
    from a2d.stores import checkpoints

    remote = Location.of(f"memory://a2d-ckpt-{tmp_path.name}/head/k/checkpoints")
    model = _Adapter(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in (1, 2, 3):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        checkpoints.publish(tmp_path / "a", step, 2, model, {}, opt, None, step, {}, remote=remote)
    assert remote.listdir() == ["step-00000002", "step-00000003"]  # keep=2 on both sides

    # A fresh machine (empty work folder) gets the newest verified checkpoint back, bit for bit.
    got = checkpoints.restore(remote, tmp_path / "b")
    assert got is not None and got.name == "step-00000003"
    assert hash_local_tree(got) == hash_local_tree(tmp_path / "a" / "step-00000003")
    assert checkpoints.latest(tmp_path / "b") == got
    # Nothing newer remotely: the local checkpoint is used and nothing is downloaded again.
    assert checkpoints.restore(remote, tmp_path / "b") == got

    # An upload cut short (no state.json) and a corrupted object are both passed over.
    remote.write_bytes("step-00000009/w.bin", b"partial")
    data = bytearray(remote.read_bytes("step-00000003/optimizer.safetensors"))
    data[-1] ^= 0xFF
    remote.write_bytes("step-00000003/optimizer.safetensors", bytes(data))
    got = checkpoints.restore(remote, tmp_path / "c")
    assert got is not None and got.name == "step-00000002"
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["step-00000002"]


@pytest.mark.parametrize("damage", [b"", b'{"step": 2, "files": {"ad', b"[1, 2]", b'"state"', b"{}"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, damage):
    """An empty, truncated or non-object state.json (a crash mid-write) never blocks a resume."""
    from a2d.stores import checkpoints

    remote = Location.of(f"memory://a2d-ckpt-bad-{tmp_path.name}/vfm/k/checkpoints")
    model = _Adapter(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    root = tmp_path / "work"
    for step in (1, 2):
        checkpoints.publish(root, step, 3, model, {}, opt, None, step, {}, remote=remote)
    (root / "step-00000002" / "state.json").write_bytes(damage)
    remote.write_bytes("step-00000002/state.json", damage)
    assert checkpoints.latest(root).name == "step-00000001"
    assert checkpoints.restore(remote, tmp_path / "fresh").name == "step-00000001"
    # the next save replaces it; keep=1 then removes both older folders, the damaged one too
    checkpoints.publish(root, 3, 1, model, {}, opt, None, 3, {})
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]


def test_a_checkpoint_save_cut_short_leaves_no_scratch_behind(tmp_path):
    from a2d.stores import checkpoints

    model = _Adapter(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    root = tmp_path / "work"
    checkpoints.publish(root, 1, 2, model, {}, opt, None, 1, {})
    (root / "step-00000002.tmp" / "adapter").mkdir(parents=True)  # a save killed mid-write
    (root / "step-00000005.download").mkdir()  # a restore killed mid-download
    assert checkpoints.latest(root).name == "step-00000001"
    checkpoints.publish(root, 3, 2, model, {}, opt, None, 3, {})
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000003"]
