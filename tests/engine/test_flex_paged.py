"""The FlexAttention paged path (`flex_paged.py`, `attention.Attention`) against the SDPA path (`attend_torch`) on
the same cache: decode steps and prefill chunks of ragged rows, a physical block shared by two rows (a fork, as
prefix caching shares them), GQA, stale data in the unused slots of partial blocks, the CUDA graphs' padding rows
(scratch slot); the block lists against the SDPA mask; the backend choice at load and the fall back at run time;
the engine end to end with flex forced. On the CPU FlexAttention runs eagerly (it evaluates `mask_mod` everywhere
and ignores the block lists), once compiled by inductor's CPU template (which reads only the listed blocks);
`gpu` tests: compiled on CUDA, fp32 and fp16."""
from __future__ import annotations

import logging

import pytest
import torch

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.kv.kv_cache import AttentionBatch, KVCache
from triton_vlm.engine.model import attention, flex_paged
from triton_vlm.params import GenerationParams, GenerationRequest

HD = 16


def make_attention(heads: int, kv_heads: int, device="cpu", dtype=torch.float32, backend="sdpa",
                   monkeypatch=None) -> attention.Attention:
    if monkeypatch is not None:
        monkeypatch.setenv(attention.ENV, backend)
    tables = torch.randn(256, HD, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    return attention.Attention(tables.cos(), tables.sin(), heads, kv_heads)


def ragged_rows(cache: KVCache) -> list:
    """Seven rows: 2 blocks + 1, its fork (the two full blocks shared, the partial one copied on its first write),
    an empty row, then rows ending at every place in a block (bs - 2, bs - 1, bs, 2 bs)."""
    bs = cache.block_size
    a = cache.new_row()
    cache.append(a, 2 * bs + 1)
    rows = [a, cache.fork(a), cache.new_row()]
    for n in (bs - 2, bs - 1, bs, 2 * bs):
        rows.append(cache.new_row())
        cache.append(rows[-1], n)
    return rows


def twin_caches(bs: int, kv_heads: int, device="cpu", dtype=torch.float32, num_blocks=160) -> tuple[KVCache, KVCache]:
    """Two caches with the same random ("stale") pool: what no row wrote must not count."""
    pair = [KVCache(num_layers=1, num_kv_heads=kv_heads, head_dim=HD, num_blocks=num_blocks, block_size=bs,
                    dtype=dtype, device=device) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    for c in pair:
        c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(2)))
        c.v.copy_(torch.randn(c.v.shape, generator=g.manual_seed(3)))
    return pair[0], pair[1]


def physical_mask(batch: AttentionBatch, slots: int) -> torch.Tensor:
    """The SDPA mask [rows, 1, q_len, T] moved to pool slots: [rows, q_len, slots]."""
    rows, _, q_len, t = batch.mask.shape
    out = torch.zeros(rows, q_len, slots + 1, dtype=torch.int8)
    idx = batch.read_slots.cpu()[:, None, :].expand(rows, q_len, t)
    out.scatter_reduce_(2, idx, batch.mask.cpu()[:, 0].to(torch.int8), "amax")  # padding columns: masked
    return out[:, :, :slots].bool()


