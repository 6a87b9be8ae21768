"""LoRA: PEFT adapters and TensorRT-LLM tensors -> the engine's per-row LoRA, token-exact to `transformers` + `peft`."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from triton_vlm.errors import InvalidArgument
from triton_vlm.lora.format import MODULE_IDS, from_trtllm, to_trtllm
from triton_vlm.lora.peft import load_peft, peft_to_trtllm
from triton_vlm.params import GenerationParams, GenerationRequest

LM_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint

    model, processor = build_random_llava_objects(seed=11, max_position_embeddings=256)
    d = tmp_path_factory.mktemp("lora-base")
    save_checkpoint(model, processor, d)
    return d


def make_adapter(base_dir, out_dir, seed: int, **lora_kw):
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration.from_pretrained(base_dir)
    cfg = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": LM_TARGETS, "init_lora_weights": False,
                        **lora_kw})
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # large enough deltas that the adapters change the generated tokens
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(20.0)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    a = make_adapter(base, root / "plain", 1)
    b = make_adapter(base, root / "patterns", 2, r=8, lora_alpha=16, use_rslora=True,
                     rank_pattern={"q_proj": 2}, alpha_pattern={r"layers\.1\.mlp\.down_proj": 3})
    return {"plain": a, "patterns": b}


def reference(base_dir, adapter_dir, prompt: list[int], **gen_kw) -> list[int]:
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(base_dir).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                                           dtype=torch.long),
                             do_sample=False, **gen_kw)
    new = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return new[:new.index(eos) + 1] if eos in new else new


PROMPTS = [[1, 45, 88, 102, 33, 7], [1, 200, 17, 17, 300, 52, 9, 140], [1, 60, 61, 62]]


def test_engine_matches_peft_with_mixed_adapters_in_one_batch(base, adapters):
    from triton_vlm.engine.engine import Engine, EngineConfig

    eng = Engine(base, EngineConfig(max_rows=16, kv_cache_tokens=2048))
    spec = eng.model_config
    loaded = {name: load_peft(d, spec) for name, d in adapters.items()}
    cases = [("plain", 1), ("patterns", 1), (None, 1), ("plain", 3), ("patterns", 2), (None, 3)]
    reqs, expected = [], {}
    for i, (name, beam) in enumerate(cases):
        prompt = PROMPTS[i % len(PROMPTS)]
        rid = f"r{i}"
        reqs.append(GenerationRequest(rid, prompt, GenerationParams(max_tokens=12, beam_width=beam),
                                      adapter=None if name is None else loaded[name]))
        expected[rid] = reference(base, None if name is None else adapters[name], prompt, max_new_tokens=12,
                                  num_beams=beam)
    out = eng.generate(reqs)  # all six in one engine: different adapters (and none) share the decode batches
    got = {rid: res[-1].sequences[0].token_ids for rid, res in out.items()}
    assert got == expected
    # the CUDA graphs' path (`cuda_graph.py`, uncaptured on the CPU): LoRA rows from the static slots, the same tokens
    graphed = Engine(base, EngineConfig(max_rows=16, kv_cache_tokens=2048, cuda_graph_lora_rank=8))
    graphs = graphed.make_decode_graphs(capture=False)
    out = graphed.generate([dataclasses.replace(r) for r in reqs])
    assert {rid: res[-1].sequences[0].token_ids for rid, res in out.items()} == expected
    assert graphs.lora_steps >= 10 and graphs.lora.loads == 2 and graphs.fallbacks == 0
    # the adapters matter: the same prompt without them answers differently
    assert expected["r0"] != reference(base, None, PROMPTS[0], max_new_tokens=12, num_beams=1)


def test_trtllm_tensors_layout_and_round_trip(base, adapters):
    from triton_vlm.spec import CheckpointSpec

    spec = CheckpointSpec.load(base).text
    adapter = load_peft(adapters["patterns"], spec)
    weights, config = peft_to_trtllm(adapters["patterns"], spec, np.float32)
    assert config.dtype == np.int32 and config.shape[1] == 3 and weights.shape[0] == config.shape[0]
    assert {MODULE_IDS[m] for _, m in adapter.modules} == set(config[:, 0].tolist()) == set(range(1, 8))
    assert MODULE_IDS["gate_proj"] == 5 and MODULE_IDS["down_proj"] == 6 and MODULE_IDS["up_proj"] == 7
    for (module_id, layer, r), row in zip(config.tolist(), weights):
        name = {v: k for k, v in MODULE_IDS.items()}[module_id]
        m = adapter.modules[(layer, name)]
        assert r == m.rank == (2 if name == "q_proj" else 8)  # rank_pattern
        n_a = m.a.numel()
        np.testing.assert_array_equal(row[:n_a], m.a.reshape(-1).numpy())  # A first, as PEFT stores it
        np.testing.assert_allclose(row[n_a:n_a + m.b.numel()], (m.b * m.scale).reshape(-1).numpy(), rtol=1e-6)
        assert not row[n_a + m.b.numel():].any()  # zero padded
        alpha = 3 if (layer, name) == (1, "down_proj") else 16  # alpha_pattern honoured
        assert m.scale == pytest.approx(alpha / np.sqrt(r))  # rsLoRA
    back = from_trtllm("t", weights, config, spec)
    for key, m in adapter.modules.items():
        torch.testing.assert_close(back.modules[key].b, m.b * m.scale)
        assert back.modules[key].scale == 1.0


def test_refused_adapters_say_why(base, tmp_path):
    from triton_vlm.spec import CheckpointSpec

    spec = CheckpointSpec.load(base).text
    vision = make_adapter(base, tmp_path / "vision", 3, target_modules=["q_proj", "v_proj"])  # hits CLIP too
    with pytest.raises(InvalidArgument, match="vision tower"):
        load_peft(vision, spec)
    good = make_adapter(base, tmp_path / "good", 4)
    for field, value, match in [("use_dora", True, "DoRA"), ("bias", "all", "biases"),
                                ("modules_to_save", ["lm_head"], "modules_to_save")]:
        cfg = json.loads((good / "adapter_config.json").read_text())
        bad = tmp_path / f"bad-{field}"
        bad.mkdir()
        (bad / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(InvalidArgument, match=match):
            load_peft(bad, spec)


def test_trtllm_tensor_errors_name_the_problem(base, adapters):
    from triton_vlm.spec import CheckpointSpec

    spec = CheckpointSpec.load(base).text
    weights, config = to_trtllm(load_peft(adapters["plain"], spec), np.float32)
    bad_layer = config.copy()
    bad_layer[0, 1] = spec.num_layers
    bad_module = config.copy()
    bad_module[0, 0] = 0  # attn_qkv: a fused module Llama does not have
    for w, c, match in [(weights, bad_layer, "Expected layerId to be in the range"),
                        (weights, bad_module, "not enabled for this model"),
                        (weights[:, :10], config, "has to few values"),
                        (weights[:-1], config, "same size")]:
        with pytest.raises(InvalidArgument, match=match):
            from_trtllm("t", w, c, spec)


def test_convert_cli_reproduces_the_tensorrt_llm_example_layout(tmp_path):
    """TensorRT-LLM's documented example: 4 layers, hidden 4, a q adapter of rank 2 (rank 8 in the last layer)
    and a k adapter of rank 4 in the first two layers -> config rows and [6, 64] weights exactly so."""
    import subprocess
    import sys

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=4, intermediate_size=8, num_hidden_layers=4,
                                        num_attention_heads=2, num_key_value_heads=2))
    cfg = LoraConfig(r=2, lora_alpha=4, init_lora_weights=False,
                     target_modules=r"model\.layers\.(\d+\.self_attn\.q_proj|[01]\.self_attn\.k_proj)",
                     rank_pattern={r"layers\.3\.self_attn\.q_proj": 8, "k_proj": 4})
    get_peft_model(base, cfg).save_pretrained(tmp_path / "peft")
    out = tmp_path / "npy"
    run = subprocess.run([sys.executable, "-m", "triton_vlm.lora.convert", "-i", str(tmp_path / "peft"), "-o",
                          str(out), "--dtype", "float32"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    config, weights = np.load(out / "model.lora_config.npy"), np.load(out / "model.lora_weights.npy")
    assert config.tolist() == [[1, 0, 2], [2, 0, 4], [1, 1, 2], [2, 1, 4], [1, 2, 2], [1, 3, 8]]
    assert weights.shape == (6, 64) and weights.dtype == np.float32  # 8 * (4 + 4) for the rank-8 row
    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    for row, (module_id, layer, r) in zip(weights, config.tolist()):
        name = "q_proj" if module_id == 1 else "k_proj"
        key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
        a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
        scale = 4 / r  # lora_alpha 4 for every module: alpha / r
        np.testing.assert_array_equal(row[:a.numel()], a.reshape(-1).numpy())
        np.testing.assert_allclose(row[a.numel():a.numel() + b.numel()], (b * scale).reshape(-1).numpy(), rtol=1e-6)
        assert not row[a.numel() + b.numel():].any()


def peft_beam(base_dir, adapter_dir, prompt, beams, n):
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    model = PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(base_dir), adapter_dir).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, num_beams=beams, num_return_sequences=n, max_new_tokens=10,
                             output_scores=True, return_dict_in_generate=True)
    eos = model.base_model.model.generation_config.eos_token_id
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        seqs.append(row[:row.index(eos) + 1] if eos in row else [t for t in row if t != eos])
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("module", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
def test_each_module_alone_beam_search_tokens_and_scores(base, tmp_path, module):
    """One adapted projection at a time, beam 3 returning 2 sequences: tokens equal, scores within 1e-4."""
    from triton_vlm.engine.engine import Engine, EngineConfig

    adapter_dir = make_adapter(base, tmp_path / module, 5, target_modules=LM_TARGETS.replace(
        "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj", module))
    eng = Engine(base, EngineConfig(max_rows=8, kv_cache_tokens=1024))
    adapter = load_peft(adapter_dir, eng.model_config)
    assert {m for _, m in adapter.modules} == {module}
    prompt = PROMPTS[1]
    req = GenerationRequest("r", prompt, GenerationParams(max_tokens=10, beam_width=3, num_return_sequences=2),
                            adapter=adapter)
    final = eng.generate([req])["r"][-1]
    seqs, scores = peft_beam(base, adapter_dir, prompt, 3, 2)
    assert [s.token_ids for s in final.sequences] == seqs
    np.testing.assert_allclose([s.cum_log_prob for s in final.sequences], scores, atol=1e-4)


def test_batch_invariance_among_sixteen_requests(base, adapters):
    """A request with an adapter gives the same tokens alone and among 15 others using other adapters or none,
    submitted while the engine is already running them."""
    from triton_vlm.engine.engine import Engine, EngineConfig

    eng = Engine(base, EngineConfig(max_rows=64, kv_cache_tokens=4096))
    loaded = [load_peft(d, eng.model_config) for d in adapters.values()] + [None]
    target = GenerationRequest("x", PROMPTS[0], GenerationParams(max_tokens=12, beam_width=2), adapter=loaded[0])
    alone = eng.generate([target])["x"][-1].sequences[0].token_ids
    others = [GenerationRequest(f"o{i}", PROMPTS[i % 3] + [50 + i], GenerationParams(max_tokens=12 + i % 5),
                                adapter=loaded[i % 3]) for i in range(15)]
    results = {}
    for r in others[:8]:
        eng.submit(r, lambda res: results.setdefault(res.request_id, []).append(res))
    for _ in range(3):  # the first eight are mid-generation when the target and the rest arrive
        eng.step()
    again = dataclasses.replace(target, request_id="x2")
    for r in [again] + others[8:]:
        eng.submit(r, lambda res: results.setdefault(res.request_id, []).append(res))
    while eng.step():
        pass
    assert results["x2"][-1].sequences[0].token_ids == alone
    assert all(results[r.request_id][-1].final for r in others)


def _tiny(name: str, rank: int = 2, scale: float = 1.0):
    from triton_vlm.lora.format import Adapter, LoraModule

    return Adapter(name, {(0, "q_proj"): LoraModule(torch.ones(rank, 4), torch.ones(4, rank), scale)})


def test_device_slots_evict_only_idle_adapters_least_recent_first():
    from triton_vlm.engine.lora.adapter_slots import DeviceAdapters

    evicted = []
    slots = DeviceAdapters(max_adapters=2, max_bytes=10**6, on_evict=lambda a: evicted.append(a.name))
    a, b, c = _tiny("a"), _tiny("b"), _tiny("c")
    assert slots.acquire(a) is not None and slots.acquire(b) is not None
    assert slots.acquire(c) is None  # both slots used by running requests: c waits, nothing is evicted
    assert evicted == [] and len(slots) == 2
    slots.release(b)
    slots.release(a)  # both idle now; a was used less recently than... b was acquired after a
    assert slots.acquire(c) is not None and evicted == ["a"]
    assert slots.acquire(b) is not None and slots.stats.hits == 1  # b stayed resident
    assert slots.stats.misses == 3 and slots.stats.evictions == 1
    with pytest.raises(InvalidArgument, match=r"needs \d+ bytes; the device adapter cache holds 100 bytes"):
        DeviceAdapters(max_adapters=4, max_bytes=100).check(_tiny("big", rank=64))


def test_engine_with_more_adapters_than_device_slots(base, adapters):
    """Six adapters through two device slots: requests wait for a slot instead of failing, a running request's
    adapter is never evicted, and every request's tokens equal those it gets alone."""
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.lora.format import Adapter, LoraModule

    eng = Engine(base, EngineConfig(max_rows=32, kv_cache_tokens=4096, max_loras=2))
    plain = load_peft(adapters["plain"], eng.model_config)
    # six distinct adapters: the plain one with its B scaled differently
    variants = [Adapter(f"v{k}", {key: LoraModule(m.a, m.b, m.scale * (1 + k / 4)) for key, m in plain.modules.items()})
                for k in range(6)]
    reqs = [GenerationRequest(f"r{i}", PROMPTS[i % 3], GenerationParams(max_tokens=8), adapter=variants[i % 6])
            for i in range(12)]
    alone = {}
    ref = Engine(base, EngineConfig(max_rows=32, kv_cache_tokens=4096, max_loras=16))
    for r in reqs:
        alone[r.request_id] = ref.generate([dataclasses.replace(r)])[r.request_id][-1].sequences[0].token_ids
    seen_running = []
    results = {}
    for r in reqs:
        eng.submit(r, lambda res: results.setdefault(res.request_id, []).append(res))
    while eng.step():
        info = eng.lora_info()
        seen_running.append(len(info.running))
        assert len(info.running) <= 2 and info.max_lora == 2
    assert {rid: res[-1].sequences[0].token_ids for rid, res in results.items()} == alone
    assert all(res[-1].error is None for res in results.values())
    assert max(seen_running) == 2 and eng.lora_slots.stats.evictions >= 4
    assert len(set(map(tuple, alone.values()))) > 1  # the variants really differ


