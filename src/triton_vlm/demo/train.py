"""Train the tiny demo LLaVA on the synthetic shapes task with plain torch (CLIP tower included).

Stage 1 trains the CLIP tower alone with a throw-away linear head (shape + colour classification on the
mean-pooled `vision_feature_layer` patch features). Stage 2 trains the whole LLaVA (tower, projector,
language model) on the question/answer task, keeping the stage-1 loss on the tower as an auxiliary term.
End-to-end training from scratch learns colour but stays at chance on shape within any affordable budget.

Data: fresh images every step (a fixed pool of 20k images gets memorised instead of learnt), drawn at
random sizes/aspect ratios and run through the real image processor (so training sees exactly what
inference sees), mixed per step with single-image questions, two-image questions and text-only prompts.
Loss only on the answer tokens and the EOS that follows them.
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
    vision_steps: int = 2000  # stage 1: vision tower + throw-away linear head classify shape and colour
    vision_lr: float = 3e-3
    stage2_vision_lr_scale: float = 1.0  # 0 = vision tower frozen in stage 2
    stage2_aux_weight: float = 1.0  # keep the stage-1 classification loss in stage 2 (if the tower trains)
    steps: int = 1000  # stage 2: the whole LLaVA on the question/answer task
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 100
    p_two_images: float = 0.4
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


class ShapesData:
    """Fresh synthetic examples every batch (no image is ever repeated) and tokenised prompt templates."""

    def __init__(self, processor: LlavaProcessor, n_tok: int, rng: random.Random):
        self.processor = processor
        self.tok = processor.tokenizer
        self.n_tok = n_tok
        self.image_token = processor.image_token
        self.rng = rng
        self._prompt_cache: dict[tuple[str, int], list[int]] = {}

    def prompt_ids(self, question: str, n_images: int) -> list[int]:
        """Prompt ids exactly as LlavaProcessor makes them (`<image>` expanded to n_tok placeholders)."""
        key = (question, n_images)
        if key not in self._prompt_cache:
            text = shapes.prompt(question, n_images).replace(self.image_token, self.image_token * self.n_tok)
            self._prompt_cache[key] = self.tok(text).input_ids
        return self._prompt_cache[key]

    def answer_ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids + [self.tok.eos_token_id]

    def _example(self, question: str, n_images: int, answer: str) -> Example:
        p, a = self.prompt_ids(question, n_images), self.answer_ids(answer)
        return Example(p + a, [-100] * len(p) + a)

    def sample(self, p_two: float, p_text: float, images: list, labels: list) -> Example:
        """One example; its images are appended to `images`, their (shape, colour) to `labels`."""
        r = self.rng.random()
        if r < p_text:
            q = self.rng.choice(list(shapes.TEXT_ONLY))
            return self._example(q, 0, shapes.TEXT_ONLY[q])
        if r < p_text + p_two:
            (i1, s1, c1), (i2, s2, c2) = shapes.random_example(self.rng), shapes.random_example(self.rng)
            q = self.rng.choice(list(shapes.TWO_IMAGE_QUESTIONS))
            images += [i1, i2]
            labels += [(s1, c1), (s2, c2)]
            return self._example(q, 2, shapes.TWO_IMAGE_QUESTIONS[q]([s1, s2], [c1, c2]))
        img, s, c = shapes.random_example(self.rng)
        q = self.rng.choice(list(shapes.QUESTIONS))
        images.append(img)
        labels.append((s, c))
        return self._example(q, 1, shapes.answer(q, s, c))

    def vision_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pixel_values [B, 3, S, S], shape labels [B], colour labels [B]) for vision pre-training."""
        exs = [shapes.random_example(self.rng) for _ in range(size)]
        pv = self.processor.image_processor([e[0] for e in exs], return_tensors="pt")["pixel_values"]
        shape_y = torch.tensor([shapes.SHAPES.index(e[1]) for e in exs])
        color_y = torch.tensor([list(shapes.COLORS).index(e[2]) for e in exs])
        return pv, shape_y, color_y

    def batch(self, size: int, p_two: float, p_text: float) -> dict[str, torch.Tensor]:
        images: list = []
        image_labels: list[tuple[str, str]] = []
        exs = [self.sample(p_two, p_text, images, image_labels) for _ in range(size)]
        L = max(len(e.input_ids) for e in exs)
        ids = torch.full((size, L), self.tok.pad_token_id, dtype=torch.long)  # [B, L], right padded
        labels = torch.full((size, L), -100, dtype=torch.long)  # [B, L]
        mask = torch.zeros((size, L), dtype=torch.long)  # [B, L]
        for b, e in enumerate(exs):
            ids[b, : len(e.input_ids)] = torch.tensor(e.input_ids)
            labels[b, : len(e.labels)] = torch.tensor(e.labels)
            mask[b, : len(e.input_ids)] = 1
        out = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        if images:
            out["pixel_values"] = self.processor.image_processor(images, return_tensors="pt")["pixel_values"]
            out["shape_labels"] = torch.tensor([shapes.SHAPES.index(s) for s, _ in image_labels])
            out["color_labels"] = torch.tensor([list(shapes.COLORS).index(c) for _, c in image_labels])
        return out  # pixel_values: [n_images, 3, S, S]; *_labels: [n_images]


