"""The DFlash drafter: its checkpoint read back by the format alone, lossless decoding with it on both
architectures, and the block a decode step feeds it equal to the block training feeds it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, Qwen3Config

from a2d.models.canvas import Canvas
from a2d.models.capture import capture_layers
from a2d.models.dflash_drafter import DFlashDrafter
from a2d.models.drafter import (
    DFlashDraftModel,
    DrafterConfig,
    block_mask,
    position_weights,
    spread_layers,
)
from a2d.models.speculative import Drafter, Proposal, accept_path, speculative_decode
from a2d.models.student import lm_head
from a2d.specs import DrafterSpec
from a2d.tasks.drafter import build_config
from tests.conftest import ARCHS, trained_like
from tests.test_decoding import EOS, PROMPT, base_greedy
from tests.test_teacher import ROPE_THETA, rope_theta_readings, teacher_with_rope_theta


def tiny_drafter(student, block=4, layers=(0, 1), seed=0) -> DFlashDraftModel:
    cfg = student.inner.config
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(
        DrafterConfig(
            hidden_size=cfg.hidden_size,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            vocab_size=cfg.vocab_size,
            block_size=block,
            target_layer_ids=tuple(layers),
            num_target_layers=cfg.num_hidden_layers,
            mask_token_id=cfg.vocab_size - 1,
        )
    )
    return drafter.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_saved_drafter_reads_back_by_the_format_and_decodes_losslessly(small_teachers, arch, tmp_path):
    student = trained_like(small_teachers, arch)
    drafter = tiny_drafter(student)
    drafter.draft_vocab = torch.arange(3, 250)
    drafter.save(tmp_path / "drafter")
    doc = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert doc["architectures"] == ["DFlashDraftModel"] and doc["model_type"] == "qwen3"
    assert doc["hidden_size"] == student.inner.config.hidden_size
    assert doc["vocab_size"] == student.inner.config.vocab_size
    assert doc["block_size"] == doc["dflash_config"]["block_size"] == 4
    assert doc["dflash_config"]["target_layer_ids"] == [0, 1]
    assert doc["num_target_layers"] == student.inner.config.num_hidden_layers
    for field in ("rms_norm_eps", "intermediate_size", "num_key_value_heads", "head_dim", "rope_parameters"):
        assert field in doc
    with safe_open(str(tmp_path / "drafter" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (doc["hidden_size"], 2 * doc["hidden_size"])
        assert f.get_tensor("fc.weight").dtype == torch.float32
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n or n.startswith("model.") for n in names)

    loaded = DFlashDraftModel.load(tmp_path / "drafter")
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0)
    truth = base_greedy(student, PROMPT, 16)
    draft = DFlashDrafter(student, loaded)
    out = speculative_decode(student, PROMPT, 16, EOS, draft, draft_len=3)
    assert out.tokens == truth
    assert draft.forwards == sum(d > 0 for d in out.drafted)  # one drafter forward per drafted verify
    assert out.forwards == len(out.drafted) + draft.forwards  # every model call counts
    assert max(out.drafted) == 3  # [newest, MASK x 3]: three drafts per block


def test_a_drafter_config_carries_the_teachers_rope_theta_in_both_spellings(tmp_path):
    """DFlash's reference code reads the drafter with transformers 4.57, which knows only top-level
    rope_theta: without it the weights load and the model silently runs at the class default."""
    text = AutoConfig.from_pretrained(teacher_with_rope_theta(tmp_path)).get_text_config()
    drafter = DFlashDraftModel(build_config(DrafterSpec(), text, [0, 1], text.vocab_size - 1))
    drafter.save(tmp_path / "drafter")
    readings = rope_theta_readings(tmp_path / "drafter", Qwen3Config)
    assert readings == dict.fromkeys(readings, ROPE_THETA)
    assert DFlashDraftModel.load(tmp_path / "drafter").config.rope_theta == ROPE_THETA


@pytest.mark.parametrize("arch", ARCHS)
def test_a_decode_step_feeds_the_drafter_what_training_feeds_it(small_teachers, arch):
    """The drafter's context built incrementally from verify forwards (hooks, accepted rows only)
    equals the context training builds from one teacher forward of the whole sequence, and the
    block's states match the training layout (many blocks per sequence under `block_mask`)."""
    student = trained_like(small_teachers, arch)
    drafter = tiny_drafter(student, block=4)
    draft = DFlashDrafter(student, drafter)
    seen = []
    original = drafter.forward

    def spy(block, positions, ctx_kv, mask=None):
        seen.append((positions[0, 0].item(), original(block, positions, ctx_kv, mask)))
        return seen[-1][1]

    drafter.forward = spy
    out = speculative_decode(student, PROMPT, 12, EOS, draft, draft_len=3)
    drafter.forward = original
    sequence = PROMPT + out.tokens
    feats = {}
    with student.base() as model, capture_layers(model, [0, 1], lambda i, h: feats.__setitem__(i, h)):
        model(input_ids=torch.tensor([sequence]), use_cache=False)
    features = torch.cat([feats[0], feats[1]], -1)  # (1, T, 2H) one forward over everything
    context = drafter.fuse(features)
    kv = drafter.context_kv(context, torch.arange(len(sequence))[None])
    starts = torch.tensor([[s for s, _ in seen]])
    embed = student.inner.get_input_embeddings()
    ids = torch.full((1, starts.shape[1], 4), drafter.config.mask_token_id)
    ids[0, :, 0] = torch.tensor([sequence[s] for s, _ in seen])
    positions = (starts[..., None] + torch.arange(4)).reshape(1, -1)
    mask = block_mask(starts, torch.tensor([len(sequence)]), len(sequence), 4)
    trained = drafter(embed(ids.reshape(1, -1)), positions, kv, mask).reshape(1, starts.shape[1], 4, -1)
    assert len(seen) >= 3
    for m, (_, decoded) in enumerate(seen):  # every block is whole, the last ones too
        torch.testing.assert_close(decoded[0], trained[0, m], atol=2e-5, rtol=1e-4)