def test_adapter_larger_than_the_device_level_is_refused_at_submit(base, adapters):
    from triton_vlm.engine.engine import Engine, EngineConfig

    eng = Engine(base, EngineConfig(max_rows=8, kv_cache_tokens=1024, lora_cache_device_mb=1))
    spec = eng.model_config
    big = from_trtllm("7", *_big_rows(spec), spec)
    with pytest.raises(InvalidArgument, match=r"LoRA adapter '7' needs \d+ bytes; the device adapter cache holds "
                                              r"1048576 bytes \(lora_cache_device_mb\)"):
        eng.submit(GenerationRequest("r", PROMPTS[0], GenerationParams(max_tokens=4), adapter=big), print)


def _big_rows(spec):
    """Rank-256 q/k/v/o/gate/up/down on every layer: more than 1 MiB in fp32 for the test model."""
    from triton_vlm.lora.format import module_shape

    rows, config = [], []
    for layer in range(spec.num_layers):
        for module, mid in MODULE_IDS.items():
            n_in, n_out = module_shape(spec, module)
            rows.append(np.full(256 * (n_in + n_out), 0.001, np.float16))
            config.append([mid, layer, 256])
    width = max(len(r) for r in rows)
    return np.stack([np.pad(r, (0, width - len(r))) for r in rows]), np.array(config, np.int32)


