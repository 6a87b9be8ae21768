"""The demo model's LoRA adapters through the live server: `french` and `sentence` answer at least 95% of
held-out images right when asked by name, mixed with base-model requests in the same batches."""
from __future__ import annotations

import base64
import io
import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from triton_vlm.demo import shapes
from triton_vlm.demo.adapters import ADAPTERS

pytestmark = pytest.mark.server


def ask(server, prompt: str, image: bytes, lora_name: str | None) -> str:
    body = {"text_input": prompt, "images": [base64.b64encode(image).decode()], "max_tokens": 12,
            "exclude_input_in_output": True}
    if lora_name:
        body["lora_name"] = lora_name
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate", json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["text_output"]


def test_demo_adapters_answer_held_out_images(triton_server):
    rng = random.Random(98765)  # neither the training nor the build's evaluation stream
    jobs = []
    for _ in range(20):
        img, shape, color = shapes.random_example(rng)
        buf = io.BytesIO()
        img.save(buf, "PNG")
        for q in shapes.QUESTIONS:
            for who in ("base", *ADAPTERS):
                expected = shapes.answer(q, shape, color) if who == "base" else ADAPTERS[who](q, shape, color)
                jobs.append((who, shapes.prompt(q), buf.getvalue(), expected.strip()))
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda j: ask(triton_server, j[1], j[2], None if j[0] == "base" else j[0]), jobs))
    for who in ("base", *ADAPTERS):
        mine = [(a.strip(), j[3]) for a, j in zip(answers, jobs) if j[0] == who]
        accuracy = sum(a == e for a, e in mine) / len(mine)
        assert accuracy >= (0.9 if who == "base" else 0.95), (who, accuracy, [m for m in mine if m[0] != m[1]][:5])