class ScriptedTree(Drafter):
    """A tree whose first branch is wrong and whose second holds the base's next two tokens (then a
    wrong leaf under it): verifying it must keep the second branch's path, out of order in the fed rows."""

    def __init__(self, prompt, truth):
        self.prompt, self.truth = prompt, truth

    def start(self, canvas):
        return self.propose(canvas, 0, None, 99, None)

    def propose(self, canvas, accepted, region, remaining, sampling):
        t = self.truth[len(canvas.tokens) - len(self.prompt) :]
        if len(t) < 3:
            return Proposal()
        wrong = lambda x: (x + 1) % 250  # noqa: E731
        #          0 (wrong)  1 (holds) 2 (wrong under 0) 3 (holds, under 1) 4 (wrong, under 3)
        return Proposal([wrong(t[0]), t[0], t[1], t[1], wrong(t[2])], parents=[-1, -1, 0, 1, 3])


def test_a_tree_of_drafts_keeps_the_accepted_branch_in_the_cache(small_teachers):
    """Tree verification on the attention-only base: the branch the base's argmax follows is kept
    (fed rows 1 and 3 of 5), the cache gathers exactly those rows, and the decode stays the base's
    greedy output token for token with two drafts per verify; the hybrid refuses a tree by name."""
    student = trained_like(small_teachers, "llama")
    truth = base_greedy(student, PROMPT, 16)
    out = speculative_decode(student, PROMPT, 16, EOS, ScriptedTree(PROMPT, truth), draft_len=5)
    assert out.tokens == truth
    assert out.accepted[:4] == [2, 2, 2, 2] and out.drafted[:4] == [5] * 4 and out.reach[:4] == [3] * 4
    assert out.forwards == 6  # 5 tree forwards land 3 tokens each, the 6th the last token

    # the gathered cache is the cache of the accepted tokens alone: the next forward equals an uncached one
    cached, fresh = Canvas(student, PROMPT, cached=True), Canvas(student, PROMPT, cached=False)
    cached.forward([], [])
    cached.keep(-1)
    wrong = (truth[0] + 1) % 250
    hidden = cached.forward([wrong, truth[0], 7, truth[1]], [], parents=[-1, -1, 0, 1])
    best = lm_head(student)(hidden[-5:]).argmax(-1).tolist()
    path = accept_path([wrong, truth[0], 7, truth[1]], [-1, -1, 0, 1], best)
    assert path == [1, 3] and best[4] == truth[2]
    cached.keep_path(path)
    for c in (cached, fresh):
        c.commit(truth[:3])
    after = [c.forward([truth[3]], [])[-2:] for c in (cached, fresh)]  # the newest token and a candidate
    torch.testing.assert_close(after[0], after[1], atol=1e-5, rtol=0)

    hybrid = trained_like(small_teachers, "qwen3_5")
    canvas = Canvas(hybrid, PROMPT, cached=True)
    with pytest.raises(ValueError, match="attention-only base"):
        canvas.forward([1, 2], [], parents=[-1, -1])