def test_client_reads_adapters_as_the_server_converts_them(base, adapters, tmp_path):
    """The client's numpy-only reader gives TensorRT-LLM tensors equal to the server's converter (rank_pattern,
    alpha_pattern, rsLoRA included) and refuses what the server refuses."""
    from triton_vlm_client.adapter import read_adapter

    for d in adapters.values():
        w, c = read_adapter(d)
        w_ref, c_ref = peft_to_trtllm(d)
        np.testing.assert_array_equal(c, c_ref)
        np.testing.assert_array_equal(w, w_ref)
    out = tmp_path / "npy"
    out.mkdir()
    np.save(out / "model.lora_weights.npy", w_ref[None])  # the converter's batch dimension of 1
    np.save(out / "model.lora_config.npy", c_ref[None])
    w, c = read_adapter(out)
    assert w.shape == w_ref.shape and c.shape == c_ref.shape
    bad = make_adapter(base, tmp_path / "dora", 3, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        read_adapter(bad)


def test_engine_equals_hf_peft_with_images_beams_and_sampling(base, adapters):
    """The engine against the `hf` baseline running the same adapters through `peft` (itself checked against
    `PeftModel.from_pretrained`): images merged into the prompt, beam search with several sequences, seeded
    sampling, a wire adapter, and the base model, one engine batch for all."""
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.baseline.generate import HFGenerator
    from triton_vlm.spec import CheckpointSpec

    spec = CheckpointSpec.load(base)
    hf = HFGenerator(base)
    eng = Engine(base, EngineConfig(max_rows=32, kv_cache_tokens=4096))
    loaded = {name: load_peft(d, eng.model_config) for name, d in adapters.items()}
    loaded["wire"] = from_trtllm("9", *to_trtllm(loaded["plain"], np.float16), eng.model_config)
    n_img = spec.vision.num_image_tokens
    g = torch.Generator().manual_seed(3)
    embeds = (torch.randn(1, n_img, spec.text.hidden_size, generator=g) * 0.5).numpy()
    with_image = [1, 45] + [spec.image_token_id] * n_img + [88, 102, 33]
    cases = [("plain", dict(), True), ("patterns", dict(beam_width=3, num_return_sequences=2), True),
             ("plain", dict(temperature=0.8, top_k=20, seed=5, do_sample=True), False),
             ("patterns", dict(temperature=1.2, top_p=0.9, seed=11, num_return_sequences=2, do_sample=True), True),
             ("wire", dict(beam_width=2), False), (None, dict(beam_width=2), True)]
    reqs = [GenerationRequest(f"r{i}", with_image if img else PROMPTS[i % 3], GenerationParams(max_tokens=10, **kw),
                              adapter=None if name is None else loaded[name], image_embeds=embeds if img else None)
            for i, (name, kw, img) in enumerate(cases)]
    got = {rid: [s.token_ids for s in res[-1].sequences] for rid, res in eng.generate(reqs).items()}
    for r in reqs:
        out = []
        hf.run(dataclasses.replace(r), out.append)
        assert [s.token_ids for s in out[-1].sequences] == got[r.request_id], r.request_id
    out = []  # the baseline's adapters are PEFT's own
    hf.run(GenerationRequest("p", PROMPTS[0], GenerationParams(max_tokens=12), adapter=loaded["plain"]), out.append)
    assert out[-1].sequences[0].token_ids == reference(base, adapters["plain"], PROMPTS[0], max_new_tokens=12)


def test_wire_and_registry_paths_equal_peft_on_a_layer_subset_with_beam_4(base, tmp_path):
    """An adapter on one layer only, weights chosen fp16-exact and scale alpha / r = 2 (a
    power of two), so TensorRT-LLM's FP16 rows (scale folded into B) carry exactly PEFT's numbers: the wire path
    and the registry path both give PEFT's tokens and scores, beam 4 returning 3 sequences."""
    from safetensors.torch import load_file, save_file

    from triton_vlm.engine.engine import Engine, EngineConfig

    d = make_adapter(base, tmp_path / "subset", 8, r=4, lora_alpha=8,  # the language model's layer 1 only
                     target_modules=r".*language_model.*layers\.1\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj")
    weights = {k: v.half().float() for k, v in load_file(str(d / "adapter_model.safetensors")).items()}
    save_file(weights, str(d / "adapter_model.safetensors"))
    eng = Engine(base, EngineConfig(max_rows=16, kv_cache_tokens=2048))
    registry = load_peft(d, eng.model_config)
    assert {layer for layer, _ in registry.modules} == {1}
    w16, c = to_trtllm(registry, np.float16)
    wire = from_trtllm("5", w16, c, eng.model_config)
    for (key, m), (_, m2) in zip(sorted(registry.modules.items()), sorted(wire.modules.items())):
        assert torch.equal(m.b * m.scale, m2.b * m2.scale)  # the same numbers on both paths
    prompt = PROMPTS[0]
    seqs, scores = peft_beam(base, d, prompt, 4, 3)
    for adapter in (registry, wire):
        req = GenerationRequest("r", prompt, GenerationParams(max_tokens=10, beam_width=4, num_return_sequences=3),
                                adapter=adapter)
        final = eng.generate([req])["r"][-1]
        assert [s.token_ids for s in final.sequences] == seqs
        np.testing.assert_allclose([s.cum_log_prob for s in final.sequences], scores, atol=1e-4)


def test_base_requests_pass_one_waiting_for_an_adapter_slot(base):
    """One device slot held by a running request: a request for another adapter waits; a base-model request
    behind it is admitted at once; a request for the resident adapter behind it is not (it could keep the slot
    busy forever); all of them finish."""
    from triton_vlm.engine.engine import Engine, EngineConfig

    eng = Engine(base, EngineConfig(max_rows=16, kv_cache_tokens=2048, max_loras=1))
    x, y = _tiny_real("x", eng.model_config, 1), _tiny_real("y", eng.model_config, 2)
    results: dict = {}

    def submit(rid, adapter, n=12):
        eng.submit(GenerationRequest(rid, PROMPTS[0], GenerationParams(max_tokens=n, min_tokens=n), adapter=adapter),
                   lambda res: results.setdefault(res.request_id, []).append(res))

    submit("holds-x", x, n=30)
    eng.step()
    submit("wants-y", y)
    submit("base", None)
    submit("more-x", x)
    eng.step()
    running = {a.id for a in eng.scheduler.running}
    assert running == {"holds-x", "base"} and [a.id for a in eng.scheduler.waiting] == ["wants-y", "more-x"]
    while eng.step():
        pass
    assert all(results[r][-1].final and results[r][-1].error is None for r in ("holds-x", "wants-y", "base", "more-x"))


def _tiny_real(name: str, spec, seed: int):
    """A small random adapter on q_proj of layer 0 of the test model."""
    from triton_vlm.lora.format import Adapter, LoraModule, module_shape

    g = torch.Generator().manual_seed(seed)
    n_in, n_out = module_shape(spec, "q_proj")
    return Adapter(name, {(0, "q_proj"): LoraModule(torch.randn(2, n_in, generator=g) * 0.1,
                                                    torch.randn(n_out, 2, generator=g) * 0.1, 1.0)})


def _half(adapter):
    """The adapter with A / B in fp16 (as wire weights are held for an fp16 model)."""
    from triton_vlm.lora.format import Adapter, LoraModule

    return Adapter(adapter.name, {k: LoraModule(m.a.half(), m.b.half(), m.scale) for k, m in adapter.modules.items()})


def _built(stacks) -> list:
    """Every tensor the cache's sets hold in their stacks."""
    return [t for e in stacks._sets.values() for st in e.stacks.values() if st is not None for t in (st.a, st.b)]


def _shares(t, adapters) -> bool:
    return any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
               for a in adapters for m in a.modules.values() for x in (m.a, m.b))


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_stack_cache_charges_the_bytes_it_allocates(half):
    """A set's charge is the nbytes of the tensors built for it that do not share the adapters' memory: nothing
    for one fp32 adapter (its own tensors), its fp32 copies for one fp16 adapter, the fp32 stacks of a pair
    (twice the pair's fp16 bytes)."""
    from triton_vlm.engine.lora.lora import StackCache

    a, b = (_half(x) if half else x for x in (_tiny("a", rank=64), _tiny("b", rank=64)))
    stacks = StackCache(max_sets=8)
    for adapters in ((a,), (a, b)):
        entry = stacks.set_for(adapters)
        stacks.build(entry, 0, "q_proj", "cpu")
        assert stacks.build(entry, 1, "q_proj", "cpu") is None  # no adapter there: nothing built, nothing charged
    solo, pair = (stacks._sets[k] for k in ((id(a),), (id(a), id(b))))
    new = [t for t in _built(stacks) if not _shares(t, (a, b))]
    assert stacks.used_bytes == solo.nbytes + pair.nbytes == sum(t.nbytes for t in new)
    assert solo.nbytes == (2 * a.nbytes if half else 0)  # one fp32 adapter: no copy, nothing charged
    assert pair.nbytes == (2 if half else 1) * (a.nbytes + b.nbytes)  # e.g. 131,072 fp16 bytes -> 262,144
    assert all(t.dtype == torch.float32 for t in _built(stacks))


