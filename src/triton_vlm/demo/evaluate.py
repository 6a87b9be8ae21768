"""Held-out accuracy of a demo model with greedy `LlavaForConditionalGeneration.generate()`."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from PIL import Image
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from triton_vlm.demo import shapes


@torch.no_grad()
def ask(model: LlavaForConditionalGeneration, processor: LlavaProcessor, question: str,
        images: list[Image.Image], max_new_tokens: int = 8) -> list[str]:
    """Greedy answers (special tokens stripped, leading space kept) to one single-image question per image."""
    text = [shapes.prompt(question)] * len(images)
    enc = processor(text=text, images=images, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


@torch.no_grad()
def ask_text(model: LlavaForConditionalGeneration, processor: LlavaProcessor, question: str,
             max_new_tokens: int = 8) -> str:
    """Greedy answer to a text-only prompt."""
    enc = processor.tokenizer(shapes.prompt(question, 0), return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


@dataclass
class Accuracy:
    n: int
    color: float  # "What color is the shape?"
    shape: float  # "What shape is this?"
    describe: float  # "Describe the image." (colour and shape both right)
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"n": self.n, "color": self.color, "shape": self.shape, "describe": self.describe}


def held_out_images(n: int, seed: int, sizes: list[tuple[int, int]] | None = None
                    ) -> list[tuple[Image.Image, str, str]]:
    """`n` fresh (image, shape, color), cycling over shapes x colours; random or cycled `sizes`."""
    rng = random.Random(seed)
    combos = [(s, c) for s in shapes.SHAPES for c in shapes.COLORS]
    out = []
    for i in range(n):
        s, c = combos[i % len(combos)]
        size = sizes[i % len(sizes)] if sizes else shapes.random_size(rng)
        out.append((shapes.draw(s, c, size, rng), s, c))
    return out


def evaluate(model: LlavaForConditionalGeneration, processor: LlavaProcessor, n: int = 96,
             seed: int = 12345, sizes: list[tuple[int, int]] | None = None, batch: int = 48) -> Accuracy:
    """Exact-match accuracy (after strip) of greedy answers on `n` held-out images drawn with `seed`."""
    data = held_out_images(n, seed, sizes)
    scores: dict[str, int] = {}
    failures: list[str] = []
    for q in shapes.QUESTIONS:
        got: list[str] = []
        for i in range(0, n, batch):
            got += ask(model, processor, q, [d[0] for d in data[i:i + batch]])
        ok = 0
        for (img, s, c), g in zip(data, got):
            want = shapes.answer(q, s, c).strip()
            if g.strip() == want:
                ok += 1
            else:
                failures.append(f"{q!r} {s}/{c} {img.size}: got {g!r}")
        scores[q] = ok
    return Accuracy(
        n=n,
        color=scores[shapes.QUESTION_COLOR] / n,
        shape=scores[shapes.QUESTION_SHAPE] / n,
        describe=scores[shapes.QUESTION_DESCRIBE] / n,
        failures=failures,
    )


@torch.no_grad()
def evaluate_two_images(model: LlavaForConditionalGeneration, processor: LlavaProcessor, n: int = 40,
                        seed: int = 54321) -> float:
    """Accuracy on two-image prompts (`TWO_IMAGE_QUESTIONS`), `n` fresh image pairs per question."""
    rng = random.Random(seed)
    ok = total = 0
    for q, f in shapes.TWO_IMAGE_QUESTIONS.items():
        pairs = [(shapes.random_example(rng), shapes.random_example(rng)) for _ in range(n)]
        text = [shapes.prompt(q, 2)] * n
        images = [img for pair in pairs for img in (pair[0][0], pair[1][0])]
        enc = processor(text=text, images=images, return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
        got = processor.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for ((_, s1, c1), (_, s2, c2)), g in zip(pairs, got):
            ok += g.strip() == f([s1, s2], [c1, c2]).strip()
            total += 1
    return ok / total


def evaluate_text_only(model: LlavaForConditionalGeneration, processor: LlavaProcessor) -> float:
    """Fraction of the `TEXT_ONLY` prompts answered exactly."""
    ok = sum(ask_text(model, processor, q).strip() == a.strip() for q, a in shapes.TEXT_ONLY.items())
    return ok / len(shapes.TEXT_ONLY)