def listed_mask(paged: flex_paged.PagedMask, rows: int, q_len: int) -> torch.Tensor:
    """What a block-sparse kernel computes with the plan: [rows, q_len, slots], True where the slot is in a full
    block of the query's tile, or in a partial one where `mask_mod` holds."""
    bm, qb = paged.block_mask, paged.q_block
    bs = bm.BLOCK_SIZE[1]
    dev = bm.kv_indices.device
    b, q = torch.arange(rows, device=dev)[:, None, None], torch.arange(q_len, device=dev)[None, :, None]
    kv = torch.arange(paged.slots, device=dev)[None, None]
    mod = bm.mask_mod(b, torch.zeros_like(b), q, kv).cpu()  # [rows, q_len, slots]
    out = torch.zeros(rows, q_len, paged.slots, dtype=torch.bool)
    for lists, nums, masked in ((bm.full_kv_indices, bm.full_kv_num_blocks, False),
                                (bm.kv_indices, bm.kv_num_blocks, True)):
        lists, nums = lists.cpu(), nums.cpu()
        present = torch.zeros(rows, lists.shape[2], paged.slots // bs, dtype=torch.bool)  # [rows, nqb, blocks]
        for r in range(rows):
            for i in range(lists.shape[2]):
                present[r, i, lists[r, 0, i, :int(nums[r, 0, i])].long()] = True
        tile = present.repeat_interleave(qb, 1)[:, :q_len].repeat_interleave(bs, 2)  # [rows, q_len, slots]
        out |= tile & mod if masked else tile
    return out


def compare(att: attention.Attention, bs: int, q_len: int, device="cpu", dtype=torch.float32, batch_of=None,
            atol=1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """flex and SDPA on twin caches: equal outputs, equal cache writes; the plan's lists give the SDPA mask."""
    flex_cache, sdpa_cache = twin_caches(bs, att.kv_heads, device, dtype)
    batches = [batch_of(c) if batch_of else c.plan(ragged_rows(c), q_len) for c in (flex_cache, sdpa_cache)]
    rows = batches[0].positions.shape[0]
    width = (att.heads + 2 * att.kv_heads) * HD
    qkv = torch.randn(rows, q_len, width, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    with torch.inference_mode():  # as the engine's forward calls it (a compiled call's guards include grad mode)
        got = att.attend(qkv, batches[0], flex_cache, 0, use_flex=True)  # [rows, q_len, heads * hd]
        want = att.attend(qkv, batches[1], sdpa_cache, 0, use_flex=False)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    # the blocks' slots equal; the scratch slot after them is left out: padding rows all write it, and which
    # duplicate write of an index_copy_ lands is not defined on CUDA (seen differing between twins on an H200)
    real = flex_cache.scratch_slot
    assert torch.equal(flex_cache.k[:, :real], sdpa_cache.k[:, :real])
    assert torch.equal(flex_cache.v[:, :real], sdpa_cache.v[:, :real])
    paged = flex_paged.plan(batches[0], bs, flex_cache.num_blocks)
    assert torch.equal(listed_mask(paged, rows, q_len), physical_mask(batches[0], paged.slots))
    return got, want


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (4, 4)])  # GQA groups of 2 and 3, plain MHA
@pytest.mark.parametrize("q_len", [1, 7, 40])  # a decode step, a chunk across blocks, chunks of several Q blocks
@pytest.mark.parametrize("bs", [4, 16])
def test_flex_equals_sdpa_on_ragged_shared_and_partial_blocks(heads, kv_heads, q_len, bs, monkeypatch):
    compare(make_attention(heads, kv_heads, monkeypatch=monkeypatch), bs, q_len)


def padded_decode(cache: KVCache, pad: int) -> AttentionBatch:
    """A decode step laid out as the CUDA graphs' buffers (`cuda_graph.DecodeGraphs._run`): the real rows, then
    `pad` padding rows at position 0 writing the scratch slot and reading block 0."""
    rows = ragged_rows(cache)
    bs, dev = cache.block_size, cache.k.device
    write = [s for r in rows for s in cache.append(r, 1)] + [cache.scratch_slot] * pad
    nb = max(len(r.blocks) for r in rows) + 1  # a keys bucket past the longest row
    tables = torch.tensor([r.blocks + [0] * (nb - len(r.blocks)) for r in rows] + [[0] * nb] * pad)
    positions = torch.tensor([r.length - 1 for r in rows] + [0] * pad)[:, None]  # [B, 1]
    read = (tables[:, :, None] * bs + torch.arange(bs)).reshape(len(tables), nb * bs)  # [B, T]
    mask = torch.arange(nb * bs)[None, :] <= positions  # [B, T]
    return AttentionBatch(positions=positions.to(dev), write_slots=torch.tensor(write, device=dev),
                          read_slots=read.to(dev), mask=mask[:, None, None, :].to(dev))


def test_padding_rows_of_a_bucketed_decode_step(monkeypatch):
    got, _ = compare(make_attention(4, 2, monkeypatch=monkeypatch), 4, 1, batch_of=lambda c: padded_decode(c, 3))
    assert got.shape == (10, 1, 4 * HD) and torch.isfinite(got).all()


def test_compiled_cpu_kernel_reads_only_the_listed_blocks(monkeypatch):
    """inductor's CPU FlexAttention reads only the listed blocks and skips `mask_mod` on full ones: equal to SDPA;
    a control without the full blocks differs (the lists are what the compiled kernel reads)."""
    att = make_attention(4, 2, monkeypatch=monkeypatch)
    cache, _ = twin_caches(4, 2)
    batch = cache.plan(ragged_rows(cache), 7)
    qkv = torch.randn(7, 7, 8 * HD, generator=torch.Generator().manual_seed(4))
    want = att.attend(qkv, batch, cache, 0, use_flex=False).view(7, 7, 4, HD).transpose(1, 2)
    q = attention.write_new(qkv, *att.tables(batch.positions), batch.write_slots, cache.k[0], cache.v[0], 4, 2)
    paged = flex_paged.plan(batch, 4, cache.num_blocks)
    got = flex_paged.attend(q, cache.k[0], cache.v[0], paged, compiled=True)  # [rows, heads, q_len, hd]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    bm = paged.block_mask
    assert int(bm.full_kv_num_blocks.sum()) > 0
    no_full = type(bm).from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, torch.zeros_like(bm.full_kv_num_blocks),
                                      bm.full_kv_indices, bm.BLOCK_SIZE, bm.mask_mod, seq_lengths=bm.seq_lengths,
                                      compute_q_blocks=False)
    control = flex_paged.attend(q, cache.k[0], cache.v[0], flex_paged.PagedMask(no_full, paged.slots,
                                                                                  paged.q_block), compiled=True)
    assert (control - want).abs().max() > 1e-2


