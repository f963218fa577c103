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


class Shards:
    """A plain shard task for `run_sharded` that records which shards it wrote."""

    def __init__(self, store: ArtifactStore, rows: int = 3):
        self.store, self.rows, self.calls = store, rows, []

    def __call__(self, ref, shard: str) -> None:
        self.calls.append(shard)
        _write(self.store, ref, shard, self.rows)

    def run(self, inputs: KeyInputs, shards: list[str], **opts):
        from a2d.flows.stage import run_sharded
        from a2d.specs import RunOptions

        return run_sharded(
            self.store, inputs, shards, self, lambda ref, s: {"ref": ref, "shard": s}, RunOptions(**opts)
        )


SHARDS = ["part-00000", "part-00001", "part-00002"]


def test_corruption_is_named_and_only_that_shard_is_redone(store):
    inputs = KeyInputs("prompts", 1, {}, {})
    build = Shards(store)
    ref = build.run(inputs, SHARDS)
    loc = store.loc(ref)
    data = bytearray(loc.read_bytes("part-00001.parquet"))
    data[len(data) // 2] ^= 0xFF
    loc.write_bytes("part-00001.parquet", bytes(data))
    problems = store.verify(ref)
    assert len(problems) == 1 and "part-00001.parquet" in problems[0] and "sha256 mismatch" in problems[0]
    build.calls.clear()
    assert build.run(inputs, SHARDS) == ref
    assert build.calls == ["part-00001"]  # the other two were kept
    assert store.verify(ref) == [] and store.is_complete(ref)


@pytest.mark.parametrize("target", ["manifest.json", "_markers/part-00001.json", "_plan.json"])
@pytest.mark.parametrize("damage", ["truncate", "empty", "not-an-object"])
def test_damaged_metadata_is_named_and_heals_on_rerun(store, target, damage, capsys):
    """A truncated/empty/non-object manifest, marker or plan: verify names the file (exit 1, not a bare
    JSON error), ls lists the artifact, and a rerun repairs it without recomputing any shard."""
    from a2d.flows.cli import main

    inputs = KeyInputs("prompts", 1, {}, {})
    build = Shards(store)
    ref = build.run(inputs, SHARDS)
    loc = store.loc(ref)
    good = loc.read_bytes(target)
    loc.write_bytes(
        target, {"truncate": good[: len(good) // 2], "empty": b"", "not-an-object": b"[]"}[damage]
    )
    problems = store.verify(ref)
    assert any(p.startswith(f"{loc.uri}/{target}: damaged") for p in problems), problems
    if store.root.is_local:
        root = str(store.root.local_path())
        capsys.readouterr()
        assert main(["verify", ref.key, "--store", root]) == 1
        assert main(["ls", "--store", root]) == 0
        assert ref.key in capsys.readouterr().out
    build.calls.clear()
    assert build.run(inputs, SHARDS) == ref
    assert (
        build.calls == []
    )  # the files verify: a marker is rewritten from the manifest, a manifest recommitted
    assert store.verify(ref) == [] and store.damaged_metadata(ref) == []


def test_a_deleted_marker_is_rewritten_from_the_manifest(store):
    inputs = KeyInputs("prompts", 1, {}, {})
    build = Shards(store)
    ref = build.run(inputs, SHARDS)
    store.loc(ref).remove("_markers/part-00002.json")
    assert any("part-00002.json: marker missing" in p for p in store.verify(ref))
    build.calls.clear()
    assert build.run(inputs, SHARDS) == ref and build.calls == []  # reused, marker rebuilt
    assert store.verify(ref) == []


def test_scratch_of_a_killed_run_is_removed_by_the_next_run(tmp_path):
    """A process killed inside `shard_output` leaves its scratch folder; the rerun removes it."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    store = ArtifactStore(str(tmp_path / "s"))
    inputs = KeyInputs("anchors", 1, {}, {})
    ref = store.ref_for(inputs)
    killer = (
        "import os, signal, sys\n"
        "from a2d.stores.artifacts import ArtifactStore\n"
        "from a2d.stores.keys import KeyInputs\n"
        "st = ArtifactStore(sys.argv[1])\n"
        "ref = st.ref_for(KeyInputs('anchors', 1, {}, {}))\n"
        "with st.shard_output(ref, 'part-00000.zarr') as out:\n"
        "    out.mkdir()\n"
        "    (out / 'chunk').write_bytes(b'x' * 100000)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", killer, str(tmp_path / "s")], cwd=ROOT, timeout=120)
    assert proc.returncode == -9
    folder = store.loc(ref).local_path()
    assert [p.name for p in folder.iterdir() if ".tmp-" in p.name]  # what the kill left
    Shards(store).run(inputs, ["part-00000"])
    assert not [p for p in folder.rglob("*") if ".tmp-" in p.name]


def test_a_failed_metadata_write_leaves_no_temp_file(tmp_path, monkeypatch):
    """Disk full while writing a marker: the error surfaces and no `.tmp-` file is left behind."""
    import errno
    import os

    loc = Location.of(str(tmp_path))
    loc.write_json("_markers/a.json", {"ok": 1})

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        loc.write_json("_markers/a.json", {"ok": 2})
    assert sorted(p.name for p in (tmp_path / "_markers").iterdir()) == ["a.json"]
    assert loc.read_json("_markers/a.json") == {"ok": 1}


def test_two_runs_building_one_artifact_take_turns(store, caplog):
    """Two runs of one stage on one store: the second waits for the first and reuses its artifact,
    instead of both publishing the same shards at once."""
    import logging
    import threading

    caplog.set_level(logging.INFO, logger="a2d")
    inputs = KeyInputs("anchors", 1, {}, {})
    first_inside, second_waits = threading.Event(), threading.Event()
    inside: list[str] = []

    class Noticed(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "another run is building it" in record.getMessage():
                second_waits.set()

    class Slow(Shards):
        def __call__(self, ref, shard: str) -> None:
            inside.append(threading.current_thread().name)
            first_inside.set()
            if len(inside) == 1:  # the first run holds its shard until the second is known to wait
                assert second_waits.wait(timeout=120), "the second run neither waited nor ran"
            super().__call__(ref, shard)

    handler = Noticed()
    logging.getLogger("a2d").addHandler(handler)
    first, second = Slow(store), Slow(store)
    results: dict[str, object] = {}

    def go(name: str, build: Shards) -> None:
        try:
            results[name] = build.run(inputs, ["part-00000", "part-00001"], workers=1)
        except BaseException as e:
            results[name] = e
        finally:
            if name == "second":
                second_waits.set()  # a second run that did not wait must not hang the first

    try:
        a = threading.Thread(target=go, args=("first", first), name="first")
        a.start()
        assert first_inside.wait(timeout=120)  # the first run holds the artifact when the second starts
        b = threading.Thread(target=go, args=("second", second), name="second")
        b.start()
        a.join(timeout=300)
        b.join(timeout=300)
    finally:
        logging.getLogger("a2d").removeHandler(handler)
    assert results["first"] == results["second"] == store.ref_for(inputs), results
    assert inside.count("second") == 0 and first.calls == ["part-00000", "part-00001"]
    assert store.verify(store.ref_for(inputs)) == []


def test_lineage_and_find(store):
    up = _planned(store, KeyInputs("teacher", 1, {}, {}), [])
    store.commit(up)
    down = _planned(store, KeyInputs("prompts", 1, {}, {"teacher": up.key}), [])
    store.commit(down)
    assert store.lineage(up) == {"upstream": [], "downstream": [f"prompts/{down.key}"]}
    assert store.lineage(down)["upstream"] == [f"teacher/{up.key}"]
    assert store.find(down.key[:6]) == down
    with pytest.raises(KeyError, match="no artifact"):
        store.find("ffff")
    with pytest.raises(KeyError, match="is not an artifact key"):
        store.find("./prompts")


def test_manifest_is_written_atomically(tmp_path, monkeypatch):
    """A crash between writing the new bytes and publishing them leaves the old manifest whole."""
    import os

    loc = Location.of(str(tmp_path))
    loc.write_json("a/manifest.json", {"ok": True})
    assert json.loads((tmp_path / "a" / "manifest.json").read_text()) == {"ok": True}

    def crash(src, dst):
        raise KeyboardInterrupt("killed between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        loc.write_json("a/manifest.json", {"ok": False, "note": "x" * 10_000})
    monkeypatch.undo()
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


def test_location_repr_hides_storage_credentials():
    loc = Location.of("memory://x", {"key": "AKIA-SECRET", "secret": "hunter2", "endpoint_url": "http://h"})
    text = repr(loc) + str(loc) + repr(ArtifactStore(loc).root)
    assert "AKIA-SECRET" not in text and "hunter2" not in text and "memory:///x" in text
    assert "endpoint_url, key, secret" in text  # the option names are still shown
