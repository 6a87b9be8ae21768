"""A Qwen2 text model with a SigLIP tower (llava-interleave-qwen's shape) through the live ensemble.

A tiny random checkpoint (`demo/variants.py`: Qwen2 tokenizer without BOS, q/k/v biases, tied embeddings, SigLIP
with SiglipImageProcessor and strategy "full"): the server's tokens for prompts with images, greedy and beam 3,
equal `generate()` on the checkpoint's own processor output. The llm's memory plan is on the metrics port.
"""
from __future__ import annotations

import io
import re
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

from triton_vlm_client import VLMClient

pytestmark = pytest.mark.server

PROMPT = "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\n<image>\n<image>\nCompare the pictures.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from conftest import _start_server, _stop_server
    from triton_vlm.demo.checkpoint import save_checkpoint
    from triton_vlm.demo.variants import build_variant_objects

    model, processor = build_variant_objects(text="qwen2", vision="siglip", seed=12, max_position_embeddings=256)
    with torch.no_grad():  # spread the logits (tied embeddings: scale the projections, not the lm_head)
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(6.0)
    path = save_checkpoint(model, processor, tmp_path_factory.mktemp("qwen2-siglip"))
    server = _start_server(tmp_path_factory, path, {}, "qwen2-server")
    yield model, processor, server
    _stop_server(server)


def image(seed: int, size) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def hf_tokens(model, processor, prompt: str, images, beam: int, max_tokens: int) -> list[list[int]]:
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    eos = [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, num_beams=beam,
                             num_return_sequences=beam, eos_token_id=eos)
    rows = out[:, inputs["input_ids"].shape[1]:].tolist()
    return [r[:next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in rows]


@pytest.mark.parametrize("beam", [1, 3])
def test_tokens_equal_transformers(qwen, beam):
    model, processor, server = qwen
    cases = [(PROMPT, [image(1, (40, 28))]), (TWO, [image(2, (20, 60)), image(3, (64, 64))])]
    with VLMClient(server.grpc_url, protocol="grpc", timeout=120) as client:
        for prompt, imgs in cases:
            res = client.generate(prompt, [png(i) for i in imgs], max_tokens=10, beam_width=beam,
                                  num_return_sequences=beam)
            got = [list(ids[:n]) for ids, n in zip(res.output_ids, res.sequence_lengths)]
            want = hf_tokens(model, processor, prompt, imgs, beam, 10)
            assert got == want, (prompt, beam)
            assert len(set(got[0])) > 2  # a varied path: a wrong bias or window would show


def test_memory_plan_on_the_metrics_port(qwen):
    _, _, server = qwen
    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()

    def value(name: str, part: str = "") -> float:
        label = f',part="{part}"' if part else ""
        m = re.search(rf'^{name}{{model="llm"{label}}} ([0-9.e+]+)$', text, re.M)
        assert m, (name, part, [ln for ln in text.splitlines() if "memory" in ln])
        return float(m.group(1))

    tokens = value("triton_vlm_engine_kv_cache_tokens")
    assert tokens == 64 * 256  # the CPU plan stops at max_rows (64) rows of the full context (256)
    assert value("triton_vlm_engine_memory_bytes", "kv_cache") == tokens * 2 * 2 * 2 * 16 * 4
    assert value("triton_vlm_engine_memory_bytes", "weights") > 0
    assert value("triton_vlm_engine_memory_bytes", "other") == 256 * 2**20  # the LoRA device level
    assert value("triton_vlm_engine_memory_bytes", "cuda_graphs") == 0  # no decode CUDA graphs on a CPU
    assert value("triton_vlm_engine_memory_bytes", "limit") > value("triton_vlm_engine_memory_bytes", "kv_cache")
