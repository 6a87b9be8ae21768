"""The multimodal front half sized from the machine (`server/front_half.py`) and a request's images decoded and
processed on threads (`preprocess/media_pool.py`): the rule on several machine shapes, the cgroup quota, the
overrides, the filled configs, the same bytes as the sequential path, and the counts a running server picked."""
import io

import numpy as np
import pytest
from PIL import Image

from triton_vlm.errors import InvalidArgument
from triton_vlm.server import front_half
from triton_vlm.server.front_half import FrontHalf, plan


@pytest.mark.parametrize("cpus, llm_threads, want", [
    (1, 0, FrontHalf(1, 1, 1, 1)),  # one CPU: nothing added
    (2, 1, FrontHalf(1, 1, 1, 1)),  # this machine, llm on the CPU: as shipped
    (2, 0, FrontHalf(1, 1, 1, 1)),
    (4, 1, FrontHalf(1, 1, 3, 3)),
    (8, 2, FrontHalf(1, 1, 4, 6)),  # llm on 2 CPUs: 6 left, one instance, 4 threads (the cap)
    (16, 0, FrontHalf(3, 1, 4, 15)),  # a GPU box: 15 CPUs for the front half
    (64, 0, FrontHalf(8, 1, 4, 63)),  # capped at 8 instances
    (192, 0, FrontHalf(8, 1, 4, 191)),
])
def test_rule_on_machine_shapes(cpus, llm_threads, want):
    assert plan(cpus, llm_threads) == want


def test_cgroup_quota_caps_the_cpus(tmp_path, monkeypatch):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert front_half.cgroup_cpu_limit(v2) == 2  # 1.5 CPUs rounds up
    (v2 / "cpu.max").write_text("max 100000\n")
    assert front_half.cgroup_cpu_limit(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert front_half.cgroup_cpu_limit(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    assert front_half.cgroup_cpu_limit(v1) == 4
    assert front_half.cgroup_cpu_limit(tmp_path / "absent") is None
    monkeypatch.setattr(front_half.os, "sched_getaffinity", lambda pid: set(range(32)))
    assert front_half.usable_cpus(v1) == 4  # 32 CPUs in the mask, a quota of 4
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert front_half.usable_cpus(v1) == 32


def test_settings_override_the_rule_and_bad_ones_are_refused():
    fh = front_half.resolve({"preprocess": {"instance_count": "3", "decode_threads": "0"},
                             "vision": {"instance_count": "2"}}, llm_cpu_threads=0, cpus=16)
    assert (fh.preprocess, fh.vision, fh.decode_threads) == (3, 2, 4)  # threads: the rule for 3 instances
    assert front_half.resolve({"*": {"instance_count": "auto"}}, 0, cpus=16) == plan(16, 0)
    assert front_half.resolve({"preprocess": {"decode_threads": "2"}}, 1, cpus=2).decode_threads == 2
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match=rf"preprocess.instance_count must be .* got '{bad}'"):
            front_half.resolve({"preprocess": {"instance_count": bad}}, 0, cpus=4)
    with pytest.raises(ValueError, match="preprocess.decode_threads"):
        front_half.resolve({"preprocess": {"decode_threads": "x"}}, 0, cpus=4)


def test_filled_repository_has_the_counts(tmp_path):
    from triton_vlm.server.process import python_instances
    from triton_vlm.server.repository import check_parameters, prepare_model_repository

    check_parameters({"preprocess": {"instance_count": "2", "decode_threads": "3"}, "vision": {"instance_count": "1"}})
    repo = prepare_model_repository(tmp_path / "repo", {}, front=FrontHalf(3, 2, 4, 15),
                                    models=("preprocess", "vision"))
    assert python_instances(repo) == {"preprocess": 3, "vision": 2}
    text = (repo / "preprocess" / "config.pbtxt").read_text()
    assert 'key: "decode_threads" value: { string_value: "4" }' in text
    assert 'key: "instance_count" value: { string_value: "3" }' in text
    with pytest.raises(ValueError, match="no instance_group"):
        front_half.set_instance_count('name: "x"\n', 2)


# --- a request's images on threads: the same bytes as one after another --------------------------------------

def _jpeg(size, seed) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


IMAGES = [_jpeg(s, i) for i, s in enumerate([(320, 180), (97, 61), (200, 300), (64, 64)])]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import torch

    from triton_vlm.demo import ensure_demo_model
    from triton_vlm.demo.qwen_checkpoint import build_qwen_vl

    torch.set_num_threads(1)
    return {"llava": ensure_demo_model(),
            "qwen2_5_vl": build_qwen_vl(tmp_path_factory.mktemp("fh") / "q", "qwen2_5_vl", seed=3)}


def _pair(model_dir, **kw):
    from triton_vlm.preprocess.service import Preprocessor

    return (Preprocessor(model_dir, image_cache_size=0, **kw),
            Preprocessor(model_dir, image_cache_size=0, decode_threads=4, **kw))


@pytest.mark.parametrize("family, prompt", [
    ("llava", "USER: <image><image>\nand <image> <image> ASSISTANT:"),
    ("qwen2_5_vl", "<|im_start|>user\n<image><image> then <image><image><|im_end|>\n<|im_start|>assistant\n"),
])
def test_parallel_decode_gives_the_sequential_bytes(checkpoints, family, prompt):
    seq, par = _pair(checkpoints[family])
    a, b = seq(prompt, IMAGES, 4), par(prompt, IMAGES, 4)
    assert par.pool.threads == 4 and len(a.image_sizes) == 4
    assert a.input_ids == b.input_ids
    for field in ("pixel_values", "image_sizes", "media_grids", "media_seconds"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), field
    par.pool.close()


def test_parallel_path_checks_the_budget_first_and_names_the_first_bad_image(checkpoints, monkeypatch):
    from triton_vlm.preprocess import service

    seq, par = _pair(checkpoints["qwen2_5_vl"], max_media_tokens=40)
    decoded = []
    monkeypatch.setattr(service, "decode_image", lambda *a, **k: decoded.append(1))
    prompt = "<image><image><image><image>"
    with pytest.raises(InvalidArgument, match="max_media_tokens"):
        par(prompt, IMAGES, 4)
    assert not decoded, "images decoded before the budget refused the request"
    monkeypatch.undo()
    seq, par = _pair(checkpoints["qwen2_5_vl"])
    broken = [IMAGES[0], b"\xff\xd8\xff" + b"x" * 50, IMAGES[1], b"not an image"]
    errors = []
    for pre in (seq, par):
        with pytest.raises(InvalidArgument) as e:
            pre(prompt, broken, 4)
        errors.append(e.value.message)
    assert errors[0] == errors[1] and errors[0].startswith("images[1]"), errors
    par.pool.close()


def test_a_running_server_picked_the_rules_counts(triton_server):
    import tritonclient.http as httpclient

    from triton_vlm.server.install import server_env

    threads = int(server_env(None)["OMP_NUM_THREADS"])  # the session server's llm runs on the CPU
    want = plan(front_half.usable_cpus(), threads)  # its parameters override nothing
    assert triton_server.front_half == want
    with httpclient.InferenceServerClient(triton_server.http_url) as client:
        for model, count in (("preprocess", want.preprocess), ("vision", want.vision)):
            cfg = client.get_model_config(model)
            assert sum(int(g.get("count", 1)) for g in cfg["instance_group"]) == count, cfg["instance_group"]
            assert cfg["parameters"]["instance_count"]["string_value"] == str(count)
        cfg = client.get_model_config("preprocess")
        assert cfg["parameters"]["decode_threads"]["string_value"] == str(want.decode_threads)
