"""a2d as an lm-evaluation-harness model: `lm_eval --model a2d --model_args store=URI,head=KEY,decoder=spec:head`.

- `generate_until` decodes with a decoder from the registry (`a2d.models.decoders`: spec:head,
  threshold:0.9, vfm:k1, ar:student-base, ...), honouring the request's `until` strings and `max_gen_toks`;
- `loglikelihood` and `loglikelihood_rolling` score with the student's base model as an AR model
  (adapters off, causal): exact log-probabilities, so multiple-choice tasks work too;
- every generation's forwards and tokens are counted, and the run's totals (tokens per forward,
  tokens/s) go into lm-eval's results under `config` (`get_model_info`).

lm-eval finds the model by the `lm_eval.models` entry point (lm-eval versions with plugin
discovery) or, for lm-eval 0.4.13, through `a2d.tasks.harness_hook` (installed as a .pth file).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from a2d.models import decoders as registry
from a2d.models.block_decode import Decoded
from a2d.models.student import Student
from a2d.stores.artifacts import ArtifactStore
from a2d.tasks.generation import find_head
from a2d.tasks.resources import needs_teacher, resources_from_store


@register_model("a2d")
class A2DLM(LM):
    """An a2d head (and optionally its VFM) from a store, decoding with one registry decoder."""

    def __init__(
        self,
        store: str = "./a2d-store",
        head: str | None = None,
        decoder: str | None = None,
        vfm: str | None = None,
        drafter: str | None = None,
        max_gen_toks: int = 256,
        device: str = "cpu",
        student: Student | None = None,
        dspec=None,
        **_: Any,
    ) -> None:
        super().__init__()
        if decoder is None:  # the default lossless decoder: the drafter's where one is given
            decoder = "spec:drafter+lookup" if drafter else "spec:head+lookup"
        info = registry.describe(decoder)  # an unknown name is refused before anything loads
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm-eval's command line defaults to cuda; a CPU machine runs on the CPU
        self.store = ArtifactStore(store)
        self.head_ref = find_head(self.store, head)
        refs = {"head": self.head_ref}
        if "vfm" in info.needs:
            if not vfm:
                raise ValueError(f"decoder={decoder} needs vfm=KEY (a vfm artifact of this head)")
            refs["vfm"] = self.store.find(f"vfm/{vfm}")
        if "drafter" in info.needs:
            if not drafter:
                raise ValueError(
                    f"decoder={decoder} needs drafter=KEY (a drafter artifact of this head's teacher)"
                )
            refs["drafter"] = self.store.find(f"drafter/{drafter}")
        # the decoders' inputs as the eval and `a2d generate` build them (logit_alignment included)
        self.res, self.dspec, self.tok = resources_from_store(
            self.store,
            refs,
            int(max_gen_toks),
            device,
            teacher=needs_teacher(self.store, self.head_ref, decoder),
            student=student,
            dspec=dspec,
        )
        self.student, self.eos = self.res.student, self.res.eos
        self.decoder = decoder
        self.max_gen_toks = int(max_gen_toks)
        self._built: dict[int, registry.Decoder] = {}  # one decoder per budget
        self.totals = {"requests": 0, "tokens": 0, "forwards": 0, "seconds": 0.0}

    # -- generation ------------------------------------------------------------------------------------------
    def _decode(self, ids: list[int], budget: int) -> Decoded:
        if budget not in self._built:
            res = dataclasses.replace(self.res, max_new_tokens=budget)
            self._built[budget] = registry.build(self.decoder, res)
        return self._built[budget](ids)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok(context, add_special_tokens=False)["input_ids"]
            start = time.perf_counter()
            decoded = self._decode(ids, budget)
            self.totals["seconds"] += time.perf_counter() - start
            self.totals["requests"] += 1
            self.totals["tokens"] += len(decoded.tokens)
            self.totals["forwards"] += decoded.forwards
            text = self.tok.decode(decoded.tokens, skip_special_tokens=True)
            for stop in until:  # cut at the first stop string, as lm-eval's own models do
                if stop and stop in text:
                    text = text.split(stop, 1)[0]
            out.append(text)
        return out

    # -- likelihoods (the student's base model, exactly) ---------------------------------------------------------
    @torch.no_grad()
    def _logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) under the base model, and whether it is its greedy choice."""
        ids = torch.tensor([context + continuation], device=next(self.student.model.parameters()).device)
        with self.student.base() as base:
            logits = base(input_ids=ids).logits[0].float()  # (T, V)
        logp = torch.log_softmax(logits[len(context) - 1 : -1], -1)  # predictions of the continuation
        target = torch.tensor(continuation, device=logp.device)
        total = float(logp.gather(-1, target[:, None]).sum())
        return total, bool((logp.argmax(-1) == target).all())

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        whole = self.tok(context + continuation, add_special_tokens=False)["input_ids"]
        ctx = self.tok(context, add_special_tokens=False)["input_ids"]
        if whole[: len(ctx)] != ctx or len(whole) == len(ctx):  # a token straddles the boundary
            return ctx, self.tok(continuation, add_special_tokens=False)["input_ids"]
        return ctx, whole[len(ctx) :]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in requests:
            context, continuation = request.args
            ctx, cont = self._split(context, continuation)
            if not ctx:  # nothing to condition on: start from EOS, as lm-eval's HF model does
                ctx = [self.eos[0]]
            out.append(self._logprob(ctx, cont))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append(self._logprob([self.eos[0]], ids)[0] if ids else 0.0)
        return out

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def get_model_info(self) -> dict[str, Any]:
        """The run's totals, written into lm-eval's results under `config`."""
        t = self.totals
        return {
            "a2d_head": self.head_ref.key,
            "a2d_decoder": self.decoder,
            "a2d_generations": t["requests"],
            "a2d_generated_tokens": t["tokens"],
            "a2d_forwards": t["forwards"],
            "a2d_tokens_per_forward": round(t["tokens"] / t["forwards"], 4) if t["forwards"] else None,
            "a2d_tokens_per_s": round(t["tokens"] / t["seconds"], 3) if t["seconds"] else None,
            "a2d_counting": "a forward is one model call (draft+verify once); tokens are response tokens incl. EOS",
        }
