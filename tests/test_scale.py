"""Scale-out on one machine: an S3 store (moto's server on 127.0.0.1), Dask shard fan-out, 2-process training."""

import json
import os
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load, load_file

from a2d.flows.cli import main
from a2d.flows.pipeline import STEPS, pipeline
from a2d.flows.pipeline import plan as pipeline_plan
from a2d.stores import checkpoints
from a2d.stores.artifacts import ArtifactStore
from tests.conftest import LLAMA_PIPELINE as LLAMA
from tests.conftest import ROOT, tiny_config

# no drafter stage (one more artifact, written to S3 as every other is): its training process is the
# costliest stage of a tiny run; tiny.yaml's eval list names the drafter's decoder
S3_RUN = (*LLAMA, "drafter=null", "eval.decoders=null")


def _run(store: str, until: str) -> list[str]:
    """`a2d run` of the tiny config with S3_RUN's overrides, up to `until`."""
    return ["run", f"{ROOT}/configs/tiny.yaml", "--until", until, "--store", store] + [
        a for s in S3_RUN for a in ("--set", s)
    ]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[str, dict]:
    """A local store of the tiny LLAMA pipeline through trajectories (no drafter stage: the drafter
    test trains its own) and its refs, built once for the tests here: their own overrides (head,
    drafter, runner) leave these stages' keys alone."""
    store = str(tmp_path_factory.mktemp("llama") / "store")
    return store, pipeline(tiny_config(store, *LLAMA, "drafter=null"), until="trajectories")


@pytest.mark.slow
def test_s3_store_reuse_resume_verify_and_ls(s3, capsys):
    cfg = tiny_config(s3, *S3_RUN)
    refs = pipeline(cfg, until="head")
    st = ArtifactStore(s3)
    assert all(st.is_complete(r) for r in refs.values())
    assert st.verify(refs["anchors"]) == [] and st.verify(refs["head"]) == []
    capsys.readouterr()
    assert main(["ls", "--json", "--store", s3]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["stage"] for r in rows if r["complete"]} == {
        "teacher",
        "prompts",
        "responses",
        "anchors",
        "trajectories",
        "head",
    }

    # A second run rewrites nothing: every object keeps its modification time.
    fs = st.root.fs
    before = {p: fs.info(p)["LastModified"] for p in fs.find(st.root.path)}
    assert main(_run(s3, "head")) == 0
    assert capsys.readouterr().out.count("reuse ") == 6  # teacher .. head
    assert {p: fs.info(p)["LastModified"] for p in fs.find(st.root.path)} == before

    # Per-shard resume: drop one anchors shard's marker and the manifest; only that shard is rebuilt
    # (a run until anchors: the later stages' keys do not change, so they would only be reused).
    loc = st.loc(refs["anchors"])
    loc.remove("_markers/part-00001.json")
    loc.remove("manifest.json")
    assert not st.is_complete(refs["anchors"])
    assert main(_run(s3, "anchors")) == 0
    after = {p: fs.info(p)["LastModified"] for p in fs.find(loc.path)}
    rebuilt = {p for p in after if before.get(p) != after[p]}
    assert rebuilt and all("part-00001" in p or p.endswith(("manifest.json", "_plan.json")) for p in rebuilt)

    # The head's checkpoints are mirrored into the store, so a retry on another machine (empty local
    # work folder) resumes from the last one there instead of starting over.
    from a2d.tasks.head import SHARD
    from a2d.tasks.training import workdir

    head = st.loc(refs["head"])
    assert head.listdir("checkpoints") == ["step-00000003", "step-00000006"]
    first = load(head.read_bytes(f"{SHARD}/adapter_model.safetensors"))
    for rel in ("manifest.json", f"_markers/{SHARD}.json", SHARD, "checkpoints/step-00000006"):
        head.remove(rel)
    shutil.rmtree(workdir(st, refs["head"]))
    again = STEPS["head"].run(cfg, refs)  # the head stage alone, as the pipeline runs it
    assert again == refs["head"]
    history = st.manifest(again)["shards"][SHARD]["history"]
    assert [h["step"] for h in history] == [4, 5, 6]
    resumed = load(head.read_bytes(f"{SHARD}/adapter_model.safetensors"))
    assert resumed.keys() == first.keys()
    for k in first:
        torch.testing.assert_close(resumed[k], first[k], atol=1e-6, rtol=0)

    # A corrupted object makes verify exit 1 naming it.
    name = next(p for p in fs.find(loc.path) if "part-00002.zarr/hidden/c" in p)
    data = bytearray(fs.cat_file(name))
    data[0] ^= 0xFF
    fs.pipe_file(name, bytes(data))
    capsys.readouterr()
    assert main(["verify", refs["anchors"].key, "--store", s3]) == 1
    assert "part-00002.zarr/hidden/c" in capsys.readouterr().out


