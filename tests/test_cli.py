"""The `a2d` CLI end to end on the tiny config: run, reuse, invalidation, ls, show, verify, rebuild."""

import json
import os

import pytest

from a2d.flows.cli import main
from tests.conftest import ROOT

TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def _ls(store, capsys):
    capsys.readouterr()
    assert main(["ls", "--json", "--store", store]) == 0
    return {(r["stage"], r["key"]): r for r in json.loads(capsys.readouterr().out)}


def test_run_reuse_invalidate_verify_rebuild(tmp_path, capsys, caplog):
    store = str(tmp_path / "s")
    assert main(["run", TINY, "--until", "prompts", "--store", store]) == 0
    assert capsys.readouterr().out.startswith("plan tiny: projected bytes per stage")
    first = _ls(store, capsys)
    assert sorted(s for s, _ in first) == ["prompts", "teacher"]
    row = next(r for (s, _), r in first.items() if s == "prompts")
    assert row["complete"] and row["shards_done"] == row["shards_total"] == 3 and row["bytes"] > 0
    assert set(row) >= {"stage", "key", "uri", "complete", "shards_done", "shards_total", "bytes", "created"}

    # Same config again: nothing is built, every stage says reuse.
    assert main(["run", TINY, "--until", "prompts", "--store", store]) == 0
    out = capsys.readouterr().out
    assert out.count("reuse ") == 2
    assert _ls(store, capsys).keys() == first.keys()

    # A runtime option reuses both; a semantic field makes a new prompts key and reuses the teacher.
    assert main(["run", TINY, "--until", "prompts", "--store", store, "--set", "run.batch_size=3"]) == 0
    assert capsys.readouterr().out.count("reuse ") == 2
    assert (
        main(["run", TINY, "--until", "prompts", "--store", store, "--set", "prompts.max_prompt_tokens=90"])
        == 0
    )
    after = _ls(store, capsys)
    assert (
        len([k for k in after if k[0] == "prompts"]) == 2
        and len([k for k in after if k[0] == "teacher"]) == 1
    )

    # Corrupt one byte of one shard: verify exits 1 naming it; a rerun rebuilds only that shard.
    key = row["key"]
    art = tmp_path / "s" / "prompts" / key
    victim = art / "part-00001.parquet"
    data = bytearray(victim.read_bytes())
    data[40] ^= 0xFF
    victim.write_bytes(bytes(data))
    mtimes = {p.name: p.stat().st_mtime_ns for p in art.glob("part-*.parquet")}
    assert main(["verify", "--store", store]) == 1
    assert "part-00001.parquet: sha256 mismatch" in capsys.readouterr().out
    assert main(["run", TINY, "--until", "prompts", "--store", store]) == 0
    capsys.readouterr()
    assert main(["verify", "--store", store, "--json"]) == 0
    assert all(r["ok"] for r in json.loads(capsys.readouterr().out))
    now = {p.name: p.stat().st_mtime_ns for p in art.glob("part-*.parquet")}
    assert now["part-00000.parquet"] == mtimes["part-00000.parquet"]
    assert now["part-00002.parquet"] == mtimes["part-00002.parquet"]
    assert now["part-00001.parquet"] != mtimes["part-00001.parquet"]

    # show: manifest, lineage and a sample of rows.
    capsys.readouterr()
    assert main(["show", key[:6], "--store", store, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["lineage"]["upstream"][0].startswith("teacher/") and shown["sample"][0]["sample_id"]

    # A truncated manifest and a deleted marker: verify names the manifest (exit 1), ls lists the
    # artifact as damaged, and run rebuilds what nothing vouches for any more (the unmarked shard)
    # and recommits; verify is clean again.
    manifest = art / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    (art / "_markers" / "part-00000.json").unlink()
    capsys.readouterr()
    assert main(["verify", key, "--store", store]) == 1
    out = capsys.readouterr().out
    assert f"{key}/manifest.json: damaged" in out and "part-00000.json: marker missing" not in out
    assert main(["ls", "--store", store]) == 0
    assert "damaged" in capsys.readouterr().out
    before = {p.name: p.stat().st_mtime_ns for p in art.glob("part-*.parquet")}
    assert main(["run", TINY, "--until", "prompts", "--store", store]) == 0
    assert main(["verify", "--store", store]) == 0
    now = {p.name: p.stat().st_mtime_ns for p in art.glob("part-*.parquet")}
    assert [name for name in sorted(now) if now[name] != before[name]] == ["part-00000.parquet"]


QWEN = os.path.join(ROOT, "configs", "qwen3.6-27b.yaml")


def _anchors_plan(capsys, *sets: str) -> dict:
    capsys.readouterr()
    args = ["plan", QWEN, "--rows", "300000", "--until", "anchors", "--json"]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    return next(s for s in json.loads(capsys.readouterr().out)["stages"] if s["stage"] == "anchors")


def test_plan_of_the_27b_recipe_stores_the_taps(capsys):
    from a2d.specs import load_config
    from a2d.tasks import anchors, drafter

    config = load_config(QWEN)  # validates, and the drafter's and anchors' checks accept it
    stored = anchors.check_layers(config.anchors, 64)
    taps = drafter.check_config(config.drafter, config.anchors, 64)
    assert taps == [1, 16, 31, 46, 61] and set(taps) <= set(stored)
    late = [i for i in stored if i >= config.head.align_from * 64]
    assert len(late) >= config.head.align_layers and len(stored) == 8

    assert main(["plan", QWEN, "--rows", "300000"]) == 0
    table = capsys.readouterr().out
    assert "8 of 64 layers x 5120 int8, 42.1 MB raw per 1024 tokens" in table and "total" in table
    assert all(f"\n{s} " in table for s in ("teacher", "prompts", "responses", "drafter", "head", "eval"))

    # int8 anchors: per token and layer 5120 codes, an fp16 scale and 8 outliers' bf16 bits; per token
    # position, confidence and entropy (Zarr metadata is the rest). 512 + 512 tokens a sample.
    def raw(layers: int) -> int:
        return 300_000 * 1024 * (layers * (5120 + 2 + 8 * 2) + 8)

    full = _anchors_plan(capsys, "anchors.layers=all")
    assert full["tokens"] == 300_000 * 1024 and full["raw_bytes"] == pytest.approx(raw(64), rel=1e-5)
    assert 336e6 < full["raw_bytes"] / 300_000 < 337e6  # ≈ 335 MB a 1k-token sample, ~101 TB in all
    assert _anchors_plan(capsys)["raw_bytes"] == pytest.approx(raw(8), rel=1e-5)
    only_taps = _anchors_plan(capsys, "anchors.layers=[1, 16, 31, 46, 61]")
    assert (
        only_taps["raw_bytes"] == pytest.approx(raw(5), rel=1e-5)
        and 26e6 < only_taps["raw_bytes"] / 300_000 < 27e6
    )
    assert only_taps["bytes"] < only_taps["raw_bytes"]


def test_typo_fails_before_any_work(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    with open(TINY) as f:
        bad.write_text(f.read().replace("bundled_rows:", "bundled_rowz:"))
    store = tmp_path / "s"
    assert main(["run", str(bad), "--store", str(store)]) == 2
    assert "unknown key 'prompts.bundled_rowz'" in capsys.readouterr().err
    assert not store.exists()


@pytest.mark.parametrize("args", [["show", "abcd"], ["verify", "abcd"]])
def test_unknown_key_is_a_clear_error(tmp_path, capsys, args):
    assert main([*args, "--store", str(tmp_path)]) == 2
    assert "no artifact with key 'abcd'" in capsys.readouterr().err


def test_layers_the_teacher_does_not_have_fail_before_any_work(tmp_path, capsys):
    store = tmp_path / "s"
    assert main(["run", TINY, "--store", str(store), "--set", "anchors.layers=[0, 999]"]) == 2
    assert "anchors.layers=[0, 999] does not fit the teacher's 64 decoder layers" in capsys.readouterr().err
    assert not store.exists()  # not even the teacher was built


def test_a_folder_is_not_taken_for_an_artifact_or_a_store(tmp_path, capsys):
    artifact = tmp_path / "s" / "prompts" / "0123456789abcdef"
    (artifact / "_markers").mkdir(parents=True)
    (artifact / "_plan.json").write_text("{}")
    root = str(tmp_path / "s")
    for args in (["show", "./prompts"], ["verify", "prompts"], ["show", "../s/prompts/0123"]):
        assert main([*args, "--store", root]) == 2
        assert "is not an artifact key" in capsys.readouterr().err
    assert main(["ls", "--store", str(tmp_path / "s" / "prompts")]) == 2
    assert "is the prompts stage folder of a store, not a store root: use --store" in capsys.readouterr().err
    assert main(["verify", "--store", str(artifact)]) == 2
    assert "is an artifact folder, not a store root" in capsys.readouterr().err


def test_a_temporary_server_that_does_not_start_gets_one_line_of_advice(tmp_path):
    """`a2d run` with no Prefect server starts a temporary one; when it does not come up in time (the
    timeout forced to 0 here, as a loaded machine forces it past Prefect's 20 s), the user gets one line
    naming the setting, no traceback."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "0"}
    cmd = [
        sys.executable,
        "-m",
        "a2d.flows.cli",
        "run",
        TINY,
        "--until",
        "teacher",
        "--store",
        str(tmp_path / "s"),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    err = [line for line in done.stderr.splitlines() if line.startswith("a2d: error")]
    assert len(err) == 1 and "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=300" in err[0]
    assert "Traceback" not in done.stderr


def test_the_servers_startup_timeout_reaches_prefect_though_prefect_is_already_imported(monkeypatch):
    """Prefect reads its settings when imported, before `main` can set the environment: the
    temporary server's startup timeout (180 s unless the user sets one) must still reach it."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as TIMEOUT

    from a2d.flows import cli

    seen = []
    monkeypatch.delenv(cli.STARTUP_TIMEOUT_VAR, raising=False)
    monkeypatch.setattr(cli, "cmd_ls", lambda args: seen.append(TIMEOUT.value()) or 0)
    assert TIMEOUT.value() == 20  # Prefect's own default, read at import
    assert cli.main(["ls"]) == 0 and seen == [cli.STARTUP_TIMEOUT_S]
    monkeypatch.setenv(cli.STARTUP_TIMEOUT_VAR, "300")
    assert cli.main(["ls"]) == 0 and seen[-1] == 300
