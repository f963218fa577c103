"""drafter.distill: the teacher's own next-token distribution, recomputed from the anchors' last
layer, as each block offset's soft target beside the greedy token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from a2d.models.capture import capture_layers
from a2d.models.drafter import DFlashDraftModel
from a2d.models.objectives.drafter import Frozen, Sequence, drafter_loss, make_batch
from a2d.specs import DrafterSpec
from a2d.stores.keys import KeyInputs
from a2d.tasks.drafter import FORMAT_VERSION, STAGE, add_soft_targets, build_config, key_inputs


class Reader:
    """The anchors a reader would return: every layer's raw output of one real forward."""

    def __init__(self, states: dict[str, dict[int, torch.Tensor]], layers: list[int]):
        self.states, self.layers = states, layers

    def samples(self, sample_ids: list[str], layers: list[int]) -> list[torch.Tensor]:
        return [torch.stack([self.states[s][i] for i in layers], 1) for s in sample_ids]


def teacher_run(small_teachers, tokens: list[int]):
    model = AutoModelForCausalLM.from_pretrained(small_teachers / "llama").eval()
    layers = list(range(model.config.num_hidden_layers))
    seen: dict[int, torch.Tensor] = {}
    with torch.no_grad(), capture_layers(model, layers, lambda i, h: seen.__setitem__(i, h[0].clone())):
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    return model, seen, logits


def test_soft_targets_are_the_teachers_own_distribution_over_the_draft_vocabulary(small_teachers):
    tokens = [5, 17, 3, 99, 42, 8, 61, 23, 7, 11]
    model, seen, logits = teacher_run(small_teachers, tokens)
    vocab = torch.tensor(sorted(set(range(0, 120, 3)) | set(tokens)))  # a draft vocabulary of 40-odd rows
    head = model.get_output_embeddings().weight.detach()[vocab]
    seq = Sequence("s0", torch.tensor(tokens), 3, torch.zeros(len(tokens), 1))
    add_soft_targets(Reader({"s0": seen}, sorted(seen)), [seq], model, head, k=4)
    want = logits[:, vocab].topk(4, -1)  # the real forward's logits, restricted to the same rows
    assert torch.equal(seq.soft_rows, want.indices)  # head rows, not token ids
    torch.testing.assert_close(seq.soft_p, want.values.softmax(-1), atol=1e-5, rtol=1e-4)

    with pytest.raises(ValueError, match=r"add 1 to anchors.layers or set drafter.distill: 0"):
        add_soft_targets(Reader({"s0": seen}, [0]), [seq], model, head)


def test_a_one_hot_soft_target_on_the_greedy_token_is_the_hard_loss(small_teachers):
    """Soft targets that put all mass on the stored next token give exactly the hard CE, whatever
    `distill` is: the soft target of offset d lines up with the token at start + d."""
    tokens = [5, 17, 3, 99, 42, 8, 61, 23, 7, 11, 4, 30]
    model, seen, _ = teacher_run(small_teachers, tokens)
    text = model.config
    spec = DrafterSpec(block_size=4, blocks_per_sample=5, target_layers=(0, 1), intermediate_size=64)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(build_config(spec, text, [0, 1], text.vocab_size - 1))
    frozen = Frozen(
        model.get_input_embeddings().weight.detach(),
        model.get_output_embeddings().weight.detach(),
        None,
        None,
    )
    feats = torch.cat([seen[0], seen[1]], -1)
    seq = Sequence("s0", torch.tensor(tokens), 4, feats)
    nxt = torch.tensor(tokens[1:] + [0])  # the token after each position
    seq.soft_rows = torch.stack([nxt, (nxt + 1) % text.vocab_size], 1)
    seq.soft_p = torch.tensor([[1.0, 0.0]]).expand(len(tokens), 2)
    weights = torch.ones(3)
    batch = make_batch([seq], spec, np.random.default_rng(0), drafter.config.mask_token_id, "cpu")
    hard, _ = drafter_loss(drafter, frozen, batch, weights)
    for distill in (0.5, 1.0):
        torch.testing.assert_close(drafter_loss(drafter, frozen, batch, weights, distill=distill)[0], hard)
    seq.soft_p = torch.tensor([[0.5, 0.5]]).expand(len(tokens), 2)  # half on another token: a different loss
    batch = make_batch([seq], spec, np.random.default_rng(0), drafter.config.mask_token_id, "cpu")
    assert abs(drafter_loss(drafter, frozen, batch, weights, distill=1.0)[0].item() - hard.item()) > 1e-2


def test_distill_without_the_last_layer_in_the_anchors_is_refused_before_any_stage_runs():
    from a2d.specs import AnchorSpec
    from a2d.tasks.drafter import check_config

    anchors = AnchorSpec(layers=[0, 1, 2], tokens="all")
    assert check_config(
        DrafterSpec(target_layers=(0, 1), distill=0.5), AnchorSpec(layers="all", tokens="all"), 3
    )
    with pytest.raises(
        ValueError, match=r"last layer \(3\).*add 3 to anchors.layers or set drafter.distill: 0"
    ):
        check_config(DrafterSpec(target_layers=(0, 1), distill=0.5), anchors, 4)
    assert check_config(DrafterSpec(target_layers=(0, 1)), anchors, 4) == [0, 1]  # no distill: no last layer


def test_distill_off_keeps_every_older_drafter_key():
    """Keys written before the option existed (a spec without `distill`) still name their drafter."""
    up = {"teacher": "t" * 16, "responses": "r" * 16, "anchors": "a" * 16}
    older = DrafterSpec(steps=7).model_dump(mode="json")
    del older["distill"]
    assert (
        key_inputs(DrafterSpec(steps=7), *up.values()).key == KeyInputs(STAGE, FORMAT_VERSION, older, up).key
    )
    assert (
        key_inputs(DrafterSpec(steps=7, distill=0.5), *up.values()).key
        != KeyInputs(STAGE, FORMAT_VERSION, older, up).key
    )
