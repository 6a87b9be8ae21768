"""The decoder forward against transformers on the same weights (CPU fp32): prefill, decode, GQA, rows joining
and leaving, forks, checkpoint layouts, rope scaling, image merging, the per-row adapter hook."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.model.merge import merge_image_embeds
from triton_vlm.engine.model.model import LM_HEAD, LlamaModel, apply_rotary, rms_norm
from triton_vlm.engine.model.weights import MODULES, load_config
from triton_vlm.errors import InvalidArgument
from triton_vlm.spec import CheckpointError

ATOL = 1e-5
VOCAB = 96


def llama_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2, bos_token_id=1)
    return LlamaConfig(**(base | kw))


def random_llama(seed=0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(llama_config(**kw)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)  # spread the logits so ties are rare
    return hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = random_llama()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return hf, LlamaModel.from_pretrained(path)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, vocab]


def test_prefill_and_decode_match_transformers(llama):
    hf, m = llama
    cache = m.new_cache(16, 4)
    ids = [1, 5, 9, 33, 7, 81, 12, 40, 3, 60, 22]
    row = cache.new_row()
    out = m.forward(m.embed(torch.tensor([ids])), cache.plan([row], len(ids)), cache, all_logits=True)[0]
    torch.testing.assert_close(out, hf_logits(hf, ids), atol=ATOL, rtol=0)
    for t in [17, 4, 90, 2, 55, 8]:  # decode crosses block boundaries
        out = m.forward(m.embed(torch.tensor([[t]])), cache.plan([row], 1), cache)[0]
        ids.append(t)
        torch.testing.assert_close(out, hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_one_shot(llama):
    hf, m = llama
    cache = m.new_cache(16, 4)
    ids = list(range(3, 40))
    row = cache.new_row()
    outs = []
    for s in range(0, len(ids), 7):
        chunk = ids[s:s + 7]
        x = m.embed(torch.tensor([chunk]))
        outs.append(m.forward(x, cache.plan([row], len(chunk)), cache, all_logits=True)[0])
    torch.testing.assert_close(torch.cat(outs), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_rows_join_and_leave_between_steps(llama):
    """Three sequences of different lengths decode in one batch while rows come and go."""
    hf, m = llama
    cache = m.new_cache(32, 4)
    seqs = {"a": [1, 8, 15, 22, 29], "b": [1, 70], "c": [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    rows = {}

    def prefill(name):
        rows[name] = cache.new_row()
        ids = seqs[name]
        m.forward(m.embed(torch.tensor([ids])), cache.plan([rows[name]], len(ids)), cache)

    def decode(names, step):
        toks = [(step * 7 + 3 * i) % VOCAB for i, _ in enumerate(names)]
        out = m.forward(m.embed(torch.tensor(toks))[:, None], cache.plan([rows[n] for n in names], 1), cache)
        for i, n in enumerate(names):
            seqs[n].append(toks[i])
            torch.testing.assert_close(out[i], hf_logits(hf, seqs[n])[-1], atol=ATOL, rtol=0)

    prefill("a")
    decode(["a"], 0)
    prefill("b")  # joins
    decode(["a", "b"], 1)
    decode(["b", "a"], 2)  # order inside a batch does not matter
    prefill("c")
    decode(["a", "b", "c"], 3)
    cache.free(rows.pop("a"))  # leaves
    decode(["b", "c"], 4)
    decode(["c", "b"], 5)
    assert cache.used_blocks == len(rows["b"].blocks) + len(rows["c"].blocks)


def test_forks_continue_the_parent_and_diverge(llama):
    """A prompt row forks into 3 beams; each appends its own token; then a beam is dropped and another forked."""
    hf, m = llama
    cache = m.new_cache(32, 4)
    prompt = [1, 11, 21, 31, 41, 51]  # 6 tokens: the last block is partial, so forks copy it on write
    root = cache.new_row()
    m.forward(m.embed(torch.tensor([prompt])), cache.plan([root], len(prompt)), cache)
    beams = [root, cache.fork(root), cache.fork(root)]
    hist = [list(prompt) for _ in beams]
    for step, toks in enumerate([[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]):
        out = m.forward(m.embed(torch.tensor(toks))[:, None], cache.plan(beams, 1), cache)
        for i, t in enumerate(toks):
            hist[i].append(t)
            torch.testing.assert_close(out[i], hf_logits(hf, hist[i])[-1], atol=ATOL, rtol=0)
        if step == 1:  # reorder like beam search: parents [0, 0, 2]
            cache.free(beams[1])
            beams = [beams[0], cache.fork(beams[0]), beams[2]]
            hist = [hist[0], list(hist[0]), hist[2]]
    for b in beams:
        cache.free(b)
    assert cache.used_blocks == 0


def test_plain_gqa_variants_and_biases(tmp_path):
    """MHA (kv == heads), MQA (1 kv head), explicit head_dim, attention/mlp biases, tied embeddings."""
    variants = [dict(num_key_value_heads=4), dict(num_key_value_heads=1, head_dim=8),
                dict(attention_bias=True, mlp_bias=True), dict(tie_word_embeddings=True)]
    ids = [1, 4, 9, 16, 25, 36, 49, 64, 81]
    for i, kw in enumerate(variants):
        hf = random_llama(seed=i, **kw)
        if kw.get("attention_bias"):
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    if name.endswith(".bias"):
                        p.normal_(0, 0.1)
        hf.save_pretrained(tmp_path / str(i))
        m = LlamaModel.from_pretrained(tmp_path / str(i))
        if kw.get("tie_word_embeddings"):
            assert torch.equal(m.lm_head.dense_weight(), m.embed_tokens)
        cache = m.new_cache(8, 4)
        out = m.forward(m.embed(torch.tensor([ids])), cache.plan([cache.new_row()], len(ids)), cache, all_logits=True)
        torch.testing.assert_close(out[0], hf_logits(hf, ids), atol=ATOL, rtol=0, msg=str(kw))


def test_llama3_rope_scaling_and_theta(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf = random_llama(rope_parameters=rope)
    hf.save_pretrained(tmp_path)
    m = LlamaModel.from_pretrained(tmp_path)
    ids = [(7 * i) % VOCAB for i in range(100)]
    cache = m.new_cache(32, 4)
    out = m.forward(m.embed(torch.tensor([ids])), cache.plan([cache.new_row()], len(ids)), cache, all_logits=True)
    torch.testing.assert_close(out[0], hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_unsupported_rope_scaling_is_rejected(tmp_path):
    cfg = json.loads(llama_config().to_json_string())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    cfg.pop("rope_scaling", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="yarn"):
        load_config(tmp_path)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    model, processor = build_random_llava_objects(seed=3, max_position_embeddings=256)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    path = save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))
    return model, path


def llava_inputs(model, images=1):
    n = model.config.image_seq_length
    img = model.config.image_token_id
    ids = [1, 30, 31] + [img] * n + [40, 41, 42] + ([img] * n + [50] if images > 1 else [])
    torch.manual_seed(7)
    pixels = torch.rand(images, 3, 32, 32)
    with torch.no_grad():
        feats = model.get_image_features(pixels, vision_feature_layer=-2,
                                         vision_feature_select_strategy="default").pooler_output
    return ids, pixels, torch.stack(list(feats))  # [images, T, hidden]


def test_llava_layouts_sharded_and_image_merge(llava, tmp_path):
    """transformers' saved (older) layout, the 5.x in-memory layout, and a sharded copy all give HF's logits,
    with two images merged at their placeholders."""
    model, path = llava
    ids, pixels, feats = llava_inputs(model, images=2)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    new_layout = tmp_path / "new"
    new_layout.mkdir()
    for f in ("config.json", "generation_config.json"):
        (new_layout / f).write_text((path / f).read_text())
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.startswith("model.language_model.layers.") for k in state)
    save_file(state, str(new_layout / "model.safetensors"))
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for d in (path, new_layout, sharded):
        m = LlamaModel.from_pretrained(d)
        assert m.config.image_token_id == model.config.image_token_id
        t = torch.tensor(ids)
        x = merge_image_embeds(t, m.embed(t), feats, m.config.image_token_id)
        cache = m.new_cache(16, 8)
        out = m.forward(x[None], cache.plan([cache.new_row()], len(ids)), cache, all_logits=True)[0]
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, msg=str(d))


def test_merge_counts_must_match_both_ways():
    ids = torch.tensor([1, 4, 4, 4, 5])
    emb = torch.zeros(5, 8)
    with pytest.raises(InvalidArgument, match="tokens: 3, features: 2"):
        merge_image_embeds(ids, emb, torch.ones(1, 2, 8), 4)
    with pytest.raises(InvalidArgument, match="tokens: 3, features: 4"):
        merge_image_embeds(ids, emb, torch.ones(2, 2, 8), 4)
    with pytest.raises(InvalidArgument, match="tokens: 3, features: 0"):
        merge_image_embeds(ids, emb, None, 4)
    with pytest.raises(InvalidArgument, match="tokens: 0, features: 3"):
        merge_image_embeds(torch.tensor([1, 5]), emb[:2], torch.ones(1, 3, 8), 4)
    with pytest.raises(InvalidArgument, match="hidden size"):
        merge_image_embeds(ids, emb, torch.ones(1, 3, 7), 4)
    out = merge_image_embeds(ids, emb, torch.arange(24.).view(1, 3, 8), 4)
    assert out[1:4].flatten().tolist() == list(range(24)) and out[0].abs().sum() == 0


class RecordingAdapters:
    """Adds a known per-row delta to one module and records every call's shapes."""

    def __init__(self, target: tuple[int, str], per_row: torch.Tensor):
        self.target, self.per_row, self.calls = target, per_row, []

    def add(self, x, y, layer, module):
        self.calls.append((layer, module, tuple(x.shape)))
        if (layer, module) != self.target:
            return y
        return y + self.per_row[:, None, :].expand(x.shape[0], x.shape[1], -1)  # [rows, q_len, out]