def test_stack_cache_is_bounded_in_bytes_and_keeps_the_current_set():
    from triton_vlm.engine.lora.lora import StackCache

    a, b, c = _tiny("a"), _tiny("b"), _tiny("c")
    one = a.nbytes
    stacks = StackCache(max_sets=8, max_bytes=2 * one)

    def use(*adapters):
        entry = stacks.set_for(adapters)
        stacks.build(entry, 0, "q_proj", "cpu")
        return entry

    use(a)  # one fp32 adapter: its own tensors, no copy
    assert stacks.used_bytes == 0
    use(a, b)
    assert stacks.used_bytes == 2 * one
    current = use(b, c)  # over budget: the least recently used sets go, never the one in use
    assert stacks.used_bytes == 2 * one and list(stacks._sets.values()) == [current]
    stacks.drop(c)
    assert stacks.used_bytes == 0 and not stacks._sets


def test_engine_charges_the_stacks_it_builds(base, adapters):
    """Through the engine (fp16 model, wire adapters held in fp16): after a batch mixing two adapters and one
    running alone, the stack cache's charge equals the bytes of the fp32 tensors it actually holds."""
    from triton_vlm.engine.engine import Engine, EngineConfig

    eng = Engine(base, EngineConfig(dtype="float16", max_rows=8, kv_cache_tokens=1024))
    spec = eng.model_config
    wire = [from_trtllm(str(i), *to_trtllm(load_peft(d, spec), np.float16), spec, dtype=torch.float16)
            for i, d in enumerate(adapters.values())]
    eng.generate([GenerationRequest(f"r{i}", PROMPTS[i], GenerationParams(max_tokens=4), adapter=w)
                  for i, w in enumerate(wire)])
    eng.generate([GenerationRequest("solo", PROMPTS[0], GenerationParams(max_tokens=4), adapter=wire[0])])
    stacks = eng.scheduler.runner.lora_stacks
    device = [s.device for s in eng.lora_slots._slots.values()]
    built = _built(stacks)
    assert built and all(not _shares(t, device) for t in built)  # fp16 adapters: every fp32 stack is a copy
    assert stacks.used_bytes == sum(t.nbytes for t in built) > 0


