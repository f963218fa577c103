"""vfm and eval: exact VFM resume, reuse, K-step generation, and an eval report with every sampler."""

import json

import pytest
import torch
from safetensors.torch import load_file

from a2d.flows.pipeline import pipeline
from a2d.models.vfm import NoiseAdapter, kl_standard_normal
from a2d.specs import TrainOptions
from a2d.stores.artifacts import ArtifactStore
from a2d.tasks.vfm import train_vfm
from tests.conftest import tiny_config

SMALL = [
    "teacher.architecture=llama",
    "teacher.layers=2",
    "prompts.bundled_rows=40",
    "prompts.rows_per_shard=20",
    "prompts.eval_fraction=0.2",
    "responses.max_new_tokens=12",
    "head.steps=4",
    "head.micro_batch_size=4",
    "head.align_layers=2",
    "vfm.steps=4",
    "vfm.max_len=12",
    "eval.max_samples=3",
    "eval.max_new_tokens=8",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("vfm-eval"))
    cfg = tiny_config(store, *SMALL)
    return store, cfg, pipeline(cfg, until="eval")


def test_kl_is_zero_only_at_the_prior():
    assert float(kl_standard_normal(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))) == 0.0
    assert float(kl_standard_normal(torch.ones(1, 2, 3), torch.zeros(1, 2, 3))) == pytest.approx(1.5)


def test_vfm_resume_is_exact_and_the_artifact_is_reused(built, tmp_path):
    store, cfg, refs = built
    st = ArtifactStore(store)
    opts = TrainOptions(checkpoint_every=2, log_every=100)
    train_vfm(st, refs["head"], refs["responses"], cfg.vfm, opts, tmp_path / "a", stop_after=2)
    resumed = train_vfm(st, refs["head"], refs["responses"], cfg.vfm, opts, tmp_path / "a")
    assert resumed["history"][0]["step"] == 3  # continued from the step-2 checkpoint
    train_vfm(st, refs["head"], refs["responses"], cfg.vfm, opts, tmp_path / "b")
    a = load_file(tmp_path / "a" / "checkpoints" / "step-00000004" / "adapter" / "noise_adapter.safetensors")
    b = load_file(tmp_path / "b" / "checkpoints" / "step-00000004" / "adapter" / "noise_adapter.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    published = NoiseAdapter.from_pretrained(st.loc(refs["vfm"]).local_path() / "noise_adapter")
    assert published.config["max_len"] == 12
    assert pipeline(cfg, until="vfm")["vfm"] == refs["vfm"]


def test_joint_lora_tuning_resumes_exactly_and_the_eval_uses_the_tuned_flow_map(built, tmp_path):
    from a2d.tasks.students import FLOW_MAP_LORA, load_flow_map, load_student

    store, cfg, refs = built
    st = ArtifactStore(store)
    spec = cfg.vfm.model_copy(update={"tune_lora": True, "lora_lr": 1e-3})
    opts = TrainOptions(checkpoint_every=2, log_every=100)
    train_vfm(st, refs["head"], refs["responses"], spec, opts, tmp_path / "a", stop_after=2)
    train_vfm(st, refs["head"], refs["responses"], spec, opts, tmp_path / "a")
    train_vfm(st, refs["head"], refs["responses"], spec, opts, tmp_path / "b")
    ckpt = "checkpoints/step-00000004/extras.safetensors"
    a, b = load_file(tmp_path / "a" / ckpt), load_file(tmp_path / "b" / ckpt)
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)

    # Through the pipeline: a new vfm key (tune_lora is semantic), the tuned LoRA published with the
    # noise adapter, and the eval's flow map carrying it while the head's own student is untouched.
    tuned_cfg = cfg.model_copy(update={"vfm": spec})
    tuned = pipeline(tuned_cfg, until="vfm")
    assert tuned["vfm"] != refs["vfm"] and tuned["head"] == refs["head"]
    assert (st.loc(tuned["vfm"]).local_path() / "noise_adapter" / FLOW_MAP_LORA).is_file()
    head_student, _ = load_student(st, refs["head"])
    flow_map = load_flow_map(st, tuned["vfm"], head_student)
    assert flow_map is not head_student
    assert load_flow_map(st, refs["vfm"], head_student) is head_student  # frozen: the head itself
    head_lora = dict(head_student.model.named_parameters())
    moved = [
        n for n, p in flow_map.model.named_parameters() if "lora_" in n and not torch.equal(p, head_lora[n])
    ]
    assert moved  # joint tuning changed the flow map's adapters