def test_the_drafter_proposes_its_most_probable_paths_as_a_tree(small_teachers):
    """Best-first over paths by the product of the drafter's per-offset probabilities: a second guess
    at offset 1 comes before a first guess deep in the block when it is more probable, every parent
    precedes its children, and the decode with that tree is the base's output."""
    student = trained_like(small_teachers, "llama")
    draft = DFlashDrafter(student, tiny_drafter(student), nodes=4)
    probs = torch.tensor([[0.55, 0.44, 0.009, 0.001], [0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    tree = draft._tree(probs.log())  # paths: 0.55, 0.44, 0.55*0.5, 0.44*0.5, then 0.55*0.3 and 0.55*0.5*0.5
    assert tree.parents == [-1, -1, 0, 1]
    assert tree.tokens == [
        0,
        1,
        0,
        0,
    ]  # offset 1's first and second guesses, then offset 2's first under each
    deep = draft._tree(
        torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.95, 0.05, 0.0, 0.0], [0.97, 0.03, 0.0, 0.0]]).log()
    )
    assert deep.parents == [-1, 0, 1, -1] and deep.tokens == [0, 0, 0, 1]  # a sure chain first
    truth = base_greedy(student, PROMPT, 16)
    for arch, nodes in (("llama", 6), ("qwen3_5", 6)):
        s = trained_like(small_teachers, arch)
        d = DFlashDrafter(s, tiny_drafter(s), nodes=nodes)
        out = speculative_decode(s, PROMPT, 16, EOS, d, draft_len=nodes)
        assert out.tokens == base_greedy(s, PROMPT, 16)
        assert max(out.drafted) == (6 if arch == "llama" else 3)  # the hybrid drafts its chain
    assert truth


def test_the_decode_chain_starts_where_the_last_block_stopped():
    from a2d.models.objectives.drafter import decode_chain

    at = {5: 2, 6: 3, 7: 3, 8: 3, 9: 0, 12: 0, 13: 1, 14: 2}
    assert decode_chain(at, 5) == [2, 3, 0, 1]  # 5 (+3) -> 8 (+4) -> 12 (+1) -> 13 (+2) -> 15: no block
    assert decode_chain(at, 6) == [3]  # 6 -> 10: no block starts there (the response ended)
    assert decode_chain({}, 0) == []


def test_block_layout_and_weights():
    mask = block_mask(torch.tensor([[2, 4]]), torch.tensor([5]), 6, 2)  # (1, 4, 6 + 4)
    assert mask[0, :2, :6].tolist() == [[True, True, False, False, False, False]] * 2
    assert mask[0, 2:, :6].tolist() == [[True, True, True, True, False, False]] * 2  # ctx_len 5 > 4
    assert mask[0, :, 6:].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    w = position_weights(4, 2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 0.6065307, 0.3678794]))
    assert spread_layers(64, 1) == [32] and spread_layers(30, 4) == [1, 10, 18, 27]