def test_resent_weights_replace_a_task_for_later_requests_only(base, adapters):
    """TensorRT-LLM's cache semantics: weights sent again for a cached task id replace it for later requests; a
    request already running keeps the adapter it started with; the id alone then finds the new one."""
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.lora.cache import AdapterCache
    from triton_vlm.lora.registry import Registry
    from triton_vlm.lora.request import parse_request

    eng = Engine(base, EngineConfig(max_rows=16, kv_cache_tokens=2048))
    spec = eng.model_config
    cache = AdapterCache(spec, Registry(None, spec), max_bytes=2**30)
    tensors = {name: to_trtllm(load_peft(d, spec), np.float32) for name, d in adapters.items()}

    def resolve(weights=None):
        w, c = weights if weights is not None else (None, None)
        return cache.resolve(parse_request(7, w, c, None, spec, cache.registry, 64))

    def solo(adapter, rid):
        return eng.generate([GenerationRequest(rid, PROMPTS[1], GenerationParams(max_tokens=10, min_tokens=10),
                                               adapter=adapter)])[rid][-1].sequences[0].token_ids

    results: dict = {}
    first = resolve(tensors["plain"])
    eng.submit(GenerationRequest("running", PROMPTS[1], GenerationParams(max_tokens=10, min_tokens=10),
                                 adapter=first), lambda r: results.setdefault(r.request_id, []).append(r))
    eng.step()
    eng.step()  # it is mid-generation when the task's weights are replaced
    second = resolve(tensors["patterns"])
    assert resolve() is second and len(cache) == 1
    while eng.step():
        pass
    assert results["running"][-1].sequences[0].token_ids == solo(first, "a")
    assert solo(resolve(), "b") == solo(second, "c") != solo(first, "d")


