"""Decoding: the exact prefix cache (and its rollback), lossless self-speculative decoding, honest
forward counts, and what the decoder feeds the model compared with what training fed it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from a2d.models import canvas as canvas_module
from a2d.models import cpu_kernels, fast_lora
from a2d.models import decoders as registry
from a2d.models.ar import ar_decode
from a2d.models.block_decode import Decoded, threshold_decode
from a2d.models.canvas import Canvas
from a2d.models.generate import generate_batch
from a2d.models.proposals import HeadDrafter, VFMDrafter
from a2d.models.speculative import Drafter, Proposal, speculative_decode
from a2d.models.student import lm_head, student_forward
from a2d.models.views import BlockView, build_batch
from tests.conftest import ARCHS, trained_like

EOS = [257]


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """Pearson's chi-square goodness-of-fit p-value (df = categories - 1)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(observed) - 1
    return float(1 - torch.special.gammainc(torch.tensor(df / 2), torch.tensor(stat / 2)))


PROMPT = [258, 104, 105, 257, 10, 33, 44, 51]


def base_greedy(student, prompt, n):
    with student.base() as model:
        return generate_batch(model, [prompt], n, EOS, 0).response_ids[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_and_uncached_decoding_agree_in_tokens_and_logits(small_teachers, arch):
    student = trained_like(small_teachers, arch)
    cached, plain = Canvas(student, PROMPT, cached=True), Canvas(student, PROMPT, cached=False)
    gen = torch.Generator().manual_seed(0)
    for step in range(7):
        region = [student.info.mask_id] * 4
        if step % 3 == 2:
            region[1] = int(torch.randint(3, 250, (1,), generator=gen))  # a token committed out of order
        a, b = cached.forward([], region), plain.forward([], region)
        torch.testing.assert_close(lm_head(student)(a), lm_head(student)(b), atol=1e-5, rtol=0)
        new = [int(x) for x in torch.randint(3, 250, (1 + step % 2,), generator=gen)]
        for c in (cached, plain):
            c.keep(-1)
            c.commit(new)
    assert cached.in_cache == plain.in_cache == len(cached.tokens) - 1 - len(new)  # newest + new commits
    assert cached.cache.get_seq_length() == cached.in_cache  # the open region never entered the cache
    for threshold in (0.0, 0.3):
        with_cache = threshold_decode(student, PROMPT, 14, threshold, EOS, cached=True)
        without = threshold_decode(student, PROMPT, 14, threshold, EOS, cached=False)
        assert with_cache.tokens == without.tokens and with_cache.forwards == without.forwards


@pytest.mark.parametrize("arch", ARCHS)
def test_a_rejected_draft_rolls_the_cache_back(small_teachers, arch):
    """Verify a draft whose third token is wrong, keep the two that hold, continue: the cached
    forward equals the uncached one (attention KV truncated, Gated DeltaNet state restored)."""
    student = trained_like(small_teachers, arch)
    truth = base_greedy(student, PROMPT, 8)
    drafts = truth[:5]
    drafts[2] = (drafts[2] + 1) % 250  # rejected: the base's next token differs
    canvases = [Canvas(student, PROMPT, cached=True), Canvas(student, PROMPT, cached=False)]
    for c in canvases:
        c.forward([], [student.info.mask_id] * 4)
        c.keep(-1)
    outs = [c.forward(drafts, [student.info.mask_id] * 4) for c in canvases]
    verify = lm_head(student)(outs[0][: 1 + len(drafts)]).argmax(-1).tolist()
    assert verify[:3] == truth[:3]  # base predictions at the newest token and the drafts
    assert drafts[:2] == verify[:2] and drafts[2] != verify[2]
    for c in canvases:
        c.keep(2)
        c.commit(drafts[:2] + [verify[2]])
    after = [c.forward([], [student.info.mask_id] * 4) for c in canvases]
    torch.testing.assert_close(after[0], after[1], atol=1e-5, rtol=0)
    nxt = lm_head(student)(after[0][-5]).argmax(-1).item()  # the newest token's state predicts the next
    assert nxt == truth[3]


class Scripted(Drafter):
    """An external drafter: `draft(done)` gives the drafts after the response so far."""

    def __init__(self, prompt, draft):
        self.prompt, self.draft = prompt, draft

    def start(self, canvas):
        return Proposal(self.draft([]))

    def propose(self, canvas, accepted, region, remaining, sampling):
        return Proposal(self.draft(canvas.tokens[len(self.prompt) :]))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_lossless_decoder_is_the_base_model(small_teachers, arch):
    """Every registry decoder flagged lossless gives the base's greedy tokens, on both architectures
    (the hybrid too: a2d's own prompt lookup, where transformers refuses stateful models)."""

    from a2d.models.student import base_is
    from a2d.models.teacher import load_teacher

    student = trained_like(small_teachers, arch)
    fast_lora.install(student.model, student.scope)
    teacher, _ = load_teacher(small_teachers / arch, device="cpu")  # as the eval loads it: packed linears
    # the eval checks an unquantized base against the teacher's ar:greedy instead of decoding it twice
    assert base_is(student, teacher)
    res = registry.Resources(student, EOS, 14, teacher=teacher)
    lossless = [
        "ar:greedy",
        "ar:student-base",
        "spec:lookup",
        "ar:prompt-lookup",
        "spec:head",
        "spec:head+lookup",
    ]
    assert all(registry.describe(n).lossless for n in lossless)
    repeating = [258, 300, 301, 302, 303, 10] * 3  # lookup finds matches here
    for prompt in (PROMPT[:3], repeating) if arch == "llama" else (repeating,):
        truth = base_greedy(student, prompt, 14)
        for name in lossless:
            out = registry.build(name, res)(prompt)
            assert out.tokens == truth, name
            if name.startswith("spec:head"):  # every forward after the prompt's carries the head's drafts
                assert all(d > 0 for d, ok in zip(out.drafted, out.draftable, strict=True) if ok)
                assert len(out.drafted) == out.forwards and max(out.drafted) <= 4
    if arch == "qwen3_5":
        with pytest.raises(ValueError, match="stateful"):
            registry.build("hf:prompt-lookup", res)


def test_ngram_drafts_copy_what_followed_the_latest_longest_match():
    from a2d.models.proposals import ngram_drafts

    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_drafts(ctx, 3, 2) == [7, 8]  # [2, 3] last seen before 7 (the 3-gram [5, 2, 3] never was)
    assert ngram_drafts(ctx + [4], 3, 4) == []  # 4 never occurred before
    assert ngram_drafts([5, 6, 5], 3, 3) == [6, 5]  # a 1-gram match, drafts run to the context's end


def test_good_drafts_are_accepted_a_block_per_forward_and_bad_ones_cost_nothing(small_teachers):
    """External drafts that are the base's own continuation gain a block per forward; drafts that are
    always wrong still gain the base's next token per forward; the output is the base's either way."""
    student = trained_like(small_teachers, "llama")
    truth = base_greedy(student, PROMPT, 16)
    good = speculative_decode(
        student, PROMPT, 16, EOS, Scripted(PROMPT, lambda done: truth[len(done) : len(done) + 4])
    )
    assert good.tokens == truth and good.accepted[:3] == [4, 4, 4]  # 4 drafts held (+ the base's next token)
    assert good.forwards == 4 and good.drafted == [4, 4, 4, 0]  # 1 token left: nothing to draft
    bad = speculative_decode(
        student,
        PROMPT,
        16,
        EOS,
        Scripted(PROMPT, lambda done: [(t + 1) % 250 for t in truth[len(done) :][:4]]),
    )
    assert bad.tokens == truth and bad.accepted == [0] * 16 and bad.forwards == 16


@pytest.mark.parametrize("arch", ARCHS)
def test_each_mask_run_sees_what_a_forward_after_that_acceptance_sees(small_teachers, arch):
    """Tree attention: the run attached after draft a (positions, visible keys, Gated DeltaNet state)
    gives the states a forward would give after committing the first a drafts; the clean rows are
    the unbranched forward's, so verification is unchanged."""
    student = trained_like(small_teachers, arch)
    mask, drafts, m = student.info.mask_id, [5, 6, 7], 2

    def canvas(committed):
        c = Canvas(student, PROMPT, cached=True)
        c.forward([], [mask])
        c.keep(-1)
        c.commit(committed)
        return c

    branched = canvas([9]).forward(drafts, [mask] * (4 * m), [(a, m) for a in range(4)])
    region = branched[-4 * m :]
    for a in range(4):
        alone = canvas([9] + drafts[:a]).forward([], [mask] * m)[-m:]
        torch.testing.assert_close(region[a * m : (a + 1) * m], alone, atol=1e-5, rtol=0)
    plain = canvas([9]).forward(drafts, [])
    torch.testing.assert_close(branched[: plain.shape[0]], plain, atol=1e-5, rtol=0)
    assert (region[:m] - region[m : 2 * m]).abs().max() > 1e-3  # the runs do differ


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", ["packed", "dense"])
def test_the_lean_lora_path_is_the_training_forward(small_teachers, arch, kernel, monkeypatch):
    """The decode fast path computes what PEFT's wrappers compute (the trained model), and the
    adapter really acts on the open rows only: with oneDNN's packed product of [W; A] per group, and
    with MKL's dense product of the same rows (where MKL is the faster kernel)."""
    monkeypatch.setenv("A2D_CPU_LINEAR", kernel)
    cpu_kernels.kernel_choice.cache_clear()
    student = trained_like(small_teachers, arch)
    _lean_is_trained(student, student.info.lora_modules)
    groups = {m._a2d_group for m in student.model.modules() if getattr(m, "_a2d_group", None)}
    if cpu_kernels.supported():  # on the CPU the deltas went in through the siblings' one product
        fast = [g for g in groups if g.adapters and g.local.lora]
        assert len(fast) == len(groups) if arch == "llama" else fast  # (qwen3_5: its reverse scans
        # run the Gated DeltaNet projections on a flipped gate, where the wrappers add the delta)
    cpu_kernels.kernel_choice.cache_clear()


def _lean_is_trained(student, routed: int) -> None:
    """Install the lean LoRA path (it routes `routed` projections) and check it against the training
    forward: the same logits, the base's on the clean rows, the adapter acting on the open rows."""
    mask = student.info.mask_id
    ids = torch.tensor([PROMPT + [mask] * 4])
    pad, open_ = torch.ones_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    open_[:, -4:] = True
    with torch.no_grad():
        trained = lm_head(student)(student_forward(student, ids, pad, open_))
        assert fast_lora.install(student.model, student.scope) == routed
        lean = lm_head(student)(student_forward(student, ids, pad, open_))
        with student.base() as base:
            plain = base(ids).logits
    torch.testing.assert_close(lean, trained, atol=1e-5, rtol=0)
    torch.testing.assert_close(lean[:, :-4], plain[:, :-4], atol=1e-5, rtol=0)  # clean rows: the base
    assert (lean[:, -3:] - plain[:, -3:]).abs().max() > 1e-2  # open rows: the adapter acts


def test_an_attention_only_lora_decodes_as_it_trains_and_leaves_the_mlp_the_base(small_teachers):
    """`head.lora_targets` (the demo adapts attention only: a decode forward then adds one delta
    product per attention group, none for the MLP): only the named projections carry LoRA, the lean
    decode path still computes the training forward, and a name the model lacks is refused."""
    student = trained_like(small_teachers, "llama", targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    names = [n.split(".lora_A")[0] for n, _ in student.model.named_parameters() if ".lora_A" in n]
    adapted = {n.rsplit(".", 1)[-1] for n in names}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"} and student.info.lora_modules == 4 * 2
    _lean_is_trained(student, 4 * 2)
    with pytest.raises(ValueError, match=r"\['qkv'\].*use some of \['down_proj', 'gate_proj'"):
        trained_like(small_teachers, "llama", targets=["q_proj", "qkv"])


@pytest.mark.parametrize("arch", ARCHS)
def test_a2d_ar_decode_is_transformers_greedy(small_teachers, arch):
    student = trained_like(small_teachers, arch)
    for prompt in (PROMPT, PROMPT[:2]):
        with student.base() as model:
            out = ar_decode(model, prompt, 12, EOS)
        assert out.tokens == base_greedy(student, prompt, 12) and out.forwards == len(out.tokens)


def test_the_vfm_drafts_from_the_verifier_states_and_counts_only_its_drafts(small_teachers):
    """spec:vfm: lossless; no forward re-encodes the prompt (each fed token is fed once, save the
    newest which the flow-map forward and the verify forward both see); accepted counts drafts only."""
    from a2d.models.vfm import NoiseAdapter

    student = trained_like(small_teachers, "llama", block=4)
    adapter = NoiseAdapter(64, 8, width=16, layers=1, heads=2)
    fed = []
    real = canvas_module.student_forward

    def record(s, ids, pad, open_, **kw):
        fed.append(int(pad.shape[1]))
        return real(s, ids, pad, open_, **kw)

    canvas_module.student_forward = record
    try:
        out = speculative_decode(student, PROMPT, 12, EOS, VFMDrafter(student, adapter, 4, shifted=True))
    finally:
        canvas_module.student_forward = real
    assert out.tokens == base_greedy(student, PROMPT, 12)
    assert out.forwards == len(fed) and max(fed[1:]) <= 1 + 3 + 1  # newest + 3 drafts or z, never the prompt
    assert sum(out.accepted) + len(out.drafted) <= len(out.tokens)  # landed base tokens are not "accepted"


def test_sampled_speculative_decoding_has_the_base_distribution(small_teachers):
    """Temperature 1: over 600 seeds the first two tokens follow the base model's distribution
    (chi-square at a fixed seed set), although the drafts come from another distribution."""
    student = trained_like(small_teachers, "llama", block=2)
    prompt = PROMPT[:4]
    with torch.no_grad(), student.base() as model:  # the exact base distribution of token 1
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
    firsts, pairs = [], []
    for seed in range(600):
        gen = torch.Generator().manual_seed(seed)
        out = speculative_decode(
            student, prompt, 2, [], HeadDrafter(student, 2), temperature=1.0, generator=gen
        )
        firsts.append(out.tokens[0])
        pairs.append(tuple(out.tokens))
    top = torch.topk(p1, 6).indices.tolist()
    observed = [sum(t == k for t in firsts) for k in top] + [sum(t not in top for t in firsts)]
    expected = [600 * float(p1[k]) for k in top] + [600 * (1 - float(p1[top].sum()))]
    assert chi_square_p(observed, expected) > 0.001
    # token 2 given the most common token 1
    t1 = max(set(firsts), key=firsts.count)
    seconds = [b for a, b in pairs if a == t1]
    with torch.no_grad(), student.base() as model:
        p2 = torch.softmax(model(torch.tensor([prompt + [t1]])).logits[0, -1], -1)
    top2 = torch.topk(p2, 4).indices.tolist()
    observed = [sum(t == k for t in seconds) for k in top2] + [sum(t not in top2 for t in seconds)]
    expected = [len(seconds) * float(p2[k]) for k in top2] + [len(seconds) * (1 - float(p2[top2].sum()))]
    assert chi_square_p(observed, expected) > 0.001


# -- honest accounting ----------------------------------------------------------------------------------
def test_tpf_is_pinned_for_a_hand_made_case(small_teachers, monkeypatch):
    """A stand-in model with scripted confidences; block 4, threshold 0.9. Forward 1 commits response
    positions 0 (the exact base token, though only 0.3 sure), 1 (0.95) and 3 (0.99); forward 2
    commits 2 (now the exact first one); forward 3 commits 4, 5 (0.97), 6 = EOS (0.98) and 7, and
    EOS has every earlier position committed, so the answer ends: 7 tokens in 3 forwards."""
    import a2d.models.block_decode as block_decode_module

    student = trained_like(small_teachers, "llama")
    prompt = [5, 6, 7]
    tokens = [8, 9, 10, 11, 12, 13, 2, 14, 15]
    conf = [0.3, 0.95, 0.2, 0.99, 0.1, 0.97, 0.98, 0.99, 0.99]
    vocab = 320  # holds the mask id (259): the decoder never commits it

    def forward(self, clean, region):  # each fed position's absolute index, as its "hidden state"
        start = self.in_cache
        n = len(self.tokens) - start + len(clean) + len(region)
        self.forwards += 1
        self._fed = (len(self.tokens) - start, len(clean))
        return torch.arange(start, start + n, dtype=torch.float32)[:, None]

    def head(rows):  # the position r predicts response position r + 1 - len(prompt)
        out = torch.empty(rows.shape[0], vocab)
        for i, r in enumerate(rows[:, 0].long().tolist()):
            q = r + 1 - len(prompt)
            probs = torch.full((vocab,), (1 - conf[q]) / (vocab - 1))
            probs[tokens[q]] = conf[q]
            out[i] = probs.log()
        return out

    monkeypatch.setattr(Canvas, "forward", forward)
    monkeypatch.setattr(
        Canvas, "keep", lambda self, n: setattr(self, "in_cache", self.in_cache + self._fed[0] + n)
    )
    monkeypatch.setattr(block_decode_module, "lm_head", lambda s: head)
    out = threshold_decode(student, prompt, 20, 0.9, [2])
    assert out.tokens == tokens[:7] and out.forwards == 3
    assert out.commit_step == [1, 1, 2, 1, 3, 3, 3]
    whole = threshold_decode(student, prompt, 20, 0.0, [2])  # head:k1: a whole block per forward
    assert whole.tokens == tokens[:7] and whole.forwards == 2


# -- training sees what decoding sees ---------------------------------------------------------------------
def test_the_decoder_feeds_the_states_training_fed(small_teachers, monkeypatch):
    """Record every forward of an uncached threshold decode; for each, build the training row of the
    same state (same block, same masked positions) and compare ids, padding and open positions."""
    student = trained_like(small_teachers, "llama")
    seen = []
    real = canvas_module.student_forward

    def record(s, ids, pad, open_, **kw):
        seen.append((ids[0].tolist(), open_[0].tolist()))
        return real(s, ids, pad, open_, **kw)

    monkeypatch.setattr(canvas_module, "student_forward", record)
    out = threshold_decode(student, PROMPT, 8, 0.2, [], cached=False)
    mask = student.info.mask_id
    size = student.block_size
    for ids, open_ in seen:
        response = ids[len(PROMPT) :]
        block = (len(response) - 1) // size
        start = block * size
        shown = response[start:]
        masked = np.array([t == mask for t in response[start:]])
        first = int(np.argmax(masked))
        view = BlockView(block, start, np.array(out.tokens[start : start + len(shown)]), masked, 0.5, "test")
        batch = build_batch([PROMPT], [np.array(out.tokens)], [view], mask, 0, complementary=False)
        assert batch["ids"][0].tolist() == ids  # same tokens, masks where the decoder had masks
        assert batch["open"][0].tolist() == open_  # the same open positions
        assert open_.index(True) == len(PROMPT) + start + first
        assert not any(
            t == mask for t in ids[: len(PROMPT) + start]
        )  # a clean prefix, nothing after the block
    assert len(seen) == out.forwards and isinstance(out, Decoded)


def _tiny_causal_lm(family: str, **extra):
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # weights far from init: q/k norms, biases and norms that are not ones or zeros
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize(
    "family, extra",
    [
        ("llama", {"attention_bias": True}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}),
        ("qwen2", {}),
        ("qwen3", {}),
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_lean_ar_step_is_the_library_forward(family, extra, packed):
    """The lean one-token step (ar:greedy's) gives the library forward's logits at every position
    (teacher-forced over 40 tokens after a prompt) and the same greedy tokens; models it does not
    reproduce keep the library forward."""
    from transformers import DynamicCache

    from a2d.models.ar import LeanStep, lean_step

    model = _tiny_causal_lm(family, **extra)
    if packed:
        cpu_kernels.pack(model)
    fast = lean_step(model)
    assert fast is not None
    gen = torch.Generator().manual_seed(1)
    prompt, forced = torch.randint(0, 300, (9,), generator=gen), torch.randint(0, 300, (40,), generator=gen)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt[None], cache=cache, use_cache=True)
        state = fast.start(cache, 9 + 40)  # the lean buffers copy the prompt's K/V; the library cache goes on
        for t in forced.tolist():
            want = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1]
            torch.testing.assert_close(fast.step(state, t), want, atol=2e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="past the 49"):
            fast.step(state, 0)
    lean, library = (
        ar_decode(model, prompt.tolist(), 30, []),
        ar_decode(model, prompt.tolist(), 30, [], lean=False),
    )
    assert lean.tokens == library.tokens and lean.forwards == library.forwards == 30
    assert not LeanStep.supports(_tiny_causal_lm(family, **extra).to(torch.bfloat16))


def test_lean_ar_step_leaves_other_models_to_the_library(small_teachers):
    from a2d.models.ar import lean_step
    from a2d.models.teacher import load_teacher

    hybrid, _ = load_teacher(small_teachers / "qwen3_5", device="cpu")
    llama, _ = load_teacher(small_teachers / "llama", device="cpu")
    student = trained_like(small_teachers, "llama")
    assert lean_step(hybrid) is None and lean_step(llama) is not None
    with student.base() as model:
        assert lean_step(model) is None  # PEFT-wrapped projections
    # a model adapted in place after a lean decode: the next decode runs the adapted model
    from peft import LoraConfig, inject_adapter_in_model

    plain = _tiny_causal_lm("llama")
    prompt = list(range(5, 14))
    before = ar_decode(plain, prompt, 20, []).tokens
    inject_adapter_in_model(
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False), plain
    )
    after = ar_decode(plain, prompt, 20, [])
    assert lean_step(plain) is None and after.tokens != before
    assert after.tokens == ar_decode(plain, prompt, 20, [], lean=False).tokens


