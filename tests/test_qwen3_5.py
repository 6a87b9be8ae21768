"""Qwen3.5 (hybrid: Gated DeltaNet linear attention beside gated full attention) on a tiny random hub-layout
checkpoint (sharded, the family's processor and chat template), against transformers'
`Qwen3_5ForConditionalGeneration` `generate()` on the same files, in fp32:
- in process: a prompt longer than one 64-token chunk, prefilled in engine chunks of 64, greedy and beam search with
  num_return_sequences equal generate(); every state slot is free afterwards; the control: beams whose states are
  not copied when they fork give other tokens (the layer-level controls, chunk size among them, are
  tests/engine/test_deltanet.py's); requests preempted mid-decode (max_utilization) get generate()'s tokens; the KV
  profile refuses state slots that do not fit, naming the numbers;
- through one live tritonserver (scheduler_policy max_utilization on a small KV cache) and its OpenAI front end:
  12 long greedy requests, some preempted mid-decode, each equal to generate(); greedy and beams 2-4 with num_return_sequences over
  images of two sizes, two images in one prompt, a video with an image (Qwen3-VL's timestamps), text and a long
  prompt, sent at once; penalties; streaming; seeded
  sampling with n; one OpenAI chat request; a burst with a cancelled request leaves every state slot free (the
  gauge) and prefix caching off (the gauge).
- LoRA on the full-attention and MLP projections equals PEFT; what is not served is refused by name;
- Qwen3.5-MoE (every layer sparse: 2 of 4 routed experts plus a sigmoid-gated shared expert; the hub's per-expert
  files), in process: greedy over a prompt of three chunks, beams 2 with num_return_sequences and seeded sampling
  with n equal generate(); the control: the shared expert's gate ignored gives other tokens; LoRA on the experts or
  the shared expert is refused by name."""
from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from qwen_vl_cases import png
from test_qwen3_vl import VIDEOS, Qwen3Reference

