"""`bench.vision.qwen_vl` (Qwen2-VL vs llava-1.5 images on one text model) without running the servers: the two
checkpoints it builds (small shapes here) take the image tokens the table states, as transformers' own processors
count them; the images are distinct per request; the vision share read off Triton's counters served over HTTP;
the medians over rounds and the table with the machine line."""
from __future__ import annotations

import http.server
import io
import threading

import pytest
from PIL import Image

from bench.common import machine
from bench.vision import qwen_vl

SMALL_TEXT = dict(text_hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_position_embeddings=1024)
SMALL_TOWER = dict(vision_hidden=32, vision_layers=1, vision_heads=2)


def test_checkpoints_take_the_tokens_the_table_states(tmp_path):
    from transformers import AutoImageProcessor, AutoProcessor

    from triton_vlm.preprocess.checkpoint import ModelInfo

    models = qwen_vl.ensure_models(tmp_path, SMALL_TEXT, SMALL_TOWER)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llava", "qwen2-vl"]  # no half-built folder left
    llava, qwen = ModelInfo.load(models["llava-1.5 (siglip)"]), ModelInfo.load(models["qwen2-vl"])
    hw = [(h, w) for w, h in qwen_vl.SIZES]
    assert [llava.image_tokens(s) for s in hw] == [256, 256, 256]
    assert [qwen.image_tokens(s) for s in hw] == [64, 128, 256] and qwen.num_image_tokens == 256
    images = [Image.open(io.BytesIO(qwen_vl.image(i))) for i in range(3)]
    grids = AutoImageProcessor.from_pretrained(str(models["qwen2-vl"]))(images, return_tensors="pt")["image_grid_thw"]
    assert [int(g.prod()) // 4 for g in grids] == [64, 128, 256]  # transformers' processor agrees
    proc = AutoProcessor.from_pretrained(str(models["llava-1.5 (siglip)"]))
    ids = proc(text=qwen_vl.PROMPT, images=images[2:], return_tensors="pt")["input_ids"]
    assert int((ids == proc.tokenizer.convert_tokens_to_ids("<image>")).sum()) == 256
    stamp = (models["qwen2-vl"] / "config.json").stat().st_mtime_ns
    assert qwen_vl.ensure_models(tmp_path, SMALL_TEXT, SMALL_TOWER) == models  # built once
    assert (models["qwen2-vl"] / "config.json").stat().st_mtime_ns == stamp


def test_images_cycle_the_sizes_with_distinct_pixels():
    got = [qwen_vl.image(i) for i in range(6)]
    assert [Image.open(io.BytesIO(b)).size for b in got] == list(qwen_vl.SIZES) * 2
    assert len(set(got)) == 6 and qwen_vl.image(4) == got[4]  # distinct per request, the same on a rerun


def _metrics(n: int, request_us: int, encoded: int, hits: int) -> str:
    return (f'nv_inference_request_success{{model="vision",version="1"}} {n}\n'
            f'nv_inference_exec_count{{model="vision",version="1"}} {n}\n'
            f'nv_inference_request_duration_us{{model="vision",version="1"}} {request_us}\n'
            f'nv_inference_compute_infer_duration_us{{model="vision",version="1"}} {request_us - 1000 * n}\n'
            f'nv_inference_request_success{{model="llm",version="1"}} {n}\n'
            '# HELP triton_vlm_vision_images_encoded_total images run through the vision encoder\n'
            f'triton_vlm_vision_images_encoded_total{{model="vision"}} {encoded}\n'
            f'triton_vlm_embedding_cache_hits_total{{model="vision"}} {hits}\n')


@pytest.fixture
def metrics_server():
    """A Prometheus endpoint whose text the test sets (`server.text`)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = self.server.text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def test_vision_share_from_scraped_counters(metrics_server):
    url = f"http://127.0.0.1:{metrics_server.server_address[1]}/metrics"
    metrics_server.text = _metrics(4, 40_000, 4, 1)
    before = qwen_vl.scrape(url)
    metrics_server.text = _metrics(13, 130_000 + 9 * 50_000, 13, 1)  # 9 requests of 50 ms more
    samples = [qwen_vl.Sample(0.2 + 0.1 * (i % 3), 1.0, 32, i % 3, 10.0 * (i % 3 + 1)) for i in range(9)]
    got = qwen_vl.summarise(samples, 10.0, before, qwen_vl.scrape(url))
    assert got["requests"] == 9 and got["tokens_per_s"] == pytest.approx(28.8)
    assert got["ttft_mean_by_size_s"] == pytest.approx([0.2, 0.3, 0.4]) and got["ttft_p50_s"] == pytest.approx(0.3)
    assert got["vision_ms_by_size"] == pytest.approx([10.0, 20.0, 30.0])
    assert got["vision_request_ms"] == pytest.approx(60.0)  # (490 - 40) ms / 9 requests
    assert got["vision_compute_infer_ms"] == pytest.approx(59.0)
    assert got["vision_share_of_ttft"] == pytest.approx(0.2)  # 60 ms of a 300 ms mean TTFT
    assert (got["vision_images_encoded"], got["embedding_cache_hits"]) == (9, 0)


def test_medians_over_rounds_and_the_table(tmp_path):
    class Info:
        def image_tokens(self, size):
            return size[0] * size[1] // 784

    def c1(ttft, vision_ms):
        return {"ttft_p50_s": ttft, "ttft_p90_s": 2 * ttft, "ttft_mean_by_size_s": [ttft, ttft, 3 * ttft],
                "vision_ms_by_size": [vision_ms / 5, vision_ms, 2 * vision_ms],
                "vision_request_ms": vision_ms, "vision_share_of_ttft": vision_ms / 1000 / ttft,
                "vision_images_encoded": 9, "embedding_cache_hits": 0}

    rounds = [(c1(0.1, 20.0), {"tokens_per_s": 50.0, "vision_images_encoded": 16}),
              (c1(0.3, 30.0), {"tokens_per_s": 70.0, "vision_images_encoded": 16}),
              (c1(0.2, 90.0), {"tokens_per_s": 60.0, "vision_images_encoded": 16})]
    r = qwen_vl.result("qwen2-vl", Info(), rounds)
    assert r["image_tokens"] == [64, 128, 256] and r["images_encoded"] == 75 and r["cache_hits"] == 0
    assert (r["ttft_p50_s"], r["vision_request_ms"], r["tokens_per_s"]) == (0.2, 30.0, 60.0)
    meta = {"command": "python -m bench.vision.qwen_vl --quick", "date": "d", "machine": machine.describe(),
            "kernel_races": {}}
    md = qwen_vl.markdown([r], meta)
    assert ("| qwen2-vl | 64 / 128 / 256 | 200 / 400 ms | 200 / 200 / 600 ms | 6 (3%) / 30 (15%) / 60 (10%) | 20% | "
            "60.0 |") in md
    assert "qwen2-vl 75 encoded, 0 cache hits" in md and f"- cpu: {machine.cpu_model()} (" in md


def test_qwen3_bench_shapes_match_active_parameters_and_the_table_states_the_ratios():
    """`bench.server.qwen3_vl`: the MoE's active MLP parameters per token equal the dense MLP's (the comparison the
    table makes), every MoE layer is sparse; the medians over rounds and the table's ratios."""
    from bench.server import qwen3_vl

    dense, moe = qwen3_vl.SHAPES.values()
    hidden = qwen3_vl.TEXT["text_hidden"]
    assert moe["top_k"] * 3 * hidden * moe["moe_intermediate"] == 3 * hidden * dense["intermediate"]
    assert moe["dense_layers"] == () and "experts" not in dense
    rows = [{"tokens_per_s": x, "latency_p50_s": x / 10, "requests": 8, "tokens": 256, "latency_max_s": 1.0}
            for x in (10.0, 30.0, 20.0)]
    med = qwen3_vl._median(rows)
    assert (med["tokens_per_s"], med["latency_p50_s"]) == (20.0, 2.0)

    def result(name, hf, s1, s16):
        return {"model": name, "rows": {"transformers, c=1": dict(med, tokens_per_s=hf),
                                        "server, c=1": dict(med, tokens_per_s=s1),
                                        "server, c=16": dict(med, tokens_per_s=s16)}}

    meta = {"command": "python -m bench.server.qwen3_vl", "date": "d", "machine": machine.describe(),
            "kernel_races": {}, "max_tokens": 32}
    md = qwen3_vl.markdown([result("dense", 10.0, 40.0, 120.0), result("moe", 4.0, 30.0, 90.0)], meta)
    assert "| dense | 10.0, 2.00 s | 40.0, 2.00 s | 4.00x | 120.0, 2.00 s |" in md
    assert "| moe | 4.0, 2.00 s | 30.0, 2.00 s | 7.50x |" in md and "server c=16: 0.75x tok/s" in md
