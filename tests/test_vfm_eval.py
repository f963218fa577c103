"""vfm and eval: exact VFM resume, reuse, K-step generation, and an eval report with every decoder."""

import json
import logging
import math
import re
import time

import pytest
import torch
from safetensors.torch import load_file

from a2d.flows.pipeline import pipeline
from a2d.models.vfm import NoiseAdapter, kl_to_prior
from a2d.specs import TrainOptions
from a2d.stores.artifacts import ArtifactStore
from a2d.tasks.vfm import train_vfm
from tests.conftest import bare_forward_seconds, log_lines, tiny_config

SMALL = [  # the 27B family's architecture (Gated DeltaNet + full attention), 4 layers
    "teacher.architecture=qwen3_5",
    "teacher.layers=4",
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
    "eval.decoders=null",  # every decoder (configs/tiny.yaml runs a smoke set of them)
]


BUILT_SECONDS: dict[str, float] = {}  # the built pipeline's wall time, teacher through eval


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("vfm-eval"))
    cfg = tiny_config(store, *SMALL)
    # the runs' INFO lines reach the harness's API (the session logs at WARNING): the eval's per-decoder lines
    loggers = [logging.getLogger(f"prefect.{name}") for name in ("flow_runs", "task_runs")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
    try:
        start = time.monotonic()
        refs = pipeline(cfg, until="eval")
        BUILT_SECONDS[store] = time.monotonic() - start
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    return store, cfg, refs


def test_kl_is_zero_only_at_the_prior():
    m = torch.tensor([0.5, -1.0, 2.0])
    assert float(kl_to_prior(m.expand(1, 2, 3), torch.zeros(1, 2, 3), m)) == 0.0
    assert float(kl_to_prior(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), m)) == pytest.approx(
        0.5 * (0.25 + 1 + 4)
    )
    assert float(kl_to_prior(m.expand(1, 2, 3), torch.full((1, 2, 3), 1.0), m)) == pytest.approx(
        1.5 * (math.e - 2)
    )


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

    # Through the pipeline: tuning is the default; a frozen flow map is a new vfm key (tune_lora is
    # semantic) that reuses the head; the tuned LoRA is published with the noise adapter, and the
    # eval's flow map carries it while the head's own student is untouched.
    frozen_cfg = cfg.model_copy(update={"vfm": cfg.vfm.model_copy(update={"tune_lora": False})})
    frozen = pipeline(frozen_cfg, until="vfm")
    assert frozen["vfm"] != refs["vfm"] and frozen["head"] == refs["head"]
    assert (st.loc(refs["vfm"]).local_path() / "noise_adapter" / FLOW_MAP_LORA).is_file()
    head_student, _ = load_student(st, refs["head"])
    flow_map = load_flow_map(st, refs["vfm"], head_student)
    assert flow_map is not head_student
    assert load_flow_map(st, frozen["vfm"], head_student) is head_student  # frozen: the head itself
    head_lora = dict(head_student.model.named_parameters())
    moved = [
        n for n, p in flow_map.model.named_parameters() if "lora_" in n and not torch.equal(p, head_lora[n])
    ]
    assert moved  # joint tuning changed the flow map's adapters


@pytest.mark.slow
def test_sigterm_to_a_vfm_flow_run_checkpoints_the_current_step_and_a_rerun_resumes(built, tmp_path):
    """The VFM trains in a process its task (on a worker thread) launched: SIGTERM to the flow run's
    process reaches it through the flow's main thread; it checkpoints the step it is on, the run fails
    with a "rerun to resume" error, no trainer is left behind, and a rerun continues from that step."""
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
    err = sigterm_flow_run(cfg, "vfm", tmp_path, "train progress", trainer=f"{vfm.key}/job.json")
    assert "rerun the vfm stage to resume" in err, err[-3000:]
    step = int(re.search(r"vfm training stopped by SIGTERM at step (\d+)", err).group(1))
    assert 1 <= step < 30
    last = checkpoints.latest(ArtifactStore(store).loc(vfm).local_path() / "checkpoints")
    assert last is not None and last.name == f"step-{step:08d}"
    resumed = STEPS["vfm"].run(cfg, plan(cfg, "head"))
    history = ArtifactStore(store).manifest(resumed)["shards"]["noise_adapter"]["history"]
    assert resumed == vfm and history[0]["step"] == step + 1 and history[-1]["step"] == 30