NEW = 8
KV_TOKENS, LONG_NEW = 1024, 120  # the live server's KV cache (max_utilization): 12 requests of 120 tokens overflow it
SIZES = {"small": (100, 60), "tall": (40, 300)}
IMAGES = {name: png(size, seed=150 + i) for i, (name, size) in enumerate(SIZES.items())}
PROMPT = "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\n<image> and <image>: compare them.<|im_end|>\n<|im_start|>assistant\n"
VIDEO = "<|im_start|>user\n<video> and <image>: what happens?<|im_end|>\n<|im_start|>assistant\n"
LONG = ("<|im_start|>user\n" + " ".join(f"word{i} and more" for i in range(12)) +
        "<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from triton_vlm.demo.qwen35_checkpoint import build_qwen3_5

    torch.set_num_threads(1)
    return build_qwen3_5(tmp_path_factory.mktemp("qwen3-5") / "qwen3_5", shards=2, seed=3, max_position_embeddings=512)


@pytest.fixture(scope="module")
def ref(checkpoint):
    return Qwen3Reference(checkpoint)  # Qwen3-VL's processors: videos sampled with timestamps as transformers does


def test_engine_long_prompt_beams_slots_and_the_beam_state_control(ref):
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.params import GenerationParams, GenerationRequest

    ids = ref.inputs(LONG, [])["input_ids"][0].tolist()
    assert len(ids) > 2 * 64, len(ids)  # three chunks of the delta rule, prefilled in engine chunks of 64
    eng = Engine(ref.model_dir, EngineConfig(max_rows=4, kv_cache_tokens=2048, block_size=16, prefill_chunk=64))

    def run(rid, beams):
        req = GenerationRequest(request_id=rid, input_ids=ids, params=GenerationParams(
            max_tokens=10, beam_width=beams, num_return_sequences=beams))
        last = eng.generate([req])[rid][-1]
        assert last.error is None, last.error
        return [s.token_ids for s in last.sequences]

    try:
        assert not eng.config.enable_prefix_caching and eng.stats().state_slots_total == 4
        plan = eng.memory  # the profile counted the slots: 4 x 18432 B; 2048 KV tokens hold 4 contexts of 512
        assert (plan.state_slots, plan.state_bytes, plan.sequences) == (4, 4 * 18432, 4)
        assert "4 state slots (0.07 MiB): 4 full-context sequences fit" in plan.summary()
        assert run("greedy", 1) == ref.generate(LONG, [], 10)
        want = ref.generate(LONG, [], 10, beams=3, num_return_sequences=3)
        assert run("beams", 3) == want
        assert eng.cache.states.free == 4 and eng.cache.free_blocks == eng.cache.num_blocks
        eng.cache.states.copy = lambda src, dst: None  # forked beams start from a zero state: not theirs
        assert run("no-copy", 3) != want
    finally:
        eng.shutdown()


def test_preempted_requests_recompute_their_states_and_get_generates_tokens(ref):
    """max_utilization on a cache of one full-context request: requests preempted mid-decode are recomputed (their
    prompt by the chunked rule in 64-token chunks, their generated tokens one at a time, as first computed; beams
    forked after the prompt) and each gets generate()'s tokens; every slot is free afterwards."""
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.params import GenerationParams, GenerationRequest

    eng = Engine(ref.model_dir, EngineConfig(max_rows=8, kv_cache_tokens=512, block_size=16, prefill_chunk=64,
                                             scheduler_policy="max_utilization"))
    g = torch.Generator().manual_seed(4)
    prompts = [[1] + torch.randint(5, 370, (n,), generator=g).tolist() for n in (90, 70, 100, 80)]
    reqs = [GenerationRequest(f"p{i}", ids, GenerationParams(max_tokens=40, min_tokens=40, beam_width=1 + (i == 2),
                                                             num_return_sequences=1 + (i == 2)))
            for i, ids in enumerate(prompts)]
    results = {r.request_id: [] for r in reqs}
    try:
        for r in reqs:
            eng.submit(r, lambda res: results[res.request_id].append(res))
        while eng.step():
            pass
        assert eng.stats().preemptions > 0
        assert eng.cache.states.free == 8 and eng.cache.used_blocks == 0
    finally:
        eng.shutdown()
    for r, ids in zip(reqs, prompts):
        width = r.params.beam_width
        with torch.no_grad():
            out = ref.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40,
                                     do_sample=False, num_beams=width, num_return_sequences=width, pad_token_id=0)
        assert [s.token_ids for s in results[r.request_id][-1].sequences] == out[:, len(ids):].tolist(), r.request_id


def test_a_bf16_hybrid_computes_in_bf16(checkpoint):
    """dtype bfloat16 (a GPU's): every projection is held and computed in bf16 (they once took the zero-centred
    norms' fp32 as the compute dtype, and the first product failed on bf16 inputs); its logits follow fp32's."""
    from triton_vlm.engine.model.hybrid import HybridModel

    ids, logits = torch.arange(5, 40)[None], {}
    for dtype in (torch.float32, torch.bfloat16):
        m = HybridModel.from_pretrained(checkpoint, dtype)
        assert {lin.weight.dtype for lin in m.linears() + [m.lm_head]} == {dtype}
        cache = m.new_cache(4, 16)
        logits[dtype] = m.forward(m.embed(ids), cache.plan([cache.new_row()], 35), cache, all_logits=True)[0]
    agree = (logits[torch.float32].argmax(-1) == logits[torch.bfloat16].argmax(-1)).float().mean()
    assert agree > 0.8, agree


def test_profile_refuses_state_slots_that_do_not_fit_and_chunks_off_64(checkpoint):
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.engine.profile import KVBudgetError
    from triton_vlm.errors import InvalidArgument

    with pytest.raises(KVBudgetError, match=r"the state slots do not fit: 64 slots \(max_rows\) x 18432 B"):
        Engine(checkpoint, EngineConfig(max_rows=64, kv_cache_mb=1, context_length=128, prefill_chunk=64))
    with pytest.raises(InvalidArgument, match="prefill_chunk 100 must be a multiple of 64 for this model"):
        Engine(checkpoint, EngineConfig(max_rows=2, kv_cache_tokens=512, prefill_chunk=100))