def test_a_drafter_without_prompt_states_is_refused_before_any_stage_runs(tmp_path):
    from a2d.flows.pipeline import pipeline, plan
    from tests.conftest import tiny_config

    store = tmp_path / "store"
    state = pipeline(tiny_config(str(store), "anchors.tokens=response"), until="drafter", return_state=True)
    # the run ends Failed with one line naming the field and the fix, before the first stage built anything
    assert state.is_failed() and "set anchors.tokens: all" in state.message and "\n" not in state.message
    assert not (store / "teacher").exists()
    odd = tiny_config(str(store), "anchors.layers=[0, 1]", "drafter.target_layers=[5]")
    state = pipeline(odd, until="drafter", return_state=True)
    assert state.is_failed() and "not all in anchors.layers" in state.message
    with pytest.raises(ValueError, match="names spec:drafter.lookup, but the eval has no drafter"):
        plan(tiny_config(str(store), "drafter=null"))  # configs/tiny.yaml's eval names the drafter's decoder
    without = plan(tiny_config(str(store), "drafter=null", "anchors.tokens=response", "eval.decoders=null"))
    assert "drafter" not in without  # the stage is skipped
    with_drafter = plan(tiny_config(str(store)))
    assert with_drafter["eval"].key != without["eval"].key  # the eval's key names the drafter it runs


def test_steps_style_prompts_ask_for_the_reasoning():
    from a2d.stores import bundled

    short, steps = bundled.generate(14, 0), bundled.generate(14, 0, "steps")
    assert all(s["prompt"].endswith("step by step, then give the answer.") for s in steps)
    assert [s["answer"] for s in steps] == [r["answer"] for r in short]  # same problems, same answers
    with pytest.raises(ValueError, match="style"):
        bundled.generate(3, 0, "essay")


@pytest.fixture
def forced_kernel(monkeypatch):
    """Force the CPU kernel choice (`A2D_CPU_LINEAR`) instead of this machine's timing."""
    from a2d.models import cpu_kernels

    def force(kind: str) -> None:
        monkeypatch.setenv("A2D_CPU_LINEAR", kind)
        cpu_kernels.kernel_choice.cache_clear()

    yield force
    monkeypatch.delenv("A2D_CPU_LINEAR", raising=False)
    cpu_kernels.kernel_choice.cache_clear()


def test_packed_cpu_linears_compute_the_same_function_and_leave_training_alone(forced_kernel):
    from torch import nn

    from a2d.models import cpu_kernels

    forced_kernel("packed")
    if not cpu_kernels.supported():
        pytest.skip("this torch build has no oneDNN packed linear")
    torch.manual_seed(0)
    layer = nn.Linear(64, 96)
    reference = nn.Linear(64, 96)
    reference.load_state_dict(layer.state_dict())
    assert cpu_kernels.pack(nn.Sequential(layer)) == 1
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(x), atol=1e-5, rtol=1e-5)  # several rows: packed
        torch.testing.assert_close(layer(x[:1, :1]), reference(x[:1, :1]), atol=1e-5, rtol=1e-5)  # one row
        layer.weight.mul_(2.0)  # changed in place (an adapter load): packed again on the next call
        reference.weight.mul_(2.0)
        torch.testing.assert_close(layer(x), reference(x), atol=1e-5, rtol=1e-5)
    layer(x).sum().backward()  # with grad: autograd's F.linear, gradients reach the weight
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_sibling_projections_run_as_one_product_in_any_order(forced_kernel):
    from torch import nn

    from a2d.models import cpu_kernels

    forced_kernel("packed")
    if not cpu_kernels.supported():
        pytest.skip("this torch build has no oneDNN packed linear")
    torch.manual_seed(0)
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (
        nn.Linear(64, 96),
        nn.Linear(64, 32, bias=False),
        nn.Linear(64, 32),
    )
    reference = {
        n: (m.weight.clone(), None if m.bias is None else m.bias.clone()) for n, m in attn.named_children()
    }
    assert cpu_kernels.pack(attn) == 3
    group = attn.q_proj._a2d_group
    assert group is attn.k_proj._a2d_group is attn.v_proj._a2d_group and group.width == 160
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    x, other = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    with torch.no_grad():
        try:
            torch.ops.mkldnn._linear_pointwise = lambda *a: calls.append(1) or real(*a)
            # k before q, v on another input in between: each member gets its own function of its input
            got = {"k": attn.k_proj(x), "v2": attn.v_proj(other), "q": attn.q_proj(x), "v": attn.v_proj(x)}
        finally:
            torch.ops.mkldnn._linear_pointwise = real
        want = {
            "k": F.linear(x, *reference["k_proj"]),
            "v2": F.linear(other, *reference["v_proj"]),
            "q": F.linear(x, *reference["q_proj"]),
            "v": F.linear(x, *reference["v_proj"]),
        }
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5)
        assert len(calls) == 3  # x, other, x again (the stash holds one input): not one per projection
        attn.v_proj.weight.mul_(3.0)  # changed in place: the group's product is rebuilt
        torch.testing.assert_close(
            attn.v_proj(x),
            F.linear(x, reference["v_proj"][0] * 3, reference["v_proj"][1]),
            atol=1e-5,
            rtol=1e-5,
        )
        one = x[:, :1]  # one row
        torch.testing.assert_close(
            attn.q_proj(one), F.linear(one, *reference["q_proj"]), atol=1e-5, rtol=1e-5
        )
    out = attn.k_proj(x)  # with grad: each projection's own F.linear, gradients reach its weight
    out.sum().backward()
    assert attn.k_proj.weight.grad is not None and attn.q_proj.weight.grad is None