def test_wire_weights_take_the_models_dtype_and_compute_as_fp32(base, adapters):
    """FP16 wire weights are held in the model's dtype (half the bytes of fp32 for an fp16 model); the adapter
    math upcasts them to fp32 as PEFT does, so the tokens equal those of the same numbers held in fp32."""
    from triton_vlm.engine.engine import Engine, EngineConfig

    eng = Engine(base, EngineConfig(dtype="float16", max_rows=8, kv_cache_tokens=1024))
    spec = eng.model_config
    w16, c = to_trtllm(load_peft(adapters["plain"], spec), np.float16)
    as16, as32 = (from_trtllm("3", w16, c, spec, dtype=d) for d in (torch.float16, torch.float32))
    assert {m.a.dtype for m in as16.modules.values()} == {torch.float16} and as16.nbytes * 2 == as32.nbytes
    out = {}
    for tag, adapter in (("16", as16), ("32", as32), ("none", None)):
        req = GenerationRequest(tag, PROMPTS[2], GenerationParams(max_tokens=10, beam_width=2), adapter=adapter)
        out[tag] = eng.generate([req])[tag][-1].sequences[0].token_ids
    assert out["16"] == out["32"] != out["none"]


def test_registry_finds_adapters_added_while_serving(base, adapters, tmp_path):
    import shutil

    from triton_vlm.lora.registry import Registry, task_id_for_name
    from triton_vlm.spec import CheckpointSpec

    reg = Registry(tmp_path, CheckpointSpec.load(base).text)
    assert reg.find_id(task_id_for_name("late")) is None
    shutil.copytree(adapters["plain"], tmp_path / "late")
    shutil.copytree(adapters["plain"], tmp_path / "77")
    assert reg.find_id(task_id_for_name("late")) == "late" and reg.find_id(77) == "77"