@pytest.fixture(scope="module")
def served(tmp_path_factory, checkpoint):
    """(the OpenAI front end, the live server) on the checkpoint, shared by the tests below (16 rows: a shorter
    profile at start)."""
    from conftest import _start_server, _stop_server
    from test_openai import FrontendConfig, Running

    params = {"llm": {"max_rows": "16", "scheduler_policy": "max_utilization", "kv_cache_tokens": str(KV_TOKENS)}}
    server = _start_server(tmp_path_factory, checkpoint, params, "qwen3-5-server")
    try:
        fe = Running(FrontendConfig(triton=server.grpc_url, model_dir=checkpoint,
                                    triton_metrics_url=f"http://localhost:{server.metrics_port}/metrics"))
    except BaseException:
        _stop_server(server)
        raise
    yield fe, server
    fe.stop()
    _stop_server(server)


def _ask(server, prompt, images, **params):
    from triton_vlm_client import VLMClient

    with VLMClient(server.grpc_url, timeout=180) as c:
        return c.generate(prompt, images, max_tokens=params.pop("max_tokens", NEW), **params)


@pytest.mark.server
def test_greedy_beams_images_and_long_prompts_equal_generate(served, ref):
    server = served[1]
    cases = [(PROMPT, [IMAGES["small"]], 1, ()), (PROMPT, [IMAGES["tall"]], 1, ()), (PROMPT, [IMAGES["tall"]], 2, ()),
             (TEXT, [], 4, ()), (TWO, [IMAGES["tall"], IMAGES["small"]], 2, ()), (LONG, [], 3, ()), (LONG, [], 1, ()),
             (VIDEO, [IMAGES["small"]], 2, VIDEOS[:1])]  # a video: its timestamps in the prompt, M-RoPE per patch
    with ThreadPoolExecutor(len(cases)) as pool:  # at once: the engine batches their decode steps
        futures = [pool.submit(_ask, server, p, imgs, beam_width=b, num_return_sequences=b,
                               **({"videos": list(v)} if v else {}))
                   for p, imgs, b, v in cases]
        results = [f.result() for f in futures]
    for (prompt, images, beams, videos), res in zip(cases, results):
        assert res.output_ids == ref.generate(prompt, images, NEW, beams=beams, num_return_sequences=beams,
                                              videos=videos), (prompt[:30], len(images), beams, len(videos))
    assert results[0].output_ids[0] != results[1].output_ids[0], "the answer depends on the image"


@pytest.mark.server
def test_penalties_and_streaming_equal_generate(served, ref):
    from triton_vlm_client import VLMClient

    server = served[1]
    got = _ask(server, LONG, [], max_tokens=12, repetition_penalty=1.5, no_repeat_ngram_size=2)
    assert got.output_ids == ref.generate(LONG, [], 12, repetition_penalty=1.5, no_repeat_ngram_size=2)
    with VLMClient(server.grpc_url, timeout=180) as c:
        pieces = list(c.stream(PROMPT, [IMAGES["tall"]], max_tokens=NEW))
    assert [t for p in pieces for t in p.token_ids] == ref.generate(PROMPT, [IMAGES["tall"]], NEW)[0]


@pytest.mark.server
def test_seeded_sampling_with_n_equals_generate(served, ref):
    got = _ask(served[1], PROMPT, [IMAGES["small"]], max_tokens=12, temperature=0.9, top_k=30, seed=11,
               num_return_sequences=3)
    x = ref.inputs(PROMPT, [IMAGES["small"]])
    torch.manual_seed(11)  # as the engine seeds its rows (the `hf` baseline backend does the same)
    with torch.no_grad():
        out = ref.model.generate(**x, max_new_tokens=12, do_sample=True, temperature=0.9, top_k=30, top_p=1.0,
                                 num_return_sequences=3, pad_token_id=0)
    want = [row[:row.index(ref.eos) + 1] if ref.eos in row else row
            for row in out[:, x["input_ids"].shape[1]:].tolist()]
    assert got.output_ids == want