def test_adapter_hook_sees_every_linear_and_adds_per_row(llama):
    hf, m = llama
    prompts = [[1, 2, 3], [1, 9, 8]]

    def run(adapters):
        cache = m.new_cache(8, 4)
        rows = [cache.new_row(), cache.new_row()]
        return m.forward(m.embed(torch.tensor(prompts)), cache.plan(rows, 3), cache, adapters=adapters)

    base = run(None)
    delta = torch.zeros(2, VOCAB)
    delta[1, 5] = 2.5  # only row 1's logit 5 moves
    rec = RecordingAdapters((-1, LM_HEAD), delta)
    out = run(rec)
    expected = base.clone()
    expected[1, 5] += 2.5
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    c = m.config
    seen = {(layer, mod) for layer, mod, _ in rec.calls}
    assert seen == {(i, mod) for i in range(c.num_layers) for mod in MODULES} | {(-1, LM_HEAD)}
    shapes = {mod: shape for layer, mod, shape in rec.calls if layer == 0}
    assert shapes["q_proj"] == (2, 3, c.hidden_size) and shapes["down_proj"] == (2, 3, c.intermediate_size)
    assert shapes["o_proj"] == (2, 3, c.num_heads * c.head_dim)
    # a zero delta on an inner module leaves the output unchanged (the no-op path)
    zero = RecordingAdapters((1, "down_proj"), torch.zeros(2, c.hidden_size))
    torch.testing.assert_close(run(zero), base, atol=0, rtol=0)


