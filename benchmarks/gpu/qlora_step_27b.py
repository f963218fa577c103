"""GPU benchmark (b): one QLoRA diffusion-head training step at Qwen3.6-27B shape.

    python benchmarks/gpu/qlora_step_27b.py [--tiny] [--seq-len 1024] [--rank 16]

Random bf16 weights are built on the device, every decoder linear projection is replaced by a
bitsandbytes NF4 Linear4bit, then a2d's own student code adds LoRA r16 on all 12 projection kinds,
the mask embedding and bidirectional attention; one masked-diffusion step (batch 1, gradient
checkpointing) is timed. Writes benchmarks/results/gpu_qlora_27b.json. JSON fields: shape, params,
seq_len, lora_rank, lora_modules, peak_memory_gb (target <= 24), step_seconds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from a2d.models.losses import masked_diffusion_loss  # noqa: E402
from a2d.models.student import lm_head, student_forward  # noqa: E402
from a2d.models.student_build import make_student  # noqa: E402
from a2d.models.teacher import byte_tokenizer, decoder_layers  # noqa: E402
from benchmarks.gpu.shapes import arguments, peak_memory_gb, report, setup, sync  # noqa: E402


def quantize_nf4(model: torch.nn.Module, device: str) -> int:
    """Replace every nn.Linear inside the decoder layers by an NF4 Linear4bit (weights quantised on `device`)."""
    import bitsandbytes as bnb

    n = 0
    for layer in decoder_layers(model):
        for module in list(layer.modules()):
            for child_name, child in list(module.named_children()):
                if type(child) is torch.nn.Linear:
                    q = bnb.nn.Linear4bit(
                        child.in_features,
                        child.out_features,
                        bias=False,
                        compute_dtype=torch.bfloat16,
                        quant_type="nf4",
                        device="meta",
                    )
                    q.weight = bnb.nn.Params4bit(
                        child.weight.data.to("cpu" if device == "cpu" else device),
                        requires_grad=False,
                        quant_type="nf4",
                    ).to(device)
                    setattr(module, child_name, q)
                    n += 1
                    del child
        if device == "cuda":
            torch.cuda.empty_cache()
    return n


def main() -> None:
    ap = arguments()
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    run = setup(args)
    shape, seq, device, model, n_params = run.shape, run.seq, run.device, run.model, run.params
    quantized = quantize_nf4(model, device)
    model.config.quantization_config = {"load_in_4bit": True}  # marks it for peft's k-bit preparation
    model.is_loaded_in_4bit = True
    tok = byte_tokenizer()
    student = make_student(
        model,
        tok,
        "nf4",
        {"rank": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "rslora": False},
        "block",
        "bidirectional",
        32,
        "masked",
        gradient_checkpointing=True,
    )
    student.model.train()
    params_trained = [p for p in student.model.parameters() if p.requires_grad] + [student.mask.weight]
    opt = torch.optim.AdamW(params_trained, lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, seq), generator=gen)
    # the decode state of the last block: a causal prefix, then a 32-token open block, half masked
    loss_mask = torch.rand((1, seq), generator=gen) < 0.5
    loss_mask[:, : seq - 32] = False
    loss_mask[:, seq - 32] = True
    open_ = torch.zeros_like(loss_mask)
    open_[:, seq - 32 :] = True
    inp = ids.masked_fill(loss_mask, student.info.mask_id).to(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(2):  # the first step warms kernels; the second is timed
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            h = student_forward(student, inp, torch.ones_like(inp), open_.to(device))
            b, t = loss_mask.nonzero(as_tuple=True)
            logits = lm_head(student)(h[b.to(device), (t - 1).to(device)])
        ones = torch.ones(len(b), device=device)
        loss, _ = masked_diffusion_loss(logits, ids[b, t].to(device), ones, ones / len(b))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    result = {
        "shape": shape,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "params": n_params,
        "nf4_linears": quantized,
        "lora_modules": student.info.lora_modules,
        "lora_rank": args.rank,
        "seq_len": seq,
        "gradient_checkpointing": True,
        "peak_memory_gb": peak_memory_gb(device),
        "step_seconds": round(times[-1], 3),
        "loss": round(loss.item(), 4),
        "target_peak_memory_gb": 24,
    }
    report("qlora", result, args.out)


if __name__ == "__main__":
    main()