@pytest.mark.server
def test_openai_chat_equals_generate(served, ref):
    from test_openai import data_url

    client = served[0].client(timeout=180)
    parts = [{"type": "image_url", "image_url": {"url": data_url(IMAGES["tall"])}},
             {"type": "text", "text": "Describe it."}]
    r = client.chat.completions.create(model="qwen3_5", messages=[{"role": "user", "content": parts}],
                                       max_tokens=NEW, temperature=0)
    prompt = ref.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
        add_generation_prompt=True, tokenize=False)
    want = ref.generate(prompt, [IMAGES["tall"]], NEW)[0]
    assert r.choices[0].message.content == ref.tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.server
def test_burst_with_a_cancellation_frees_every_state_slot(served):
    """32 requests at once: beams 2-4, samples with n = 2, greedy with and without an image, and two long requests
    cancelled mid-decode: afterwards every state slot is free (the gauge), and the gauges say prefix caching is off
    for this model."""
    import tritonclient.grpc as grpcclient
    from test_server_engine import _gauge, _grpc_input, _metric, _wait_for

    server = served[1]
    total = _gauge(server, "state_slots_total")
    assert total == 16 and _gauge(server, "prefix_caching") == 0  # one slot per row (max_rows 16)
    assert _metric(server, "triton_vlm_engine_memory_bytes", 'part="state_slots"') == 16 * 18432
    streams = []
    for beams in (3, 1):  # two long requests, cancelled while the others run: a beam search and a greedy one
        q: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(server.grpc_url)
        c.start_stream(callback=lambda result, error, q=q: q.put((result, error)))
        c.async_stream_infer("llm", [
            _grpc_input("input_ids", np.array([[1, 50, 60 + beams, 70]], np.int32), "INT32"),
            _grpc_input("max_tokens", np.array([[200]], np.int32), "INT32"),
            _grpc_input("min_tokens", np.array([[200]], np.int32), "INT32"),
            _grpc_input("beam_width", np.array([[beams]], np.int32), "INT32"),
            _grpc_input("stream", np.array([[True]]), "BOOL")])
        _, err = q.get(timeout=60)
        assert err is None
        streams.append(c)
    with ThreadPoolExecutor(30) as pool:  # 30 more at once (32 in all, over the 16 rows: some wait for slots)
        others = [pool.submit(_ask, server, TEXT, [], beam_width=b, num_return_sequences=b) for b in (2, 3, 4) * 3]
        others += [pool.submit(_ask, server, TEXT, [], temperature=1.0, seed=s, num_return_sequences=2)
                   for s in range(11)]
        others += [pool.submit(_ask, server, PROMPT if i % 2 else TEXT, [IMAGES["small"]] if i % 2 else [])
                   for i in range(10)]
        _wait_for(lambda: _gauge(server, "state_slots_free") < total, "the running rows hold state slots")
        for c in streams:
            c.stop_stream(cancel_requests=True)
        assert all(len(f.result().output_ids) >= 1 for f in others)
    _wait_for(lambda: server.log_file.read_text(errors="replace").count("cancelled by the client;") >= 2,
              "both long requests cancelled mid-decode")
    _wait_for(lambda: _gauge(server, "running_requests") == 0 and _gauge(server, "state_slots_free") == total,
              "every state slot free after the burst")