# --- the choice at load and the fall back at run time ------------------------------------------------------
def test_a_ragged_forwards_segments_each_build_their_block_mask_once(monkeypatch):
    """A ragged prefill attends segment by segment at every layer: each segment's block mask is built at the
    first layer and reused by the others (not rebuilt per segment per layer)."""
    att = make_attention(4, 2, backend="flex", monkeypatch=monkeypatch)
    cache, _ = twin_caches(4, 2)
    rows = [cache.new_row() for _ in range(3)]
    batches = [cache.plan([r], n) for r, n in zip(rows, (5, 2, 7))]
    built = []
    real_plan = flex_paged.plan
    monkeypatch.setattr(flex_paged, "plan", lambda *a: built.append(a[0]) or real_plan(*a))
    width = (4 + 2 * 2) * HD
    for _ in range(4):  # layers
        for b in batches:
            att.attend(torch.randn(1, b.positions.shape[1], width), b, cache, 0)
    assert [id(b) for b in built] == [id(b) for b in batches]


def test_backend_choice_and_its_reason(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=attention.__name__)
    assert make_attention(4, 2, backend="auto", monkeypatch=monkeypatch).backend == "sdpa"  # CPU: SDPA, C kernel
    assert "auto on cpu: SDPA and the C decode kernel" in caplog.text
    assert make_attention(4, 2, backend="sdpa", monkeypatch=monkeypatch).backend == "sdpa"
    att = make_attention(4, 2, backend="flex", monkeypatch=monkeypatch)
    assert att.backend == "flex" and "self-check against SDPA passed" in att.reason
    assert att.kernel_for(1) is None  # decode steps take flex, not the C kernel
    with pytest.raises(ValueError, match="TRITON_VLM_ATTENTION='fast': expected one of auto, flex, sdpa"):
        make_attention(4, 2, backend="fast", monkeypatch=monkeypatch)


def test_the_one_layer_race_times_both_backends(monkeypatch):
    att = make_attention(4, 2, backend="flex", monkeypatch=monkeypatch)
    flex_ms, sdpa_ms = att.race(rows=3, keys=40, reps=2)  # runs (eagerly here), both timed
    assert flex_ms > 0 and sdpa_ms > 0


def test_a_failing_self_check_leaves_sdpa(monkeypatch, caplog):
    def wrong(q, kc, vc, paged, compiled=None):
        return torch.zeros_like(q)

    monkeypatch.setattr(flex_paged, "attend", wrong)
    att = make_attention(4, 2, backend="flex", monkeypatch=monkeypatch)
    assert att.backend == "sdpa" and "flex cannot run: self-check: q_len 5 differs from SDPA" in att.reason
    assert "flex cannot run" in caplog.text