def _warmup_cosine(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t))
    return f


def _aux_loss(head: torch.nn.Linear, feats: torch.Tensor, shape_y: torch.Tensor,
              color_y: torch.Tensor) -> torch.Tensor:
    """Shape + colour cross-entropy of `head` on mean-pooled patch features (CLS dropped)."""
    logits = head(feats[:, 1:].mean(1))  # [B, shapes + colours]
    n = len(shapes.SHAPES)
    return (torch.nn.functional.cross_entropy(logits[:, :n], shape_y)
            + torch.nn.functional.cross_entropy(logits[:, n:], color_y))


def pretrain_vision(model: LlavaForConditionalGeneration, data: ShapesData, recipe: Recipe,
                    progress: bool) -> torch.nn.Linear | None:
    """Stage 1: train the CLIP tower (features of `vision_feature_layer`, CLS dropped, mean-pooled) with a
    linear head (not part of the checkpoint) to classify shape and colour; returns the head."""
    if recipe.vision_steps <= 0:
        return None
    tower = model.model.vision_tower
    layer = model.config.vision_feature_layer
    hidden = model.config.vision_config.hidden_size
    head = torch.nn.Linear(hidden, len(shapes.SHAPES) + len(shapes.COLORS))
    params = list(tower.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=recipe.vision_lr, weight_decay=recipe.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(recipe.warmup, recipe.vision_steps))
    tower.train()
    bar = tqdm(range(recipe.vision_steps), desc="stage 1/2: vision tower", disable=not progress)
    ema = None
    for step in bar:
        pv, shape_y, color_y = data.vision_batch(recipe.batch_size)
        feats = tower(pv, output_hidden_states=True).hidden_states[layer]  # [B, 1 + patches, hidden]
        loss = _aux_loss(head, feats, shape_y, color_y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{ema:.4f}")
    tower.eval()
    return head  # [hidden -> shapes + colours]


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
    data = ShapesData(processor, num_image_tokens(model.config), random.Random(recipe.seed + 1))
    head = pretrain_vision(model, data, recipe, progress)
    use_aux = head is not None and recipe.stage2_aux_weight > 0 and recipe.stage2_vision_lr_scale > 0
    captured: list[torch.Tensor] = []
    hook = None
    if use_aux:  # capture the vision_feature_layer output inside the LLaVA forward
        n_layers = model.config.vision_config.num_hidden_layers
        idx = model.config.vision_feature_layer % (n_layers + 1)  # index into hidden_states
        tower = model.model.vision_tower
        encoder = tower.encoder if hasattr(tower, "encoder") else tower.vision_model.encoder
        layer_mod = encoder.layers[idx - 1]
        hook = layer_mod.register_forward_hook(lambda m, i, o: captured.append(o))
        head.requires_grad_(False)  # fixed: the features must stay readable by the stage-1 head
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for n, p in model.named_parameters():
        is_vision = n.startswith("model.vision_tower.")
        if is_vision and recipe.stage2_vision_lr_scale == 0:
            p.requires_grad_(False)
            continue
        groups.setdefault((is_vision, p.ndim >= 2 and "embed" not in n), []).append(p)
    opt = torch.optim.AdamW(
        [{"params": ps, "weight_decay": recipe.weight_decay if decay else 0.0,
          "lr": recipe.lr * (recipe.stage2_vision_lr_scale if vis else 1.0)}
         for (vis, decay), ps in sorted(groups.items())],
        lr=recipe.lr, betas=(0.9, 0.98))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(recipe.warmup, recipe.steps))
    model.train()
    bar = tqdm(range(recipe.steps), desc="stage 2/2: llava", disable=not progress)
    ema = None
    for step in bar:
        batch = data.batch(recipe.batch_size, recipe.p_two_images, recipe.p_text_only)
        shape_y, color_y = batch.pop("shape_labels", None), batch.pop("color_labels", None)
        captured.clear()
        loss = model(**batch).loss
        if use_aux and captured:
            loss = loss + recipe.stage2_aux_weight * _aux_loss(head, captured[0], shape_y, color_y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups.values() for p in g], 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{ema:.4f}")
    if hook is not None:
        hook.remove()
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return model, processor