@pytest.mark.server
def test_requests_preempted_mid_decode_through_the_server_equal_generate(served, ref):
    """The module's server runs scheduler_policy max_utilization on a cache of KV_TOKENS: 12 greedy requests of
    LONG_NEW tokens start together, some are preempted mid-decode (the counter moves: their KV blocks and state
    slots freed), and each gets generate()'s tokens: the recompute rebuilt its linear layers' states."""
    from test_server_preemption import preemptions

    server = served[1]
    before = preemptions(server)
    prompts = [f"<|im_start|>user\nCount to {i} slowly.<|im_end|>\n<|im_start|>assistant\n" for i in range(12)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_ask, server, p, [], max_tokens=LONG_NEW, min_tokens=LONG_NEW) for p in prompts]
        results = [f.result() for f in futures]
    assert preemptions(server) > before, "no request was preempted: nothing recomputed its states"
    for prompt, res in zip(prompts, results):
        assert res.output_ids == ref.generate(prompt, [], LONG_NEW, min_new_tokens=LONG_NEW), prompt[:40]


def test_lora_equals_peft_and_what_is_not_served_is_refused_by_name(ref, tmp_path):
    """A PEFT LoRA on the full-attention layer's q_proj (its doubled output: query and gate) and v_proj and on MLPs
    of a linear and a full layer equals PEFT's generate(); adapters on a linear layer's projections or on q_proj of
    a linear layer are refused at load, never applied in part."""
    import json

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.errors import InvalidArgument
    from triton_vlm.lora.peft import load_peft
    from triton_vlm.params import GenerationParams, GenerationRequest
    from triton_vlm.spec import CheckpointSpec

    torch.manual_seed(2)
    peft_model = get_peft_model(type(ref.model).from_pretrained(str(ref.model_dir)), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False,
        target_modules=r".*language_model\.layers\.(3\.self_attn\.(q_proj|v_proj)|[13]\.mlp\.down_proj)"))
    peft_model.save_pretrained(tmp_path / "adapter")
    want = ref.generate(LONG, [], 12)
    lora = ref.generate(LONG, [], 12, model=peft_model.eval())
    assert lora != want, "the adapter must change the answer"
    eng = Engine(ref.model_dir, EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=16, prefill_chunk=64))
    ids = ref.inputs(LONG, [])["input_ids"][0].tolist()
    try:
        req = GenerationRequest("lora", ids, GenerationParams(max_tokens=12),
                                adapter=load_peft(tmp_path / "adapter", eng.model_config, "a"))
        assert [s.token_ids for s in eng.generate([req])["lora"][-1].sequences] == lora
    finally:
        eng.shutdown()
    spec = CheckpointSpec.load(ref.model_dir)
    for key, shape, what in (("layers.0.self_attn.q_proj", (64, 256), "layer 0 is a linear-attention"),
                             ("layers.0.linear_attn.in_proj_qkv", (64, 128), "not a LoRA weight")):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
        prefix = f"base_model.model.model.language_model.{key}"
        save_file({f"{prefix}.lora_A.weight": torch.zeros(2, shape[0]), f"{prefix}.lora_B.weight":
                   torch.zeros(shape[1], 2)}, str(bad / "adapter_model.safetensors"))
        with pytest.raises(InvalidArgument, match=what.replace("layer 0 is", "layer 0: that layer is")):
            load_peft(bad, spec.text, "bad")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3.5-MoE (every layer sparse: 2 of 4 experts plus the shared expert), its experts one tensor per
    expert as the hub's files hold them, and its reference."""
    from triton_vlm.demo.qwen35_checkpoint import build_qwen3_5

    torch.set_num_threads(1)
    return Qwen3Reference(build_qwen3_5(tmp_path_factory.mktemp("qwen3-5-moe") / "qwen3_5_moe", shards=2, seed=6,
                                        max_position_embeddings=512, experts=4))