def test_preprocess_check_refuses_every_bad_kind_without_building(base, adapters):
    """`check_request` (preprocess) refuses each kind of bad wire tensors the live test sends, with the message
    `parse_request` (llm) gives; on good tensors it allocates no copy of the weights (numpy's allocations are
    traced: its peak stays far below the weights' size, where building the adapter copies them)."""
    import tracemalloc

    from lora_cases import bad_wire
    from triton_vlm.lora.registry import Registry
    from triton_vlm.lora.request import check_request, parse_request
    from triton_vlm.spec import CheckpointSpec

    spec = CheckpointSpec.load(base).text
    registry = Registry(None, spec)
    weights, config = to_trtllm(load_peft(adapters["plain"], spec), np.float16)
    cases = bad_wire(weights, config, spec.num_layers, max_rank=64)
    assert len(cases) == 10
    for name, lora, message in cases:
        args = (lora.get("task_id"), lora.get("weights"), lora.get("config"), None, spec, registry, 64)
        with pytest.raises(InvalidArgument) as checked:
            check_request(*args)
        with pytest.raises(InvalidArgument) as parsed:
            parse_request(*args)
        assert message in checked.value.message and checked.value.message == parsed.value.message, name
    big, big_config = _big_rows(spec)
    wide = np.pad(big, ((0, 0), (0, 8 * big.shape[1])))  # zero padded rows: 12 MB of FP16 weights
    wide.flags.writeable = False  # Triton's input buffers are read-only
    tracemalloc.start()
    try:
        check_request(5, wide, big_config, None, spec, registry, 256)
        checked_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        np.isfinite(wide).all()  # what the check did before: a bool array as large as the weights
        isfinite_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert checked_peak < wide.nbytes // 32 < isfinite_peak, (checked_peak, isfinite_peak, wide.nbytes)