def test_the_cpu_kernel_is_chosen_per_shape_and_row_count(monkeypatch):
    """Where MKL is the faster kernel for a row count, a packed linear (alone or grouped) calls
    F.linear and no oneDNN product, with the same result; where oneDNN is, the packed product runs.
    The choice is timed per shape (here faked: oneDNN wins from 4 rows on)."""
    from torch import nn

    from a2d.models import cpu_kernels

    if not cpu_kernels.supported():
        pytest.skip("this torch build has no oneDNN packed linear")
    monkeypatch.setattr(cpu_kernels, "kernel_choice", lambda i, o: (False, False, True, True, True))
    torch.manual_seed(0)
    block = nn.Module()
    block.gate_proj, block.up_proj, block.down_proj = nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64)
    want = {n: (m.weight.clone(), m.bias.clone()) for n, m in block.named_children()}
    assert cpu_kernels.pack(block) == 3
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    with torch.no_grad():
        try:
            torch.ops.mkldnn._linear_pointwise = lambda *a: calls.append(a[0].shape[0]) or real(*a)
            for rows in (1, 2, 4, 9):
                x = torch.randn(1, rows, 64)
                for name in ("gate_proj", "up_proj"):
                    torch.testing.assert_close(getattr(block, name)(x), F.linear(x, *want[name]))
                h = torch.randn(1, rows, 96)
                torch.testing.assert_close(block.down_proj(h), F.linear(h, *want["down_proj"]))
        finally:
            torch.ops.mkldnn._linear_pointwise = real
    assert calls == [4, 4, 9, 9]  # gate/up as one product, and down, at 4 and 9 rows only


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_drafter_verifies_on_the_teacher_where_it_is_the_base(small_teachers, arch):
    """The registry's spec:drafter (a tree of drafts on llama, a chain on the hybrid) gives the base's
    tokens; on the attention-only base its verify forwards run on the teacher itself (no PEFT
    wrappers: the lean canvas over the teacher's own weights), on the hybrid on the student (its
    scan wrappers hold the rollback points)."""
    from a2d.models import decoders as registry
    from a2d.models import lean_canvas
    from a2d.models.teacher import load_teacher

    student = trained_like(small_teachers, arch)
    teacher, _ = load_teacher(small_teachers / arch, device="cpu")
    calls, lean = [], []
    hook = teacher.model.register_forward_hook(lambda *_: calls.append(1))
    original = lean_canvas.lean_forward

    def spy(step, *a, **k):
        lean.append(step.model is teacher)
        return original(step, *a, **k)

    lean_canvas.lean_forward = spy
    try:
        res = registry.Resources(student, EOS, 16, teacher=teacher, drafter=tiny_drafter(student))
        out = registry.build("spec:drafter", res)(PROMPT)
    finally:
        hook.remove()
        lean_canvas.lean_forward = original
    assert out.tokens == base_greedy(student, PROMPT, 16)
    assert calls == [] and lean == ([True] * len(out.drafted) if arch == "llama" else [])
    assert max(out.drafted) == (registry.PROFILES["cpu"].tree_nodes if arch == "llama" else 3)


