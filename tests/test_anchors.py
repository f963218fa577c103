"""anchors: stored states equal the teacher's own layer outputs; int8; reader checks; kill and resume."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from a2d.flows.pipeline import pipeline, plan
from a2d.models.capture import capture_layers
from a2d.models.quant import cosine_stats, from_bf16_bits
from a2d.models.teacher import build_random_teacher, decoder_layers, load_teacher
from a2d.stores.anchors import AnchorMismatchError, AnchorReader
from a2d.stores.artifacts import ArtifactStore
from a2d.tasks.anchors import capture_shard
from tests.conftest import ROOT, finished_markers, tiny_config

SMALL = ["prompts.bundled_rows=12", "prompts.rows_per_shard=4", "responses.max_new_tokens=8"]


def reference_states(model, seq: list[int]) -> list[torch.Tensor]:
    """Every decoder layer's output for one unpadded sequence, the last one taken before the final norm."""
    n = len(decoder_layers(model))
    out = [None] * n
    with capture_layers(model, range(n), lambda i, h: out.__setitem__(i, h[0].detach().clone())):
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    for i in range(n - 1):  # the hooks agree with output_hidden_states wherever the latter is pre-norm
        assert torch.equal(out[i], hs[i + 1][0])
    assert not torch.allclose(out[-1], hs[-1][0])  # hidden_states[-1] is after the final norm
    # ...and the hook's last output is exactly what that final norm is applied to
    torch.testing.assert_close(model.model.norm(out[-1]), hs[-1][0], atol=1e-6, rtol=1e-5)
    return out


@pytest.mark.parametrize("arch,layers", [("qwen3_5", 64), ("llama", 4)])
def test_stored_states_equal_layer_outputs(tmp_path, arch, layers):
    build_random_teacher(arch, layers, 64, 0, tmp_path / "t", "float32")
    model, tok = load_teacher(tmp_path / "t", device="cpu")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 9, 3)]
    responses = [rng.integers(0, 256, size=n).tolist() for n in (4, 2, 7)]
    cap = capture_shard(
        model, prompts, responses, list(range(layers)), "response", tok.pad_token_id, batch_size=2
    )
    assert cap.bits.shape == (13, layers, 64) and cap.offsets.tolist() == [0, 4, 6, 13]
    got = from_bf16_bits(cap.bits).float()
    for s, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ref = reference_states(model, p + r)
        rows = slice(cap.offsets[s], cap.offsets[s + 1])
        assert cap.positions[rows].tolist() == list(range(len(p), len(p) + len(r)))
        for i in range(layers):
            want = ref[i][len(p) :]
            torch.testing.assert_close(got[rows, i], want, atol=1e-5, rtol=2**-7)  # bf16 rounding
        # confidence is the teacher's probability of each actual response token
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0]
        probs = torch.softmax(logits[len(p) - 1 : -1], -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.from_numpy(cap.confidence[rows]), probs, atol=1e-5, rtol=1e-4)


def test_bf16_autocast_capture_is_close_to_fp32_and_keyed_apart(tmp_path):
    """anchors.autocast=bf16 runs the capture forward's matmuls in bf16: the states move (it is not a
    no-op) by about bf16's rounding, the confidence stays a probability of the same tokens, and
    the option is part of the anchors key."""
    from a2d.specs import AnchorSpec, LoadSpec
    from a2d.tasks.anchors import key_inputs

    build_random_teacher("llama", 4, 64, 0, tmp_path / "t", "float32")
    model, tok = load_teacher(tmp_path / "t", device="cpu")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (6, 11)]
    responses = [rng.integers(0, 256, size=n).tolist() for n in (5, 8)]
    args = (model, prompts, responses, [0, 3], "all", tok.pad_token_id, 2)
    fp32, bf16 = capture_shard(*args), capture_shard(*args, autocast="bf16")
    a, b = from_bf16_bits(fp32.bits).float(), from_bf16_bits(bf16.bits).float()
    rel = ((b - a).norm(dim=-1) / a.norm(dim=-1)).max().item()
    assert 1e-3 < rel < 5e-2, rel
    assert np.nanmax(np.abs(bf16.confidence - fp32.confidence)) < 0.02
    # tokens: all stores prompt states too, but confidence only where the token is the teacher's
    prompt_len = np.repeat([len(p) for p in prompts], np.diff(fp32.offsets))
    at_prompt = fp32.positions < prompt_len
    assert at_prompt.sum() == 17 and np.isnan(fp32.confidence[at_prompt]).all()
    assert not np.isnan(fp32.confidence[~at_prompt]).any()
    load = LoadSpec()
    none, on = (key_inputs(AnchorSpec(autocast=m), load, "r", "t") for m in ("none", "bf16"))
    assert on.key != none.key  # (tests/snapshots pin that the unset option keeps every older key)