def test_moe_greedy_beams_and_sampling_equal_generate_and_the_shared_gate_control(moe, tmp_path):
    import json

    from safetensors.torch import save_file

    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.engine.model.model import Experts
    from triton_vlm.errors import InvalidArgument
    from triton_vlm.families import family_of
    from triton_vlm.lora.peft import load_peft
    from triton_vlm.params import GenerationParams, GenerationRequest
    from triton_vlm.spec import CheckpointSpec

    spec = CheckpointSpec.load(moe.model_dir)
    assert family_of(spec).name == "qwen3_5_moe"
    assert (spec.text.sparse_layers, spec.text.shared_expert_size, spec.text.experts_per_token) == ((0, 1, 2, 3), 48, 2)
    assert any(".mlp.experts.0.gate_proj." in k for k in json.loads(
        (moe.model_dir / "model.safetensors.index.json").read_text())["weight_map"]), "the hub's per-expert layout"
    _check_expert_layouts(moe, spec, tmp_path)
    ids = moe.inputs(LONG, [])["input_ids"][0].tolist()
    eng = Engine(moe.model_dir, EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=16, prefill_chunk=64))

    def run(rid, **params):
        req = GenerationRequest(request_id=rid, input_ids=ids, params=GenerationParams(max_tokens=10, **params))
        last = eng.generate([req])[rid][-1]
        assert last.error is None, last.error
        return [s.token_ids for s in last.sequences]

    try:
        greedy = moe.generate(LONG, [], 10)
        assert run("greedy") == greedy
        assert run("beams", beam_width=2, num_return_sequences=2) == moe.generate(LONG, [], 10, beams=2,
                                                                                  num_return_sequences=2)
        x = moe.inputs(LONG, [])
        torch.manual_seed(11)  # as the engine seeds its rows
        with torch.no_grad():
            out = moe.model.generate(**x, max_new_tokens=10, do_sample=True, temperature=0.9, top_k=30, top_p=1.0,
                                     num_return_sequences=2, pad_token_id=0)
        want = [row[:row.index(moe.eos) + 1] if moe.eos in row else row for row in out[:, len(ids):].tolist()]
        assert run("sample", do_sample=True, temperature=0.9, top_k=30, seed=11, num_return_sequences=2) == want
        shared = [m.shared for m in eng.model.mlps if isinstance(m, Experts)]
        assert len(shared) == 4 and all(s is not None for s in shared)
        for s in shared:  # the control: the shared expert's output without its sigmoid gate
            s.gated = False
        assert run("ungated") != greedy
    finally:
        eng.shutdown()
    for key, what in (("layers.1.mlp.shared_expert.gate_proj", "mixture-of-experts weights"),
                      ("layers.1.mlp.down_proj", "down_proj of layer 1 is in a mixture-of-experts layer")):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
        prefix = f"base_model.model.model.language_model.{key}"
        save_file({f"{prefix}.lora_A.weight": torch.zeros(2, 64), f"{prefix}.lora_B.weight": torch.zeros(64, 2)},
                  str(bad / "adapter_model.safetensors"))
        with pytest.raises(InvalidArgument, match=what):
            load_peft(bad, spec.text, "bad")


def _check_expert_layouts(moe, spec, tmp_path):
    """The hub's per-expert tensors load stacked as transformers' conversion stacks them (its in-memory fused
    parameters), and a checkpoint holding the fused tensors (transformers' in-memory names) loads the same."""
    import shutil

    from safetensors.torch import save_file

    from triton_vlm.engine.model.hybrid_weights import load_hybrid_weights

    got = load_hybrid_weights(moe.model_dir, spec.text, torch.float32, "cpu")
    mem = {k: v.detach() for k, v in moe.model.state_dict().items()}
    for i in range(4):
        p = f"model.language_model.layers.{i}.mlp."
        assert torch.equal(got[f"layers.{i}.experts.gate_up_proj"], mem[p + "experts.gate_up_proj"])
        assert torch.equal(got[f"layers.{i}.experts.down_proj"], mem[p + "experts.down_proj"])
        assert torch.equal(got[f"layers.{i}.shared_expert_gate"], mem[p + "shared_expert_gate.weight"])
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(moe.model_dir / "config.json", fused)
    save_file({k: v.contiguous() for k, v in mem.items() },
              str(fused / "model.safetensors"))
    again = load_hybrid_weights(fused, spec.text, torch.float32, "cpu")
    assert again.keys() == got.keys() and all(torch.equal(again[k], got[k]) for k in got)
