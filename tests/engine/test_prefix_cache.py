"""Prefix caching: the block index and its LRU of idle blocks (KVCache), block hashes (images, adapters), and
the engine: a request reusing a cached prefix gets exactly the tokens it gets with caching off (greedy, beams,
seeded sampling, adapters, images), never another adapter's or image's KV, and reservations stay exact under
eviction."""
from __future__ import annotations

import pytest
import torch

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.kv.kv_cache import KVCache, blocks_needed
from triton_vlm.engine.kv.prefix_cache import RequestHasher, adapter_key, image_spans
from triton_vlm.lora.format import Adapter, LoraModule, module_shape
from triton_vlm.params import GenerationParams, GenerationRequest

BS = 4


# --- the block index -------------------------------------------------------------------------------------------
def make_cache(num_blocks=8, block_size=BS) -> KVCache:
    return KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=block_size)


def cached_row(c: KVCache, hashes: list[bytes], extra: int = 0):
    """A row holding len(hashes) full registered blocks (+ `extra` tokens), as a finished prefill leaves it."""
    r = c.new_row()
    c.append(r, len(hashes) * c.block_size + extra)
    for i, h in enumerate(hashes):
        c.register(r, i, h)
        r.hashes.append(h)
    return r


H = [bytes([i]) * 32 for i in range(16)]


def test_reuse_takes_the_longest_cached_prefix_and_always_leaves_a_token_to_compute():
    c = make_cache()
    first = cached_row(c, H[:3], extra=1)
    blocks = list(first.blocks)
    c.free(first)
    assert c.used_blocks == 0 and c.free_blocks == 8 and c.cached_blocks == 3  # 3 idle cached blocks
    r = c.new_row()
    assert c.reuse(r, [H[0], H[1], H[9]], prompt_len=14) == 8  # stops at the first miss
    assert r.blocks == blocks[:2] and r.hashes == H[:2]
    assert [c.refcount[b] for b in r.blocks] == [1, 1] and c.used_blocks == 2
    c.free(r)
    # a prompt of exactly 3 full blocks reuses 2: its last token must be computed for its logits
    r = c.new_row()
    assert c.reuse(r, H[:3], prompt_len=12) == 8
    assert c.reuse(c.new_row(), H[:3], prompt_len=13) == 12  # held blocks are shared (refcount 2)
    assert c.prefix_stats.requests == 3 and c.prefix_stats.queries == 14 + 12 + 13
    assert c.prefix_stats.hits == 8 + 8 + 12


def test_idle_blocks_are_evicted_least_recently_used_and_the_tail_of_a_prefix_first():
    c = make_cache(num_blocks=6)
    a = cached_row(c, H[0:3])  # blocks of prefix a
    b = cached_row(c, H[3:6])
    c.free(a)  # a's blocks idle first (least recently used), tail first
    c.free(b)
    assert c.free_blocks == 6 and c.used_blocks == 0
    r = c.new_row()
    c.append(r, 2 * BS)  # two allocations: both evict from a's prefix, its last block first
    probe = c.new_row()
    assert c.reuse(probe, H[0:3], prompt_len=100) == BS  # a keeps its head block only
    c.free(probe)
    assert c.reuse(c.new_row(), H[3:6], prompt_len=100) == 3 * BS  # b is untouched


def test_a_hit_refreshes_its_blocks_in_the_lru():
    c = make_cache(num_blocks=4)
    a, b = cached_row(c, H[0:2]), cached_row(c, H[2:4])
    c.free(a)
    c.free(b)
    r = c.new_row()
    c.reuse(r, H[0:2], prompt_len=100)  # a is used again: b is now the least recently used
    c.free(r)
    c.append(c.new_row(), 2 * BS)
    assert c.reuse(c.new_row(), H[0:2], prompt_len=100) == 2 * BS
    assert c.reuse(c.new_row(), H[2:4], prompt_len=100) == 0


