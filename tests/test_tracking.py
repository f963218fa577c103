"""W&B tracking: a finished run's record is on disk when `Tracker.finish` returns."""

import json


def test_an_offline_run_is_flushed_when_the_tracker_finishes(tmp_path, monkeypatch):
    from a2d.tasks.tracking import Tracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    values = [1.2345678 + i for i in range(5)]
    with Tracker("a2d-test", "vfm", "0123456789abcdef", {"note": "flush"}, tmp_path) as tracker:
        for step, v in enumerate(values, start=1):
            tracker.log({"loss": v}, step)
    (run,) = (tmp_path / "wandb").glob("offline-run-*-vfm-0123456789abcdef")
    record = next(run.glob("run-*.wandb")).read_bytes()  # read at once: no waiting on the writer
    assert all(json.dumps(v).encode() in record for v in values)
