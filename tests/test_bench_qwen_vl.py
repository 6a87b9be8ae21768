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
