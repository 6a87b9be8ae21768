"""Train the tiny demo LLaVA on the synthetic shapes task with plain torch (CLIP tower included).

Data: a pool of images drawn at random sizes/aspect ratios and run through the real image processor (so
training sees exactly what inference sees), mixed per step with single-image questions, two-image
questions and text-only prompts. Loss only on the answer tokens and the EOS that follows them.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from triton_vlm.demo import shapes
from triton_vlm.demo.checkpoint import build_random_llava_objects, num_image_tokens


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the demo model. Change anything here -> bump DEMO_VERSION in build.py."""

    seed: int = 0
    # model
    image_size: int = 32
    patch_size: int = 8
    vision_hidden: int = 64
    vision_layers: int = 3  # vision_feature_layer=-2 -> the output of layer 2 feeds the projector
    vision_heads: int = 4
    vision_intermediate: int = 128
    text_hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab_size: int = 384
    max_position_embeddings: int = 512
    # data / optimisation
    pool_images: int = 6000
    steps: int = 1500
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 100
    p_two_images: float = 0.1
    p_text_only: float = 0.05


def vocab_texts() -> list[str]:
    """Texts the tokenizer is trained on: every prompt/answer of the task plus a little general text."""
    texts = []
    for q in shapes.QUESTIONS:
        for s in shapes.SHAPES:
            for c in shapes.COLORS:
                texts.append(shapes.prompt(q) + shapes.answer(q, s, c))
    for q in shapes.TWO_IMAGE_QUESTIONS:
        texts.append(shapes.prompt(q, 2) + " red circle")
    for q, a in shapes.TEXT_ONLY.items():
        texts.append(shapes.prompt(q, 0) + a)
    texts += [
        "The quick brown fox jumps over the lazy dog. 0123456789 ,.;:!?'\"()[]{}<>/-_+=*&^%$#@~`|\\",
        "Hello, how are you? I am a tiny vision language model. I can see images of shapes.",
    ]
    return texts


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    image_idx: list[int]  # indices into the image pool, in placeholder order


class ShapesData:
    """Image pool (processed pixel values) and tokenised prompt templates."""

    def __init__(self, processor: LlavaProcessor, n_tok: int, pool: int, rng: random.Random):
        self.tok = processor.tokenizer
        self.n_tok = n_tok
        self.image_token = processor.image_token
        self.rng = rng
        imgs, self.shapes, self.colors = [], [], []
        for _ in tqdm(range(pool), desc="drawing images", leave=False):
            img, s, c = shapes.random_example(rng)
            imgs.append(img)
            self.shapes.append(s)
            self.colors.append(c)
        pv = []
        for i in range(0, pool, 500):
            pv.append(processor.image_processor(imgs[i:i + 500], return_tensors="pt")["pixel_values"])
        self.pixel_values = torch.cat(pv)  # [pool, 3, S, S]
        self._prompt_cache: dict[tuple[str, int], list[int]] = {}

    def prompt_ids(self, question: str, n_images: int) -> list[int]:
        key = (question, n_images)
        if key not in self._prompt_cache:
            text = shapes.prompt(question, n_images).replace(self.image_token, self.image_token * self.n_tok)
            self._prompt_cache[key] = self.tok(text).input_ids
        return self._prompt_cache[key]

    def answer_ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids + [self.tok.eos_token_id]

    def _example(self, question: str, n_images: int, answer: str, image_idx: list[int]) -> Example:
        p, a = self.prompt_ids(question, n_images), self.answer_ids(answer)
        return Example(p + a, [-100] * len(p) + a, image_idx)

    def sample(self, p_two: float, p_text: float) -> Example:
        r = self.rng.random()
        n = len(self.shapes)
        if r < p_text:
            q = self.rng.choice(list(shapes.TEXT_ONLY))
            return self._example(q, 0, shapes.TEXT_ONLY[q], [])
        if r < p_text + p_two:
            i, j = self.rng.randrange(n), self.rng.randrange(n)
            q = self.rng.choice(list(shapes.TWO_IMAGE_QUESTIONS))
            a = shapes.TWO_IMAGE_QUESTIONS[q]([self.shapes[i], self.shapes[j]], [self.colors[i], self.colors[j]])
            return self._example(q, 2, a, [i, j])
        i = self.rng.randrange(n)
        q = self.rng.choice(list(shapes.QUESTIONS))
        return self._example(q, 1, shapes.answer(q, self.shapes[i], self.colors[i]), [i])

    def batch(self, size: int, p_two: float, p_text: float, pad_id: int) -> dict[str, torch.Tensor]:
        exs = [self.sample(p_two, p_text) for _ in range(size)]
        L = max(len(e.input_ids) for e in exs)
        ids = torch.full((size, L), pad_id, dtype=torch.long)  # [B, L], right padded
        labels = torch.full((size, L), -100, dtype=torch.long)  # [B, L]
        mask = torch.zeros((size, L), dtype=torch.long)  # [B, L]
        idx: list[int] = []
        for b, e in enumerate(exs):
            ids[b, : len(e.input_ids)] = torch.tensor(e.input_ids)
            labels[b, : len(e.labels)] = torch.tensor(e.labels)
            mask[b, : len(e.input_ids)] = 1
            idx += e.image_idx
        out = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        if idx:
            out["pixel_values"] = self.pixel_values[idx]  # [n_images, 3, S, S]
        return out


def train(recipe: Recipe, progress: bool = True) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """Build the random model from `recipe` and train it; returns (model in eval mode, processor)."""
    torch.manual_seed(recipe.seed)
    random.seed(recipe.seed)
    model, processor = build_random_llava_objects(
        text_hidden=recipe.text_hidden, layers=recipe.layers, heads=recipe.heads, kv_heads=recipe.kv_heads,
        intermediate=recipe.intermediate, vocab_texts=vocab_texts(), vocab_size=recipe.vocab_size,
        image_size=recipe.image_size, patch_size=recipe.patch_size, vision_hidden=recipe.vision_hidden,
        vision_layers=recipe.vision_layers, vision_heads=recipe.vision_heads,
        vision_intermediate=recipe.vision_intermediate, max_position_embeddings=recipe.max_position_embeddings,
        seed=recipe.seed,
    )
    data = ShapesData(processor, num_image_tokens(model.config), recipe.pool_images,
                      random.Random(recipe.seed + 1))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < recipe.warmup:
            return (step + 1) / recipe.warmup
        t = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    pad = processor.tokenizer.pad_token_id
    bar = tqdm(range(recipe.steps), desc="training demo model", disable=not progress)
    ema = None
    for step in bar:
        batch = data.batch(recipe.batch_size, recipe.p_two_images, recipe.p_text_only, pad)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{ema:.4f}")
    model.eval()
    return model, processor