def test_eval_reports_every_decoder(built):
    store, cfg, refs = built
    st = ArtifactStore(store)
    out = st.loc(refs["eval"]).local_path() / "report"
    doc = json.loads((out / "metrics.json").read_text())
    names = doc["decoder_order"]
    assert set(doc["decoders"]) == set(names)
    assert names == [  # configs/tiny.yaml: thresholds [0.9, 0.5], entropy [1.0], VFM K in [1, 2]
        "spec:drafter+lookup",  # the default decoder's row first (one prompt set: no per-set rows)
        "ar:greedy",
        "ar:student-base",
        "spec:drafter",
        "spec:lookup",
        "spec:head",
        "spec:head+lookup",
        "threshold:0.9",
        "threshold:0.5",
        "entropy:1",
        "head:k1",
        "vfm:k1",
        "vfm:k2",
        "spec:vfm",
        "untrained:k1",
    ]
    s = doc["decoders"]
    assert (
        doc["reference"] == "ar:student-base"
    )  # an NF4 base is not the teacher: its own decode is the reference
    assert s["ar:greedy"]["token_agreement"] == 1.0  # the eval's AR decode is the responses stage's
    assert doc["default_decoder"] == "spec:drafter+lookup"
    for lossless in (
        "spec:drafter+lookup",
        "spec:head",
        "spec:head+lookup",
        "spec:drafter",
        "spec:vfm",
        "spec:lookup",
    ):  # token for token the student's base model
        assert s[lossless]["mismatches_vs_reference"] == 0
        assert s[lossless]["outputs"] == s["ar:student-base"]["outputs"]
    # one verify forward per round; its tokens are the drafts that held plus the base's own next token
    assert s["spec:head"]["tpf"] == pytest.approx(s["spec:head"]["mean_accepted"] + 1)
    assert s["spec:head"]["no_draft_share"] == 0.0  # after each prompt's first forward, drafts every time
    # the drafter's own forward counts: one per drafted verify, so TPF = (accepted + 1) / 2 per round
    drafter = s["spec:drafter"]
    assert drafter["no_draft_share"] == 0.0
    assert drafter["tpf"] < (drafter["mean_accepted"] + 1) / 2 + 0.35
    # the VFM's flow-map forwards count: two forwards per round land the base token its clean row
    # computed, the accepted drafts and the correction, so TPF is about (accepted + 2) / 2
    vfm = s["spec:vfm"]
    assert vfm["tpf"] <= (vfm["mean_accepted"] + 2) / 2 + 0.2 and vfm["mean_accepted"] >= 0
    block = st.manifest(refs["head"])["metrics"]["diffusion_spec"]["block_size"]
    assert 1 < s["head:k1"]["tpf"] <= block  # a whole block per forward, never more
    max_len = min(cfg.eval.max_new_tokens, cfg.vfm.max_len)
    assert s["vfm:k1"]["tpf"] <= max_len / 2  # the prompt forward that conditions q(z | prompt) counts
    assert s["vfm:k1"]["tpf"] > s["vfm:k2"]["tpf"]
    for summary in s.values():
        lo, hi = summary["ci95"]["token_agreement"]
        assert lo <= summary["token_agreement"] <= hi
    assert doc["aup_metric"] in ("answer_accuracy", "token_agreement") and doc["aup_metric_reason"]
    report = (out / "report.md").read_text()
    assert all(name in report for name in names) and "95% CI" in report
    assert (out / "speed_quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert st.verify(refs["eval"]) == []


def test_the_eval_subflow_logs_each_decoder_and_every_artifact_has_a_key(built):
    """The pipeline's eval subflow logs one line per decoder (with tokens/s) as each finishes; every
    artifact its runs made has a key (the Artifacts page lists none unnamed) and a stage's page says
    what its artifact holds without a click into the table; the tiny run through eval takes a time
    bounded against a bare forward of its teacher (a run that went pathological once took 47 min)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    store, cfg, refs = built
    seconds, forward = BUILT_SECONDS[store], bare_forward_seconds(store, refs["teacher"])
    print(f"tiny pipeline teacher..eval: {seconds:.1f} s = {seconds / forward:.0f} bare forwards")
    # 7,100 bare forwards (104 s) alone on 2 AVX2 cores (2026-12-07); the pathological run: ~400,000
    assert seconds / forward < 30_000, f"the tiny run through eval took {seconds / forward:.0f} bare forwards"
    report = ArtifactStore(store).loc(refs["eval"]).local_path() / "report" / "metrics.json"
    ran = [n for n, d in json.loads(report.read_text())["decoders"].items() if "tokens_per_s" in d]
    assert {"spec:drafter+lookup", "ar:greedy"} <= set(ran)
    with get_client(sync_client=True) as client:
        evals = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["eval"])))
        first = min(
            (r for r in evals if r.parameters.get("store") == store), key=lambda r: r.expected_start_time
        )  # the fixture's run, the one that decoded (a later run of the same key reuses it)
        lines = log_lines(client, first.id, until="committed")
        top = client.read_task_run(first.parent_task_run_id).flow_run_id  # the fixture's pipeline run
        below = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[top]))
        runs = [top, *(r.id for r in client.read_flow_runs(flow_run_filter=below))]
        made = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=runs))
        )
    logged = [m[1] for line in lines if (m := re.match(r"eval (\S+): [\d.]+ tokens/s", line))]
    assert sorted(logged) == sorted(ran), (logged, ran)
    assert made and all(a.key for a in made), [a.type for a in made if not a.key]
    pages = {a.key: a.description for a in made if a.type == "table"}
    for stage in ("drafter", "anchors", "responses"):
        assert re.search(r"\d+ rows, \d+ tokens, [\d,]+ bytes", pages[f"a2d-{stage}"]), pages[f"a2d-{stage}"]


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


def test_a_new_decoder_changes_the_eval_key():
    """The eval key lists its decoders, so adding one invalidates old eval artifacts by itself."""
    from a2d.specs import EvalSpec
    from a2d.tasks import evaluate

    up = {"teacher": "t" * 16, "responses": "r" * 16, "head": "h" * 16, "vfm": "v" * 16}
    spec = EvalSpec()
    base = evaluate.key_inputs(spec, up)
    names = evaluate.decoder_names(spec, with_vfm=True)
    assert base.payload["decoders"] == [evaluate.KEY_SPELLING.get(n, n) for n in names]
    assert evaluate.key_inputs(spec.model_copy(update={"thresholds": (0.9,)}), up).key != base.key
    original = evaluate.decoder_names
    try:
        evaluate.decoder_names = lambda s, *has: [*original(s, *has), "new:decoder"]
        assert evaluate.key_inputs(spec, up).key != base.key
    finally:
        evaluate.decoder_names = original
    # a drafter upstream adds spec:drafter; eval.decoders picks a list (the AR references always run)
    with_drafter = evaluate.key_inputs(spec, {**up, "drafter": "d" * 16})
    assert "spec:drafter" in with_drafter.payload["decoders"] and with_drafter.key != base.key
    picked = spec.model_copy(update={"decoders": ("spec:head", "threshold:0.9")})
    assert evaluate.decoder_names(picked, True) == [
        "ar:greedy",
        "ar:student-base",
        "spec:head",
        "threshold:0.9",
    ]
    with pytest.raises(ValueError, match="no drafter artifact"):
        evaluate.decoder_names(spec.model_copy(update={"decoders": ("spec:drafter",)}), True, False)


def test_a2d_generate_streams_counts_and_explains_its_errors(built, tmp_path, capsys):
    from a2d.flows.cli import main

    store, cfg, refs = built
    args = ["generate", "--prompt", "What is 2 + 3?", "--store", store, "--max-new-tokens", "10"]
    outputs = {}
    for decoder in ("spec:head+lookup", "ar:student-base", "threshold:0.9"):
        assert main([*args, "--decoder", decoder, "--show-steps"]) == 0
        out, err = capsys.readouterr()
        assert f"head {refs['head'].key}" in err and " tokens, " in err and "tokens/s" in err
        steps = [line for line in out.splitlines() if line.startswith("forward ")]
        forwards = int(err.split(" forwards")[0].rsplit(" ", 1)[1])
        assert len(steps) == forwards  # one line per forward, each naming what it committed
        outputs[decoder] = out.split("\nforward ")[0]
    assert outputs["spec:head+lookup"] == outputs["ar:student-base"]  # lossless: the base model's own answer
    assert main([*args, "--decoder", "spec:nothing"]) == 2
    assert "unknown decoder 'spec:nothing'" in capsys.readouterr().err
    assert main([*args, "--head", "zzzz"]) == 2
    assert "no head artifact with key 'zzzz'" in capsys.readouterr().err
    assert main([*args[:-4], "--store", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "no trained head" in err and "a2d run" in err


# -- lm-evaluation-harness ------------------------------------------------------------------------------------
def test_lm_eval_cli_scores_the_eval_rows_like_the_eval_stage(built, tmp_path, monkeypatch):
    """`lm_eval --model a2d` through lm-eval's own command line, on the rows the eval stage exported:
    the same generations, so its exact match is the eval stage's answer accuracy for that decoder."""
    from lm_eval._cli import HarnessCLI

    from a2d.tasks.lm_eval_run import TASKS_DIR

    store, cfg, refs = built
    st = ArtifactStore(store)
    report = st.loc(refs["eval"]).local_path() / "report"
    doc = json.loads((report / "metrics.json").read_text())
    heldout = report / "heldout.jsonl"
    assert len(heldout.read_text().splitlines()) == doc["samples"]
    cli = [
        "lm_eval", "run", "--model", "a2d",
        "--model_args", f"store={store},head={refs['head'].key},decoder=spec:head",
        "--tasks", "a2d_bundled", "--include_path", str(TASKS_DIR),
        "--metadata", json.dumps({"path": str(heldout)}), "--limit", "4",
        "--gen_kwargs", f"max_gen_toks={cfg.eval.max_new_tokens}",
        "--output_path", str(tmp_path / "out"), "--log_samples", "--device", "cpu",
    ]  # fmt: skip
    # `lm_eval run …` as its console script runs it, in this process (a child re-imports torch)
    monkeypatch.setattr("sys.argv", cli)
    monkeypatch.chdir(tmp_path)
    harness = HarnessCLI()
    harness.execute(harness.parse_args())
    (result,) = (tmp_path / "out").rglob("results_*.json")
    scores = json.loads(result.read_text())
    assert (
        scores["results"]["a2d_bundled"]["exact_match,none"]
        == doc["decoders"]["spec:head"]["answer_accuracy"]
    )
    assert (
        scores["config"]["a2d_decoder"] == "spec:head" and scores["config"]["a2d_forwards"] >= doc["samples"]
    )
    (samples,) = (tmp_path / "out").rglob("samples_a2d_bundled_*.jsonl")
    generated = [json.loads(line)["resps"][0][0] for line in samples.read_text().splitlines()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(st.loc(refs["teacher"]).local_path() / "model")
    wanted = [tok.decode(t, skip_special_tokens=True) for t in doc["decoders"]["spec:head"]["outputs"]]
    assert sorted(generated) == sorted(wanted)  # token for token the eval stage's spec decode


def test_one_decoder_name_is_one_decoding_in_the_eval_lm_eval_and_a2d_generate(built, monkeypatch):
    """`spec:head` asked for by name: the lm-eval model reproduces the eval stage's tokens on the
    eval's prompts, and `a2d generate` the lm-eval model's on a chat prompt; each built it through
    the registry under that name."""
    from a2d.models import decoders as registry
    from a2d.stores.readers import read_held_out
    from a2d.tasks.generation import generate, prompt_ids
    from a2d.tasks.harness import A2DLM

    store, cfg, refs = built
    st = ArtifactStore(store)
    doc = json.loads((st.loc(refs["eval"]).local_path() / "report" / "metrics.json").read_text())
    asked, real = [], registry.build
    monkeypatch.setattr(
        registry, "build", lambda name, res, on_step=None: asked.append(name) or real(name, res, on_step)
    )
    lm = A2DLM(store=store, head=refs["head"].key, decoder="spec:head")
    rows = read_held_out(st, refs["responses"])[: cfg.eval.max_samples]
    want = doc["decoders"]["spec:head"]["outputs"]
    assert [lm._decode(r["prompt_ids"], cfg.eval.max_new_tokens).tokens for r in rows] == want
    gen = generate(st, refs["head"], "What is 12 + 30?", "spec:head", max_new_tokens=10)
    assert gen.tokens == lm._decode(prompt_ids(lm.tok, "What is 12 + 30?"), 10).tokens
    assert set(asked) == {"spec:head"} and len(asked) == 3  # lm-eval: per budget (8, 10); generate: once
    drafted = A2DLM(store=store, head=refs["head"].key, decoder="spec:drafter", drafter=refs["drafter"].key)
    want = doc["decoders"]["spec:drafter"]["outputs"]
    assert [drafted._decode(r["prompt_ids"], cfg.eval.max_new_tokens).tokens for r in rows] == want
    gen = generate(st, refs["head"], "What is 12 + 30?", "spec:drafter", max_new_tokens=10)
    assert gen.tokens == drafted._decode(prompt_ids(lm.tok, "What is 12 + 30?"), 10).tokens


def test_the_drafter_resumes_exactly_and_refuses_anchors_it_cannot_use(built, tmp_path):
    from a2d.models.drafter import DFlashDraftModel
    from a2d.stores.anchors import AnchorMismatchError, AnchorReader
    from a2d.tasks.drafter import check_anchors, check_config, train_drafter

    store, cfg, refs = built
    st = ArtifactStore(store)
    spec = cfg.drafter.model_copy(update={"steps": 4, "lr_schedule": "linear", "warmup_steps": 0})
    opts = TrainOptions(checkpoint_every=2, log_every=100)
    drefs = {k: refs[k] for k in ("teacher", "responses", "anchors")}
    train_drafter(st, drefs, spec, opts, tmp_path / "a", stop_after=2)
    resumed = train_drafter(st, drefs, spec, opts, tmp_path / "a")
    assert resumed["history"][0]["step"] == 3  # continued from the step-2 checkpoint
    train_drafter(st, drefs, spec, opts, tmp_path / "b")
    a = DFlashDraftModel.load(tmp_path / "a" / "checkpoints" / "step-00000004" / "adapter").state_dict()
    b = DFlashDraftModel.load(tmp_path / "b" / "checkpoints" / "step-00000004" / "adapter").state_dict()
    first = DFlashDraftModel.load(tmp_path / "a" / "checkpoints" / "step-00000002" / "adapter").state_dict()
    assert any(not torch.equal(first[k], a[k]) for k in a)  # steps 3-4 changed the weights
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    # the published artifact is a DFlash directory whose provenance names what it was trained from
    folder = st.loc(refs["drafter"]).local_path() / "drafter"
    provenance = json.loads((folder / "drafter_spec.json").read_text())
    assert provenance["anchors_key"] == refs["anchors"].key and provenance["capture"] == "residual"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    reader = AnchorReader(st, refs["anchors"])
    with pytest.raises(AnchorMismatchError, match="teacher_key"):
        check_anchors(reader, st.ref("teacher", "0" * 16), [1])
    with pytest.raises(AnchorMismatchError, match=r"missing \[7\]"):
        check_anchors(reader, refs["teacher"], [1, 7])  # a layer the anchors do not hold
    with pytest.raises(ValueError, match="anchors.tokens: all"):
        check_config(spec, cfg.anchors.model_copy(update={"tokens": "response"}), 4)
    assert pipeline(cfg, until="drafter")["drafter"] == refs["drafter"]  # reused
    # the model stages' tables count the training responses they learned from
    from a2d.stores.readers import read_responses

    train = [r for r in read_responses(st, refs["responses"]).to_pylist() if r["split"] == "train"]
    tokens = sum(len(r["response_ids"]) for r in train)
    for stage in ("head", "vfm", "drafter"):
        assert (st.manifest(refs[stage])["rows"], st.manifest(refs[stage])["tokens"]) == (len(train), tokens)


def test_lm_eval_loglikelihood_is_the_base_model(built):
    from a2d.tasks.harness import A2DLM

    store, cfg, refs = built
    model = A2DLM(store=store, head=refs["head"].key)

    class Request:
        def __init__(self, *args):
            self.args = args

    context, continuation = "What is 2 + 3?", " It is 5."
    ((got, greedy),) = model.loglikelihood([Request(context, continuation)])
    ctx = model.tok(context, add_special_tokens=False)["input_ids"]
    cont = model.tok(context + continuation, add_special_tokens=False)["input_ids"][len(ctx) :]
    with torch.no_grad(), model.student.base() as base:
        logp = torch.log_softmax(base(torch.tensor([ctx + cont])).logits[0].float(), -1)
    want = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    assert got == pytest.approx(want, abs=1e-4) and isinstance(greedy, bool)
    (rolling,) = model.loglikelihood_rolling([Request(continuation)])
    assert rolling < 0


def test_the_eval_stage_runs_lm_eval_tasks_and_reuses_them(built):
    """Also the eval of an unquantized head (the demo's): its base is the teacher, so the teacher's
    ar:greedy is the lossless reference and ar:student-base is not decoded a second time."""
    store, cfg, refs = built
    with_tasks = cfg.model_copy(
        update={
            "eval": cfg.eval.model_copy(
                update={"lm_eval_tasks": ("a2d_bundled",), "lm_eval_limit": 2, "decoders": ("spec:head",)}
            ),
            "head": cfg.head.model_copy(update={"quantization": "none"}),
        }
    )
    first = pipeline(with_tasks, until="eval")["eval"]
    assert first != refs["eval"]  # the tasks and the lm-eval version are in the key
    st = ArtifactStore(store)
    report = st.loc(first).local_path() / "report"
    stored = json.loads((report / "lm_eval.json").read_text())
    assert "a2d_bundled" in stored["results"]
    doc = json.loads((report / "metrics.json").read_text())
    assert (
        doc["reference"] == "ar:greedy" and "is the teacher" in doc["decoders"]["ar:student-base"]["skipped"]
    )
    assert doc["decoders"]["spec:head"]["mismatches_vs_reference"] == 0
    assert "differ from ar:greedy's" in (report / "report.md").read_text()
    assert (
        set(doc["lm_eval"]["tasks"]) == {"a2d_bundled"}
        # unset eval.lm_eval_decoder: the default lossless decoder, the drafter's where there is one
        and doc["lm_eval"]["model"]["a2d_decoder"] == "spec:drafter+lookup"
    )
    assert "lm-evaluation-harness" in (report / "report.md").read_text()
    manifest = (st.loc(first).local_path() / "manifest.json").stat().st_mtime_ns
    assert pipeline(with_tasks, until="eval")["eval"] == first
    assert (
        st.loc(first).local_path() / "manifest.json"
    ).stat().st_mtime_ns == manifest  # reused, not rebuilt


@pytest.mark.slow
def test_an_aligned_head_decodes_one_way_in_the_eval_lm_eval_and_a2d_generate(built):
    """The decoders' inputs come from one assembly (`a2d.tasks.resources.resources_from_store`): a head
    trained `logit_alignment: aligned` decodes the same tokens in the eval stage, the lm-eval model
    and `a2d generate` (the lm-eval model's own assembly once dropped the alignment)."""
    import dataclasses

    from a2d.models import decoders as registry
    from a2d.stores.readers import read_held_out
    from a2d.tasks.generation import generate, prompt_ids
    from a2d.tasks.harness import A2DLM
    from a2d.tasks.resources import resources_from_store

    store, cfg, _ = built
    aligned = cfg.model_copy(
        update={
            "head": cfg.head.model_copy(update={"logit_alignment": "aligned"}),
            "eval": cfg.eval.model_copy(update={"decoders": ("threshold:0.5",)}),
        }
    )
    refs = pipeline(aligned, until="eval")
    st = ArtifactStore(store)
    assert st.manifest(refs["head"])["spec"]["logit_alignment"] == "aligned"
    doc = json.loads((st.loc(refs["eval"]).local_path() / "report" / "metrics.json").read_text())
    want = doc["decoders"]["threshold:0.5"]["outputs"]
    rows = read_held_out(st, refs["responses"])[: cfg.eval.max_samples]
    lm = A2DLM(store=store, head=refs["head"].key, decoder="threshold:0.5")
    assert [lm._decode(r["prompt_ids"], cfg.eval.max_new_tokens).tokens for r in rows] == want
    gen = generate(st, refs["head"], "What is 12 + 30?", "threshold:0.5", max_new_tokens=8)
    assert gen.tokens == lm._decode(prompt_ids(lm.tok, "What is 12 + 30?"), 8).tokens
    # the alignment changes what is decoded: read as shifted, the same head decodes otherwise
    res = resources_from_store(st, {"head": refs["head"]}, cfg.eval.max_new_tokens, teacher=False).res
    shifted = registry.build("threshold:0.5", dataclasses.replace(res, logit_alignment="shifted"))
    assert [shifted(r["prompt_ids"]).tokens for r in rows] != want