def test_a_run_time_failure_recomputes_with_sdpa_and_stays_there(monkeypatch, caplog):
    monkeypatch.setattr(attention, "flex_failed", None)
    att = make_attention(4, 2, backend="flex", monkeypatch=monkeypatch)
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(flex_paged, "attend", broken)
    flex_cache, sdpa_cache = twin_caches(4, 2)
    batches = [c.plan(ragged_rows(c), 3) for c in (flex_cache, sdpa_cache)]
    qkv = torch.randn(7, 3, 8 * HD)
    for _ in range(2):
        got = att.attend(qkv, batches[0], flex_cache, 0)
        assert torch.equal(got, att.attend(qkv, batches[1], sdpa_cache, 0, use_flex=False))
    assert calls == [1] and attention.flex_failed == "RuntimeError: no kernel for this shape"
    assert "every later one uses SDPA" in caplog.text


def test_model_with_a_sliding_window_layer_runs_it_on_sdpa(tmp_path, monkeypatch):
    """A windowed layer keeps SDPA under flex, the others take flex: prefill chunks and decode steps give the SDPA
    model's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from triton_vlm.engine.model.model import LlamaModel  # noqa: PLC0415

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(tmp_path)
    logits = {}
    for backend in ("sdpa", "flex"):
        monkeypatch.setenv(attention.ENV, backend)
        m = LlamaModel.from_pretrained(tmp_path)
        m.layers[1].window = 5
        calls = {"flex": 0, "sdpa": 0}
        flex_attend, sdpa_attend = flex_paged.attend, attention.attend_torch
        monkeypatch.setattr(flex_paged, "attend", lambda *a, **k: calls.__setitem__("flex", calls["flex"] + 1)
                            or flex_attend(*a, **k))
        monkeypatch.setattr(attention, "attend_torch", lambda *a: calls.__setitem__("sdpa", calls["sdpa"] + 1)
                            or sdpa_attend(*a))
        cache = m.new_cache(16, 4)
        rows = [cache.new_row(), cache.new_row()]
        ids = torch.arange(2 * 11).view(2, 11) % 60 + 3
        outs = [m.forward(m.embed(ids[:, s:s + 6]), cache.plan(rows, ids[:, s:s + 6].shape[1]), cache,
                          all_logits=True) for s in (0, 6)]
        outs += [m.forward(m.embed(torch.tensor([[t], [t + 1]])), cache.plan(rows, 1), cache)[:, None]
                 for t in (7, 9, 30)]
        logits[backend] = torch.cat(outs, dim=1)  # [2, 14, vocab]
        assert m.attention.backend == backend
        assert calls == {"flex": 5, "sdpa": 5} if backend == "flex" else calls["flex"] == 0  # layer 1: SDPA
        monkeypatch.undo()
    torch.testing.assert_close(logits["flex"], logits["sdpa"], atol=1e-5, rtol=0)


# --- end to end ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model, processor = build_random_llava_objects(seed=5, max_position_embeddings=96)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # spread the logits so near-ties are rare
    return save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))


def greedy(path, prompts: list[list[int]]) -> tuple[Engine, dict[str, list[int]]]:
    eng = Engine(path, EngineConfig(max_rows=8, kv_cache_tokens=512, block_size=4, prefill_chunk=8))
    reqs = [GenerationRequest(f"r{i}", p, GenerationParams(max_tokens=6, min_tokens=6))
            for i, p in enumerate(prompts)]
    out = {rid: res[-1].sequences[0].token_ids for rid, res in eng.generate(reqs[:1]).items()}  # caches a prefix
    out |= {rid: res[-1].sequences[0].token_ids for rid, res in eng.generate(reqs[1:]).items()}
    return eng, out


def test_engine_greedy_tokens_with_flex_forced_equal_the_default_path(ckpt, monkeypatch):
    """Prompts sharing a cached prefix (the same physical blocks in several rows), ragged lengths, chunked prefill
    and batched decode: the same greedy tokens as the default CPU path (SDPA + the C decode kernel)."""
    shared = [1] + list(range(10, 22))  # three full blocks of 4, reused from the first request's prefill
    prompts = [shared + [40, 41], shared + [50], shared + [60, 61, 62, 63, 64, 65], [1, 7, 8]]
    monkeypatch.setenv(attention.ENV, "sdpa")
    _, want = greedy(ckpt, prompts)
    monkeypatch.setenv(attention.ENV, "flex")
    monkeypatch.setattr(attention, "flex_failed", None)
    calls = {"flex": 0, "sdpa": 0}
    flex_attend, sdpa_attend = flex_paged.attend, attention.attend_torch
    monkeypatch.setattr(flex_paged, "attend", lambda *a, **k: calls.__setitem__("flex", calls["flex"] + 1)
                        or flex_attend(*a, **k))
    monkeypatch.setattr(attention, "attend_torch", lambda *a: calls.__setitem__("sdpa", calls["sdpa"] + 1)
                        or sdpa_attend(*a))
    eng, got = greedy(ckpt, prompts)
    assert eng.model.attention.backend == "flex" and eng.prefix_cache_stats().hits >= 24
    assert got == want
    assert calls["flex"] > 50 and calls["sdpa"] == 2  # the load's self-check compared against SDPA twice
    assert attention.flex_failed is None


# --- on a GPU: compiled ----------------------------------------------------------------------------------------
@pytest.fixture
def fresh_dynamo():
    """Each CUDA test compiles as a server process would, for its one model: dynamo's caches (and their
    per-function recompile budget, which flex_paged makes a hard failure) start empty and are emptied after."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float16, 5e-3)])
