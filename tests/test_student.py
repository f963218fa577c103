"""The student on the decode state: what each position sees, where the adapter acts, the training
views and the loss math, checked against the base model and hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from a2d.models.attention import attention_masks, open_suffix
from a2d.models.losses import alignment_loss, masked_diffusion_loss, time_weight
from a2d.models.student import lm_head, student_forward
from a2d.models.teacher import load_teacher
from a2d.models.views import ViewSampler, build_batch, canvas
from tests.conftest import ARCHS, trained_like


def logits_of(student, ids, pad, open_):
    return lm_head(student)(student_forward(student, ids, pad, open_))  # (B, T, V)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_positions_are_the_base_model_exactly_for_any_mask_pattern(small_teachers, arch):
    """adapter_scope: masked: every position before the open block computes the base model's causal
    logits (Gated DeltaNet layers and reverse scan included), whatever is masked after it; open
    positions change with the adapter."""
    student = trained_like(small_teachers, arch)
    base, _ = load_teacher(small_teachers / arch)
    gen = torch.Generator().manual_seed(1)
    t = 14
    ids = torch.randint(3, 250, (6, t), generator=gen)
    first = torch.tensor([4, 6, 8, 10, 12, 13])  # where each row's open block starts
    for row, f in enumerate(first.tolist()):
        pattern = torch.rand(t - f, generator=gen) < 0.5
        pattern[0] = True  # an open block starts at its first masked position
        ids[row, f:][pattern] = student.info.mask_id
    pad = torch.ones_like(ids)
    got = logits_of(student, ids, pad, open_suffix(first, t))
    want = base(input_ids=ids.clamp(max=base.config.vocab_size - 1)).logits  # causal, no adapter
    for row, f in enumerate(first.tolist()):
        torch.testing.assert_close(got[row, :f], want[row, :f], atol=1e-5, rtol=0)
        assert (got[row, f:] - want[row, f:]).abs().max() > 1e-2  # the open block is the adapter's
    with torch.no_grad():  # a different adapter changes open positions only
        for name, p in student.model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.0)
    again = logits_of(student, ids, pad, open_suffix(first, t))
    for row, f in enumerate(first.tolist()):
        torch.testing.assert_close(again[row, :f], got[row, :f], atol=0, rtol=0)
        assert (again[row, f:] - got[row, f:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention,scope", [("block", "masked"), ("block", "all"), ("bidirectional", "all")])
def test_what_each_position_sees(small_teachers, arch, attention, scope):
    """Changing a later token changes an earlier position exactly when the mode lets it see that token."""
    student = trained_like(small_teachers, arch, attention, scope)
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(2))
    ids[0, 8:] = student.info.mask_id
    open_ = open_suffix(torch.tensor([8]), 12)
    pad = torch.ones_like(ids)
    base = logits_of(student, ids, pad, open_)[0]
    for changed in (3, 10):  # a prefix token, an open-block token
        edited = ids.clone()
        edited[0, changed] = 5 if edited[0, changed] != 5 else 6
        moved = (logits_of(student, edited, pad, open_)[0] - base).abs().amax(-1) > 1e-6  # (T,)
        for pos in range(12):
            # causal prefix; the open block (from 8) sees the prefix and the whole block
            sees = attention == "bidirectional" or pos >= changed or pos >= 8
            assert bool(moved[pos]) == sees, (changed, pos)


def test_the_attention_mask_spells_the_decode_state():
    pad = torch.tensor([[0, 1, 1, 1, 1]])
    open_ = open_suffix(torch.tensor([3]), 5)
    allowed = attention_masks(pad, open_, "block", torch.float32)[0, 0] == 0
    assert allowed.int().tolist() == [
        [1, 0, 0, 0, 0],  # a padding query sees only itself
        [0, 1, 0, 0, 0],  # prefix: causal, never the padding
        [0, 1, 1, 0, 0],
        [0, 1, 1, 1, 1],  # open block: the prefix and the whole block
        [0, 1, 1, 1, 1],
    ]
    cached = attention_masks(pad[:, 3:], open_[:, 3:], "block", torch.float32, past=3)[0, 0] == 0
    assert cached.int().tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]  # cached tokens are committed prefix
    with pytest.raises(ValueError, match="no exact cache"):
        attention_masks(pad, open_, "bidirectional", torch.float32, past=2)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention", ["block", "bidirectional"])
def test_a_row_alone_equals_the_row_in_a_left_padded_batch(small_teachers, arch, attention):
    student = trained_like(small_teachers, arch, attention, "masked" if attention == "block" else "all")
    gen = torch.Generator().manual_seed(3)
    short, long = torch.randint(3, 250, (1, 7), generator=gen), torch.randint(3, 250, (1, 11), generator=gen)
    short[0, 4:] = long[0, 8:] = student.info.mask_id
    alone = logits_of(student, short, torch.ones_like(short), open_suffix(torch.tensor([4]), 7))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    pad = torch.ones_like(batch)
    pad[0, :4] = 0
    both = logits_of(student, batch, pad, open_suffix(torch.tensor([8, 8]), 11))
    torch.testing.assert_close(both[0, 4:], alone[0], atol=2e-5, rtol=0)


# -- training views -----------------------------------------------------------------------------------
def test_views_are_decode_states_block_aligned_from_the_response_start():
    """Every view: prompt + whole committed blocks + the open block, nothing after; whatever the
    prompt length, the first response token opens block 0."""
    sampler = ViewSampler(seed=0, total_steps=10, block_size=4, r_max=1.0)
    eos, mask = 2, 99
    response = np.array([10, 11, 12, 13, 14, 15, 16, 17, 18, 2])  # ends with EOS: padded to 12
    seen_blocks = set()
    for index in range(40):
        prompt = list(range(50, 50 + 1 + index % 7))
        view = sampler.view(0, 0, index, "s", response, eos, True, None, max_blocks=10)
        seen_blocks.add(view.block)
        batch = build_batch([prompt], [response], [view], mask, 0, complementary=False)
        row = batch["ids"][0][batch["pad"][0]].tolist()
        want = prompt + response[: view.start].tolist()
        assert row[: len(want)] == want  # clean causal prefix
        assert len(row) == len(want) + len(view.tokens)  # nothing after the open block
        shown = ["M" if t == mask else "c" for t in row[len(want) :]]
        assert shown == ["M" if m else "c" for m in view.masked]
        assert view.start == 4 * view.block and view.start % 4 == 0
        cols = torch.nonzero(batch["block"][0]).flatten()
        assert int(cols[0]) - int(batch["offset"][0]) == view.start  # block counted from the response start
    assert seen_blocks == {0, 1, 2}
    full = canvas(response, 4, eos, finished=True)
    assert full.tolist()[-4:] == [18, 2, 2, 2] and len(full) == 12  # EOS-padded to the block, supervised
    cut = canvas(response[:-1], 4, eos, finished=False)
    assert cut.tolist() == [10, 11, 12, 13, 14, 15, 16, 17]  # no EOS invented for a cut response


def test_trajectory_views_mask_what_the_teacher_committed_last_up_to_everything():
    sampler = ViewSampler(seed=0, total_steps=100, block_size=8, r_min_start=0.0, r_min_end=0.0, r_max=1.0)
    response = np.arange(100, 116)
    steps = np.array([3, 1, 4, 1, 5, 9, 2, 6, 8, 7, 6, 5, 4, 3, 2, 1], dtype=np.int16)
    traj = {"sample_id": "s", "response_ids": response, "unmask_step": steps}
    ratios, full = [], 0
    for index in range(300):
        view = sampler.view(0, 0, index, "s", response, 0, False, traj, max_blocks=2)
        assert view.source == "trajectory"
        block_steps = steps[view.start : view.start + 8]
        if (~view.masked).any():  # a teacher state: every clean position committed no later than any masked
            assert block_steps[~view.masked].max() <= block_steps[view.masked].min()
        ratios.append(view.masked.mean())
        full += int(view.masked.all())
    assert full > 0 and min(ratios) >= 1 / 8  # all-masked views occur; never an unsupervised view
    assert abs(np.mean(ratios) - 0.5) < 0.05


def test_views_respect_max_seq_len_and_complements_mask_the_rest():
    sampler = ViewSampler(seed=1, total_steps=10, block_size=4)
    response = np.arange(10, 30)
    blocks = {sampler.view(0, 0, i, "s", response, 0, False, None, max_blocks=2).block for i in range(50)}
    assert blocks == {0, 1}  # truncation at max_seq_len: only blocks that fit
    view = sampler.view(0, 0, 0, "s", response, 0, False, None, max_blocks=5)
    batch = build_batch([[1, 2]], [response], [view], 99, 0, complementary=True)
    if view.masked.all():
        assert batch["ids"].shape[0] == 1  # an empty complement is not a view
    else:
        primary, comp = batch["loss"][0], batch["loss"][1]
        assert not bool((primary & comp).any()) and bool(((primary | comp) == batch["block"][0]).all())
        assert batch["t"][1] == pytest.approx(1 - batch["t"][0])  # the complement's own t


# -- loss math ------------------------------------------------------------------------------------------
def test_masked_diffusion_loss_by_hand():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    targets = torch.tensor([0, 2, 1])
    ce = [math.log(math.exp(2) + 2) - 2, math.log(math.e + 2), math.log(3)]
    t = torch.tensor([0.5, 0.25, 0.25])  # each position's row mask ratio
    for weighting, w in (("none", [1, 1, 1]), ("inv_t", [2, 4, 4]), ("min_snr", [2, 4, 4])):
        norm = torch.tensor([1 / 1, 1 / 2, 1 / 2])  # view A has 1 masked token, view B 2
        loss, info = masked_diffusion_loss(logits, targets, time_weight(t, weighting), norm)
        want = ce[0] * w[0] + (ce[1] * w[1] + ce[2] * w[2]) / 2
        assert float(loss) == pytest.approx(want, rel=1e-6), weighting
    assert float(time_weight(torch.tensor([0.1]), "min_snr")) == pytest.approx(5.0)  # capped at γ
    assert info["masked_acc"] == pytest.approx(1 / 3)
    # sharpening: only the correct position 0 adds its entropy at temperature 0.5
    p = torch.softmax(logits[0] / 0.5, -1)
    entropy = float(-(p * p.log()).sum())
    sharp, info = masked_diffusion_loss(logits, targets, torch.ones(3), torch.ones(3), entropy_weight=0.3)
    assert float(sharp) == pytest.approx(sum(ce) + 0.3 * entropy, rel=1e-6)
    assert info["sharpen"] == pytest.approx(entropy, rel=1e-6)


def test_alignment_is_mean_centred():
    centre = torch.tensor([10.0, 10.0])
    s, t = torch.tensor([[11.0, 10.0]]), torch.tensor([[10.0, 11.0]])  # orthogonal once centred
    assert float(alignment_loss([s], [t], [centre])) == pytest.approx(1.0)
    assert float(alignment_loss([s], [t], [torch.zeros(2)])) == pytest.approx(1 - 220 / 221, abs=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_prefix_once_without_grad_gives_the_full_forward_loss_and_gradients(small_teachers, arch):
    """Training runs the base-model prefix once without grad into a cache and only the open block
    with grad; loss, gradients and captured states equal one full forward with grad."""
    from a2d.models.objectives.head import diffusion_ce
    from a2d.specs import HeadSpec

    student = trained_like(small_teachers, arch)
    sampler = ViewSampler(0, 10, 4, r_max=1.0)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 250, n)) for n in (5, 9, 7)]
    responses = [rng.integers(3, 250, n) for n in (13, 6, 9)]
    views = [sampler.view(0, 0, i, "s", r, 257, False, None, 10) for i, r in enumerate(responses)]
    batch = build_batch(prompts, responses, views, student.info.mask_id, 0, complementary=True)
    assert (batch["kind"] == 1).any()  # complements share their sample's cached prefix
    results = []
    for scope in ("masked", "all"):  # "all" in the spec turns the split off; the student stays masked-scope
        spec = HeadSpec(block_size=4, adapter_scope=scope, entropy_weight=0.1, weighting="inv_t")
        student.model.zero_grad()
        loss, _, captured, split = diffusion_ce(student, batch, spec, "cpu", capture=[1])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in student.model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, captured[1][:, -4:].detach(), split))
    (a, ga, ca, split), (b, gb, cb, none) = results
    assert split > 0 and none == 0
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ca, cb, atol=1e-5, rtol=1e-5)