@pytest.mark.parametrize("family, extra", [("llama", {"attention_bias": True}), ("qwen3", {})])
def test_the_lean_canvas_is_the_library_canvas(family, extra):
    """A verify forward on the lean canvas (the prompt, then a chain, then a tree of drafts, each
    followed by a kept path) gives the library canvas's hidden states and layer outputs, and a
    speculative decode gives the same tokens and forwards on both; a region of masks is refused."""
    from a2d.models.attention import Scope
    from a2d.models.canvas import Canvas
    from a2d.models.lean_canvas import LeanCanvas, lean_canvas
    from a2d.models.proposals import LookupDrafter
    from a2d.models.speculative import speculative_decode
    from a2d.models.student import Student, StudentInfo

    model = _tiny_causal_lm(family, **extra)
    s = Student(model, None, None, StudentInfo(299, 0, [], 0, "none"), Scope(masked=True), "block", 4)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 299, (11,), generator=gen).tolist()
    lean, ref = lean_canvas(s, prompt, 64), Canvas(s, prompt, cached=True)
    assert isinstance(lean, LeanCanvas)
    seen: dict[str, list] = {"lean": [], "ref": []}
    lean.taps = ([1], lambda i, h: seen["lean"].append(h[0].clone()))
    steps = [
        ([], None, []),
        ([5, 6, 7], None, [0, 1]),
        ([8, 9, 10, 11], [-1, 0, -1, 2], [2, 3]),
        ([], None, []),
    ]
    with torch.no_grad():
        from a2d.models.capture import capture_layers

        with capture_layers(model.model, [1], lambda i, h: seen["ref"].append(h[0].clone())):
            for clean, parents, path in steps:
                got = lean.forward(clean, [], parents=parents)
                want = ref.forward(clean, [], parents=parents)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                for c in (lean, ref):
                    c.keep_path(path)
                    c.commit([clean[i] for i in path] + [int(got[-1].argmax())])
        for a, b in zip(seen["lean"], seen["ref"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="open region"):
            lean.forward([], [299, 299])
        repeating = prompt[:5] * 4
        for p in (prompt, repeating):
            fast = speculative_decode(s, p, 20, [], LookupDrafter(3, 4))
            slow = speculative_decode(s, p, 20, [], LookupDrafter(3, 4), lean=False)
            assert fast.tokens == slow.tokens == ar_decode(model, p, 20, []).tokens
            assert fast.forwards == slow.forwards


def test_the_spec_decoder_pattern_and_the_registry_name_the_same_decoders():
    """specs cannot import the registry (the layers point down), so its decoder-name pattern is a
    second list: every registry family a spec may name matches it, and every name it admits is one
    the registry knows (spec:model needs an external draft model no spec provides)."""
    import re

    from a2d.models.decoders import ALIASES, FAMILIES, describe
    from a2d.specs.stages import DECODER_NAME

    samples = {"threshold": "threshold:0.5", "entropy": "entropy:1", "vfm": "vfm:k2"}
    for family in FAMILIES:
        name = samples.get(family, family)
        describe(name)
        assert bool(re.fullmatch(DECODER_NAME, name)) == (family != "spec:model"), name
    for alternative in DECODER_NAME.removeprefix("^(").removesuffix(")$").split("|"):
        name = (
            alternative.replace("\\+", "+").replace("[0-9]*\\.?[0-9]+", "0.5").replace("k[1-9][0-9]*", "k3")
        )
        assert re.fullmatch(DECODER_NAME, name), alternative
        describe(name)  # a name the pattern admits but the registry does not know raises here
    for alias, name in ALIASES.items():  # a former name the form still admits means its decoder
        assert re.fullmatch(DECODER_NAME, alias), alias
        assert describe(alias) == describe(name)


def test_the_registry_docstring_table_is_the_registry():
    """The module docstring's table lists every family once with its lossless flag and needs, as
    the records say (the last column, what it does, is prose)."""
    rows = [line.split(" | ") for line in registry.__doc__.splitlines() if line.startswith("| `")]
    table = {name.strip("|` "): (lossless, needs) for name, lossless, needs, _ in rows}
    assert list(table) == [f.shown for f in registry.DECODERS]
    for f in registry.DECODERS:
        lossless, needs = table[f.shown]
        assert (lossless in ("yes", "reference")) == f.lossless and lossless in ("yes", "reference", "no")
        assert tuple(needs.split(", ")) == f.needs, f.name
        assert set(f.needs) <= set(registry.NEEDS)


def test_decoder_names_are_described_and_refused_as_before():
    """Whole names, `family:ARG` names and aliases describe as the registry names them; a family
    without its argument, or with one it does not take, is refused with the names it knows."""
    assert registry.describe("threshold:0.7") == registry.DecoderInfo(
        "threshold:0.7", "threshold", "0.7", False, ("head",)
    )
    assert registry.describe("vfm:k2").needs == ("vfm",) and registry.describe("vfm:k2").arg == "k2"
    assert registry.describe("ar:prompt-lookup").name == "spec:lookup"
    assert registry.describe("spec:head").family == "spec" and registry.describe("spec:head").lossless
    for bad in ("threshold", "threshold:x", "vfm:2", "vfm:k0", "head:k2", "spec:nothing"):
        with pytest.raises(ValueError, match="unknown decoder .* use one of ar:greedy, .*threshold:P"):
            registry.describe(bad)
