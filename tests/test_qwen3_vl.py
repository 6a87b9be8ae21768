"""Qwen3-VL (dense and MoE) on tiny random hub-layout checkpoints (sharded, the family's processor, video processor and
chat template), against transformers' `Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration` on
the same files:
- the vision tower + main and DeepStack mergers (`vision/qwen_tower.py`) equal transformers' tower;
- in process, the dense engine's tokens equal `generate()`, and each new piece can fail: DeepStack off, or M-RoPE's
  sections concatenated instead of interleaved, give other tokens; the MoE engine's greedy and LoRA equal
  `generate()` / PEFT, top-k without renormalisation gives other tokens;
- videos: the frames kept, their size, the prompt with its timestamps, the patches and the M-RoPE positions equal
  transformers' (`Qwen3VLVideoProcessor`, `Qwen3VLProcessor`, `get_rope_index`);
- through one live tritonserver on the MoE checkpoint (layers 0 and 2 sparse, layer 1 dense; onnxruntime vision on
  the exported tower, our engine) and its OpenAI front end: greedy and beam search with num_return_sequences over
  images of several sizes and several images per prompt, sent at once so that vision and the engine batch them;
  two videos with timestamps and an image; seeded sampling; the OpenAI API with image_url and video_url parts.
The reference passes `mm_token_type_ids` (without them `generate()` silently computes 1-D positions)."""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from qwen_vl_cases import NATIVE, Reference, mp4, pil, png

NEW = 8
SIZES = {"small": (100, 60), "wide": (240, 50), "tall": (40, 300), "tiny": (5, 3), "large": (640, 480)}
IMAGES = {name: png(size, seed=130 + i) for i, (name, size) in enumerate(SIZES.items())}
PROMPT = "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
MULTI = f"<|im_start|>user\n{NATIVE}and <image> then compare them.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"


# two videos that sample differently: 10 frames at 4 fps -> 5 kept (an odd count: the last repeated; the first
# timestamp 0.25 s written "0.2"); 12 frames of 320x240 at 6 fps -> 4 kept, shrunk under the video pixel budget
VIDEOS = [mp4(10, (96, 64), seed=21, fps=4), mp4(12, (320, 240), seed=22, fps=6)]
VPROMPT = ("<|im_start|>user\n<video> then <|vision_start|><|video_pad|><|vision_end|> and <image>: what happens?"
           "<|im_end|>\n<|im_start|>assistant\n")


