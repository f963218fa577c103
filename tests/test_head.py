"""head: attention modes proven on both architectures, losses fall, exact resume, provenance, decoding."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from a2d.flows.pipeline import STEPS, pipeline
from a2d.flows.pipeline import plan as pipeline_plan
from a2d.models.block_decode import threshold_decode
from a2d.models.student import BidirectionalScan, lm_head, student_forward
from a2d.models.student_build import build_student
from a2d.models.teacher import build_random_teacher
from a2d.specs import TrainOptions
from a2d.stores.anchors import AnchorMismatchError
from a2d.stores.artifacts import ArtifactStore
from a2d.tasks.head import key_inputs
from a2d.tasks.train import TrainJob, train
from a2d.tasks.training import workdir
from tests.conftest import LORA, ROOT, tiny_config


def _logits(student, ids):
    open_ = ids == student.info.mask_id
    return lm_head(student)(student_forward(student, ids, torch.ones_like(ids), open_)[0])  # (T, V)


def test_reverse_scan_is_what_makes_linear_attention_see_later_tokens(small_teachers):
    """Gate 0: the causal teacher scan; opened, an open position sees a later token of the open block
    through the reverse scan alone (the one full-attention layer is made causal here)."""
    student = build_student(
        small_teachers / "qwen3_5", "none", "float32", "cpu", LORA, "block", "bidirectional", 4
    )
    scan = student.inner.model.layers[0].linear_attn
    assert isinstance(scan, BidirectionalScan) and float(scan.gate) == 0.0  # untrained student == teacher
    x = torch.randn(1, 12, 64)
    y = x.clone()
    y[0, 10] += 1.0
    student.scope.set(torch.arange(12)[None] >= 8, 4, torch.ones(1, 12))  # positions 8..11 open
    closed = (scan(x) - scan(y)).abs().amax(-1)[0]
    assert torch.all(closed[:10] == 0)  # gate 0: the causal teacher scan
    scan.gate.data.fill_(0.5)
    opened = (scan(x) - scan(y)).abs().amax(-1)[0]
    assert opened[9] > 1e-6 and torch.all(opened[:8] == 0)  # only inside the open block


def test_training_events_come_from_rank_zero_and_a_garbled_line_is_not_fatal(capfd, monkeypatch):
    from a2d.tasks.train import emit
    from a2d.tasks.train.process import parse_event

    monkeypatch.setenv("RANK", "1")
    emit("done", step=2)
    monkeypatch.setenv("RANK", "0")
    emit("done", step=2)
    lines = capfd.readouterr().out.splitlines()
    assert lines == ['A2D done {"step": 2}']
    assert parse_event(lines[0]) == ("done", '{"step": 2}', {"step": 2})
    # two processes writing into one pipe: logged as plain output instead of failing the run
    assert parse_event('A2D done {"step": 2}A2D done {"step": 2}') is None
    assert parse_event("A2D done") is None and parse_event("loading weights") is None


def test_nf4_falls_back_to_the_unquantized_base_where_bitsandbytes_cannot_run(small_teachers, monkeypatch):
    import a2d.models.student_build as student_module
    from a2d.models.student_build import nf4_unavailable

    assert nf4_unavailable(torch.device("cpu")) is None  # bitsandbytes serves the CPU here
    assert "mps" in nf4_unavailable(torch.device("mps"))
    monkeypatch.setattr(student_module, "nf4_unavailable", lambda device: "no 4-bit kernels (test)")
    student = build_student(
        small_teachers / "llama", "nf4", "float32", "cpu", LORA, "block", "bidirectional", 4
    )
    assert student.info.quantization == "none" and student.info.fallback == "no 4-bit kernels (test)"
    assert not any(type(m).__name__ == "Linear4bit" for m in student.model.modules())


def test_a_resized_vocabulary_keeps_checkpoints_small_and_reloads_identically(tmp_path):
    """No free embedding row for the mask token: the vocabulary grows by one zero row, checkpoints
    hold only the adapters (not the embedding matrix), and a reload reproduces the logits exactly."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from a2d.stores import checkpoints

    build_random_teacher("llama", 1, 64, 0, tmp_path / "t", "float32")
    tok = AutoTokenizer.from_pretrained(tmp_path / "t")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "full")
    tok.save_pretrained(tmp_path / "full")
    student = build_student(tmp_path / "full", "none", "float32", "cpu", LORA, "block", "causal", 4)
    assert student.info.mask_id == len(tok)  # a new row
    embed = student.model.get_input_embeddings().weight
    assert embed.shape[0] == len(tok) + 1 and not embed[-1].any()
    with torch.no_grad():  # move the adapters away from their identity init
        for name, p in student.model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    opt = torch.optim.SGD([p for p in student.model.parameters() if p.requires_grad], lr=0.1)
    checkpoints.save(tmp_path / "ck", student.model, student.extras(), opt, None, 1, 0, {})
    saved = load_file(tmp_path / "ck" / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # no embed_tokens / lm_head matrices
    again = build_student(
        tmp_path / "full", "none", "float32", "cpu", LORA, "block", "causal", 4,
        adapter_dir=tmp_path / "ck" / "adapter",
    )  # fmt: skip
    again.load_extras(load_file(tmp_path / "ck" / "extras.safetensors"))
    ids = torch.tensor([[5, 6, student.info.mask_id, 7]])
    torch.testing.assert_close(_logits(again, ids), _logits(student, ids), atol=0, rtol=0)


def test_lora_covers_every_projection_of_the_hybrid(small_teachers):
    student = build_student(
        small_teachers / "qwen3_5", "nf4", "float32", "cpu", LORA, "block", "bidirectional", 4
    )
    assert student.info.target_names == sorted(
        [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "in_proj_qkv",
            "in_proj_z",
            "in_proj_a",
            "in_proj_b",
            "out_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    assert student.info.lora_modules == 3 * 8 + 1 * 7
    assert any(type(m).__name__ == "Linear4bit" for m in student.model.modules())
    assert student.info.mask_id == 259  # an unused embedding row of the padded vocabulary


SMALL = [
    "teacher.architecture=llama",
    "teacher.layers=2",
    "prompts.bundled_rows=24",
    "prompts.rows_per_shard=12",
    "prompts.eval_fraction=0.1",
    "responses.max_new_tokens=16",
    "head.steps=6",
    "head.micro_batch_size=4",
    "head.lr=0.003",
    "head.warmup_steps=0",
    "head.lr_schedule=constant",
    "head.align_layers=2",
    "train.checkpoint_every=3",
    "drafter=null",  # the head's inputs only: no drafter stage (a training process) before it
    "eval.decoders=null",  # (tiny.yaml's list names the drafter's decoder)
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("head-data"))
    cfg = tiny_config(store, *SMALL)
    return store, cfg, pipeline(cfg, until="trajectories")


def _job(store, cfg, refs, spec=None, stop_after=None, workdir_=None):
    spec = spec or cfg.head
    st = ArtifactStore(store)
    ref = st.ref(
        "head", key_inputs(spec, refs["teacher"].key, refs["anchors"].key, refs["trajectories"].key).key
    )
    return TrainJob(
        store_uri=ArtifactStore(store).root.uri,
        ref=ref,
        inputs={k: refs[k] for k in ("teacher", "responses", "anchors", "trajectories")},
        teacher_spec=cfg.teacher,
        spec=spec,
        train=cfg.train,
        workdir=str(workdir_ or workdir(st, ref)),
        stop_after=stop_after,
    )


def test_loss_and_alignment_fall(data, tmp_path):
    """On a fixed batch of views the masked CE falls after 24 training steps, and steps on the centred
    alignment term alone lower it (a random teacher's CE noise hides alignment inside full training)."""
    import numpy as np

    from a2d.models.objectives.head import align_term, diffusion_ce, make_batch
    from a2d.tasks.train.loop import resume, setup

    store, cfg, refs = data
    train_opts = TrainOptions(checkpoint_every=100, log_every=100)
    base = {
        "steps": 24,
        "complementary": False,
        "mask_schedule": "uniform",
        "lr": 0.01,
        "entropy_weight": 0.0,
    }

    def fixed(job):  # (CE, alignment) of the student at the newest checkpoint on one fixed batch
        run = setup(job)
        resume(run)
        head = run.objective
        samples = head.samples[:16]
        batch = make_batch(samples, head.trajs, head.sampler, job.spec, 0, 999, head.token_ids)
        with torch.no_grad():
            _, info, captured, split = diffusion_ce(
                head.student, batch, job.spec, run.device, head.align_layers
            )
            align = align_term(
                head, batch, samples, head.align_layers, captured, split, np.random.default_rng(0)
            )
        return info["ce"], float(align)

    plain = _job(
        store, cfg, refs, cfg.head.model_copy(update={**base, "align_weight": 0.0}), workdir_=tmp_path / "a"
    )
    plain = plain.model_copy(update={"train": train_opts})
    before = fixed(plain)
    train(plain)
    assert fixed(plain)[0] < before[0] - 0.05, before
    # The alignment gradient reaches the adapter: on one fixed batch, steps on the alignment term
    # alone lower it (through the same capture, centring and anchor lookup training uses).
    run = setup(plain)
    head = run.objective
    samples = head.samples[:8]
    batch = make_batch(samples, head.trajs, head.sampler, plain.spec, 0, 7, head.token_ids)
    history = []
    for _ in range(8):
        _, _, captured, split = diffusion_ce(head.student, batch, plain.spec, run.device, head.align_layers)
        align = align_term(head, batch, samples, head.align_layers, captured, split, np.random.default_rng(0))
        align.backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
        history.append(float(align))
    assert history[-1] < history[0] - 0.02, history


def test_foreign_anchors_are_refused(data, tmp_path):
    store, cfg, refs = data
    from a2d.flows.teacher import teacher_flow

    other = teacher_flow(cfg.teacher.model_copy(update={"seed": 1}), store)  # another teacher, same store
    job = _job(store, cfg, refs, workdir_=tmp_path / "w")
    job = job.model_copy(update={"inputs": {**job.inputs, "teacher": other}})
    with pytest.raises(
        AnchorMismatchError, match=f"teacher_key='{refs['teacher'].key}'.*teacher_key='{other.key}'"
    ):
        train(job)


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import a2d.tasks.train.loop as loop
    from a2d.tasks.train.process import main
    original = loop.train_step
    def train_step(run, step):
        if step == 3:  # steps 1-3 done, the checkpoint is of step 2: die inside step 4
            os.kill(os.getpid(), signal.SIGKILL)
        return original(run, step)
    loop.train_step = train_step
    sys.exit(main(sys.argv[1:]))
    """
)

HYBRID = [
    "teacher.layers=4",  # qwen3_5: 3 Gated DeltaNet + 1 full attention layer
    "prompts.bundled_rows=16",
    "prompts.rows_per_shard=8",
    "prompts.max_prompt_tokens=64",
    "responses.max_new_tokens=8",
    "anchors.layers=[1, 3]",
    "head.steps=4",
    "head.micro_batch_size=2",
    "head.complementary=false",
    "head.lr=0.003",
    "head.warmup_steps=1",  # the cosine schedule's state matters
    "head.lr_schedule=cosine",
    "head.lora_dropout=0.1",  # dropout draws from the RNG: its restored state matters
    "head.align_layers=2",
    "train.checkpoint_every=2",
    "drafter=null",
    "eval.decoders=null",
]


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_is_exact(tmp_path_factory, tmp_path):
    """A trainer killed inside step 4 (its last checkpoint is step 2) and resumed ends with the same
    adapter, mask embedding and reverse-scan gates as an uninterrupted run: cosine schedule with
    warmup, LoRA dropout, and a hybrid teacher whose reverse scans are trained."""
    store = str(tmp_path_factory.mktemp("hybrid"))
    cfg = tiny_config(store, *HYBRID)
    refs = pipeline(cfg, until="trajectories")
    env = {**os.environ, "PYTHONPATH": ROOT}
    killed = _job(store, cfg, refs, workdir_=tmp_path / "killed")
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "job.json").write_text(killed.model_dump_json())
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(tmp_path / "killed" / "job.json")], env=env, cwd=ROOT, timeout=600
    )
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["step-00000002"]
    resumed = subprocess.run(
        [sys.executable, "-m", "a2d.tasks.train", str(tmp_path / "killed" / "job.json")],
        env=env,
        cwd=ROOT,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0 and '"step": 2' in resumed.stdout and "A2D resume" in resumed.stdout
    train(_job(store, cfg, refs, workdir_=tmp_path / "clean"))  # uninterrupted, in this process
    final = "checkpoints/step-00000004"
    a = load_file(tmp_path / "killed" / final / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "clean" / final / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    ea = load_file(tmp_path / "killed" / final / "extras.safetensors")
    eb = load_file(tmp_path / "clean" / final / "extras.safetensors")
    gates = [k for k in ea if k.startswith("scan_gate")]
    assert ea.keys() == eb.keys() and len(gates) == 3 and any(ea[k].abs().max() > 0 for k in gates)
    for k in ea:  # mask embedding and the three reverse-scan gates
        torch.testing.assert_close(ea[k], eb[k], atol=1e-6, rtol=0)


def test_mixed_precision_resolution_and_autocast(monkeypatch):
    """`auto` is bf16 exactly on a GPU that supports it; forced modes are taken as given."""
    from a2d.models.teacher import autocast, resolve_precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision("auto", cpu) == "no"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", cuda) == "bf16" and resolve_precision("auto", cpu) == "no"
    assert resolve_precision("no", cuda) == "no"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision("auto", cuda) == "no" and resolve_precision("bf16", cpu) == "bf16"
    layer = torch.nn.Linear(4, 4)
    with autocast(cpu, "bf16"):
        assert layer(torch.ones(1, 4)).dtype == torch.bfloat16
    with autocast(cpu, "no"):
        assert layer(torch.ones(1, 4)).dtype == torch.float32


def test_bf16_autocast_and_offline_wandb_run_resumed_under_one_id(data, tmp_path, monkeypatch):
    """train.mixed_precision=bf16 runs the forwards under autocast (also on CPU when forced); a W&B
    project with WANDB_MODE=offline writes a local run holding the step metrics as soon as training
    returns, and a resumed training continues the same run id with the steps after the checkpoint."""
    store, cfg, refs = data
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = cfg.head.model_copy(update={"steps": 2})
    job = _job(store, cfg, refs, spec, workdir_=tmp_path).model_copy(
        update={
            "train": cfg.train.model_copy(update={"mixed_precision": "bf16", "wandb_project": "a2d-test"})
        }
    )
    first = train(job.model_copy(update={"stop_after": 1}))
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(f"head-{job.ref.key}")
    # the run's record log (protobuf) carries the logged keys and values as JSON text, flushed by now
    record = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"lambda" in record and json.dumps(first["history"][-1]["loss"]).encode() in record

    out = train(job)  # resumes from the step-1 checkpoint
    assert out["precision"] == "bf16" and all(math.isfinite(h["loss"]) for h in out["history"])
    assert [h["step"] for h in out["history"]] == [2]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"head-{job.ref.key}") for r in runs)  # one run id
    resumed = next(runs[1].glob("run-*.wandb")).read_bytes()
    assert json.dumps(out["history"][-1]["loss"]).encode() in resumed
    assert json.dumps(first["history"][-1]["loss"]).encode() not in resumed  # only the new steps


FLOW_RUN = """
import sys
from a2d.flows.pipeline import STEPS, plan
from a2d.specs import load_config
config = load_config(sys.argv[1])
refs = plan(config, sys.argv[2])  # the upstream artifacts exist: run the stage's own flow
STEPS[sys.argv[2]].run(config, refs)
"""


def trainers(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line names `marker`: a trainer and its ranks."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(d))
    return found


def sigterm_flow_run(cfg, stage: str, tmp_path, ready: str, trainer: str | None = None) -> str:
    """Run the flow of `stage` in a child process (the flow on its main thread, the stage's task on a
    worker thread, as in a served run), SIGTERM it once a log line contains `ready`, and return its
    stderr. Fails unless the child exits by itself with 1 and no process naming `trainer` outlives it."""
    from prefect.settings import PREFECT_API_URL

    (tmp_path / "config.yaml").write_text(json.dumps(cfg.model_dump(mode="json")))
    env = {**os.environ, "PYTHONPATH": ROOT, "PREFECT_API_URL": PREFECT_API_URL.value()}
    env["PREFECT_LOGGING_LEVEL"] = "INFO"  # the run's log lines are what the test watches
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOW_RUN, str(tmp_path / "config.yaml"), stage],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if ready in line:
                proc.send_signal(signal.SIGTERM)
                break
        lines.append(proc.communicate(timeout=600)[1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        orphans = trainers(trainer) if trainer else []
        for pid in orphans:  # never leave them running, whatever the outcome
            os.kill(pid, signal.SIGKILL)
    err = "".join(lines)
    assert proc.returncode == 1, f"exit {proc.returncode}:\n{err[-3000:]}"
    assert not orphans, f"trainer processes {orphans} outlived the flow run"
    return err


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_to_a_flow_run_checkpoints_the_current_step_and_a_rerun_resumes(data, tmp_path, processes):
    """SIGTERM to the process of a real flow run (pod eviction, Prefect cancellation): the flow's main
    thread forwards it to the trainer that the head task (on a worker thread) launched; the trainer
    (through accelerate to every rank) checkpoints the step it is on and exits; the run fails with a
    "rerun to resume" error; no trainer is left behind; a rerun resumes from that checkpoint."""
    from a2d.stores import checkpoints

    store, cfg, refs = data
    cfg = cfg.model_copy(
        update={
            "head": cfg.head.model_copy(update={"steps": 16, "seed": processes}),  # a key per case
            "train": cfg.train.model_copy(
                update={"log_every": 1, "checkpoint_every": 100, "num_processes": processes}
            ),
        }
    )
    head = pipeline_plan(cfg)["head"]
    err = sigterm_flow_run(cfg, "head", tmp_path, "train progress", trainer=f"{head.key}/job.json")
    assert "rerun the head stage to resume" in err, err[-3000:]
    step = int(re.search(r"stopped by SIGTERM at step (\d+)", err).group(1))
    assert 1 <= step < 16  # ~0.1-0.3 s a step: the signal lands many steps before the end
    work = ArtifactStore(store).loc(head).local_path()
    last = checkpoints.latest(work / "checkpoints")
    assert last is not None and last.name == f"step-{step:08d}"  # the step it was on, off the every-100 grid
    assert json.loads((last / checkpoints.STATE).read_text())["world"] == processes
    assert not ArtifactStore(store).is_complete(head)
    if processes == 1:  # a 2-process resume is checked for exactness in test_scale
        from a2d.flows.outcomes import observe

        resumed, outcome = observe(ArtifactStore(store), head, lambda: STEPS["head"].run(cfg, refs))
        assert outcome.outcome == f"resumed from the checkpoint of step {step}"  # the run's summary row
        history = ArtifactStore(store).manifest(resumed)["shards"]["adapter"]["history"]
        assert resumed == head and history[0]["step"] == step + 1 and history[-1]["step"] == 16


def test_head_stage_publishes_a_loadable_adapter_and_decodes(data, tmp_path, monkeypatch, capsys):
    """`a2d run` from another directory with the default `./a2d-store`: the trainer process reads
    and writes that directory's store (it once read the repository's and failed)."""
    store, cfg, refs = data
    from peft import PeftModel

    from a2d.flows.cli import main
    from a2d.tasks.students import load_student

    monkeypatch.delenv("A2D_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    os.symlink(store, tmp_path / "a2d-store")  # ./a2d-store here is the data store
    repo_store = os.path.join(ROOT, "a2d-store", "head")
    repo_heads = set(os.listdir(repo_store)) if os.path.isdir(repo_store) else set()
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    assert main(["run", tiny, "--until", "head", *(a for o in SMALL for a in ("--set", o))]) == 0
    assert "head " in capsys.readouterr().out
    refs = pipeline(cfg, until="head")  # reused: built by the CLI above, in ./a2d-store
    assert (tmp_path / "a2d-store" / "head" / refs["head"].key / "manifest.json").is_file()
    assert (set(os.listdir(repo_store)) if os.path.isdir(repo_store) else set()) == repo_heads
    st = ArtifactStore(store)
    spec = st.manifest(refs["head"])["metrics"]["diffusion_spec"]
    assert (spec["attention"], spec["adapter_scope"], spec["logit_alignment"]) == (
        "block",
        "masked",
        "shifted",
    )
    assert spec["lora_modules"] == 14 and spec["block_size"] == cfg.head.block_size
    student, dspec = load_student(st, refs["head"])
    assert isinstance(student.model, PeftModel)
    # The published mask embedding is the trained one of the final checkpoint (castlehill's bug 3:
    # it was never trained), and the loaded student carries it.
    adapter = st.loc(refs["head"]).local_path() / "adapter"
    final = load_file(
        st.loc(refs["head"]).local_path() / "checkpoints" / "step-00000006" / "extras.safetensors"
    )
    published = load_file(adapter / "extras.safetensors")["mask_embedding"]
    torch.testing.assert_close(published, final["mask_embedding"], atol=0, rtol=0)
    torch.testing.assert_close(student.mask.weight.detach(), published, atol=0, rtol=0)
    from a2d.tasks.teacher import local_dir

    untrained = build_student(
        local_dir(st, refs["teacher"]), "none", "float32", "cpu", LORA, "block", "bidirectional", 4
    )
    assert (published - untrained.mask.weight.detach()).abs().max() > 1e-4
    out = threshold_decode(student, [258, 104, 105, 257, 10], 12, 0.9, [257])
    assert 1 <= len(out.tokens) <= 12 and 1 <= out.forwards <= len(out.tokens)
    assert max(out.commit_step) == out.forwards and min(out.commit_step) >= 1
    assert pipeline(cfg, until="head")["head"] == refs["head"]  # reused


def test_diffusion_decode_trajectories_from_a_trained_head(data):
    from a2d.flows.trajectories import trajectories_flow
    from a2d.stores.readers import read_trajectories

    store, cfg, refs = data
    refs = pipeline(cfg, until="head")
    spec = cfg.trajectories.model_copy(
        update={"source": "diffusion-decode", "head_key": refs["head"].key, "threshold": 0.2}
    )
    ref = trajectories_flow(refs["responses"], refs["anchors"], spec, store)
    assert ref.key != refs["trajectories"].key
    recs = read_trajectories(ArtifactStore(store), ref)
    for rec in recs.values():
        steps = rec["unmask_step"]
        assert len(steps) == len(rec["response_ids"]) and steps.min() >= 1 and rec["num_steps"] == steps.max()
        assert rec["source"] == "diffusion-decode"
        # blocks are decoded left to right: every step of block b precedes every step of block b + 1
        blocks = [steps[i : i + spec.block_size] for i in range(0, len(steps), spec.block_size)]
        assert all(a.max() < b.min() for a, b in zip(blocks, blocks[1:], strict=False))
    assert ArtifactStore(store).manifest(ref)["spec"]["head_key"] == refs["head"].key


def test_the_student_is_built_with_the_teachers_trust_remote_code(data, tmp_path, monkeypatch):
    """teacher.trust_remote_code reaches the student's from_pretrained (it was dropped there)."""
    import a2d.models.teacher as teacher_module
    from a2d.tasks.train.loop import setup

    store, cfg, refs = data
    seen = []

    class Loaded(Exception):
        pass

    def load_teacher(path, dtype="float32", quantization="none", device="auto", trust_remote_code=False):
        seen.append(trust_remote_code)
        raise Loaded

    monkeypatch.setattr(teacher_module, "load_teacher", load_teacher)
    for trust in (False, True):
        job = _job(store, cfg, refs, workdir_=tmp_path).model_copy(
            update={"teacher_spec": cfg.teacher.model_copy(update={"trust_remote_code": trust})}
        )
        with pytest.raises(Loaded):
            setup(job)
    assert seen == [False, True]


def test_library_warnings_stay_out_of_the_run_log():
    """The trainer's stderr lines that are library warnings (as seen in a served run's log) are kept
    off the Prefect log; a2d's own lines and tracebacks are not."""
    from a2d.tasks.train.process import THIRD_PARTY_NOISE

    noise = [
        "/x/.venv/lib/python3.11/site-packages/transformers/modeling_utils.py:3312: FutureWarning: "
        "`is_gradient_checkpointing` is deprecated and will be removed in v6.",
        "  warnings.warn(",
        "The installed version of bitsandbytes was compiled without GPU support.",
    ]
    kept = [
        "Traceback (most recent call last):",
        "RuntimeError: CUDA out of memory",
        "resumed from step-00000004",
    ]
    assert all(THIRD_PARTY_NOISE.search(line) for line in noise)
    assert not any(THIRD_PARTY_NOISE.search(line) for line in kept)
