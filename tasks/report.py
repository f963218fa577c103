"""Prefect artifacts a person wants to look at: a stage table, a Markdown lineage summary, progress."""

from __future__ import annotations

import re

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact

from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks.runtime import in_prefect_run


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


# the columns every stage's row has; the rest are the stage's own metrics (held-out τ, losses, ...)
STANDARD = ("stage", "key", "uri", "rows", "tokens", "bytes", "shards", "seconds", "reused", "resumed_shards")


def stage_row(store: ArtifactStore, ref: ArtifactRef, seconds: float, reused: bool) -> dict:
    manifest = store.manifest(ref)
    metrics = manifest.get("metrics", {})
    row = {
        "stage": ref.stage,
        "key": ref.key,
        "uri": ref.uri,
        "rows": manifest["rows"],
        "tokens": manifest["tokens"],
        "bytes": manifest["bytes"],
        "shards": len(manifest["shards"]),
        "seconds": round(seconds, 2),
        "reused": reused,
        "checksums_verified": True,
    }
    for name, value in metrics.items():
        if isinstance(value, int | float | str | bool) and name not in row:
            row[name] = value
    return row


def publish_stage_table(
    store: ArtifactStore, ref: ArtifactRef, seconds: float, reused: bool, resumed_shards: int = 0
) -> None:
    """A table artifact (stable key per stage, so the UI shows history) and a lineage summary;
    `resumed_shards`: shards a killed or failed run had finished, kept rather than rebuilt."""
    if not in_prefect_run():
        return
    row = stage_row(store, ref, seconds, reused) | {"resumed_shards": resumed_shards}
    did = "reused" if reused else f"resumed, {resumed_shards} shards kept" if resumed_shards else "built"
    create_table_artifact(
        key=artifact_key("a2d", ref.stage),
        table=[row],
        description=f"**{ref.stage}** `{ref.key}` ({did} in {seconds:.1f} s): {row['rows']} rows, "
        f"{row['tokens']} tokens, {row['bytes']:,} bytes in {row['shards']} shards at `{ref.uri}`"
        + "".join(f"; {k} {v}" for k, v in row.items() if k not in STANDARD and not isinstance(v, bool)),
    )
    lineage = store.lineage(ref)
    lines = [
        f"# {ref.stage} `{ref.key}`",
        "",
        f"- URI: `{ref.uri}`",
        f"- {'reused' if reused else 'built'} in {seconds:.1f} s; {row['rows']} rows, {row['tokens']} tokens, "
        f"{row['bytes']:,} bytes in {row['shards']} shards",
        "- upstream: " + (", ".join(f"`{u}`" for u in lineage["upstream"]) or "none"),
        "- downstream at publication (current lineage: `a2d show "
        + ref.key
        + "`): "
        + (", ".join(f"`{d}`" for d in lineage["downstream"]) or "none yet"),
    ]
    create_markdown_artifact(
        key=artifact_key("a2d", ref.stage, "summary"),
        markdown="\n".join(lines),
        description=f"{ref.stage} {ref.key}: where it lives, what it holds, its lineage",
    )


class Progress:
    """A Prefect progress artifact updated at most every `every` items (a no-op outside a run), keyed
    by what it counts (`a2d-responses-part-00001-progress`), so the Artifacts page names it."""

    def __init__(self, total: int, description: str, every: int = 1):
        self.total, self.done, self.every = max(total, 1), 0, max(every, 1)
        self.id = None
        if in_prefect_run():
            key = artifact_key("a2d", description, "progress")
            self.id = create_progress_artifact(progress=0.0, key=key, description=f"{description}: progress")

    def advance(self, n: int = 1) -> None:
        from prefect.artifacts import update_progress_artifact

        self.done += n
        if self.id is not None and (self.done % self.every == 0 or self.done >= self.total):
            update_progress_artifact(self.id, progress=100.0 * min(self.done, self.total) / self.total)
