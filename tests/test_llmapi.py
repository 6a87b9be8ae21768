"""The `tensorrt_llm` model's logic without a server: TensorRT-LLM's `llmapi` tensors -> the ensemble's inputs,
finish reasons in TensorRT-LLM's words, `lora_path` confined to the lora_root folders and bound to its
`lora_id`, and the engine's per-request KV counts and timestamps."""
from __future__ import annotations

import json
import os

import pytest

from triton_vlm import names as N
from triton_vlm.errors import InvalidArgument
from triton_vlm.llmapi import outputs as O
from triton_vlm.llmapi.request import DEFAULT_MAX_TOKENS, parse, with_markers
from triton_vlm.lora.paths import parse_roots, resolve_lora_path


def _parse(values=None, prompts=("hi",), urls=(), stop=()):
    return parse(values or {}, list(prompts), list(urls), list(stop))


def test_defaults_are_tensorrt_llms():
    r = _parse()
    assert r.generation == {N.MAX_TOKENS: DEFAULT_MAX_TOKENS, N.EXCLUDE_INPUT_IN_OUTPUT: False, N.STREAM: False}
    assert DEFAULT_MAX_TOKENS == 32 and not r.streaming and r.best_of_samples == 1 and r.lora is None
    assert not (r.return_finish_reason or r.return_stop_reason or r.return_cumulative_logprob
                or r.return_perf_metrics)


def test_sampling_params_map_to_the_ensembles():
    r = _parse({N.SP_TEMPERATURE: 0.7, N.SP_TOP_K: 5, N.SP_TOP_P: 0.9, N.SP_SEED: 3, N.SP_MAX_TOKENS: 7,
                N.SP_FREQUENCY_PENALTY: 0.5, N.SP_PRESENCE_PENALTY: -0.5, N.SP_EXCLUDE_INPUT: True,
                N.STREAMING: True})
    assert r.generation == {N.MAX_TOKENS: 7, N.EXCLUDE_INPUT_IN_OUTPUT: True, N.STREAM: True, N.TEMPERATURE: 0.7,
                            N.TOP_K: 5, N.TOP_P: 0.9, N.FREQUENCY_PENALTY: 0.5, N.PRESENCE_PENALTY: -0.5,
                            N.SEED: 3}


def test_best_of_is_beams_when_greedy_and_samples_when_sampling():
    greedy = _parse({N.SP_BEST_OF: 3})
    assert greedy.generation[N.BEAM_WIDTH] == 3 and greedy.generation[N.NUM_RETURN_SEQUENCES] == 1
    assert greedy.best_of_samples == 1
    assert _parse({N.SP_BEST_OF: 3, N.SP_TOP_K: 1}).generation[N.BEAM_WIDTH] == 3  # top_k 1 is greedy
    sampled = _parse({N.SP_BEST_OF: 3, N.SP_TEMPERATURE: 0.8, N.SP_SEED: 1})
    assert N.BEAM_WIDTH not in sampled.generation and sampled.generation[N.NUM_RETURN_SEQUENCES] == 3
    assert sampled.best_of_samples == 3
    with pytest.raises(InvalidArgument, match="cannot stream"):
        _parse({N.SP_BEST_OF: 3, N.SP_TEMPERATURE: 0.8, N.STREAMING: True})
    with pytest.raises(InvalidArgument, match=r"sampling_param_best_of must be in \[1, 16\], got 0"):
        _parse({N.SP_BEST_OF: 0})


@pytest.mark.parametrize("url,what", [("file:///etc/passwd", "file://"), ("/etc/passwd", "local paths"),
                                      ("ftp://x/y.png", "other schemes")])
def test_image_urls_other_than_data_and_http_are_refused(url, what):
    with pytest.raises(InvalidArgument, match=f"image_url\\[1\\].*{what}"):
        _parse(urls=["data:image/png;base64,AA==", url])


def test_bad_inputs_are_refused_naming_them():
    with pytest.raises(InvalidArgument, match="text_input must hold exactly one prompt, got 2"):
        _parse(prompts=["a", "b"])
    with pytest.raises(InvalidArgument, match="sampling_param_stop holds an empty string"):
        _parse(stop=["x", ""])
    with pytest.raises(InvalidArgument, match="lora_path '/a' needs a lora_id"):
        _parse({N.LORA_PATH: "/a"})
    with pytest.raises(InvalidArgument, match="lora_id 4 needs lora_path"):
        _parse({N.LORA_ID: 4})
    with pytest.raises(InvalidArgument, match="lora_ckpt_source must be one of hf, got 'nemo'"):
        _parse({N.LORA_CKPT_SOURCE: "nemo"})


def test_markers_go_before_the_text_only_when_the_prompt_has_none():
    assert with_markers("Describe.", 2, ("<image>",)) == "<image>\n<image>\nDescribe."
    assert with_markers("A <image> B", 1, ("<image>",)) == "A <image> B"
    assert with_markers("text", 0, ("<image>",)) == "text"