@pytest.mark.slow
def test_sigterm_to_a_vfm_flow_run_checkpoints_the_current_step_and_a_rerun_resumes(built, tmp_path):
    """The VFM loop runs inside its task's worker thread: SIGTERM to the flow run's process reaches it
    through the flow's main thread; it checkpoints the step it is on, the run fails with a "rerun to
    resume" error, and a rerun continues from that step."""
    import re

    from a2d.flows.pipeline import STEPS, plan
    from a2d.stores import checkpoints
    from tests.test_head import sigterm_flow_run

    store, cfg, refs = built
    cfg = cfg.model_copy(
        update={
            "vfm": cfg.vfm.model_copy(update={"steps": 30}),
            "train": cfg.train.model_copy(update={"log_every": 1, "checkpoint_every": 100}),
        }
    )
    vfm = plan(cfg, "vfm")["vfm"]
    err = sigterm_flow_run(cfg, "vfm", tmp_path, "vfm step 1/")
    assert "rerun the vfm stage to resume" in err, err[-3000:]
    step = int(re.search(r"vfm training stopped by SIGTERM at step (\d+)", err).group(1))
    assert 1 <= step < 30
    last = checkpoints.latest(ArtifactStore(store).loc(vfm).local_path() / "checkpoints")
    assert last is not None and last.name == f"step-{step:08d}"
    resumed = STEPS["vfm"].run(cfg, plan(cfg, "head"))
    history = ArtifactStore(store).manifest(resumed)["shards"]["noise_adapter"]["history"]
    assert resumed == vfm and history[0]["step"] == step + 1 and history[-1]["step"] == 30


def test_eval_reports_every_sampler(built):
    store, cfg, refs = built
    st = ArtifactStore(store)
    out = st.loc(refs["eval"]).local_path() / "report"
    doc = json.loads((out / "metrics.json").read_text())
    names = set(doc["samplers"])
    assert names == {  # configs/tiny.yaml: thresholds [0.9, 0.5], entropy [1.0], VFM K in [1, 2]
        "ar:greedy",
        "head:conf0.9",
        "head:conf0.5",
        "head:k1",
        "d3llm:ent1",
        "vfm:k1",
        "vfm:k2",
        "untrained:k1",
    }
    ar = doc["samplers"]["ar:greedy"]
    assert ar["tpf"] == 1.0 and ar["token_agreement"] == 1.0  # the teacher agrees with its own greedy output
    assert (
        doc["samplers"]["head:k1"]["tpf"] >= 1.0
        and doc["samplers"]["vfm:k1"]["tpf"] > doc["samplers"]["vfm:k2"]["tpf"]
    )
    report = (out / "report.md").read_text()
    assert all(name in report for name in names)
    assert (out / "speed_quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert st.verify(refs["eval"]) == []


def test_every_stage_manifest_spec_hashes_to_its_key(built):
    """The key, the plan and the manifest come from one `key_inputs` per stage: they cannot drift."""
    import importlib

    from a2d.flows.pipeline import plan
    from a2d.stores.keys import artifact_key

    store, cfg, refs = built
    st = ArtifactStore(store)
    assert plan(cfg) == refs  # planning from specs names exactly what the run built
    for stage, ref in refs.items():
        m = st.manifest(ref)
        module = importlib.import_module(f"a2d.tasks.{'evaluate' if stage == 'eval' else stage}")
        assert m["format_version"] == module.FORMAT_VERSION
        assert artifact_key(stage, m["format_version"], m["spec"], m["upstream"]) == ref.key, stage


def test_a_new_sampler_changes_the_eval_key():
    """The eval key lists its samplers, so adding one invalidates old eval artifacts by itself."""
    from a2d.specs import EvalSpec
    from a2d.tasks import evaluate

    up = {"teacher": "t" * 16, "responses": "r" * 16, "head": "h" * 16, "vfm": "v" * 16}
    spec = EvalSpec()
    base = evaluate.key_inputs(spec, up)
    assert base.payload["samplers"] == evaluate.sampler_names(spec, with_vfm=True)
    assert evaluate.key_inputs(spec.model_copy(update={"thresholds": (0.9,)}), up).key != base.key
    original = evaluate.sampler_names
    try:
        evaluate.sampler_names = lambda s, with_vfm: [*original(s, with_vfm), "new:sampler"]
        assert evaluate.key_inputs(spec, up).key != base.key
    finally:
        evaluate.sampler_names = original