@pytest.mark.parametrize(
    "amx, avx512_bf16, runs", [(True, False, "bf16"), (False, True, "bf16"), (False, False, "none")]
)
def test_native_autocast_runs_bf16_only_where_the_cpu_computes_it(monkeypatch, amx, avx512_bf16, runs):
    """`native` is bf16 on a CPU with AMX or AVX512-BF16 and fp32 elsewhere (emulated bf16 ran 5x
    slower than fp32 on an AVX2 host); the anchors key is the key of the precision that ran."""
    from a2d.models.teacher import resolve_precision
    from a2d.specs import AnchorSpec, LoadSpec
    from a2d.tasks.anchors import capture_autocast, key_inputs

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    native = AnchorSpec(autocast="native")
    assert capture_autocast(native, "cpu") == runs
    load = LoadSpec()
    ran = key_inputs(AnchorSpec(autocast=runs), load, "r", "t")
    assert key_inputs(native, load, "r", "t", "cpu").key == ran.key
    assert resolve_precision("native", torch.device("cpu")) == {"bf16": "bf16", "none": "no"}[runs]


@pytest.fixture(scope="module")
def anchored(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("anchors"))
    cfg = tiny_config(store, *SMALL, "anchors.layers=[0, 31, -1]")
    refs = pipeline(cfg, until="anchors")
    return store, cfg, refs


@pytest.fixture(scope="module")
def captured(anchored) -> tuple[list[dict], torch.Tensor]:
    """One responses shard's rows and the teacher's states for them at layers [0, 31, 63], captured
    afresh for the tokens the config stores (float32 from the bf16 bits): (T, 3, H)."""
    from a2d.stores.parquet import read_shard
    from a2d.tasks.teacher import local_dir

    store, cfg, refs = anchored
    st = ArtifactStore(store)
    rows = read_shard(st.loc(refs["responses"]), "part-00001.parquet").to_pylist()
    model, tok = load_teacher(local_dir(st, refs["teacher"]), device="cpu")
    prompts, responses = [r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows]
    cap = capture_shard(model, prompts, responses, [0, 31, 63], cfg.anchors.tokens, tok.pad_token_id, 4)
    return rows, from_bf16_bits(cap.bits).float()


def test_reader_round_trip_and_provenance_checks(anchored, captured):
    store, cfg, refs = anchored
    reader = AnchorReader(ArtifactStore(store), refs["anchors"])
    assert reader.layers == [0, 31, 63]
    # what comes back from Zarr is, bit for bit, what the teacher's layers produced
    rows, want = captured
    got = torch.cat([reader.sample(r["sample_id"], [0, 31, 63]) for r in rows])
    assert got.shape == want.shape and torch.equal(got, want)
    # the bulk read (one per shard), in an order across shards, is each sample's own read
    ids = [r["sample_id"] for r in rows][::-1][:5] + reader.sample_ids[:2]
    bulk = reader.samples(ids, [63, 0])
    assert all(torch.equal(b, reader.sample(sid, [63, 0])) for b, sid in zip(bulk, ids, strict=True))
    assert [b.shape[0] for b in bulk] == [reader.sample(sid, [0]).shape[0] for sid in ids]
    with pytest.raises(KeyError, match="have no anchors"):
        reader.samples(["nope"], [0])
    sid = reader.sample_ids[0]
    one = reader.get(sid, 31)
    both = reader.sample(sid, [0, 63])
    assert one.shape == (both.shape[0], 64) and both.shape[1] == 2
    reader.check(teacher_key=refs["teacher"].key, capture="residual")
    with pytest.raises(AnchorMismatchError, match=r"layers \[5\] were not stored.*hold layers \[0, 31, 63\]"):
        reader.get(sid, 5)
    with pytest.raises(AnchorMismatchError, match="teacher_key='.*'.*expects teacher_key='deadbeefdeadbeef'"):
        reader.check(teacher_key="deadbeefdeadbeef")
    with pytest.raises(AnchorMismatchError, match="tokenizer_sha256"):
        reader.check(tokenizer_sha256="0" * 64)
    batch = reader.batch(reader.sample_ids[:2], [31], 0.5, np.random.default_rng(0))
    assert (
        batch[0]["hidden"].shape[1:] == (1, 64) and len(batch[0]["positions"]) == batch[0]["hidden"].shape[0]
    )