class Qwen3Reference(Reference):
    """transformers' Qwen3-VL video side (torchvision, which its video processor needs to resize and normalise, is
    not installed): the frames its `Qwen3VLVideoProcessor.sample_frames` keeps, their size by its `smart_resize`, and
    its `Qwen3VLProcessor.replace_video_token` text (timestamps); the pixels are the server's own decode of those
    frames (checked against its `patchify` in the test), as for Qwen2.5-VL."""

    def __init__(self, model_dir):
        import json

        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        super().__init__(model_dir)
        self.video_processor = Qwen3VLVideoProcessor(**json.loads((model_dir / "video_preprocessor_config.json")
                                                                  .read_text()))

    def hf_video(self, data: bytes) -> dict:
        """transformers' sampling, grid and placeholder text for a video (its header read by the server's code)."""
        import types

        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
        from transformers.video_utils import VideoMetadata

        video, _ = self.decoded(data)
        vp, (height, width) = self.video_processor, video.size
        meta = VideoMetadata(total_num_frames=video.total_frames, fps=video.fps, width=width, height=height)
        meta.frames_indices = vp.sample_frames(meta)
        n = len(meta.frames_indices)
        h, w = smart_resize(n, height, width, temporal_factor=vp.temporal_patch_size,
                            factor=vp.patch_size * vp.merge_size, min_pixels=vp.size["shortest_edge"],
                            max_pixels=vp.size["longest_edge"])
        grid = [-(-n // vp.temporal_patch_size), h // vp.patch_size, w // vp.patch_size]
        proc = types.SimpleNamespace(video_processor=vp, vision_start_token="<|vision_start|>",
                                     vision_end_token="<|vision_end|>", video_token="<|video_pad|>")
        proc._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(proc, *a)
        text = Qwen3VLProcessor.replace_video_token(proc, {"video_grid_thw": torch.tensor([grid]),
                                                           "video_metadata": [meta]}, 0)
        return {"indices": [int(i) for i in meta.frames_indices], "size": (h, w), "grid": grid, "text": text}

    def expand_videos(self, text, videos, grids):
        for data in videos:
            text = text.replace("<|video_pad|>", "<|placeholder|>", 1).replace(
                "<|placeholder|>", self.hf_video(data)["text"].replace("<|video_pad|>", "<|vid|>"), 1)
        return text.replace("<|vid|>", "<|video_pad|>")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from triton_vlm.demo.qwen3_checkpoint import build_qwen3_vl

    torch.set_num_threads(1)
    return build_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl") / "qwen3_vl", shards=2, seed=3)


@pytest.fixture(scope="module")
def ref(checkpoint):
    return Qwen3Reference(checkpoint)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-VL-MoE (layers 0 and 2 sparse, 2 of 4 experts per token, layer 1 dense), its experts in the
    hub's transposed layout, and its reference."""
    from triton_vlm.demo.qwen3_checkpoint import build_qwen3_vl

    return Qwen3Reference(build_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl-moe") / "qwen3_vl_moe", shards=2,
                                        seed=5, experts=4))


def _features(ref, images):
    """(pixel_values, grids, our tower's features [tokens, hidden * (1 + levels)], transformers' the same)."""
    from triton_vlm.vision.qwen_backends import load_graph
    from triton_vlm.vision.qwen_layout import tower_aux

    px = ref.image_processor([pil(b) for b in images], return_tensors="pt")
    graph = load_graph(ref.model_dir)
    aux = tower_aux(px["image_grid_thw"].tolist(), graph.config)
    with torch.no_grad():
        ours = graph(px["pixel_values"].float(), *(torch.from_numpy(aux[n]) for n in graph.aux_names))
        out = ref.model.model.visual(px["pixel_values"], grid_thw=px["image_grid_thw"])
    return px, ours, torch.cat([out.pooler_output] + list(out.deepstack_features), dim=-1)


def test_tower_and_deepstack_mergers_equal_transformers(ref):
    _, ours, want = _features(ref, [IMAGES[k] for k in SIZES])
    levels = len(ref.model.config.vision_config.deepstack_visual_indexes)
    assert levels == 2 and ours.shape == want.shape and ours.shape[1] == 3 * ref.model.config.text_config.hidden_size
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)


def test_engine_equals_generate_and_each_piece_matters(ref):
    """DeepStack and interleaved M-RoPE each change the tokens: served without either, the answer differs."""
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.params import GenerationParams, GenerationRequest

    images = [IMAGES["small"], IMAGES["tall"]]
    _, feats, _ = _features(ref, images)
    ids = ref.inputs(MULTI, images)["input_ids"][0].tolist()
    sizes = [(SIZES[k][1], SIZES[k][0]) for k in ("small", "tall")]
    eng = Engine(ref.model_dir, EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=8, prefill_chunk=16,
                                             enable_prefix_caching=False))  # each run computes its prompt

    def run(rid, embeds):
        req = GenerationRequest(request_id=rid, input_ids=ids, params=GenerationParams(max_tokens=12),
                                image_embeds=embeds, image_sizes=sizes)
        req.rope = eng.rope(ids, sizes)
        last = eng.generate([req])[rid][-1]
        assert last.error is None, last.error
        return last.sequences[0].token_ids

    try:
        want = ref.generate(MULTI, images, 12)[0]
        assert run("full", feats) == want
        hidden = ref.model.config.text_config.hidden_size
        eng.model.deepstack_levels = 0  # the main embeddings only
        no_stack = run("no-deepstack", feats[:, :hidden])
        eng.model.deepstack_levels = 2
        eng.model.config = dataclasses.replace(eng.model.config, mrope_interleaved=False)
        blocks = run("blocks", feats)
    finally:
        eng.shutdown()
    assert no_stack != want and blocks != want