@pytest.mark.slow
def test_dask_fan_out_matches_threads(llama, tmp_path):
    """The same shards from a Dask cluster of worker processes as from threads; the cluster's task
    stream shows the shard tasks ran there (on its workers, not in this process)."""
    from distributed import Client, LocalCluster, get_task_stream
    from prefect.settings import PREFECT_API_URL

    os.environ["PREFECT_API_URL"] = PREFECT_API_URL.value()  # Dask worker processes report to the harness
    store, built = llama  # the same config's stages from threads
    try:
        with (
            LocalCluster(
                n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
            ) as cluster,
            Client(cluster) as client,
            get_task_stream(client) as stream,
        ):
            config = tiny_config(
                str(tmp_path / "dask"),
                *LLAMA,
                "run.runner=dask",
                "run.workers=2",
                f"run.dask_address={cluster.scheduler_address}",
            )
            dask = pipeline(config, until="anchors")
            worker_pids = set(client.run(os.getpid).values())
            workers = set(cluster.scheduler.workers)
    finally:
        os.environ.pop("PREFECT_API_URL", None)
    ran = [t for t in stream.data if "_shard-" in str(t["key"])]
    kinds = Counter(str(t["key"]).split("-", 1)[0] for t in ran)
    assert kinds == {"prompts_shard": 3, "responses_shard": 3, "anchors_shard": 3}, kinds
    assert {t["worker"] for t in ran} <= workers and os.getpid() not in worker_pids
    threads = {k: built[k] for k in dask}
    assert dask == {
        k: v.model_copy(update={"uri": v.uri.replace(store, str(tmp_path / "dask"))})
        for k, v in threads.items()
    }
    for stage in ("responses", "anchors"):
        a = ArtifactStore(store).manifest(threads[stage])["shards"]
        b = ArtifactStore(str(tmp_path / "dask")).manifest(dask[stage])["shards"]
        assert {s: m["sha256"] for s, m in a.items()} == {s: m["sha256"] for s, m in b.items()}


@pytest.mark.slow
def test_two_gloo_processes_agree_with_one_resume_exactly_and_load_single_process(llama, tmp_path):
    from a2d.tasks.train import launch_command, run_training, train
    from tests.test_head import _job

    store, built = llama
    # SGD, not AdamW: Adam's first steps are ~lr·sign(g), so float noise in near-zero gradients (other
    # summation orders across processes) flips whole updates; SGD shows the gradients really agree.
    # No clipping (the pre-clip norms here are ~3-5): clipped to the same norm, a gradient summed over
    # ranks instead of averaged would give the same update and pass.
    cfg = tiny_config(
        store,
        *LLAMA,
        "head.optimizer=sgd",
        "head.lr=0.05",
        "head.max_grad_norm=1000000",
        "head.steps=2",
        "head.micro_batch_size=2",
        "head.align_layers=1",
        "train.checkpoint_every=2",
    )
    refs = built  # its head options keep these stages' keys:
    assert refs == {k: v for k, v in pipeline_plan(cfg).items() if k in refs}
    one = _job(store, cfg, refs, cfg.head.model_copy(update={"grad_accum": 2}), workdir_=tmp_path / "one")
    two = _job(store, cfg, refs, cfg.head, workdir_=tmp_path / "two").model_copy(
        update={"train": cfg.train.model_copy(update={"num_processes": 2})}
    )
    assert launch_command(tmp_path / "j.json", two.train)[2:4] == [
        "accelerate.commands.launch",
        "--num_processes",
    ]
    train(one)  # the 1-process reference in this process: the trainer's code without a launch
    # the 2-process run is stopped after step 1 (its checkpoint), then resumed by 2 processes
    run_training(two.model_copy(update={"stop_after": 1}))
    assert checkpoints.latest(tmp_path / "two" / "checkpoints").name == "step-00000001"
    resumed = run_training(two)
    assert [h["step"] for h in resumed["history"]] == [2]

    def final(run: str) -> dict:
        ckpt = tmp_path / run / "checkpoints" / "step-00000002"
        return {
            **load_file(ckpt / "adapter" / "adapter_model.safetensors"),
            **load_file(ckpt / "extras.safetensors"),
        }

    a, b = final("one"), final("two")
    assert a.keys() == b.keys() and "mask_embedding" in a
    for k in a:  # LoRA weights and the mask embedding: 2 resumed processes = 1 uninterrupted process
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4)
    assert any(v.abs().max() > 1e-4 for k, v in a.items() if "lora_B" in k)  # training did move the weights
    assert (a["mask_embedding"] - _initial_mask(store, refs)).abs().max() > 1e-5
    assert (
        json.loads((tmp_path / "two" / "checkpoints" / "step-00000002" / "state.json").read_text())["world"]
        == 2
    )
    # the single-process loader reads the 2-process checkpoint
    from peft import PeftModel

    from a2d.models.teacher import load_teacher
    from a2d.tasks.teacher import local_dir

    base, _ = load_teacher(local_dir(ArtifactStore(store), refs["teacher"]))
    model = PeftModel.from_pretrained(
        base, str(tmp_path / "two" / "checkpoints" / "step-00000002" / "adapter")
    )
    assert sum(1 for _, m in model.named_modules() if hasattr(m, "lora_A")) == 14


