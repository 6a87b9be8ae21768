"""LoRA through the live server with stock `tritonclient`: by registry name, by TensorRT-LLM tensors then id
alone, from a registry task-id folder, mixed with the base model in concurrent requests; each answer token-exact
to `transformers` + `peft` on the same weights, and every refusal an INVALID_ARG that says why."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from lora_cases import bad_wire, preprocess_error
from triton_vlm.lora.format import to_trtllm
from triton_vlm.lora.peft import load_peft
from triton_vlm.spec import CheckpointSpec

pytestmark = pytest.mark.server

PROMPTS = ["USER: Say hello. ASSISTANT:", "USER: What colors do you know? ASSISTANT:"]
LM = r".*language_model.*\.({})"


def make_adapter(base_dir, out_dir, seed, modules, r, alpha):
    """A PEFT adapter with fp16-exact weights and a power-of-two scale, so the fp16 wire tensors carry exactly
    the numbers PEFT computes with."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration.from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False,
                                                  target_modules=LM.format("|".join(modules))))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_((p * (8.0 if "lora_B" in n else 1.0)).half().float())
    peft_model.save_pretrained(out_dir)
    return out_dir


def reference(base_dir, adapter_dir, prompt: str, max_new_tokens: int = 8) -> list[int]:
    from peft import PeftModel
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = LlavaForConditionalGeneration.from_pretrained(base_dir).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens)
    new = out[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    return new[:new.index(eos) + 1] if eos in new else new


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, demo_model):
    from conftest import _start_server, _stop_server

    root = tmp_path_factory.mktemp("lora-dir")
    a = make_adapter(demo_model, root / "tenant-a", 1, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"], r=4, alpha=8)
    b_peft = make_adapter(demo_model, tmp_path_factory.mktemp("b") / "b", 2, ["q_proj", "v_proj"], r=2, alpha=4)
    spec = CheckpointSpec.load(demo_model).text
    (root / "4242").mkdir()  # TensorRT-LLM's prefetch layout: the folder name is the task id
    w, c = to_trtllm(load_peft(b_peft, spec), np.float16)
    np.save(root / "4242" / "model.lora_weights.npy", w)
    np.save(root / "4242" / "model.lora_config.npy", c)
    refs = {(name, p): reference(demo_model, d, p) for name, d in (("base", None), ("a", a), ("b", b_peft))
            for p in PROMPTS}
    assert refs[("a", PROMPTS[0])] != refs[("base", PROMPTS[0])], "the adapter must change the answer"
    # one device slot: requests of different adapters take turns (they wait in the queue, never fail)
    server = _start_server(tmp_path_factory, demo_model, {"*": {"lora_dir": str(root)}, "llm": {"max_loras": "1"}},
                           "lora-server")
    yield server, refs, to_trtllm(load_peft(a, spec), np.float16)
    _stop_server(server)


def http(server, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate",
                                 json.dumps({"max_tokens": 8, "exclude_input_in_output": True, **body}).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
            ids = out["output_ids"]  # the generate extension answers a one-element tensor as a scalar
            out["output_ids"] = ids if isinstance(ids, list) else [ids]
            return r.status, out
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def grpc_ids(server, prompt: str, **lora) -> list[int]:
    """One request on a stream with stock tritonclient; returns the new token ids (raises on an error)."""
    arrays = {"text_input": (np.array([[prompt.encode()]], dtype=object), "BYTES"),
              "max_tokens": (np.array([[8]], np.int32), "INT32"),
              "exclude_input_in_output": (np.array([[True]]), "BOOL")}
    if "task_id" in lora:
        arrays["lora_task_id"] = (np.array([[lora["task_id"]]], np.uint64), "UINT64")
    if lora.get("weights") is not None:
        arrays["lora_weights"] = (lora["weights"][None].astype(np.float16), "FP16")
    if lora.get("config") is not None:
        arrays["lora_config"] = (lora["config"][None].astype(np.int32), "INT32")
    inputs = []
    for name, (arr, dtype) in arrays.items():
        x = grpcclient.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        inputs.append(x)
    client, got, done = grpcclient.InferenceServerClient(server.grpc_url), [], threading.Event()
    client.start_stream(callback=lambda result, error: (got.append((result, error)), done.set()))
    try:
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        assert done.wait(60)
        result, error = got[0]
        if error is not None:
            raise RuntimeError(error.message())
        n = int(result.as_numpy("sequence_length").reshape(-1)[0])
        return result.as_numpy("output_ids").reshape(-1)[:n].tolist()
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def test_by_registry_name_matches_peft(lora_setup):
    server, refs, _ = lora_setup
    for p in PROMPTS:
        status, out = http(server, {"text_input": p, "lora_name": "tenant-a"})
        assert status == 200, out
        assert out["output_ids"] == refs[("a", p)]


def test_weights_first_then_id_alone_and_a_registry_task_id_folder(lora_setup):
    server, refs, (weights, config) = lora_setup
    assert grpc_ids(server, PROMPTS[0], task_id=77, weights=weights, config=config) == refs[("a", PROMPTS[0])]
    assert grpc_ids(server, PROMPTS[1], task_id=77) == refs[("a", PROMPTS[1])]  # cached: the id alone
    assert grpc_ids(server, PROMPTS[0], task_id=4242) == refs[("b", PROMPTS[0])]  # loaded from the registry
    assert grpc_ids(server, PROMPTS[0]) == refs[("base", PROMPTS[0])]


def test_weights_under_a_registry_id_are_refused(lora_setup):
    """A registry task id, an all-digit folder's or a name's computed one, cannot be uploaded over: INVALID_ARG
    naming the id and its owner (the status code as preprocess answers it; through the ensemble's stream, where
    gRPC carries no code, the message), and the registry adapter still answers by id and by name afterwards
    (zero weights were sent, which would answer as the base model)."""
    from triton_vlm.lora.registry import task_id_for_name

    server, refs, (weights, config) = lora_setup
    zeros = np.zeros_like(weights)
    for task_id, owner in ((4242, "4242"), (task_id_for_name("tenant-a"), "tenant-a")):
        why = f"lora_task_id {task_id} belongs to the registry adapter '{owner}'"
        status, message = preprocess_error(server.grpc_url, PROMPTS[0], task_id=task_id, weights=zeros, config=config)
        assert status == "StatusCode.INVALID_ARGUMENT" and why in message, (status, message)
        with pytest.raises(RuntimeError) as e:
            grpc_ids(server, PROMPTS[0], task_id=task_id, weights=zeros, config=config)
        assert why in str(e.value), str(e.value)
    assert preprocess_error(server.grpc_url, PROMPTS[0], task_id=80, weights=zeros, config=config) == (None, None)
    assert grpc_ids(server, PROMPTS[0], task_id=4242) == refs[("b", PROMPTS[0])]
    assert grpc_ids(server, PROMPTS[0], task_id=task_id_for_name("tenant-a")) == refs[("a", PROMPTS[0])]
    assert http(server, {"text_input": PROMPTS[0], "lora_name": "tenant-a"})[1]["output_ids"] == refs[("a", PROMPTS[0])]


def scrape(server) -> str:
    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_adapters_and_base_mixed_in_concurrent_requests(lora_setup):
    """Two adapters and the base model at once through one device slot: every answer equals PEFT's, and the
    Gateway API LoRA gauge stays one series while its labels change."""
    import re

    server, refs, _ = lora_setup
    jobs = [(["base", "a", "b"][i % 3], PROMPTS[i % 2]) for i in range(12)]
    results: dict[int, tuple[int, dict]] = {}
    series, done = [], threading.Event()

    def watch():
        while not done.is_set():
            series.append(re.findall(r"^triton_vlm_lora_requests_info\{([^}]*)\}", scrape(server), re.M))
            time.sleep(0.05)

    def run(i, who, prompt):
        body = {"text_input": prompt, **({"lora_name": "tenant-a"} if who == "a" else
                                         {"lora_task_id": 4242} if who == "b" else {})}
        results[i] = http(server, body)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    deadline = time.monotonic() + 10  # the gauge is refreshed every 0.5 s: wait for the idle state
    while time.monotonic() < deadline and not (series and series[-1] and 'running_lora_adapters=""' in series[-1][0]):
        time.sleep(0.1)
    done.set()
    watcher.join(30)
    for i, (who, prompt) in enumerate(jobs):
        status, out = results[i]
        assert status == 200 and out["output_ids"] == refs[(who, prompt)], (who, prompt, out)
    assert all(len(s) <= 1 for s in series), series
    assert 'max_lora="1"' in series[-1][0] and 'running_lora_adapters=""' in series[-1][0]


@pytest.mark.parametrize("body,message", [
    ({"lora_task_id": 999}, "LoRA task 999 not found in cache. Please send LoRA weights with request"),
    ({"lora_name": "nobody"}, "lora_name 'nobody' is not in the registry"),
    ({"lora_name": "../etc"}, "is not a valid adapter name"),
    ({"lora_name": "tenant-a", "lora_task_id": 5}, "but lora_task_id 5 was sent"),
])
def test_lora_errors_are_invalid_arg(lora_setup, body, message):
    server, _, _ = lora_setup
    status, out = http(server, {"text_input": PROMPTS[0], **body})
    assert status == 400 and message in out["error"], out


def test_wire_tensor_errors_are_refused_by_preprocess(lora_setup, demo_model):
    """Each bad input is INVALID_ARG naming the row and what is allowed, refused by preprocess (before vision and
    llm run: their request counts do not move), and the server goes on answering."""
    import re

    server, refs, (weights, config) = lora_setup

    def counts():  # requests vision and llm received, whatever their outcome
        found = re.findall(r'^nv_inference_request_(?:success|failure)\{model="(\w+)"[^}]*\} ([0-9.e+]+)$',
                           scrape(server), re.M)
        return sum(float(v) for m, v in found if m in ("vision", "llm")), {m for m, _ in found}

    cases = bad_wire(weights, config, CheckpointSpec.load(demo_model).text.num_layers)
    before, models = counts()
    assert {"vision", "llm"} <= models
    for name, lora, message in cases:
        with pytest.raises(RuntimeError) as e:
            grpc_ids(server, PROMPTS[0], **lora)
        assert message in str(e.value), (name, str(e.value))
    assert counts()[0] == before  # neither vision nor llm saw any of them
    assert grpc_ids(server, PROMPTS[0], task_id=79, weights=weights, config=config) == refs[("a", PROMPTS[0])]


def _lora_state(server) -> tuple[dict, dict, float]:
    """(LoRA cache metrics by (name, level), the Gateway gauge's labels, its value) from one scrape."""
    import re

    text = scrape(server)
    values = {(m.group(1), m.group(2)): float(m.group(3)) for m in
              re.finditer(r'^(triton_vlm_lora_cache_\w+)\{[^}]*level="(\w+)"[^}]*\} ([0-9.e+]+)$', text, re.M)}
    info = re.findall(r"^triton_vlm_lora_requests_info\{([^}]*)\} ([0-9.e+]+)$", text, re.M)
    assert len(info) <= 1, info  # one series, whatever its labels
    return values, dict(re.findall(r'(\w+)="([^"]*)"', info[0][0])) if info else {}, \
        float(info[0][1]) if info else 0.0


def test_adapter_cache_metrics(lora_setup):
    server, refs, _ = lora_setup
    for body in ({"lora_name": "tenant-a"}, {"lora_task_id": 4242}, {"lora_name": "tenant-a"}):
        assert http(server, {"text_input": PROMPTS[0], **body})[0] == 200  # loads (first time), then hits
    assert http(server, {"text_input": PROMPTS[0], "lora_task_id": 999})[0] == 400  # a miss
    def unmet(values: dict, labels: dict, stamp: float) -> list[str]:
        def v(name, level):
            return values.get((f"triton_vlm_lora_cache_{name}", level), 0.0)

        checks = {
            "registry loads >= 2 (tenant-a, task 4242 from disk)": v("registry_loads_total", "host") >= 2,
            "host hits >= 1": v("hits_total", "host") >= 1,
            "host misses >= 3 (the two loads and the unknown id 999)": v("misses_total", "host") >= 3,
            "host adapters >= 2": v("adapters", "host") >= 2,
            "host bytes > 0": v("bytes", "host") > 0,
            "device misses >= 2 (copied into a device slot)": v("misses_total", "device") >= 2,
            "device adapters >= 1 (idle adapters stay resident)": v("adapters", "device") >= 1,
            "device evictions >= 2 (one slot: a, 4242, a)": v("evictions_total", "device") >= 2,
            # the Gateway API Inference Extension's LoRA gauge: one series, value the time of the last update
            "gauge labels idle, max_lora 1": (labels.get("running_lora_adapters"), labels.get("waiting_lora_adapters"),
                                              labels.get("max_lora")) == ("", "", "1"),
            "gauge value a recent time": abs(stamp - time.time()) < 30,
        }
        return [what for what, ok in checks.items() if not ok]

    deadline = time.monotonic() + 15  # gauges and counters are refreshed every 0.5 s: wait for the state
    while (missing := unmet(*_lora_state(server))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not missing, (missing, _lora_state(server))