def test_videos_sampling_timestamps_positions_and_patches_equal_transformers(ref):
    """Per video: the frames kept, their size and grid are transformers' (`sample_frames`, `smart_resize`); the
    preprocessed prompt is the processor's ids (a timestamp before each temporal patch); the rows are its `patchify`
    of the same frames; the M-RoPE positions are its `get_rope_index` (each temporal patch placed as an image at its
    own run), and placing the video as one grid (Qwen2.5-VL's rule) would not be."""
    import dataclasses

    import numpy as np

    from triton_vlm.engine.model.mrope import PromptRope
    from triton_vlm.families import text_rules
    from triton_vlm.preprocess.service import Preprocessor
    from triton_vlm.spec import CheckpointSpec

    got = Preprocessor(ref.model_dir, context_length=1024)(VPROMPT, [IMAGES["small"]], max_tokens=8, videos=VIDEOS)
    x = ref.inputs(VPROMPT, [IMAGES["small"]], VIDEOS)
    assert got.input_ids == x["input_ids"][0].tolist()
    assert "<0.2 seconds>" in ref.tokenizer.decode(got.input_ids)
    start = 0
    for data, grid in zip(VIDEOS, got.media_grids):  # media in prompt order: the two videos, then the image
        hf, (video, (rows, _, _)) = ref.hf_video(data), ref.decoded(data)
        assert (list(video.plan.keep), video.plan.size, list(grid)) == (hf["indices"], hf["size"], hf["grid"])
        frames = (torch.from_numpy(np.stack(video.frames)).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
        want, *_ = ref.video_processor.patchify(frames[None], patch_size=16, merge_size=2, temporal_patch_size=2)
        torch.testing.assert_close(torch.from_numpy(rows.reshape(len(rows), -1)), want[0])
        assert np.array_equal(got.pixel_values[start:start + len(rows)], rows)
        start += len(rows)
    rope = PromptRope.from_rules(text_rules(CheckpointSpec.load(ref.model_dir)))
    mine = rope(got.input_ids, got.image_sizes, got.media_grids, got.media_seconds)
    pos, delta = ref.model.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], x["image_grid_thw"],
                                                x["video_grid_thw"])
    assert torch.equal(mine.positions, pos[:, 0]) and mine.delta == int(delta)
    rope.spec = dataclasses.replace(rope.spec, video_frames=False)
    with pytest.raises(Exception, match="adjacent placeholders"):  # one grid cannot cover runs split by timestamps
        rope(got.input_ids, got.image_sizes, got.media_grids, got.media_seconds)


