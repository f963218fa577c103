"""Responses benchmark: the stage's generation with its KV buffers against transformers' growing cache.

    python benchmarks/responses.py [--config configs/demo.yaml] [--store PATH] [--shards 4,5,22,23,33,34]
        [--threads 2]

On pairs of the demo store's prompts shards (bundled, code, docs), greedy with the demo's anchor
capture, at the config's `run.batch_size`, through the stage's own loop (`tasks.responses._generate`):

- `before`: transformers' `DynamicCache`, which concatenates the whole cache with each token;
- `now`: `preallocated_cache`, the buffers the stage generates into.

`--threads 2` generates each pair's two shards at once in two threads, as `run.workers: 2` runs
them; `--threads 1` one after the other. The two arms alternate per pair in one run. Writes
benchmarks/results/responses.json: seconds a row per pair and in all, the ratio, and the share of
responses that came out token for token the same.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from a2d.models import generate as gen  # noqa: E402
from a2d.models.capture import resolve_layers  # noqa: E402
from a2d.models.teacher import decoder_layers  # noqa: E402
from a2d.stores.parquet import read_shard  # noqa: E402
from a2d.tasks import responses as stage  # noqa: E402
from a2d.tasks import teacher as teacher_stage  # noqa: E402
from benchmarks.common import built, write_result  # noqa: E402


def pair_seconds(
    model, tok, shards: list[list[dict]], spec, opts, layers, now: bool, threads: int
) -> tuple[float, list]:
    """Wall seconds for the shards (in `threads` threads at once, or in turn), each one's responses."""
    out: list = [None] * len(shards)

    def run(i: int) -> None:
        out[i] = stage._generate(model, tok, shards[i], spec, opts, f"s{i}", layers)[0]

    growing = contextlib.nullcontext() if now else mock.patch.object(gen, "preallocated_cache", _growing)
    start = time.perf_counter()
    with growing:
        if threads == 1:
            [run(i) for i in range(len(shards))]
        else:
            workers = [threading.Thread(target=run, args=(i,)) for i in range(len(shards))]
            [t.start() for t in workers]
            [t.join() for t in workers]
    return time.perf_counter() - start, out


def _growing(model, capacity):
    """The cache generation used before: transformers' own, grown by concatenation."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"))
    ap.add_argument("--store", default=None)
    ap.add_argument("--shards", default="4,5,22,23,33,34", help="prompts shard numbers, taken in pairs")
    ap.add_argument(
        "--threads", type=int, default=2, choices=[1, 2], help="a pair's shards at once (2) or in turn"
    )
    args = ap.parse_args()
    cfg, refs, st = built(args.config, args.store, "prompts")
    numbers = [int(x) for x in args.shards.split(",")]
    if len(numbers) % 2:
        raise SystemExit(
            "--shards takes pairs of shard numbers (two generate at once, as workers: 2 runs them)"
        )
    model, tok = teacher_stage.load(st, refs["teacher"], cfg.teacher, cfg.teacher.load, "cpu")
    layers = resolve_layers(cfg.anchors.layers, len(decoder_layers(model)))
    opts = cfg.run.model_copy(update={"progress": False})
    pairs, totals = [], {"before": 0.0, "now": 0.0}
    rows_total, same, count = 0, 0, 0
    for p in range(0, len(numbers), 2):
        shards = [
            read_shard(st.loc(refs["prompts"]), f"part-{n:05d}.parquet").to_pylist()
            for n in numbers[p : p + 2]
        ]
        rows = sum(len(s) for s in shards)
        order = ["before", "now"] if (p // 2) % 2 == 0 else ["now", "before"]
        seconds, outs = {}, {}
        for name in order:
            seconds[name], outs[name] = pair_seconds(
                model, tok, shards, cfg.responses, opts, layers, name == "now", args.threads
            )
            print(
                f"shards {numbers[p : p + 2]} {name}: {seconds[name]:.1f} s ({seconds[name] / rows:.3f} s a row)"
            )
        for a, b in zip(outs["before"], outs["now"], strict=True):
            same += sum(x == y for x, y in zip(a, b, strict=True))
            count += len(a)
        kinds = sorted({r["kind"] for s in shards for r in s})
        pairs.append(
            {
                "shards": numbers[p : p + 2],
                "rows": rows,
                "kinds": kinds,
                "mean_prompt_tokens": round(sum(len(r["prompt_ids"]) for s in shards for r in s) / rows, 1),
                "seconds_per_row": {k: round(v / rows, 4) for k, v in seconds.items()},
                "speedup": round(seconds["before"] / seconds["now"], 3),
            }
        )
        for k in totals:
            totals[k] += seconds[k]
        rows_total += rows
    result = {
        "teacher": cfg.teacher.source,
        "threads": torch.get_num_threads(),
        "before": "transformers' DynamicCache (the whole cache concatenated each token)",
        "now": "preallocated_cache (buffers sized for the generation)",
        "batch_size": opts.batch_size,
        "shard_threads": args.threads,
        "max_new_tokens": cfg.responses.max_new_tokens,
        "capture_layers": layers,
        "rows": rows_total,
        "seconds_per_row": {k: round(v / rows_total, 4) for k, v in totals.items()},
        "speedup": round(totals["before"] / totals["now"], 3),
        "same_responses": round(same / max(count, 1), 4),
        "pairs": pairs,
    }
    print(
        f"before {result['seconds_per_row']['before']} s a row, now {result['seconds_per_row']['now']}: "
        f"{result['speedup']}x; same responses {result['same_responses']}"
    )
    write_result("responses", result)


if __name__ == "__main__":
    main()
