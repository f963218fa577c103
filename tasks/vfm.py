"""vfm stage: train the noise adapter against the frozen diffusion student; resumable like the head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prefect import task
from tqdm import tqdm

from a2d.models.generate import eos_ids
from a2d.models.student import DiffusionSpec, apply_lora, lora_parameters
from a2d.models.teacher import autocast, resolve_device, resolve_precision
from a2d.models.vfm import NoiseAdapter, encode_prompt, flow_map_logits, kl_to_prior
from a2d.specs import TrainOptions, VFMSpec
from a2d.stores import checkpoints
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.keys import KeyInputs
from a2d.stores.readers import read_responses
from a2d.stores.uri import Location
from a2d.tasks.head import trained_on
from a2d.tasks.interrupt import StopFlag, on_sigterm
from a2d.tasks.report import Progress
from a2d.tasks.runtime import logger
from a2d.tasks.students import FLOW_MAP_LORA, VFM_SHARD, load_student
from a2d.tasks.tracking import Tracker
from a2d.tasks.training import run_trainer

STAGE = "vfm"
SHARD = VFM_SHARD
FORMAT_VERSION = 1


def key_inputs(spec: VFMSpec, head_key: str, responses_key: str) -> KeyInputs:
    """The vfm key: the VFM spec, the head it distils and the responses it trains on."""
    return KeyInputs(
        STAGE, FORMAT_VERSION, spec.model_dump(mode="json"), {"head": head_key, "responses": responses_key}
    )


def batch_tensors(rows: list[dict], length: int, eos: int, pad: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts (B, P) and completion targets (B, L): the response, then EOS to length L."""
    width = max(len(r["prompt_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), length), eos, dtype=torch.long)
    for i, r in enumerate(rows):
        p = r["prompt_ids"]
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
        resp = r["response_ids"][:length]
        targets[i, : len(resp)] = torch.tensor(resp)
    return {"ids": ids, "pad": mask, "targets": targets}


def tunable_lora(student: Any) -> dict[str, torch.nn.Parameter]:
    """The student's LoRA parameters, switched to trainable, by name."""
    lora = lora_parameters(student)
    if not lora:
        raise ValueError("vfm.tune_lora is set but the head's student has no LoRA parameters")
    for p in lora.values():
        p.requires_grad_(True)
    return lora


def vfm_losses(
    student: Any,
    adapter: NoiseAdapter,
    batch: dict[str, torch.Tensor],
    rng: np.random.Generator,
    spec: VFMSpec,
    dspec: DiffusionSpec,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch through q_φ and the flow map: (CE of the one-step logits, KL(q ‖ N(mask, I)))."""
    ids, pad, targets = (batch[k].to(device) for k in ("ids", "pad", "targets"))
    prompt = encode_prompt(student, ids, pad)  # once, without grad: the flow map's prefix cache too
    mu, logvar = adapter(prompt.states, pad, spec.max_len)
    mu, logvar = mu.float(), logvar.float()
    noise = torch.from_numpy(rng.standard_normal(mu.shape).astype(np.float32)).to(device)
    z = adapter.embed(mu + (0.5 * logvar).exp() * noise)  # reparameterised, in embedding units
    supervised = torch.ones_like(targets, dtype=torch.bool)
    if spec.refine_fraction > 0:  # commit a random share of true tokens; the loss is on the rest
        keep = torch.from_numpy(rng.random(targets.shape) < rng.uniform(0, spec.refine_fraction)).to(device)
        true_emb = student.model.get_base_model().get_input_embeddings()(targets)
        z = torch.where(keep[..., None], true_emb.to(z.dtype), z)
        supervised = ~keep
    shifted = dspec.logit_alignment == "shifted"
    logits = flow_map_logits(student, prompt, z, shifted)
    ce = torch.nn.functional.cross_entropy(logits[supervised].float(), targets[supervised])  # (B, L, V) rows
    return ce, kl_to_prior(mu, logvar, adapter.prior_mean)


def train_vfm(
    store: ArtifactStore,
    head: ArtifactRef,
    responses: ArtifactRef,
    spec: VFMSpec,
    train: TrainOptions,
    work: Path,
    device: str = "cpu",
    stop_after: int | None = None,
    remote: Location | None = None,
) -> dict[str, Any]:
    """Train q_φ; checkpoints (adapter, optimizer, scheduler, RNG, step) under `work/checkpoints`."""
    log = logger()
    torch.manual_seed(spec.seed)
    student, dspec = load_student(store, head, device)
    student.model.requires_grad_(False)
    eos = eos_ids(student.model.get_base_model(), student.tok)
    hidden = student.model.get_base_model().get_input_embeddings().weight.shape[1]
    adapter = NoiseAdapter(hidden, spec.max_len, spec.width, spec.layers, spec.heads).to(device)
    embed_weight = student.model.get_base_model().get_input_embeddings().weight
    adapter.init_mean(student.mask.weight.detach(), float(embed_weight.float().pow(2).mean().sqrt()))
    # Joint tuning trains the flow map's LoRA weights too; they are checkpointed as "extras".
    lora = tunable_lora(student) if spec.tune_lora else {}
    groups = [{"params": list(adapter.parameters()), "lr": spec.lr}]
    if lora:
        groups.append({"params": list(lora.values()), "lr": spec.lora_lr})
    params = [p for g in groups for p in g["params"]]
    optimizer = torch.optim.AdamW(groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    rows = sorted(
        (r for r in read_responses(store, responses).to_pylist() if r["split"] == "train"),
        key=lambda r: r["sample_id"],
    )
    root = work / "checkpoints"
    step = 0
    last = checkpoints.latest(root)
    if last is not None:
        state, extras = checkpoints.load(last, optimizer, scheduler)
        apply_lora(lora, extras)
        from safetensors.torch import load_file

        adapter.load_state_dict(load_file(last / "adapter" / "noise_adapter.safetensors"))
        step = state["step"]
        log.info("vfm: resumed from %s", last.name)
    history = []
    progress = Progress(spec.steps, "vfm")
    bar = tqdm(total=spec.steps, initial=step, desc="vfm", leave=False)
    stop = StopFlag()  # SIGTERM: checkpoint after this step, then stop
    precision = resolve_precision(train.mixed_precision, torch.device(device))
    tracker = Tracker(
        train.wandb_project,
        "vfm",
        work.name,
        {"vfm": spec.model_dump(mode="json"), "train": train.model_dump(mode="json"), "precision": precision},
        work,
    )
    tracker.publish_link()
    with on_sigterm(stop), tracker:
        while step < spec.steps:
            rng = np.random.default_rng(np.random.SeedSequence([spec.seed, step]))
            batch = batch_tensors(
                [rows[i] for i in rng.choice(len(rows), spec.micro_batch_size)],
                spec.max_len,
                eos[0],
                student.tok.pad_token_id,
            )
            with autocast(torch.device(device), precision):
                ce, kl = vfm_losses(student, adapter, batch, rng, spec, dspec, device)
            beta = spec.beta * min(1.0, (step + 1) / max(1.0, spec.beta_warmup * spec.steps))
            loss = ce / (2 * spec.tau**2) + beta * kl
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            history.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 6),
                    "ce": round(ce.item(), 6),
                    "kl": round(kl.item(), 4),
                }
            )
            tracker.log({**history[-1], "beta": beta}, step)
            bar.update(1)
            progress.advance(1)
            if step % train.log_every == 0:
                log.info("vfm step %d/%d ce %.4f kl %.2f", step, spec.steps, ce.item(), kl.item())
            if step % train.checkpoint_every == 0 or step in (spec.steps, stop_after) or stop.set:
                checkpoints.publish(
                    root,
                    step,
                    train.keep_checkpoints,
                    adapter,
                    {name: p.detach() for name, p in lora.items()},
                    optimizer,
                    scheduler,
                    step * spec.micro_batch_size,
                    {},
                    remote=remote,
                )
            if step == stop_after or stop.set:
                break
    bar.close()
    return {"step": step, "history": history, "stopped": stop.set}


@task(name="vfm-train", task_run_name="vfm-{ref.key}", tags=["gpu"])
def vfm_train(
    store_uri: str,
    ref: ArtifactRef,
    spec: VFMSpec,
    train: TrainOptions,
    head: ArtifactRef,
    responses: ArtifactRef,
    device: str,
) -> dict:
    store = ArtifactStore(store_uri)
    dev = str(resolve_device(device))
    result, last = run_trainer(
        store,
        ref,
        spec.steps,
        lambda work, remote: train_vfm(store, head, responses, spec, train, work, dev, remote=remote),
    )
    with store.shard_output(ref, SHARD) as out:
        shutil.copytree(last / "adapter", out)
        if spec.tune_lora:
            shutil.copy(last / "extras.safetensors", out / FLOW_MAP_LORA)
        (out / "vfm_spec.json").write_text(
            json.dumps({**spec.model_dump(mode="json"), "head_key": head.key}, indent=2, sort_keys=True)
        )
        files = {f"{SHARD}/{k}": v for k, v in hash_local_tree(out).items()}
    hist = result["history"]
    rows, tokens = trained_on(store, responses)
    stats = {
        "rows": rows,  # the training responses the flow map learned from
        "tokens": tokens,
        "first_ce": hist[0]["ce"] if hist else None,
        "final_ce": hist[-1]["ce"] if hist else None,
        "history": hist[-50:],
    }
    return store.write_marker(ref, SHARD, files, stats)


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    m = markers[SHARD]
    return {"first_ce": m["first_ce"], "final_ce": m["final_ce"]}
