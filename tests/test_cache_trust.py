"""No cache key a client sends is trusted (live server, stock `tritonclient`).

- `vision`'s embedding cache is keyed by the pixels it receives, not by keys a client names: the attack of issue
  24 (a direct `vision` call with a red circle's pixels under the SHA-256 of a blue triangle's file, then an
  ordinary ensemble request with that blue triangle) leaves the ensemble's answer " blue".
- The llm's prefix cache keys image positions by the embeddings it receives: a direct `llm` call with a victim's
  prompt ids and forged embeddings caches blocks that the victim's request never finds.
- `cache_salt` (vLLM's): requests share prefix-cache blocks only with requests of the same salt, through the
  ensemble and the OpenAI API (the official client, `extra_body`); with --api-key the salt is derived from the
  key as well.
"""
from __future__ import annotations

import hashlib
import io
import queue
import random
import re
import uuid
from dataclasses import replace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_vlm import names as N
from triton_vlm.demo.shapes import draw
from triton_vlm_client import VLMClient

from metrics_support import after_next_refresh

Q = "USER: <image>\nWhat color is the shape? ASSISTANT:"


def png(shape: str, color: str, seed: int) -> bytes:
    buf = io.BytesIO()
    draw(shape, color, (80, 80), random.Random(seed)).save(buf, "PNG")
    return buf.getvalue()