def test_int8_anchors_are_close_and_smaller(anchored, captured):
    store, cfg, refs = anchored
    st = ArtifactStore(store)
    cfg8 = tiny_config(
        store, *SMALL, "anchors.layers=[0, 31, -1]", "anchors.dtype=int8", "anchors.outlier_channels=4"
    )
    ref8 = pipeline(cfg8, until="anchors")["anchors"]
    assert ref8.key != refs["anchors"].key and ref8 != refs["anchors"]
    bf, i8 = AnchorReader(st, refs["anchors"]), AnchorReader(st, ref8)
    sid = bf.sample_ids[0]
    stats = cosine_stats(bf.sample(sid, [0, 31, 63]), i8.sample(sid, [0, 31, 63]))
    assert stats["mean_cos"] > 0.999
    # against the captured states: each value within half an int8 step of its token-layer's absmax
    rows, want = captured
    got = torch.cat([i8.sample(r["sample_id"], [0, 31, 63]) for r in rows])
    assert torch.equal(torch.cat(i8.samples([r["sample_id"] for r in rows], [0, 31, 63])), got)  # bulk int8
    step = want.abs().amax(-1, keepdim=True) / 127  # (T, L, 1): the int8 step is at most this
    assert got.shape == want.shape and bool(((got - want).abs() <= 0.5 * step + 1e-3 * step + 1e-6).all())
    assert st.manifest(ref8)["bytes"] < st.manifest(refs["anchors"])["bytes"]


def test_projected_bytes_match_what_the_run_wrote(anchored):
    """`a2d plan`'s figures for the tiny run are within 10 % of the bytes its shard files take."""
    from a2d.flows.plan import plan_config

    store, cfg, refs = anchored
    st = ArtifactStore(store)
    int8 = tiny_config(
        store, *SMALL, "anchors.layers=[0, 31, -1]", "anchors.dtype=int8", "anchors.outlier_channels=4"
    )
    for config in (cfg, int8):
        built = pipeline(config, until="anchors")  # the int8 anchors: reused when the test above ran
        projected = {s.stage: s for s in plan_config(config, tuple(built)).stages}
        for stage in ("teacher", "prompts", "responses", "anchors"):
            manifest = st.manifest(built[stage])
            wrote = sum(m["bytes"] for m in manifest["shards"].values())
            assert wrote == manifest["bytes"]
            assert 0.9 <= projected[stage].bytes / wrote <= 1.1, (config.anchors.dtype, stage)
            assert (projected[stage].rows, projected[stage].tokens) == (manifest["rows"], manifest["tokens"])
            if stage != "teacher":  # zstd only shrinks the layout (the teacher's weights are stored raw)
                assert projected[stage].raw_bytes >= wrote


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from a2d.stores.artifacts import ArtifactStore
    original = ArtifactStore.write_marker
    def write_marker(self, ref, shard, files, stats):
        out = original(self, ref, shard, files, stats)
        if ref.stage == "anchors":
            os.kill(os.getpid(), signal.SIGKILL)  # die right after the first anchors shard is finished
        return out
    ArtifactStore.write_marker = write_marker
    from a2d.flows.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_sigkill_mid_anchors_then_rerun_matches_uninterrupted(tmp_path, anchored):
    clean, _, clean_refs = anchored  # the uninterrupted run: the module's own
    killed, small = str(tmp_path / "killed"), [*SMALL, "anchors.layers=[0, 31, -1]"]
    args = ["run", f"{ROOT}/configs/tiny.yaml", "--until", "anchors", *sum((["--set", s] for s in small), [])]
    from prefect.settings import PREFECT_API_URL

    # The session's server (a temporary one of its own would take ~20 s to start); its own process
    # group, so that whatever it starts dies with it (killpg below).
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "ph"), "PYTHONPATH": ROOT}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLER, *args, "--store", killed], env=env, cwd=ROOT, start_new_session=True
    )
    try:
        assert proc.wait(timeout=300) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    st = ArtifactStore(killed)
    aref = plan(tiny_config(killed, *small), "anchors")["anchors"]
    assert aref.key == clean_refs["anchors"].key
    assert not st.is_complete(aref)
    # Only finished markers: the kill can land while the other worker thread is mid-way through its
    # marker's atomic write, which leaves a `<shard>.json.tmp-<id>` beside them.
    done = {p.stem for p in finished_markers(st.loc(aref).local_path() / "_markers")}
    assert 1 <= len(done) < 3
    before = {s: os.stat(st.loc(aref).local_path() / f"{s}.zarr" / "zarr.json").st_mtime_ns for s in done}

    pipeline(tiny_config(killed, *small), until="anchors")
    a, b = st.manifest(aref), ArtifactStore(clean).manifest(aref)
    assert {s: m["sha256"] for s, m in a["shards"].items()} == {
        s: m["sha256"] for s, m in b["shards"].items()
    }
    after = {s: os.stat(st.loc(aref).local_path() / f"{s}.zarr" / "zarr.json").st_mtime_ns for s in done}
    assert after == before  # finished shards were not recomputed
