"""Head benchmark: NF4+LoRA vs bf16+LoRA peak memory, and step time with vs without anchor alignment.

    python benchmarks/head.py [--model smollm2|tiny] [--batch 4] [--seq-len 128]

Each configuration runs in a fresh subprocess; peak memory is the process's resident high-water
mark over one training step (reset with /proc/self/clear_refs after the model is loaded), so the
ratio compares what training adds on the same batch. Writes benchmarks/results/head.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def one(model_kind: str, quant: str, align: bool | str, batch: int, seq_len: int, steps: int) -> dict:
    """align: False, True, or "both" (alternate plain and aligned steps in one process, for timing)."""
    """Runs inside the subprocess: build the student, time `steps` training steps, report memory."""
    import torch

    from a2d.models.capture import capture_layers
    from a2d.models.losses import alignment_loss, masked_diffusion_loss
    from a2d.models.student import lm_head, student_forward
    from a2d.models.student_build import build_student
    from a2d.models.teacher import decoder_layers
    from benchmarks.common import teacher, token_batches

    _, tok = teacher(model_kind)
    path = Path("/tmp/a2d-bench") / model_kind
    torch.manual_seed(0)
    dtype = "bfloat16" if quant == "nf4" else "float32"  # NF4 computes in bf16, like the bf16 baseline
    student = build_student(
        path,
        quant if quant == "nf4" else "none",
        dtype,
        "cpu",
        {"rank": 16, "alpha": 32, "dropout": 0.0, "rslora": False},
        "block",
        "bidirectional",
        32,
    )
    if quant == "bf16":
        student.model.to(torch.bfloat16)
    seqs = torch.tensor(token_batches(tok, batch, seq_len))
    params = [p for p in student.model.parameters() if p.requires_grad] + [student.mask.weight]
    opt = torch.optim.AdamW(params, lr=1e-4)
    layers = list(range(0, len(decoder_layers(student.model.get_base_model())), 8))[:4]
    teacher_h = {i: torch.randn(batch, seq_len, student.mask.weight.shape[0]) for i in layers}
    Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark: count training only
    base = _rss_peak_kib()
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(steps):
        aligned = (step % 2 == 1) if align == "both" else bool(align)
        gen = torch.Generator().manual_seed(step)
        # the decode state: a causal prefix, then an open block of 32 with about half its positions masked
        loss_mask = torch.rand(seqs.shape, generator=gen) < 0.5
        loss_mask[:, : seq_len - 32] = False
        loss_mask[:, seq_len - 32] = True
        ids = seqs.masked_fill(loss_mask, student.info.mask_id)
        open_ = torch.zeros_like(loss_mask)
        open_[:, seq_len - 32 :] = True
        start = time.perf_counter()
        captured = {}
        with capture_layers(student.inner, layers if aligned else [], captured.__setitem__):
            h = student_forward(student, ids, torch.ones_like(ids), open_)
        b, t = loss_mask.nonzero(as_tuple=True)
        logits = lm_head(student)(h[b, t - 1])
        ones = torch.ones(len(b))
        loss, _ = masked_diffusion_loss(logits, seqs[b, t], ones, ones / len(b))
        if aligned:
            loss = loss + 0.25 * alignment_loss(
                [captured[i][b, t] for i in layers],
                [teacher_h[i][b, t] for i in layers],
                [torch.zeros(h.shape[-1]) for _ in layers],
            )
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= (2 if align == "both" else 1):  # the first step(s) warm up kernels and allocator
            times[aligned].append(time.perf_counter() - start)

    def median(xs: list[float]) -> float | None:
        return sorted(xs)[len(xs) // 2] if xs else None

    return {
        "peak_train_kib": _rss_peak_kib(),
        "base_kib": base,
        "step_seconds": median(times[bool(align) if align != "both" else False]),
        "step_seconds_aligned": median(times[True]),
    }


def run(model_kind: str, quant: str, align: bool | str, args: argparse.Namespace) -> dict:
    code = (
        f"import json,sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.head import one; "
        f"print('RESULT', json.dumps(one({model_kind!r}, {quant!r}, {align!r}, {args.batch}, {args.seq_len}, {args.steps})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def alignment_row(config: str, store: str | None, steps: int, samples: int) -> dict:
    """Held-out masked CE after `steps` training steps with and without anchor alignment (same data,
    masks, seed), on the demo store: does alignment carry signal at equal steps?"""
    import numpy as np
    import torch

    from a2d.models.objectives.head import diffusion_ce
    from a2d.models.views import ViewSampler, build_batch
    from a2d.specs import TrainOptions
    from a2d.stores.readers import read_held_out
    from a2d.tasks.train import TrainJob, train
    from a2d.tasks.train.loop import resume, setup
    from benchmarks.common import built

    cfg, refs, st = built(config, store, "trajectories")
    held_out = read_held_out(st, refs["responses"])[:samples]
    out = {}
    for weight in (0.0, cfg.head.align_weight or 0.25):
        spec = cfg.head.model_copy(update={"steps": steps, "align_weight": weight})
        work = Path("/tmp/a2d-bench") / f"align-{weight}"
        inputs = {k: refs[k] for k in ("teacher", "responses", "anchors", "trajectories")}
        job = TrainJob(
            store_uri=st.root.uri, ref=st.ref("head", f"bench-align-{weight}"), inputs=inputs,
            teacher_spec=cfg.teacher, spec=spec, train=TrainOptions(checkpoint_every=steps, log_every=steps),
            workdir=str(work),
        )  # fmt: skip
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        history = train(job)["history"]
        run = setup(job)
        resume(run)
        head = run.objective
        head.student.model.eval()
        sampler = ViewSampler(1234, 1, spec.block_size, r_min_start=0.0, r_min_end=0.0, r_max=1.0)
        eos, ces = head.token_ids["eos"], []
        with torch.no_grad():
            for i, r in enumerate(held_out):
                response = np.asarray(r["response_ids"])
                finished = bool(len(response)) and int(response[-1]) in head.token_ids["eos_set"]
                view = sampler.view(0, 0, i, r["sample_id"], response, eos, finished, None, 64)
                batch = build_batch(
                    [r["prompt_ids"]],
                    [response],
                    [view],
                    head.token_ids["mask"],
                    head.token_ids["pad"],
                    False,
                )
                _, info, _, _ = diffusion_ce(
                    head.student, batch, spec.model_copy(update={"entropy_weight": 0.0}), run.device
                )
                ces.append(info["ce"])
        out["with_alignment" if weight else "without_alignment"] = {
            "align_weight": weight,
            "held_out_ce": round(float(np.mean(ces)), 4),
            "final_train_align": history[-1]["align"],
        }
    out["held_out_ce_ratio_with_vs_without"] = round(
        out["with_alignment"]["held_out_ce"] / out["without_alignment"]["held_out_ce"], 4
    )
    out.update({"steps": steps, "held_out_samples": len(held_out)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="steps of the memory runs")
    ap.add_argument(
        "--timing-steps", type=int, default=10, help="alternating plain/aligned steps of the timing run"
    )
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="alignment row: the data")
    ap.add_argument("--store", default=None, help="alignment row: store with the config's trajectories")
    ap.add_argument(
        "--align-steps", type=int, default=30, help="alignment row: training steps per arm (0 skips)"
    )
    ap.add_argument("--align-samples", type=int, default=24, help="alignment row: held-out samples")
    args = ap.parse_args()
    from benchmarks.common import teacher, write_result

    teacher(args.model)  # convert/build once, outside the measured processes
    nf4 = run(args.model, "nf4", False, args)
    bf16 = run(args.model, "bf16", False, args)
    timing = run(args.model, "nf4", "both", argparse.Namespace(**{**vars(args), "steps": args.timing_steps}))
    write_result(
        "head",
        {
            "model": args.model,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "lora_rank": 16,
            "peak_mem_ratio_nf4_vs_bf16": round(nf4["peak_train_kib"] / bf16["peak_train_kib"], 4),
            "step_time_ratio_align_vs_plain": round(
                timing["step_seconds_aligned"] / timing["step_seconds"], 4
            ),
            "nf4": nf4,
            "bf16": bf16,
            "nf4_alternating_timing": timing,
            "alignment": (
                alignment_row(args.config, args.store, args.align_steps, args.align_samples)
                if args.align_steps
                else None
            ),
            "note": "CPU resident-memory high-water mark of the whole process during training steps; on CPU the NF4 "
            "kernels dequantise to the compute dtype, so the ratio is far from the GPU one",
        },
    )


if __name__ == "__main__":
    main()