def _initial_mask(store: str, refs: dict) -> torch.Tensor:
    """The untrained student's mask embedding (the mean of the teacher's embeddings)."""
    from a2d.models.student_build import build_student
    from a2d.tasks.teacher import local_dir

    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "rslora": False}
    student = build_student(
        local_dir(ArtifactStore(store), refs["teacher"]),
        "none",
        "float32",
        "cpu",
        lora,
        "bidirectional",
        "causal",
        32,
    )
    return student.mask.weight.detach()


@pytest.mark.slow
def test_two_gloo_processes_train_the_drafter_as_one_does(llama, tmp_path):
    """The drafter on the one training process path: 2 gloo processes, each training half of every
    step's responses, end with the weights of 1 process training all of them."""
    from a2d.models.drafter import DFlashDraftModel
    from a2d.tasks.drafter import key_inputs
    from a2d.tasks.train import TrainJob, run_training, train

    store, built = llama
    # No clipping: clipped to one norm, a gradient summed over ranks instead of averaged would pass;
    # AdamW hides a gradient's scale, so the logged pre-clip norms are compared too. A non-constant
    # schedule (warmup, then linear decay) makes the scheduler's steps count.
    cfg = tiny_config(
        store,
        *LLAMA,
        "drafter.steps=3",
        "drafter.micro_batch_size=4",
        "drafter.max_grad_norm=1000000",
        "drafter.warmup_steps=1",
        "drafter.lr_schedule=linear",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=3",
    )
    refs = built
    assert refs["anchors"] == pipeline_plan(cfg)["anchors"]  # its drafter options keep the anchors' key
    st = ArtifactStore(store)
    inputs = {k: refs[k] for k in ("teacher", "responses", "anchors")}
    ref = st.ref("drafter", key_inputs(cfg.drafter, *(refs[k].key for k in inputs)).key)

    def job(folder: str, processes: int) -> TrainJob:
        opts = cfg.train.model_copy(update={"num_processes": processes})
        return TrainJob(
            store_uri=st.root.uri,
            ref=ref,
            inputs=inputs,
            spec=cfg.drafter,
            train=opts,
            workdir=str(tmp_path / folder),
        )

    one = train(job("one", 1))  # in this process: the loop without a launch
    two = run_training(job("two", 2))
    assert [h["step"] for h in two["history"]] == [1, 2, 3]
    for a, b in zip(one["history"], two["history"], strict=True):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4) and b["lr"] == a["lr"]
    assert len({h["lr"] for h in one["history"]}) == 3

    def weights(folder: str, step: int) -> dict:
        return DFlashDraftModel.load(tmp_path / folder / f"checkpoints/step-{step:08d}/adapter").state_dict()

    a, b = weights("one", 3), weights("two", 3)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4)
    first = weights("one", 1)
    assert any(not torch.equal(first[k], a[k]) for k in a)  # steps 2-3 moved the weights