def _in(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
    x = grpcclient.InferInput(name, list(value.shape), dtype)
    x.set_data_from_numpy(value)
    return x


def preprocess(client, prompt: str, image: bytes) -> dict[str, np.ndarray]:
    """A direct `preprocess` call (any client may make one): its outputs by name."""
    res = client.infer("preprocess", [_in(N.TEXT_INPUT, np.array([[prompt.encode()]], object), "BYTES"),
                                      _in(N.IMAGES, np.array([[image]], object), "BYTES"),
                                      _in(N.MAX_TOKENS, np.array([[8]], np.int32), "INT32")])
    return {o.name: res.as_numpy(o.name) for o in res.get_response().outputs}


def vision(client, pre: dict, extra: list | None = None) -> dict[str, np.ndarray]:
    inputs = [_in(N.PIXEL_VALUES, pre[N.PIXEL_VALUES], "FP32"), _in(N.NUM_IMAGES, pre[N.NUM_IMAGES], "INT32"),
              _in(N.IMAGE_SIZES, pre[N.IMAGE_SIZES], "INT32")] + (extra or [])
    res = client.infer("vision", inputs)
    return {n: res.as_numpy(n) for n in (N.IMAGE_EMBEDS, N.IMAGE_FEATURE_LENS)}


def stream_infer(url: str, model: str, inputs: list) -> grpcclient.InferResult:
    """One request to a decoupled model (`llm`, or `ensemble`, which ends in it): its one response."""
    got: queue.Queue = queue.Queue()
    inputs = inputs + [_in(N.MAX_TOKENS, np.array([[4]], np.int32), "INT32"),
                       _in(N.RETURN_NUM_INPUT_TOKENS, np.array([[True]]), "BOOL"),
                       _in(N.EXCLUDE_INPUT_IN_OUTPUT, np.array([[True]]), "BOOL")]
    with grpcclient.InferenceServerClient(url) as c:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        c.async_stream_infer(model, inputs)
        result, error = got.get(timeout=120)
        c.stop_stream()
    if error is not None:
        raise error
    return result


def cached(result: grpcclient.InferResult) -> int:
    return int(result.as_numpy(N.NUM_CACHED_TOKENS).reshape(-1)[0])


def llm(url: str, input_ids: np.ndarray, emb: dict) -> tuple[list[int], int]:
    """A direct `llm` call: the generated ids and num_cached_tokens."""
    r = stream_infer(url, "llm", [_in(N.INPUT_IDS, input_ids, "INT32"), _in(N.IMAGE_EMBEDS, emb[N.IMAGE_EMBEDS], "FP32"),
                                  _in(N.IMAGE_FEATURE_LENS, emb[N.IMAGE_FEATURE_LENS], "INT32")])
    return r.as_numpy(N.OUTPUT_IDS).reshape(-1).tolist(), cached(r)


def ensemble(url: str, prompt: str, salt: str | None = None) -> grpcclient.InferResult:
    inputs = [_in(N.TEXT_INPUT, np.array([[prompt.encode()]], object), "BYTES")]
    if salt is not None:
        inputs.append(_in(N.CACHE_SALT, np.array([[salt.encode()]], object), "BYTES"))
    return stream_infer(url, "ensemble", inputs)


@pytest.mark.server
def test_a_forged_image_key_sent_to_vision_never_reaches_another_tenant(triton_server, hf_server):
    """`hf_server`: a server never attacked, which never saw these images (the transformers baseline, the
    session's: no server is started for this)."""
    victim, forged = png("triangle", "blue", 24301), png("circle", "red", 24302)  # images no other test sends
    other_blue = png("triangle", "blue", 24303)
    with VLMClient(triton_server.grpc_url, protocol="grpc", timeout=120) as c:
        assert c.generate(Q, [other_blue], max_tokens=4).text.strip() == "blue"  # the answer before the attack
        assert c.generate(Q, [forged], max_tokens=4).text.strip() == "red"
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        pre = preprocess(client, Q, forged)
        key = hashlib.sha256(victim).hexdigest().encode()  # anyone can compute it from the victim's file
        forged_key = _in("image_keys", np.array([[key]], object), "BYTES")
        try:
            vision(client, pre, [forged_key])  # the attack: refused, or ignored
        except InferenceServerException as e:
            assert "image_keys" in str(e)  # Triton names the input vision does not take
        vision(client, pre)  # the same pixels without a key: cached under their own content
    with VLMClient(triton_server.grpc_url, protocol="grpc", timeout=120) as c:
        got = c.generate(Q, [victim], max_tokens=4)
    assert got.text.strip() == "blue"
    with VLMClient(hf_server.grpc_url, protocol="grpc", timeout=120) as c:
        assert c.generate(Q, [victim], max_tokens=4).output_ids == got.output_ids  # as a fresh server answers


@pytest.mark.server
def test_forged_embeddings_sent_to_llm_never_fill_a_victims_prefix(triton_server, hf_server):
    victim, forged = png("square", "green", 24311), png("circle", "yellow", 24312)
    prompt = "USER: <image>\n" + "Look at this image closely. " * 4 + "What color is the shape? ASSISTANT:"
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        pre = preprocess(client, prompt, victim)  # the victim's prompt ids, as anyone can compute them
        emb = vision(client, preprocess(client, prompt, forged))  # a yellow circle's embeddings
    # the attacker's request (the victim's ids, forged features) fills the prefix cache; sent again, it hits
    ids, first = llm(triton_server.grpc_url, pre[N.INPUT_IDS], emb)
    _, again = llm(triton_server.grpc_url, pre[N.INPUT_IDS], emb)
    assert first == 0 and again > 0
    with VLMClient(triton_server.grpc_url, protocol="grpc", timeout=120) as c:
        got = c.generate(prompt, [victim], max_tokens=4, return_num_input_tokens=True)
    with VLMClient(hf_server.grpc_url, protocol="grpc", timeout=120) as c:  # a server never attacked
        clean = c.generate(prompt, [victim], max_tokens=4)
    with VLMClient(triton_server.grpc_url, protocol="grpc", timeout=120) as c:
        forged_answer = c.generate(prompt, [forged], max_tokens=4)
    # the victim gets the answer to its own image (the demo model's, right or wrong: as built by today's
    # transformers it reads this green square as "red" after the long prompt), not the forged image's
    assert got.output_ids == clean.output_ids
    assert got.output_ids != forged_answer.output_ids
    assert got.num_cached_tokens < again  # not the blocks holding the forged image (only text before it, if any)


# --- the vision model's keys, without a server ---------------------------------------------------------------
def test_vision_cache_keys_are_the_pixels_received(demo_model):
    """The same pixels hit whoever sends them; other pixels never find them, whatever else is the same."""
    import torch

    from triton_vlm.vision.service import VisionInput, build, content_digest

    svc = build(demo_model, {"vision_backend": "torch"})
    s = svc.image_size
    rng = np.random.default_rng(24)
    a, b = (rng.standard_normal((1, 3, s, s)).astype(np.float32) for _ in range(2))
    first = svc.encode_rows([VisionInput(a)])[0].embeds
    other = svc.encode_rows([VisionInput(b)])[0].embeds  # a miss: encoded, not a's features
    assert svc.stats.images_encoded == 2 and not torch.equal(first, other)
    again = svc.encode_rows([VisionInput(a.copy()), VisionInput(np.concatenate([b, a]))])  # a copy hits
    assert svc.stats.images_encoded == 2 and svc.cache.stats.hits == 3
    assert torch.equal(again[0].embeds, first) and torch.equal(again[1].embeds[1], first[0])
    assert content_digest(a, (10, 20)) != content_digest(a, (20, 10))  # LLaVA-NeXT packs by size
    assert content_digest(a, (1, 1)) == content_digest(a.astype(np.float64), (1, 1))  # what the encoder sees


def test_vision_hashes_many_images_on_threads_with_the_same_keys():
    from triton_vlm.vision import service as S

    rng = np.random.default_rng(5)
    images = [(rng.standard_normal((2, 3, 336, 336)).astype(np.float32), (336, 336 + i)) for i in range(4)]
    assert sum(t.nbytes for t, _ in images) >= S.HASH_PARALLEL_BYTES
    assert S.content_digests(images) == [S.content_digest(t, sz) for t, sz in images]


# --- cache_salt in the engine's block hashes -------------------------------------------------------------------
def test_cache_salt_enters_the_first_block_hash():
    from triton_vlm.engine.kv.prefix_cache import RequestHasher

    ids = list(range(100, 164))  # 4 blocks of 16

    def hashes(salt):
        return RequestHasher(ids, 16, spans=[], image_token_id=None, salt=salt).prompt_hashes

    none, a, b = hashes(None), hashes("tenant-a"), hashes("tenant-b")
    assert a == hashes("tenant-a")  # the same salt shares every block
    for x, y in ((none, a), (a, b), (none, hashes(""))):
        assert all(p != q for p, q in zip(x, y)), "different salts share no block"


def test_cache_salt_is_checked():
    from triton_vlm.errors import InvalidArgument
    from triton_vlm.params import MAX_CACHE_SALT, GenerationParams, GenerationRequest, ModelLimits

    limits = ModelLimits(vocab_size=1000, context_length=64, eos_ids=(2,))
    req = GenerationRequest("r", [1, 2, 3], GenerationParams(max_tokens=4))
    for salt in ("x", "é" * MAX_CACHE_SALT, None):
        replace(req, cache_salt=salt).validate(limits)
    for salt, needle in (("", "non-empty"), ("x" * (MAX_CACHE_SALT + 1), f"at most {MAX_CACHE_SALT}")):
        with pytest.raises(InvalidArgument, match=f"cache_salt .*{needle}"):
            replace(req, cache_salt=salt).validate(limits)


def test_openai_cache_salt_and_the_api_key():
    from triton_vlm.openai.errors import APIError
    from triton_vlm.openai.params import make_plan, tenant_salt
    from triton_vlm.openai.schemas import CompletionRequest

    def plan(**kw):
        return make_plan(CompletionRequest(model="m", prompt="p", **kw), {})

    assert plan(cache_salt="s").cache_salt == "s" and plan().cache_salt is None
    assert plan(prompt_cache_key="k").cache_salt is None  # a routing hint: no isolation, no effect
    for bad, needle in (("", "non-empty string"), ("x" * 1025, "at most 1024"), ("\ud800", "lone surrogate")):
        with pytest.raises(APIError) as e:
            plan(cache_salt=bad)
        assert e.value.status == 400 and needle in str(e.value.body()) and e.value.body()["error"]["param"] == \
            "cache_salt"
    assert tenant_salt(None, "s") == "s" and tenant_salt(None, None) is None
    keyed = {tenant_salt(k, s) for k in ("k1", "k2") for s in (None, "s", "t")}
    assert len(keyed) == 6 and "s" not in keyed  # per key, per salt; never a client's plain salt
    assert tenant_salt("k1", "s") == tenant_salt("k1", "s")


# --- cache_salt through the server -------------------------------------------------------------------------------
def _prompt(tag: str) -> str:
    """A text prompt of several full KV blocks that no other test sends."""
    return f"USER: {tag} " + "Tell me about the shapes and their colors, please. " * 6 + "ASSISTANT:"


@pytest.mark.server
def test_the_ensembles_cache_salt_shares_blocks_within_a_salt_only(triton_server):
    url, prompt = triton_server.grpc_url, _prompt(uuid.uuid4().hex)
    assert cached(ensemble(url, prompt, "tenant-a")) == 0
    assert cached(ensemble(url, prompt, "tenant-b")) == 0  # another salt: nothing shared
    assert cached(ensemble(url, prompt)) == 0  # no salt: nothing shared either
    hit = cached(ensemble(url, prompt, "tenant-a"))
    assert hit > 0 and cached(ensemble(url, prompt, "tenant-b")) == hit and cached(ensemble(url, prompt)) == hit
    with pytest.raises(InferenceServerException, match="cache_salt must be a non-empty string"):
        ensemble(url, prompt, "")


def prefix_hits(server) -> float:
    """triton_vlm_prefix_cache_hits_total (prompt tokens found cached) with every request answered before the
    call counted (the llm refreshes it every 0.5 s: read after the next refresh)."""
    text = after_next_refresh(server.metrics_url)
    return sum(float(v) for v in re.findall(r"^triton_vlm_prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.M))


@pytest.mark.server
def test_the_openai_cache_salt_and_api_key_isolate_tenants(triton_server, demo_model):
    import openai

    from test_openai import Running
    from triton_vlm.openai import FrontendConfig

    config = FrontendConfig(triton=triton_server.grpc_url, model_dir=demo_model)
    plain, keyed = Running(config), Running(replace(config, api_key="tenant-key"))
    prompt = _prompt(uuid.uuid4().hex)

    def ask(fe, salt=None, key="unused", **kw):
        before = prefix_hits(triton_server)
        extra = {"cache_salt": salt, **kw} if salt is not None else kw
        fe.client(api_key=key).completions.create(model="demo-v3", prompt=prompt, max_tokens=2, extra_body=extra)
        return prefix_hits(triton_server) - before

    try:
        assert ask(plain, "a") == 0
        assert ask(plain, "b") == 0 and ask(plain) == 0
        assert ask(plain, "a") > 0  # the same salt shares its blocks
        assert ask(keyed, key="tenant-key") == 0  # with --api-key: a salt of the key's, unlike every plain one
        assert ask(keyed, "a", key="tenant-key") == 0  # the client's salt under the key: not plain "a"
        assert ask(keyed, "a", key="tenant-key") > 0
        assert ask(plain, "x", prompt_cache_key="k") == 0  # prompt_cache_key: accepted, no effect
        with pytest.raises(openai.BadRequestError) as e:
            plain.client().completions.create(model="demo-v3", prompt=prompt, max_tokens=2,
                                              extra_body={"cache_salt": ""})
        assert e.value.body["param"] == "cache_salt" and "non-empty string" in e.value.body["message"]
    finally:
        plain.stop()
        keyed.stop()
