"""Qwen2-VL / Qwen2.5-VL in the engine: M-RoPE positions exactly as transformers' `get_rope_index`, and greedy /
beam / sampling tokens equal to `generate()` on the same checkpoint, with images of several sizes (their features
from transformers' own tower, so this checks the text model and M-RoPE alone)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from triton_vlm.demo.qwen_checkpoint import build_qwen_vl
from triton_vlm.engine.model import mrope
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.profile import text_rules_of
from triton_vlm.errors import InvalidArgument
from triton_vlm.params import GenerationParams, GenerationRequest
from triton_vlm.preprocess.service import Preprocessor

SIZES = [(60, 100), (300, 40), (224, 224), (30, 30)]  # (H, W): small, tall, at max_pixels, below min_pixels


def _png(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def ckpt(request, tmp_path_factory):
    torch.set_num_threads(1)
    from transformers import AutoModelForImageTextToText  # noqa: PLC0415

    path = build_qwen_vl(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    model = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # spread the logits: near-ties would make fp ulps decide tokens
    from triton_vlm.demo.qwen_checkpoint import save_hub_weights  # noqa: PLC0415

    save_hub_weights(model, path)  # the scaled head, so both sides run the same weights
    return model, path, Preprocessor(path)


def _inputs(pre: Preprocessor, text: str, images: list[bytes]):
    r = pre(text, images, max_tokens=12)
    ids = torch.tensor([r.input_ids])
    grids = torch.tensor([pre.info.layout.grid(tuple(s)) for s in r.image_sizes]).reshape(-1, 3)
    pixels = torch.from_numpy(r.pixel_values.reshape(r.pixel_values.shape[0], 3 * 28 * 14))  # the processor's rows
    return r, ids, grids, pixels


def _hf(model, ids, grids, pixels, **gen):
    cfg = model.config
    kw = {}
    if len(grids):
        kw = dict(pixel_values=pixels, image_grid_thw=grids,
                  mm_token_type_ids=(ids == cfg.image_token_id).int())
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen.pop("max", 10),
                             eos_token_id=model.generation_config.eos_token_id, pad_token_id=0, **kw, **gen)
    return out[:, ids.shape[1]:]


def _features(model, grids, pixels):
    with torch.no_grad():
        out = model.model.get_image_features(pixels, grids)
    feats = getattr(out, "pooler_output", out)
    return torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats  # [tokens, hidden]


def _strip(row, eos):
    row = row.tolist()
    cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return row[:cut]


PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>describe <image> and the picture"
          "<|im_end|>\n<|im_start|>assistant\n")


def test_rope_index_equals_transformers(ckpt):
    model, path, pre = ckpt
    rope = mrope.PromptRope.from_rules(text_rules_of(path))
    for a, b in ((0, 1), (2, 3), (1, 2)):
        r, ids, grids, _ = _inputs(pre, PROMPT, [_png(*SIZES[a], a), _png(*SIZES[b], b)])
        want, want_delta = model.model.get_rope_index(ids, (ids == model.config.image_token_id).int(), grids)
        got = rope(r.input_ids, r.image_sizes)
        assert torch.equal(got.positions, want[:, 0]) and got.delta == int(want_delta)
    assert rope([5, 6, 7], None) is None  # text only: 1-D positions


@pytest.mark.parametrize("mode", ["greedy", "beam3", "sample"])
def test_generation_equals_transformers(ckpt, mode):
    model, path, pre = ckpt
    eng = Engine(path, EngineConfig(max_rows=16, kv_cache_tokens=4096, block_size=8, prefill_chunk=32))
    cases = [(PROMPT, [_png(*SIZES[0], 0), _png(*SIZES[1], 1)]), (PROMPT, [_png(*SIZES[2], 2), _png(*SIZES[3], 3)]),
             ("<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n", [])]
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    reqs, wants = [], []
    for k, (text, images) in enumerate(cases):
        r, ids, grids, pixels = _inputs(pre, text, images)
        feats = _features(model, grids, pixels) if len(grids) else None
        if mode == "greedy":
            params, gen = GenerationParams(max_tokens=10), {}
        elif mode == "beam3":
            params = GenerationParams(max_tokens=8, beam_width=3, num_return_sequences=2)
            gen = dict(num_beams=3, num_return_sequences=2, do_sample=False, max=8)
        else:
            params = GenerationParams(max_tokens=10, temperature=0.8, top_k=20, seed=7 + k)
            gen = None
        reqs.append(GenerationRequest(request_id=f"{mode}{k}", input_ids=r.input_ids, params=params,
                                      image_embeds=feats, image_sizes=[tuple(s) for s in r.image_sizes]))
        if gen is not None:
            wants.append([_strip(row, eos) for row in _hf(model, ids, grids, pixels, **gen)])
    out = eng.generate(reqs)
    for req, want in zip(reqs, wants):
        last = out[req.request_id][-1]
        assert last.error is None, last.error
        assert [s.token_ids for s in last.sequences] == want, req.request_id
    if mode == "sample":  # seeded sampling: the same tokens alone as in the batch (transformers' RNG differs)
        for req in reqs:
            alone = eng.generate([GenerationRequest(request_id=req.request_id + "a", input_ids=req.input_ids,
                                                    params=req.params, image_embeds=req.image_embeds,
                                                    image_sizes=req.image_sizes)])
            assert [s.token_ids for s in alone[req.request_id + "a"][-1].sequences] == \
                [s.token_ids for s in out[req.request_id][-1].sequences]
    eng.shutdown()


def test_sizes_that_do_not_match_the_placeholders_are_refused(ckpt):
    model, path, pre = ckpt
    eng = Engine(path, EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=8))
    r, ids, grids, pixels = _inputs(pre, PROMPT, [_png(*SIZES[0], 0), _png(*SIZES[1], 1)])
    feats = _features(model, grids, pixels)
    for sizes, msg in ((None, "image_sizes"), ([(60, 100)], "more image"), ([(224, 224), (300, 40)], "placeholders"),
                       ([(1, 1000)], "aspect ratio")):
        req = GenerationRequest(request_id="bad", input_ids=r.input_ids, params=GenerationParams(max_tokens=2),
                                image_embeds=feats, image_sizes=sizes)
        with pytest.raises(InvalidArgument, match=msg):
            eng.submit(req, lambda res: None)
    eng.shutdown()


def test_control_without_mrope_the_tokens_differ(ckpt):
    """The check above can fail: with 1-D positions (M-RoPE off) the same requests give other tokens."""
    model, path, pre = ckpt
    eng = Engine(path, EngineConfig(max_rows=4, kv_cache_tokens=2048, block_size=8, prefill_chunk=32))
    eng.rope = None  # every token at its cache position, as a Qwen2 text model would have it
    differ = 0
    for k, (a, b) in enumerate(((0, 1), (2, 3))):
        r, ids, grids, pixels = _inputs(pre, PROMPT, [_png(*SIZES[a], a), _png(*SIZES[b], b)])
        req = GenerationRequest(request_id=f"c{k}", input_ids=r.input_ids, params=GenerationParams(max_tokens=10),
                                image_embeds=_features(model, grids, pixels))
        got = eng.generate([req])[req.request_id][-1].sequences[0].token_ids
        differ += got != _hf(model, ids, grids, pixels)[0].tolist()[:len(got)]
    assert differ >= 1
    eng.shutdown()


def test_prefix_cache_keys_cover_the_image_sizes(ckpt):
    """The same tokens and features with transposed image sizes (same token count, other M-RoPE positions) share no
    block; the same request again reuses its prompt blocks and gives the same tokens."""
    from triton_vlm.engine.kv.prefix_cache import request_hasher

    model, path, pre = ckpt
    rope = mrope.PromptRope.from_rules(text_rules_of(path))
    r, ids, grids, pixels = _inputs(pre, PROMPT, [_png(*SIZES[0], 0), _png(*SIZES[1], 1)])
    feats = _features(model, grids, pixels)
    hashes = []
    for sizes in ([(60, 100), (300, 40)], [(100, 60), (300, 40)]):
        req = GenerationRequest(request_id="h", input_ids=r.input_ids, params=GenerationParams(max_tokens=2),
                                image_embeds=feats, image_sizes=sizes)
        req.rope = rope(req.input_ids, req.image_sizes)
        hashes.append(request_hasher(req, 8, model.config.image_token_id).prompt_hashes)
    first_image = r.input_ids.index(model.config.image_token_id) // 8
    assert hashes[0][:first_image] == hashes[1][:first_image]  # text before any image: the same positions
    assert not set(hashes[0][first_image:]) & set(hashes[1][first_image:])
    eng = Engine(path, EngineConfig(max_rows=4, kv_cache_tokens=2048, block_size=8, prefill_chunk=32))
    req = lambda rid: GenerationRequest(request_id=rid, input_ids=r.input_ids, params=GenerationParams(max_tokens=8),
                                        image_embeds=feats, image_sizes=[tuple(s) for s in r.image_sizes])
    a = eng.generate([req("a")])["a"][-1]
    b = eng.generate([req("b")])["b"][-1]
    want = _hf(model, ids, grids, pixels, max=8)[0].tolist()
    assert a.sequences[0].token_ids == b.sequences[0].token_ids == want[:len(a.sequences[0].token_ids)]
    assert eng.cache.prefix_stats.hits >= (len(r.input_ids) // 8 - 1) * 8
    eng.shutdown()


def test_video_positions_equal_transformers(ckpt):
    """Videos (several frames per temporal patch, Qwen2.5-VL's time spacing) and an image in one prompt."""
    from triton_vlm.preprocess.videos import encode_mp4

    model, path, pre = ckpt
    rng = np.random.default_rng(4)
    videos = [encode_mp4(rng.integers(0, 255, (n, 48, 64, 3), dtype=np.uint8), fps=fps) for n, fps in ((10, 4), (30, 8))]
    r = pre("<video> a <|vision_start|><|video_pad|><|vision_end|> b <image> c", [_png(*SIZES[0], 0)], 8,
            videos=videos)
    ids = torch.tensor([r.input_ids])
    cfg = model.config
    kinds = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    grids = torch.tensor(r.media_grids)
    kw = {"second_per_grid_ts": torch.tensor(r.media_seconds[:2])} if cfg.model_type == "qwen2_5_vl" else {}
    want, delta = model.model.get_rope_index(ids, kinds, grids[2:], grids[:2], **kw)
    got = mrope.PromptRope.from_rules(text_rules_of(path))(r.input_ids, r.image_sizes, [tuple(g) for g in r.media_grids],
                                                list(r.media_seconds))
    assert torch.equal(got.positions, want[:, 0]) and got.delta == int(delta)
    assert grids[0, 0] == 2 and grids[1, 0] == 3  # several temporal patches each


def test_static_decode_steps_take_the_rotary_delta(ckpt):
    """The bucketed static steps (what CUDA graphs record; uncaptured here) carry each row's M-RoPE delta: an engine
    routing decode steps through them gives the eager engine's tokens for image prompts, and every step was static."""
    model, path, pre = ckpt
    cfg = EngineConfig(max_rows=8, kv_cache_tokens=2048, block_size=8, prefill_chunk=32, enable_prefix_caching=False)
    reqs = []
    for k, (a, b) in enumerate(((0, 1), (2, 3))):
        r, ids, grids, pixels = _inputs(pre, PROMPT, [_png(*SIZES[a], a), _png(*SIZES[b], b)])
        reqs.append(lambda rid, r=r, f=_features(model, grids, pixels): GenerationRequest(
            request_id=rid, input_ids=r.input_ids, params=GenerationParams(max_tokens=10, beam_width=2),
            image_embeds=f, image_sizes=[tuple(s) for s in r.image_sizes]))
    eager = Engine(path, cfg)
    want = eager.generate([q(f"e{i}") for i, q in enumerate(reqs)])
    static = Engine(path, cfg)
    graphs = static.make_decode_graphs(capture=False)
    got = static.generate([q(f"s{i}") for i, q in enumerate(reqs)])
    for i in range(len(reqs)):
        assert [s.token_ids for s in got[f"s{i}"][-1].sequences] == [s.token_ids for s in want[f"e{i}"][-1].sequences]
    assert graphs.static_steps > 5 and graphs.fallbacks == 0
    eager.shutdown()
    static.shutdown()