def test_finish_reasons_in_tensorrt_llms_words():
    eos = frozenset({2})
    assert O.finish_reason([5, 6, 2], eos, [], [], 8) == ("stop", None)
    assert O.finish_reason([5, 6, 2], eos, [], [], 3) == ("stop", None)  # an end id at max_tokens is a stop
    assert O.finish_reason([5, 7, 9], eos, [[3], [7, 9]], ["x", "yz"], 8) == ("stop", "yz")
    assert O.finish_reason([5, 7, 9], eos, [[3]], ["x"], 3) == ("length", None)
    assert O.best([-3.0, -1.0, -2.0]) == 1


def test_error_texts_name_the_llmapi_inputs():
    assert O.their_names("max_tokens must be >= 1, got 0") == "sampling_param_max_tokens must be >= 1, got 0"
    assert O.their_names("presence_penalty must be a finite number") == \
        "sampling_param_presence_penalty must be a finite number"
    assert O.their_names("sampling_param_max_tokens") == "sampling_param_max_tokens"  # never twice


def _peft_folder(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 2}))
    return path


def test_lora_path_is_confined_to_the_roots(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    good = _peft_folder(root / "a")
    _peft_folder(outside / "b")
    os.symlink(outside / "b", root / "link")
    (root / "empty").mkdir()
    roots = parse_roots(f"{root},{tmp_path / 'missing'}")
    assert roots == (root.resolve(),)
    assert resolve_lora_path(str(good), roots) == good.resolve()
    assert resolve_lora_path("a", roots) == good.resolve()  # relative to a root
    for path, why in ((str(outside / "b"), "outside the server's adapter folders"),
                      (str(root / "link"), "outside the server's adapter folders"),  # a symlink out
                      (str(root / "a" / ".." / ".." / "outside" / "b"), "outside"),
                      (str(root / "nope"), "does not exist"),
                      (str(root / "empty"), "holds no adapter_config.json"),
                      (f"file://{good}", "not a URL")):
        with pytest.raises(InvalidArgument, match=f"lora_path .*{why}"):
            resolve_lora_path(path, roots)
    with pytest.raises(InvalidArgument, match="reads no adapter folders"):
        resolve_lora_path(str(good), ())


def test_the_model_can_be_served_under_another_name(tmp_path):
    from triton_vlm.server.repository import prepare_model_repository

    repo = prepare_model_repository(tmp_path / "repo", {}, renames={"tensorrt_llm": "vlm_llmapi"})
    assert not (repo / "tensorrt_llm").exists()
    assert (repo / "vlm_llmapi" / "config.pbtxt").read_text().count('name: "vlm_llmapi"') == 1
    with pytest.raises(ValueError, match="only tensorrt_llm"):
        prepare_model_repository(tmp_path / "repo2", {}, renames={"llm": "x"})


def test_lora_ids_stay_bound_to_their_folder_and_reload_after_eviction(demo_model, demo_adapters, tmp_path):
    import shutil

    from triton_vlm.lora.cache import AdapterCache
    from triton_vlm.lora.registry import Registry
    from triton_vlm.lora.request import LoraRequest
    from triton_vlm.spec import CheckpointSpec

    spec = CheckpointSpec.load(demo_model).text
    root = tmp_path / "root"
    for name in ("french", "sentence"):
        shutil.copytree(demo_adapters / name, root / name)
    registry = Registry(demo_adapters, spec)
    cache = AdapterCache(spec, registry, max_bytes=1 << 30, path_roots=parse_roots(str(root)))
    fr = cache.resolve_path(5, str(root / "french"))
    assert cache.resolve_path(5, "french") is fr and cache.resolve(LoraRequest(5)) is fr  # the id alone too
    with pytest.raises(InvalidArgument, match="lora_id 5 is bound to another adapter folder"):
        cache.resolve_path(5, str(root / "sentence"))
    with pytest.raises(InvalidArgument, match="lora_task_id 5 is bound to an adapter folder"):
        cache.resolve(LoraRequest(5, wire=fr))  # no upload replaces it either
    with pytest.raises(InvalidArgument, match="belongs to the registry adapter 'french'"):
        cache.resolve_path(registry.task_id("french"), str(root / "sentence"))
    se = cache.resolve_path(6, "sentence")
    small = AdapterCache(spec, registry, max_bytes=max(fr.nbytes, se.nbytes), path_roots=cache.path_roots)
    a = small.resolve_path(7, "french")
    small.resolve_path(8, "sentence")  # evicts 7
    assert small.stats.evictions == 1
    b = small.resolve(LoraRequest(7))  # read again from its folder
    assert b is not a and all(torch_equal(b.modules[k], a.modules[k]) for k in a.modules)


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x.a, y.a) and torch.equal(x.b, y.b) and x.scale == y.scale
