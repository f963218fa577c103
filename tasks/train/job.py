"""What a training process is given (a JSON job) and the lines it reports back on."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pydantic import BaseModel, ConfigDict

from a2d.specs import DrafterSpec, HeadSpec, TeacherSpec, TrainOptions, VFMSpec
from a2d.stores.artifacts import ArtifactRef


class TrainJob(BaseModel):
    """Everything one training needs, passed as JSON: the artifact it trains, what it reads, how."""

    model_config = ConfigDict(extra="forbid")
    store_uri: str  # absolute: the training process resolves nothing relative
    ref: ArtifactRef  # the artifact trained (its stage names the objective)
    inputs: dict[str, ArtifactRef]  # the upstream artifacts, by stage
    spec: HeadSpec | VFMSpec | DrafterSpec
    train: TrainOptions
    teacher_spec: TeacherSpec | None = None  # head: how the student's base is loaded
    device: str = "cpu"
    workdir: str
    stop_after: int | None = None  # for tests/debugging: exit cleanly after this step
    max_train_rows: int | None = None  # drafter: train on that many responses (the data-curve benchmark)

    @property
    def stage(self) -> str:
        return self.ref.stage


def emit(kind: str, **fields: Any) -> None:
    """A structured line the parent task parses (progress, metrics, W&B link); rank 0 only.

    Every rank shares the parent's stdout pipe, so the line goes out in one write: a write under
    PIPE_BUF bytes is never interleaved with another process's output.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        return
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"A2D {kind} {json.dumps(fields, sort_keys=True)}\n".encode())
