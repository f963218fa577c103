"""teacher stage: materialise the teacher checkpoint as an artifact, and load it back for forwards."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from prefect import task

from a2d.models import teacher as tm
from a2d.specs import LoadSpec, TeacherSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, cache_root, hash_local_tree
from a2d.stores.keys import KeyInputs, dir_sha256, sha256_file_cached

STAGE = "teacher"
# 2: config.json carries rope_theta at the top level beside rope_parameters (4.x readers)
FORMAT_VERSION = 2
SHARD = "model"


def source_identity(spec: TeacherSpec) -> dict[str, Any]:
    """What identifies the weights beyond the spec: content hashes of local inputs."""
    if spec.source == "local":
        path = Path(spec.path or "").expanduser()
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ValueError(
                f"teacher.path {path} is not a model directory: it must hold config.json and weights"
            )
        return {"content_sha256": dir_sha256(path)}
    if spec.source == "smollm2":
        return {"gguf": tm.SMOLLM2_GGUF, "gguf_sha256": sha256_file_cached(tm.smollm2_gguf_path())}
    return {}


def key_inputs(spec: TeacherSpec) -> KeyInputs:
    """The teacher key: the source spec and the content hash of local inputs (load options do not count)."""
    return KeyInputs(STAGE, FORMAT_VERSION, {**spec.key_fields(), **source_identity(spec)}, {})


def build(spec: TeacherSpec, out: Path) -> None:
    """Write the teacher's HF directory to `out` (a local scratch path)."""
    if spec.source == "random":
        tm.build_random_teacher(spec.architecture, spec.layers, spec.hidden, spec.seed, out, spec.dtype)
    elif spec.source == "smollm2":
        tm.convert_smollm2(out, spec.dtype)
    elif spec.source == "local":
        tm.copy_pretrained(str(Path(spec.path).expanduser()), out, spec.dtype, spec.trust_remote_code, None)
    else:
        tm.copy_pretrained(spec.repo_id, out, spec.dtype, spec.trust_remote_code, spec.revision)


@task(name="teacher-materialise", task_run_name="teacher-{ref.key}", retries=0)
def materialise(store_uri: str, ref: ArtifactRef, spec: TeacherSpec) -> dict:
    """Build the checkpoint into scratch, publish it as the `model` shard, write its marker."""
    store = ArtifactStore(store_uri)
    with store.shard_output(ref, SHARD) as out:
        build(spec, out)
        hashes = hash_local_tree(out)
        info = tm.describe_config(out)
    files = {f"{SHARD}/{rel}": h for rel, h in hashes.items()}
    return store.write_marker(ref, SHARD, files, {"rows": 0, "tokens": 0, "architecture": info})


_LOCAL_LOCK = threading.RLock()


def local_dir(store: ArtifactStore, ref: ArtifactRef) -> Path:
    """A local directory holding the teacher: the artifact itself on disk, else a verified download."""
    with _LOCAL_LOCK:
        return store.local_copy(ref, SHARD, cache_root())


def trusts_remote_code(store: ArtifactStore, ref: ArtifactRef) -> bool:
    """Whether the teacher was materialised with custom modelling code allowed: only then may
    anything built from it (students, the eval's models) run that code."""
    return bool(store.manifest(ref)["spec"].get("trust_remote_code", False))


_MODELS: dict[tuple, tuple] = {}


def load(store: ArtifactStore, ref: ArtifactRef, spec: TeacherSpec, load_spec: LoadSpec, device: str):
    """Load (once per process) the materialised teacher for inference."""
    cache_key = (ref.uri, load_spec, device)
    with _LOCAL_LOCK:
        if cache_key not in _MODELS:
            _MODELS.clear()  # one teacher resident at a time
            path = local_dir(store, ref)
            with store.reading(ref):  # a damaged weight file is named, not a loader's error
                _MODELS[cache_key] = tm.load_teacher(
                    path, load_spec.dtype, load_spec.quantization, device, spec.trust_remote_code
                )
        return _MODELS[cache_key]