@pytest.mark.parametrize("q_len", [1, 7, 100])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_cuda_compiled_flex_equals_sdpa(dtype, atol, q_len, heads, kv_heads, monkeypatch, fresh_dynamo):
    monkeypatch.setattr(attention, "flex_failed", None)
    att = make_attention(heads, kv_heads, "cuda", dtype, backend="flex", monkeypatch=monkeypatch)
    assert att.backend == "flex", att.reason  # the self-check passed: compiled on CUDA
    compare(att, 16, q_len, "cuda", dtype, atol=atol)
    compare(att, 32, q_len, "cuda", dtype, atol=atol)


@pytest.mark.gpu
def test_auto_on_cuda_serves_sdpa_and_says_why(monkeypatch):
    """auto keeps SDPA on CUDA (flex measured behind end to end on an H200) without compiling anything."""
    att = make_attention(4, 2, "cuda", torch.float16, backend="auto", monkeypatch=monkeypatch)
    assert att.backend == "sdpa" and att.reason == f"{attention.ENV}=auto {attention.AUTO_CUDA}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_padding_rows_and_engine_tokens(ckpt, dtype, monkeypatch, fresh_dynamo):
    """The bucketed decode step's padding rows, compiled; the engine on CUDA (CUDA graphs on, 16-slot blocks)
    with flex and with SDPA: the same greedy tokens in fp32."""
    monkeypatch.setattr(attention, "flex_failed", None)
    att = make_attention(4, 2, "cuda", dtype, backend="flex", monkeypatch=monkeypatch)
    compare(att, 16, 1, "cuda", dtype, batch_of=lambda c: padded_decode(c, 3), atol=5e-3)
    if dtype != torch.float32:
        return
    prompts = [[1] + list(range(10, 60)), [1] + list(range(10, 40)) + [70], [1, 7, 8]]
    runs = {}
    for backend in ("sdpa", "flex"):
        monkeypatch.setenv(attention.ENV, backend)
        eng = Engine(ckpt, EngineConfig(device="cuda", max_rows=8, kv_cache_tokens=1024, block_size=16,
                                        prefill_chunk=32))
        assert eng.model.attention.backend == backend and eng.decode_graphs is not None
        reqs = [GenerationRequest(f"r{i}", p, GenerationParams(max_tokens=8, min_tokens=8))
                for i, p in enumerate(prompts)]
        runs[backend] = {rid: res[-1].sequences[0].token_ids for rid, res in eng.generate(reqs).items()}
        assert eng.decode_graphs.replays > 0
        eng.shutdown()
    assert runs["flex"] == runs["sdpa"] and attention.flex_failed is None
