"""anchors.source=generation: the responses stage's own forwards give the anchors a forward would."""

import numpy as np
import pytest
import torch

from a2d.flows.pipeline import pipeline
from a2d.models.generate import generate_batch, left_pad
from a2d.models.quant import from_bf16_bits
from a2d.models.teacher import build_random_teacher, load_teacher
from a2d.stores.anchors import AnchorReader
from a2d.stores.artifacts import ArtifactStore
from a2d.tasks.anchors import capture_shard, captured_in_generation
from tests.conftest import LLAMA_PIPELINE, tiny_config

LLAMA = (*LLAMA_PIPELINE, "anchors.dtype=bf16")


@pytest.mark.parametrize("arch,layers", [("qwen3_5", 4), ("llama", 2)])
def test_generation_keeps_the_states_and_tokens_a_forward_and_generate_give(tmp_path, arch, layers):
    """Left-padded prompts of three lengths, one sample stopping early on EOS: the loop's tokens are
    transformers' `generate`'s, with or without the capture, and the states it keeps at every
    prompt and response token equal a right-padded forward over prompt + response (bf16 rounding),
    the confidences and entropies too (qwen3_5: linear-attention layers under left padding)."""
    build_random_teacher(arch, layers, 64, 0, tmp_path / "t", "float32")
    model, tok = load_teacher(tmp_path / "t", device="cpu")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 11, 8)]
    free = generate_batch(model, prompts, 10, [10**6], tok.pad_token_id)
    eos = free.response_ids[1][3]  # sample 1 now stops at its 4th token (others may, earlier)
    got = generate_batch(model, prompts, 10, [eos], tok.pad_token_id, capture=list(range(layers)))
    assert got.response_ids == generate_batch(model, prompts, 10, [eos], tok.pad_token_id).response_ids
    assert got.finish_reason[1] == "eos" and len(got.response_ids[1]) == 4
    assert got.forwards == max(len(r) for r in got.response_ids) + 1  # the last tokens fed once
    ids, mask = left_pad(prompts, tok.pad_token_id, torch.device("cpu"))
    hf = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=[eos],
        pad_token_id=tok.pad_token_id, temperature=None, top_p=None, top_k=None,
    )  # fmt: skip
    for row, resp in zip(hf[:, ids.shape[1] :].tolist(), got.response_ids, strict=True):
        assert row[: len(resp)] == resp

    cap = captured_in_generation(prompts, got.response_ids, [([0, 1, 2], got.states)], "all")
    ref = capture_shard(model, prompts, got.response_ids, list(range(layers)), "all", tok.pad_token_id, 3)
    assert cap.offsets.tolist() == ref.offsets.tolist() and cap.positions.tolist() == ref.positions.tolist()
    a, b = from_bf16_bits(cap.bits).float(), from_bf16_bits(ref.bits).float()
    rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
    assert rel < 2**-7, rel  # within bf16's rounding of the same fp32 states
    assert (np.isnan(cap.confidence) == np.isnan(ref.confidence)).all()
    np.testing.assert_allclose(cap.confidence, ref.confidence, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(cap.entropy, ref.entropy, atol=1e-4, rtol=1e-4)


def _anchors(store: str, ref) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    st = ArtifactStore(store)
    where = {s: m["captured_in"] for s, m in st.manifest(ref)["shards"].items()}
    reader = AnchorReader(st, ref)
    states = {sid: (reader.sample(sid, [0, 1]).float(), reader.scalars(sid)) for sid in reader.sample_ids}
    return where, states


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for sid, (h, scalars) in got.items():
        torch.testing.assert_close(h, want[sid][0], atol=1e-5, rtol=2**-7)
        for name, v in scalars.items():
            np.testing.assert_allclose(v, want[sid][1][name], atol=1e-4, rtol=1e-4)


def test_pipeline_captures_anchors_while_generating_and_forwards_only_what_it_missed(tmp_path):
    """Two shards generating at once in threads of one model: every anchors shard is captured in the
    responses stage, none by the anchors stage's forward, and the states are those of a forward
    run (another store); a shard lost afterwards is rebuilt by the forward, the same states."""
    gen, fwd = str(tmp_path / "gen"), str(tmp_path / "fwd")
    refs = pipeline(tiny_config(gen, *LLAMA, "anchors.source=generation", "run.workers=2"), until="anchors")
    other = pipeline(tiny_config(fwd, *LLAMA), until="anchors")
    assert refs["responses"].key == other["responses"].key and refs["anchors"].key != other["anchors"].key
    where, states = _anchors(gen, refs["anchors"])
    assert set(where.values()) == {"generation"} and len(where) == 3
    assert ArtifactStore(gen).manifest(refs["anchors"])["metrics"]["shards_captured_in_generation"] == 3
    want = _anchors(fwd, other["anchors"])[1]
    _same(states, want)

    st = ArtifactStore(gen)
    st.loc(refs["anchors"]).remove("_markers/part-00001.json")
    st.loc(refs["anchors"]).remove("manifest.json")
    again = pipeline(tiny_config(gen, *LLAMA, "anchors.source=generation"), until="anchors")
    assert again["anchors"].key == refs["anchors"].key
    where, states = _anchors(gen, again["anchors"])
    assert where == {"part-00000": "generation", "part-00001": "forward", "part-00002": "generation"}
    _same(states, want)


@pytest.mark.parametrize("arch,layers", [("qwen3_5", 4), ("llama", 2)])
def test_the_preallocated_cache_gives_the_growing_caches_logits_bit_for_bit(tmp_path, arch, layers):
    """Prefill of left-padded prompts and five one-token steps: every step's logits through the
    buffers equal those through transformers' DynamicCache exactly (qwen3_5: its linear-attention
    layers keep their own cache), and a feed past the buffers' size is refused, not truncated."""
    from transformers import DynamicCache

    from a2d.models.generate import preallocated_cache

    build_random_teacher(arch, layers, 64, 0, tmp_path / "t", "float32")
    model, tok = load_teacher(tmp_path / "t", device="cpu")
    prompts = [np.random.default_rng(1).integers(3, 256, size=n).tolist() for n in (7, 3, 12)]
    ids, mask = left_pad(prompts, tok.pad_token_id, torch.device("cpu"))
    steps = torch.randint(3, 256, (5, 3), generator=torch.Generator().manual_seed(0))
    outs = []
    for cache in (DynamicCache(config=model.config), preallocated_cache(model, ids.shape[1] + len(steps))):
        m, position, feed, logits = mask, (mask.cumsum(-1) - 1).clamp_min(0), ids, []
        with torch.no_grad():
            for token in [None, *steps]:
                if token is not None:
                    feed, position = token[:, None], position[:, -1:] + 1
                    m = torch.cat([m, m.new_ones(3, 1)], dim=1)
                out = model(input_ids=feed, attention_mask=m, position_ids=position, past_key_values=cache)
                logits.append(out.logits[:, -1])
        outs.append((torch.stack(logits), cache, m, position))
    assert torch.equal(outs[0][0], outs[1][0])
    _, cache, m, position = outs[1]
    with pytest.raises(RuntimeError, match="cache sized for"), torch.no_grad():
        model(input_ids=steps[0][:, None], attention_mask=torch.cat([m, m.new_ones(3, 1)], 1),
              position_ids=position + 1, past_key_values=cache)  # fmt: skip


def test_the_preallocated_cache_follows_a_batch_select_as_the_growing_cache_does(tmp_path):
    """After `batch_select_indices` (rows 2 and 0 of 3) the buffers hold the selected rows: the next
    steps' logits equal DynamicCache's exactly (before, the old buffers' rows were read back)."""
    from transformers import DynamicCache

    from a2d.models.generate import preallocated_cache

    build_random_teacher("llama", 2, 64, 0, tmp_path / "t", "float32")
    model, tok = load_teacher(tmp_path / "t", device="cpu")
    prompts = [np.random.default_rng(2).integers(3, 256, size=n).tolist() for n in (5, 9, 4)]
    ids, mask = left_pad(prompts, tok.pad_token_id, torch.device("cpu"))
    keep, steps = (
        torch.tensor([2, 0]),
        torch.randint(3, 256, (3, 2), generator=torch.Generator().manual_seed(1)),
    )
    outs = []
    for cache in (DynamicCache(config=model.config), preallocated_cache(model, ids.shape[1] + len(steps))):
        position = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache)
            cache.batch_select_indices(keep)
            m, position, logits = mask[keep], position[keep], []
            for token in steps:
                m, position = torch.cat([m, m.new_ones(2, 1)], dim=1), position[:, -1:] + 1
                out = model(
                    input_ids=token[:, None], attention_mask=m, position_ids=position, past_key_values=cache
                )
                logits.append(out.logits[:, -1])
        outs.append(torch.stack(logits))
    assert torch.equal(outs[0], outs[1])