@pytest.mark.parametrize("hidden", [64, 96, 512, 4096])
def test_rms_norm_fused_is_the_formula_bit_for_bit(hidden):
    """The fp32 CPU path uses `torch.rms_norm`; it must equal transformers' LlamaRMSNorm ops exactly."""
    g = torch.Generator().manual_seed(hidden)
    x, w = torch.randn(3, 5, hidden, generator=g) * 4, torch.randn(hidden, generator=g)
    h = x.to(torch.float32)
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), want)


def test_apply_rotary_is_transformers_rotation_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 6, 64, generator=g)  # [rows, q_len, heads, head_dim]
    cos, sin = torch.randn(4, 3, 1, 64, generator=g), torch.randn(4, 3, 1, 64, generator=g)
    rotate_half = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    sin_rot = torch.cat((-sin[..., :32], sin[..., 32:]), dim=-1)
    assert torch.equal(apply_rotary(x, cos, sin_rot), x * cos + rotate_half * sin)


@pytest.mark.parametrize("window", [None, 4])
def test_ragged_prefill_of_several_prompts_matches_transformers(tmp_path, window):
    """Three prompts' chunks in one ragged forward (one of them continuing a cached prefix, one a single token)
    give each prompt's own logits, and the K/V that three separate forwards write; with a sliding window too."""
    from transformers import MistralConfig, MistralForCausalLM

    from triton_vlm.engine.model.model import Segment

    torch.manual_seed(3)
    cfg = llama_config() if window is None else MistralConfig(**(llama_config().to_dict() | {"sliding_window": window}))
    hf = (LlamaForCausalLM(cfg) if window is None else MistralForCausalLM(cfg)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)
    hf.save_pretrained(tmp_path)
    m = LlamaModel.from_pretrained(tmp_path)
    prompts = [[1, 5, 9, 33, 7, 81, 12, 40, 3, 60, 22], [1, 70, 8, 15, 22, 29, 4, 90, 2, 55, 8, 17, 6], [1]]
    prefix = 8  # the second prompt's first 8 tokens are in the cache already
    caches = [m.new_cache(24, 4) for _ in range(2)]
    rows = [[c.new_row() for _ in prompts] for c in caches]
    for c, rs in zip(caches, rows):
        m.forward(m.embed(torch.tensor([prompts[1][:prefix]])), c.plan([rs[1]], prefix), c)
    starts = [0, prefix, 0]
    chunks = [p[s:] for p, s in zip(prompts, starts)]
    x = torch.cat([m.embed(torch.tensor([ch])) for ch in chunks], dim=1)  # [1, 11 + 5 + 1, hidden]
    segments = [Segment(len(ch), caches[0].plan([r], len(ch))) for ch, r in zip(chunks, rows[0])]
    got = m.forward_ragged(x, segments, caches[0])  # [3, vocab]
    alone = torch.stack([m.forward(m.embed(torch.tensor([ch])), caches[1].plan([r], len(ch)), caches[1])[0]
                         for ch, r in zip(chunks, rows[1])])
    want = torch.stack([hf_logits(hf, p)[-1] for p in prompts])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(caches[0].k, caches[1].k, atol=ATOL, rtol=0)
    torch.testing.assert_close(caches[0].v, caches[1].v, atol=ATOL, rtol=0)
    assert not torch.equal(caches[0].k, torch.zeros_like(caches[0].k))  # the ragged forward wrote its K/V
    with pytest.raises(ValueError, match="do not cover"):
        m.forward_ragged(x[:, :-1], segments, caches[0])