@pytest.mark.parametrize("arch", ARCHS)
def test_drafter_and_lookup_is_lossless_and_stops_feeding_drafts_that_fail(small_teachers, arch, monkeypatch):
    """spec:drafter+lookup gives the base's tokens (a tree on llama, a chain on the hybrid). With an
    untrained drafter on a prompt lookup cannot match, its drafts keep failing: it soon feeds no
    node (one-token forwards) and rests the drafter, where spec:drafter feeds its whole tree every
    forward; the forwards it runs stay close to the tokens it emits."""
    from a2d.models import adaptive
    from a2d.models import decoders as registry
    from a2d.models.teacher import load_teacher

    student = trained_like(small_teachers, arch)
    teacher, _ = load_teacher(small_teachers / arch, device="cpu")
    drafter = tiny_drafter(student)
    made = []
    original = adaptive.DrafterLookup.__init__

    def keep(self, *a, **k):
        original(self, *a, **k)
        made.append(self)

    # a CPU's cost of feeding (SmolLM2-like: each fed token ~10 % of a forward), not the tiny model's
    monkeypatch.setattr(registry, "forward_cost", lambda verifier: lambda n: 1 + 0.1 * (n - 1))
    adaptive.DrafterLookup.__init__ = keep
    try:
        res = registry.Resources(student, EOS, 24, teacher=teacher, drafter=drafter)
        out = registry.build("spec:drafter+lookup", res)(PROMPT)
    finally:
        adaptive.DrafterLookup.__init__ = original
    truth = base_greedy(student, PROMPT, 24)
    assert out.tokens == truth
    plain = registry.build("spec:drafter", res)(PROMPT)
    assert plain.tokens == truth and min(plain.drafted[1:-3]) >= 3  # the plain drafter feeds every forward
    fed = made[0].fed
    # failing drafts stop being fed after a few rounds (lookup's still are, where it matches)
    assert sum(out.drafted[6:]) * 5 <= sum(plain.drafted[6:])
    assert sum(k > 0 for k in fed[6:]) <= 3
    assert made[0].forwards < len(fed) // 2  # the drafter rests (probes now and then)
    assert out.forwards <= len(out.tokens) + made[0].forwards


def test_drafter_and_lookup_feeds_what_pays_for_the_forward(small_teachers):
    """The choice of nodes follows expected landed drafts against the measured forward cost: the same
    candidates are all fed where feeding is cheap, none where each token costs a forward, and a
    lookup chain that has held is fed while drafter nodes whose drafts failed are not."""
    from a2d.models.adaptive import DrafterLookup

    student = trained_like(small_teachers, "llama")
    drafter = tiny_drafter(student)
    nodes = [(11, -1, 0.9), (12, 0, 0.8), (13, 1, 0.7), (14, -1, 0.05)]

    def chooser(cost):
        return DrafterLookup(student, drafter, cost, max_nodes=10)

    cheap = chooser(lambda n: 1 + 0.01 * (n - 1))
    assert cheap._choose(nodes, [])[0].tokens == [11, 12, 13, 14]
    dear = chooser(lambda n: float(n))
    assert dear._choose(nodes, [])[0].tokens == []
    tree = chooser(lambda n: 1 + 0.3 * (n - 1))._choose(nodes, [])[0]
    assert tree.tokens == [11, 12, 13] and tree.parents == [-1, 0, 1]  # the unlikely branch is left out
    learned = chooser(lambda n: 1 + 0.3 * (n - 1))
    learned._last = ([11, 12, 13], [0.9, 0.8, 0.7], [21, 22, 23])
    for _ in range(6):  # the drafter's drafts fail, lookup's chain holds
        learned._learn([21, 22, 23, 24])
        learned._last = ([11, 12, 13], [0.9, 0.8, 0.7], [21, 22, 23])
    chosen = learned._choose(nodes, [21, 22, 23])[0]
    assert chosen.tokens[:3] == [21, 22, 23] and 11 not in chosen.tokens