def test_registry_ids_cannot_be_uploaded_over(base, adapters, tmp_path):
    """Registry and wire adapters are separate namespaces: weights sent under a registry id (a name's computed
    id, an all-digit folder) are refused naming the id and its owner, by preprocess's check and llm's parse; ids
    uploaded before a registry folder took them resolve to the registry's adapter once it exists, by name and
    by id, while wire ids stay shared as in TensorRT-LLM (a later upload replaces the earlier one)."""
    import shutil

    from triton_vlm.lora.cache import AdapterCache
    from triton_vlm.lora.registry import Registry, task_id_for_name
    from triton_vlm.lora.request import check_request, parse_request
    from triton_vlm.spec import CheckpointSpec

    spec = CheckpointSpec.load(base).text
    shutil.copytree(adapters["plain"], tmp_path / "fr")
    shutil.copytree(adapters["plain"], tmp_path / "4242")
    cache = AdapterCache(spec, Registry(tmp_path, spec), max_bytes=2**30)
    w, c = to_trtllm(load_peft(adapters["patterns"], spec), np.float16)

    def resolve(task_id=None, weights=None, config=None, name=None):
        return cache.resolve(parse_request(task_id, weights, config, name, spec, cache.registry, 64))

    for task_id, owner in ((task_id_for_name("fr"), "fr"), (4242, "4242")):
        for check in (check_request, parse_request):
            with pytest.raises(InvalidArgument, match=rf"lora_task_id {task_id} belongs to the registry adapter "
                                                      rf"'{owner}'"):
                check(task_id, w, c, None, spec, cache.registry, 64)
    assert resolve(name="fr").name == "fr" and resolve(task_id_for_name("fr")).name == "fr"
    assert resolve(4242).name == "4242"

    early = resolve(77, w, c)  # wire ids: shared, replaced by a later upload
    assert resolve(77) is early and resolve(77, w, c) is not early
    late_id = task_id_for_name("late")
    uploaded = resolve(late_id, w, c)  # an id no registry adapter has yet
    shutil.copytree(adapters["plain"], tmp_path / "late")
    shutil.copytree(adapters["plain"], tmp_path / "77")
    for got in (resolve(name="late"), resolve(late_id), resolve(77), resolve(name="77")):
        assert got.name in ("late", "77") and got is not uploaded and got is not early
        assert got.max_rank == 4  # the registry's "plain" adapter, not the uploaded "patterns" weights (r 8)