def test_reserved_allocations_never_fail_because_of_cached_blocks():
    """Idle cached blocks are capacity: with all 8 idle and cached, the whole cache can be reserved and every
    reserved block allocated."""
    c = make_cache(num_blocks=8)
    for k in range(4):
        c.free(cached_row(c, H[2 * k:2 * k + 2]))
    assert c.cached_blocks == 8 and c.free_blocks == 8
    assert c.try_reserve(8)
    rows = [c.new_row() for _ in range(2)]
    for r in rows:
        c.append(r, 4 * BS)  # 8 allocations, each one evicting
    assert c.used_blocks == 8 and c.cached_blocks == 0


def test_forks_share_cached_blocks_and_copy_on_write_never_touches_them():
    c = make_cache()
    parent = cached_row(c, H[:2], extra=2)  # two cached full blocks and a partial one
    for s in range(parent.length):
        c.k[:, parent.blocks[s // BS] * BS + s % BS] = s
    child = c.fork(parent)
    assert child.hashes == parent.hashes and child.hashes is not parent.hashes
    c.append(child, 1)  # copy-on-write of the partial block only
    assert child.blocks[:2] == parent.blocks[:2] and child.blocks[2] != parent.blocks[2]
    c.free(parent)
    c.free(child)
    assert c.used_blocks == 0 and c.cached_blocks == 2
    r = c.new_row()
    assert c.reuse(r, H[:2], prompt_len=9) == 8
    assert [float(c.k[0, r.blocks[s // BS] * BS + s % BS, 0, 0]) for s in range(8)] == list(range(8))


# --- hashes ------------------------------------------------------------------------------------------------------
IMG = 99


def hashes(ids, feats=None, adapter=None) -> list[bytes]:
    spans = image_spans(ids, feats, IMG)
    assert spans is not None
    return RequestHasher(ids, BS, spans=spans, image_token_id=IMG, adapter=adapter).prompt_hashes


def test_image_blocks_hash_the_image_content_and_the_offset_inside_it():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 6, 8, generator=g), torch.randn(1, 6, 8, generator=g)
    ids = [1, 5, 6, 7] + [IMG] * 6 + [8, 9, 10, 11, 12, 13]  # blocks: text | 4 img | 2 img + 2 text | text
    ha = hashes(ids, a)
    assert hashes(ids, a.clone()) == ha  # the same image content at the same place matches
    hb = hashes(ids, b)
    assert hb[0] == ha[0] and hb[1] != ha[1] and hb[3] != ha[3]  # a different image never does, nor what follows
    two = torch.cat([a, b])  # [2, 6, 8]
    ids2 = [1, 5, 6, 7] + [IMG] * 12 + [8, 9, 10, 11]
    ab, ba = hashes(ids2, two), hashes(ids2, two.flip(0))
    assert ab[0] == ba[0] and ab[1] != ba[1] and ab[2] != ba[2]  # which image sits where
    assert hashes(ids2, torch.cat([a, a]))[1] == ha[1]  # a at the same place, whatever follows
    moved = [1, 5, 6, 7, 4] + [IMG] * 6 + [8, 9, 10, 11, 12]
    assert hashes(moved, a)[0] == ha[0] and hashes(moved, a)[1] != ha[1]  # a one position later
    # 2-D embeddings [N, hidden] are one image
    assert hashes(ids, a[0]) == ha
    # images of different lengths arrive concatenated ([N, hidden]): each image's run of placeholders is a span
    c = torch.randn(4, 8, generator=g)
    ids3 = ids[:10] + [8, IMG, IMG, IMG, IMG, 9, 10, 11]
    h3 = hashes(ids3, torch.cat([a[0], c]))
    assert h3[:2] == ha[:2] and h3[2] != ha[2]
    # features that do not fit the placeholders: not cacheable (the prefill refuses the request)
    assert image_spans(ids, two, IMG) is None and image_spans(ids, None, IMG) is None


def adapter(name: str, seed: int, n_in=8, n_out=8) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    return Adapter(name, {(0, "q_proj"): LoraModule(torch.randn(2, n_in, generator=g),
                                                    torch.randn(n_out, 2, generator=g), 1.0)})


def test_adapter_identity_is_its_name_and_its_weights():
    a1 = adapter("7", 1)
    assert adapter_key(a1) == adapter_key(a1) == adapter_key(adapter("7", 1))  # same weights sent again
    assert adapter_key(adapter("7", 2)) != adapter_key(a1)  # new weights under the same task id
    assert adapter_key(adapter("8", 1)) != adapter_key(a1)  # another tenant's id
    ids = [1] + list(range(5, 16))
    base = hashes(ids)
    assert all(x != y for x, y in zip(hashes(ids, adapter=a1), base))
    assert hashes(ids, adapter=adapter("7", 1)) == hashes(ids, adapter=a1)


# --- the engine ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    model, processor = build_random_llava_objects(seed=5, max_position_embeddings=96)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # spread the logits so near-ties (and flips) are rare
    return model, save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))


def make_engine(path, caching=True, **kw) -> Engine:
    base = dict(max_rows=32, kv_cache_tokens=1024, block_size=BS, prefill_chunk=8, enable_prefix_caching=caching)
    return Engine(path, EngineConfig(**(base | kw)))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(5, 300, (n - 1,), generator=g).tolist()


def req(rid, ids, max_tokens=8, image_embeds=None, adapter=None, **kw) -> GenerationRequest:
    return GenerationRequest(rid, list(ids), GenerationParams(max_tokens=max_tokens, **kw),
                             image_embeds=image_embeds, adapter=adapter)


def run(eng: Engine, r: GenerationRequest):
    """-> (token ids of every returned sequence, cached_tokens) of one request run alone."""
    res = eng.generate([r])[r.request_id][-1]
    assert res.final and res.error is None, res.error
    return [s.token_ids for s in res.sequences], res.cached_tokens


MODES = {
    "greedy": dict(),
    "beam": dict(beam_width=3, num_return_sequences=2),
    "sampling": dict(do_sample=True, temperature=0.9, top_k=40, seed=1234, num_return_sequences=2),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_chat_turns_reuse_the_history_and_match_caching_off(ckpt, mode):
    """Turn 2 resends turn 1 (prompt and answer) and adds to it: with caching it computes only what is new and
    gets the tokens it gets without caching; the prompt blocks and the answer's decoded blocks are reused."""
    _, path = ckpt
    on, off = make_engine(path), make_engine(path, caching=False)
    kw = MODES[mode]
    p1 = prompt(23, 1)
    t1 = req("t1", p1, max_tokens=12, min_tokens=12, **kw)
    got1, cached1 = run(on, t1)
    assert (got1, cached1) == (run(off, t1)[0], 0)
    again_on, again_off = run(on, req("t1b", p1, max_tokens=12, min_tokens=12, **kw)), run(off, t1)
    assert again_on == (again_off[0], 20)  # 5 full blocks cached; the last prompt token is computed
    p2 = p1 + got1[0] + prompt(9, 2)[1:]  # 23 + 12 + 8 = 43 tokens
    t2 = req("t2", p2, max_tokens=10, **kw)
    got2, cached2 = run(on, t2)
    assert got2 == run(off, t2)[0]
    if mode == "greedy":  # the answer of turn 1 was one row: its decoded full blocks are cached too
        assert cached2 == (23 + 12 - 1) // BS * BS == 32
    else:  # beams / samples: at least the prompt of turn 1
        assert cached2 >= 20
    stats = on.prefix_cache_stats()
    assert (stats.requests, stats.queries) == (3, 23 + 23 + 43)
    assert stats.hits == 20 + cached2
    assert on.cache.used_blocks == 0 and on.cache.reserved == 0 and on.cache.cached_blocks > 0


def image_feats(model, seed: int, n: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return torch.stack(list(model.get_image_features(
            torch.rand(n, 3, 32, 32), vision_feature_layer=-2, vision_feature_select_strategy="default").pooler_output))


def test_images_hit_only_the_same_image_at_the_same_place(ckpt):
    model, path = ckpt
    n, img = model.config.image_seq_length, model.config.image_token_id
    a, b = image_feats(model, 1), image_feats(model, 2)
    ids = [1, 20, 21, 22, 23, 24, 25, 26] + [img] * n + [30, 31, 32, 33, 34, 35, 36]
    on, off = make_engine(path), make_engine(path, caching=False)
    two = ids[:8] + [img] * n + ids[8:]  # 8 text, 2 images, 7 text
    cases = [("a", ids, a), ("a-again", ids, a.clone()), ("b", ids, b), ("a-moved", ids[:7] + ids[8:8 + n] +
             ids[7:8] + ids[8 + n:], a), ("ab", two, torch.cat([a, b])), ("ba", two, torch.cat([b, a]))]
    cached = {}
    for name, tokens, feats in cases:
        for kw in (dict(), dict(beam_width=2)):
            r = req(f"{name}{kw}", tokens, max_tokens=6, image_embeds=feats, **kw)
            got, cached[name, bool(kw)] = run(on, r)
            assert got == run(off, r)[0], (name, kw, cached)
    P = len(ids)
    assert cached["a", False] == 0 and cached["a", True] == (P - 1) // BS * BS  # the beam run reuses greedy's
    assert cached["a-again", False] == (P - 1) // BS * BS
    assert cached["b", False] == 8  # the text blocks before the image only
    assert cached["a-moved", False] == 4  # the image one position later: the blocks before it
    # the first image where "a" (or "b") had it, then the other one: the blocks up to the end of the first one
    assert cached["ab", False] == cached["ba", False] == (8 + n) // BS * BS


def lora(eng: Engine, name: str, seed: int) -> Adapter:
    """An adapter of k_proj and v_proj in every layer: what it changes is in the KV cache itself."""
    spec = eng.model_config
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in range(spec.num_layers):
        for m in ("k_proj", "v_proj"):
            n_in, n_out = module_shape(spec, m)
            mods[(layer, m)] = LoraModule(torch.randn(2, n_in, generator=g), torch.randn(n_out, 2, generator=g), 1.0)
    return Adapter(name, mods)


def test_adapters_never_reuse_kv_computed_with_another_adapter(ckpt):
    """Tenants: a task id's KV is found again only with the same weights; new weights under the same id, another
    id, or the base model compute their own, and every answer is the one caching off gives."""
    _, path = ckpt
    on, off = make_engine(path), make_engine(path, caching=False)
    ids = prompt(21, 7)
    first = lora(on, "7", 1)
    cases = [("first", first, 0), ("same-object", first, 20), ("same-weights", lora(on, "7", 1), 20),
             ("reupload", lora(on, "7", 2), 0), ("other-id", lora(on, "8", 1), 0), ("base", None, 0),
             ("base-again", None, 20), ("reupload-again", lora(on, "7", 2), 20)]
    answers = {}
    for name, ad, want in cases:
        r = req(name, ids, max_tokens=8, adapter=ad)
        got, cached = run(on, r)
        assert cached == want, name
        assert got == run(off, r)[0], name
        answers[name] = got
    assert answers["reupload"] != answers["first"] != answers["base"]  # the adapters change the answer


def test_eviction_under_pressure_keeps_reservations_and_answers_exact(ckpt):
    """A cache of 24 blocks, requests whose reservations fill it: idle cached blocks are evicted as needed,
    nothing waits for them, every answer equals caching off, and the index never outgrows the cache."""
    _, path = ckpt
    on, off = make_engine(path, kv_cache_tokens=24 * BS), make_engine(path, caching=False, kv_cache_tokens=24 * BS)
    reqs = [req(f"r{i}", prompt(17 + i % 3, 100 + i % 4), max_tokens=6, beam_width=1 + i % 2) for i in range(10)]
    assert max(on.validate(r) for r in reqs) <= 24
    for wave in (reqs[:5], reqs[5:]):
        got_on, got_off = on.generate(wave), off.generate(wave)
        for r in wave:
            assert [s.token_ids for s in got_on[r.request_id][-1].sequences] == \
                [s.token_ids for s in got_off[r.request_id][-1].sequences], r.request_id
        assert on.cache.used_blocks == 0 and on.cache.reserved == 0 and on.cache.cached_blocks <= 24
    assert on.prefix_cache_stats().hits > 0


def test_blocks_of_a_failed_prefill_chunk_are_not_cached(ckpt, monkeypatch):
    _, path = ckpt
    on, off = make_engine(path), make_engine(path, caching=False)
    ids = prompt(21, 3)
    forward, calls = on.model.forward, [0]

    def second_call_fails(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("forward failed")
        return forward(*args, **kwargs)

    monkeypatch.setattr(on.model, "forward", second_call_fails)
    res = on.generate([req("fails", ids)])["fails"][-1]
    assert res.error is not None and "forward failed" in str(res.error)
    assert on.cache.cached_blocks == 2  # the first chunk's 8 tokens only
    monkeypatch.setattr(on.model, "forward", forward)
    assert run(on, req("retry", ids)) == (run(off, req("retry", ids))[0], 8)


def test_caching_off_caches_nothing(ckpt):
    _, path = ckpt
    off = make_engine(path, caching=False)
    ids = prompt(21, 4)
    assert run(off, req("x", ids))[1] == 0 and run(off, req("y", ids))[1] == 0
    assert off.cache.cached_blocks == 0 and off.prefix_cache_stats().queries == 0
    assert blocks_needed(21, 8, 1, BS) <= off.cache.num_blocks


@pytest.mark.gpu
def test_chat_turn_reuse_on_cuda_matches_caching_off(ckpt):
    """The same on a GPU (fp32 weights there): a second turn reuses its history and answers as caching off does."""
    _, path = ckpt
    on, off = make_engine(path, device="cuda"), make_engine(path, caching=False, device="cuda")
    p1 = prompt(23, 5)
    got1, _ = run(on, req("t1", p1, max_tokens=12, min_tokens=12))
    t2 = req("t2", p1 + got1[0] + prompt(9, 6)[1:], max_tokens=10, beam_width=2)
    got2, cached2 = run(on, t2)
    assert cached2 == 32 and got2 == run(off, t2)[0]


def test_per_request_kv_counts_and_times(ckpt):
    """A result's own KV counts (TensorRT-LLM's kv_cache_* outputs): a repeated prompt reuses its full blocks with
    caching on and none with it off; its timestamps are ordered on the wall clock."""
    import time

    _, path = ckpt
    on, off = make_engine(path), make_engine(path, caching=False)
    ids, blocks = prompt(21, 6), -(-21 // BS)

    def final(eng, rid):
        res = eng.generate([req(rid, ids, max_tokens=6, min_tokens=6)])[rid][-1]
        assert res.final and res.error is None, res.error
        return res.stats

    t0 = time.time_ns()
    first = final(on, "k1")
    t1 = time.time_ns()
    assert t0 <= first.times_ns[0] <= first.times_ns[1] <= first.times_ns[2] <= first.times_ns[3] <= t1
    kv = first.kv
    assert (kv.reused_blocks, kv.missed_blocks, kv.hit_rate) == (0, blocks, 0.0)
    assert kv.total_blocks == kv.new_blocks >= blocks
    again = final(on, "k2").kv
    reused = (21 - 1) // BS  # full blocks, the last prompt token always computed
    assert (again.reused_blocks, again.missed_blocks) == (reused, blocks - reused)
    assert again.new_blocks == kv.new_blocks - reused and again.hit_rate == reused / blocks
    for rid in ("o1", "o2"):
        k = final(off, rid).kv
        assert (k.reused_blocks, k.missed_blocks, k.new_blocks) == (0, blocks, kv.new_blocks)