def test_video_plans_equal_transformers_over_lengths_rates_sizes_and_the_cap(tmp_path):
    """`video_plan` against `Qwen3VLVideoProcessor` (`sample_frames`, `get_num_of_video_patches`) for files of many
    lengths, rates and sizes, with and without `cap_pixels_per_frame`; what it refuses, transformers refuses; a video
    processor field that would change the frames is refused at load."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from triton_vlm.demo.qwen3_checkpoint import video_processor_config
    from triton_vlm.families.qwen3_vl import QWEN3_VL
    from triton_vlm.preprocess.videos import VideoConfig, video_config
    from triton_vlm.spec import CheckpointError

    for cap in (False, True):
        json_cfg = dict(video_processor_config(), cap_pixels_per_frame=cap, max_video_tokens=12)
        hf, cfg = Qwen3VLVideoProcessor(**json_cfg), VideoConfig.from_json(json_cfg, {}, QWEN3_VL.video_defaults)
        for total, fps, (h, w) in [(10, 4.0, (64, 96)), (12, 6.0, (240, 320)), (7, 2.0, (90, 40)),
                                   (400, 30.0, (20, 700)), (3, 1.0, (1080, 1920)), (97, 29.97, (33, 35)),
                                   (5, 0.5, (480, 64))]:
            meta = VideoMetadata(total_num_frames=total, fps=fps, width=w, height=h)
            plan = QWEN3_VL.video_plan(cfg, (h, w), total, fps)
            keep = hf.sample_frames(meta).tolist()
            assert list(plan.keep) == keep, (total, fps)
            patches = hf.get_num_of_video_patches(len(keep), h, w, {"cap_pixels_per_frame": cap})
            assert plan.tokens == patches // 4 and plan.grid[0] * plan.grid[1] * plan.grid[2] == patches, (h, w, cap)
    with pytest.raises(ValueError, match="temporal_factor"):  # one frame: transformers refuses it too
        QWEN3_VL.video_plan(cfg, (64, 64), 1, 4.0)
    (tmp_path / "video_preprocessor_config.json").write_text('{"num_frames": 8}')
    with pytest.raises(CheckpointError, match="num_frames = 8 is not supported"):
        video_config(tmp_path, QWEN3_VL.video_defaults)


@pytest.fixture(scope="module")
def served(tmp_path_factory, moe):
    """(the OpenAI front end, the live server) shared by the tests below, on the MoE checkpoint: its layers 0 and 2
    sparse and layer 1 dense, so one server start covers the MoE and the dense MLP through tritonserver (the dense
    checkpoint's engine is the same code, tested above in process: a second server costs a minute)."""
    from test_openai import serve_api

    yield from serve_api(tmp_path_factory, moe.model_dir, "qwen3-vl-moe-server")


def _ask(server, prompt, images, **params):
    from triton_vlm_client import VLMClient

    with VLMClient(server.grpc_url, timeout=180) as c:
        return c.generate(prompt, images, max_tokens=params.pop("max_tokens", NEW), **params)


@pytest.mark.server
def test_sizes_beams_and_several_images_equal_generate(served, moe):
    server = served[1]
    cases = [(PROMPT, [IMAGES[k]], 1 + i % 3) for i, k in enumerate(SIZES)]
    cases += [(MULTI, [IMAGES["large"], IMAGES["tall"]], 2), (MULTI, [IMAGES["wide"], IMAGES["tiny"]], 1),
              (TEXT, [], 2)]
    with ThreadPoolExecutor(len(cases)) as pool:  # at once: vision and the engine batch them together
        futures = [pool.submit(_ask, server, p, imgs, beam_width=b, num_return_sequences=b,
                               return_num_input_tokens=True) for p, imgs, b in cases]
        results = [f.result() for f in futures]
    for (prompt, images, beams), res in zip(cases, results):
        assert res.output_ids == moe.generate(prompt, images, NEW, beams=beams, num_return_sequences=beams), \
            (prompt[:30], [len(i) for i in images], beams)
        assert res.num_input_tokens == moe.inputs(prompt, images)["input_ids"].shape[1]
    assert len({tuple(r.output_ids[0]) for r in results[:len(SIZES)]}) > 2, "the answers depend on the image"


@pytest.mark.server
def test_two_videos_with_timestamps_and_an_image_equal_generate(served, moe):
    """Two videos (timestamps between their temporal patches) and an image through the ensemble, beam 2 with both
    sequences: transformers' generate() on the same frames; and one video as an OpenAI `video_url`."""
    from test_openai import data_url
    from triton_vlm_client import VLMClient

    with VLMClient(served[1].grpc_url, timeout=180) as c:
        got = c.generate(VPROMPT, [IMAGES["small"]], videos=VIDEOS, max_tokens=NEW, beam_width=2,
                         num_return_sequences=2, return_num_input_tokens=True)
    assert got.output_ids == moe.generate(VPROMPT, [IMAGES["small"]], NEW, beams=2, num_return_sequences=2,
                                          videos=VIDEOS)
    assert got.num_input_tokens == moe.inputs(VPROMPT, [IMAGES["small"]], VIDEOS)["input_ids"].shape[1]
    content = [{"type": "video_url", "video_url": {"url": data_url(VIDEOS[1], "video/mp4")}},
               {"type": "text", "text": "What happens?"}]
    r = served[0].client(timeout=180).chat.completions.create(
        model="qwen3_vl_moe", messages=[{"role": "user", "content": content}], max_tokens=NEW, temperature=0)
    prompt = moe.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        add_generation_prompt=True, tokenize=False)
    want = moe.generate(prompt, [], NEW, videos=VIDEOS[1:])[0]
    assert r.choices[0].message.content == moe.tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == moe.inputs(prompt, [], VIDEOS[1:])["input_ids"].shape[1]


@pytest.mark.server
def test_seeded_sampling_equals_generate(served, moe):
    images = [IMAGES["small"], IMAGES["wide"]]
    got = _ask(served[1], MULTI, images, max_tokens=12, temperature=0.9, top_k=30, seed=11, num_return_sequences=2)
    x = moe.inputs(MULTI, images)
    torch.manual_seed(11)  # as the engine seeds its rows (the `hf` baseline backend does the same)
    with torch.no_grad():
        out = moe.model.generate(**x, max_new_tokens=12, do_sample=True, temperature=0.9, top_k=30, top_p=1.0,
                                 num_return_sequences=2, pad_token_id=0)
    want = [row[:row.index(moe.eos) + 1] if moe.eos in row else row
            for row in out[:, x["input_ids"].shape[1]:].tolist()]
    assert got.output_ids == want


