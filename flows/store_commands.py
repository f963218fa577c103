"""The store's commands of the `a2d` command line: ls, show, verify (no flow, no Prefect server)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from a2d.specs import STAGES

DEFAULT_STORE = "./a2d-store"


def store_arg(args: argparse.Namespace) -> str:
    """The store root a command reads: --store, else $A2D_STORE, else the default."""
    return args.store or os.environ.get("A2D_STORE") or DEFAULT_STORE


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def format_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def cmd_ls(args: argparse.Namespace) -> int:
    from a2d.stores.artifacts import ArtifactStore

    store = ArtifactStore(store_arg(args))
    store.check_root()
    rows = [store.describe(r) for r in store.iter_refs(args.stage)]
    rows.sort(key=lambda r: (STAGES.index(r["stage"]) if r["stage"] in STAGES else 99, r["created"] or ""))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        r["state"] = "damaged" if r["damaged"] else "complete" if r["complete"] else "partial"
        r["shards"] = f"{r['shards_done']}/{r['shards_total']}"
        r["size"] = human_size(r["bytes"])
    print(
        format_table(rows, ["stage", "key", "state", "shards", "size", "created"]) if rows else "no artifacts"
    )
    for r in rows:
        for problem in r["damaged"]:
            print(f"  {r['stage']}/{r['key']}: {problem}; a rerun of the stage repairs it")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from a2d.stores.artifacts import ArtifactStore

    store = ArtifactStore(store_arg(args))
    store.check_root()
    ref = store.find(args.key)
    info = store.describe(ref)
    out: dict[str, Any] = {"artifact": info, "lineage": store.lineage(ref)}
    out["manifest"] = store.manifest(ref) if info["complete"] else store.plan(ref)
    out["sample"] = _sample_rows(store, ref, args.rows)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    manifest = out["manifest"] or {}
    print(f"{ref.stage}/{ref.key}  {'complete' if info['complete'] else 'PARTIAL'}  {ref.uri}")
    print(
        f"created {info['created']}  shards {info['shards_done']}/{info['shards_total']}  size {human_size(info['bytes'])}"
    )
    print("spec: " + json.dumps(manifest.get("spec", {}), sort_keys=True))
    if manifest.get("metrics"):
        print("metrics: " + json.dumps(manifest["metrics"], sort_keys=True))
    print("upstream:   " + (", ".join(out["lineage"]["upstream"]) or "none"))
    print("downstream: " + (", ".join(out["lineage"]["downstream"]) or "none"))
    for row in out["sample"]:
        print("  " + json.dumps(row, default=str)[:300])
    return 0


def _sample_rows(store: Any, ref: Any, n: int) -> list[dict[str, Any]]:
    """A few rows of the first finished Parquet shard, token lists shortened."""
    from a2d.stores.parquet import read_shard

    for name in sorted(store.loc(ref).listdir()):
        if name.endswith(".parquet"):
            rows = read_shard(store.loc(ref), name).slice(0, n).to_pylist()
            for row in rows:
                for k, v in row.items():
                    if isinstance(v, list) and len(v) > 12:
                        row[k] = [*v[:12], f"…({len(v)})"]
            return rows
    return []


def cmd_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from a2d.stores.artifacts import ArtifactStore

    store = ArtifactStore(store_arg(args))
    store.check_root()
    refs = [store.find(args.key)] if args.key else list(store.iter_refs())
    results = []
    for ref in tqdm(refs, desc="verify", disable=args.json or not sys.stderr.isatty()):
        problems = store.verify(ref)
        results.append({"stage": ref.stage, "key": ref.key, "ok": not problems, "problems": problems})
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['stage']}/{r['key']}")
            for p in r["problems"]:
                print(f"     {p}")
        print(f"{sum(r['ok'] for r in results)} of {len(results)} artifacts verified")
    return 0 if all(r["ok"] for r in results) else 1