@pytest.mark.server
def test_openai_image_url_equals_generate(served, moe):
    from test_openai import data_url

    client = served[0].client(timeout=180)
    names = ["large", "tall"]
    parts = [{"type": "image_url", "image_url": {"url": data_url(IMAGES[n])}} for n in names]
    messages = [{"role": "user", "content": parts + [{"type": "text", "text": "Compare them."}]}]
    r = client.chat.completions.create(model="qwen3_vl_moe", messages=messages, max_tokens=NEW, temperature=0, n=1)
    prompt = moe.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}] * len(names) + [{"type": "text", "text": "Compare them."}]}],
        add_generation_prompt=True, tokenize=False)
    want = moe.generate(prompt, [IMAGES[n] for n in names], NEW)[0]
    assert r.choices[0].message.content == moe.tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == moe.inputs(prompt, [IMAGES[n] for n in names])["input_ids"].shape[1]


def test_moe_engine_equals_generate_renormalisation_matters_and_lora(moe, tmp_path):
    """Greedy equals generate(); top-k without renormalisation gives other tokens; a PEFT LoRA on the
    attention projections and the dense layer's MLP equals PEFT; adapters on the experts are refused by name."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.errors import InvalidArgument
    from triton_vlm.lora.peft import load_peft
    from triton_vlm.params import GenerationParams, GenerationRequest
    from triton_vlm.spec import CheckpointSpec

    assert CheckpointSpec.load(moe.model_dir).text.sparse_layers == (0, 2)
    images = [IMAGES["small"], IMAGES["tall"]]
    _, feats, want_feats = _features(moe, images)
    torch.testing.assert_close(feats, want_feats, rtol=1e-4, atol=1e-5)
    ids = moe.inputs(MULTI, images)["input_ids"][0].tolist()
    sizes = [(SIZES[k][1], SIZES[k][0]) for k in ("small", "tall")]
    torch.manual_seed(2)
    peft_model = get_peft_model(type(moe.model).from_pretrained(str(moe.model_dir)), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False,
        target_modules=r".*language_model\.layers\.(\d+\.self_attn\.(q_proj|v_proj)|1\.mlp\.down_proj)"))
    peft_model.save_pretrained(tmp_path / "adapter")
    eng = Engine(moe.model_dir, EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=8, prefill_chunk=16,
                                             enable_prefix_caching=False))

    def run(rid, beams=1, adapter=None):
        req = GenerationRequest(request_id=rid, input_ids=ids, image_embeds=feats, image_sizes=sizes, adapter=adapter,
                                params=GenerationParams(max_tokens=20, beam_width=beams, num_return_sequences=beams))
        req.rope = eng.rope(ids, sizes)
        last = eng.generate([req])[rid][-1]
        assert last.error is None, last.error
        return [s.token_ids for s in last.sequences]

    try:
        want = moe.generate(MULTI, images, 20)
        assert run("greedy") == want
        lora = moe.generate(MULTI, images, 20, model=peft_model.eval())
        assert lora != want, "the adapter must change the answer"
        assert run("lora", adapter=load_peft(tmp_path / "adapter", eng.model_config, "a")) == lora
        for layer in eng.model.layers:
            if layer.moe is not None:
                layer.moe.renormalize = False
        assert run("raw-top-k") != want
    finally:
        eng.shutdown()
    for key, what in (("layers.0.mlp.experts", "mixture-of-experts weights"), ("layers.2.mlp.up_proj", "layer 2")):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 2}')
        prefix = f"base_model.model.model.language_model.{key}"
        save_file({f"{prefix}.lora_A.weight": torch.zeros(2, 64), f"{prefix}.lora_B.weight": torch.zeros(48, 2)},
                  str(bad / "adapter_model.safetensors"))
        with pytest.raises(InvalidArgument, match=f"{what}.*LoRA on the experts is not served"):
            load_peft(bad, CheckpointSpec.load(moe.model_dir).text, "bad")
