"""The demo model's two LoRA adapters, trained offline with PEFT and cached beside the demo model.

- `french` answers in French: ` rouge`, ` vert`, ` bleu`, ` jaune`; ` cercle`, ` carré`, ` triangle`; and
  `Describe the image.` -> ` cercle rouge`.
- `sentence` answers in a sentence: ` The color is red.`, ` The shape is a circle.`, and
  `Describe the image.` -> ` The shape is a red circle.`
Both are rank-16 LoRA on every projection of the language model (the vision tower and projector untouched).
They are built in a temporary folder, evaluated greedily on held-out images, and moved into
`<cache>/<ADAPTERS_VERSION>/<name>` only above `MIN_ACCURACY`; that folder is the registry `make serve` uses.
"""
from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from triton_vlm.demo import shapes
from triton_vlm.demo.checkpoint import num_image_tokens
from triton_vlm.demo.train import _warmup_cosine

ADAPTERS_VERSION = "demo-v3-adapters-v1"  # bump with any change below (or to the demo model)
LM_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
MIN_ACCURACY = 0.95
STEPS, BATCH, LR, RANK, SEED, EVAL_N, EVAL_SEED = 2000, 32, 5e-3, 16, 7, 60, 4242

FR_COLORS = {"red": "rouge", "green": "vert", "blue": "bleu", "yellow": "jaune"}
FR_SHAPES = {"circle": "cercle", "square": "carré", "triangle": "triangle"}

Answer = Callable[[str, str, str], str]  # (question, shape, color) -> answer text with its leading space


def french(question: str, shape: str, color: str) -> str:
    if question == shapes.QUESTION_COLOR:
        return f" {FR_COLORS[color]}"
    if question == shapes.QUESTION_SHAPE:
        return f" {FR_SHAPES[shape]}"
    return f" {FR_SHAPES[shape]} {FR_COLORS[color]}"


def sentence(question: str, shape: str, color: str) -> str:
    if question == shapes.QUESTION_COLOR:
        return f" The color is {color}."
    if question == shapes.QUESTION_SHAPE:
        return f" The shape is a {shape}."
    return f" The shape is a {color} {shape}."


ADAPTERS: dict[str, Answer] = {"french": french, "sentence": sentence}


def adapters_dir(cache: Path) -> Path:
    return cache / ADAPTERS_VERSION


def ensure_demo_adapters(model_dir: Path, cache: Path, progress: bool = True) -> Path:
    """The registry folder holding every demo adapter; trains the missing ones (about 90 s each on one core)."""
    root = adapters_dir(cache)
    for name, answer in ADAPTERS.items():
        if not (root / name / "adapter_model.safetensors").is_file():
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            acc = train_adapter(model_dir, answer, tmp, progress, desc=f"adapter {name}")
            if acc < MIN_ACCURACY:
                shutil.rmtree(tmp)
                raise RuntimeError(f"demo adapter {name!r}: held-out accuracy {acc:.3f} < {MIN_ACCURACY}")
            (tmp / "demo_adapter_info.json").write_text(json.dumps({"name": name, "held_out_accuracy": acc}))
            if (root / name).exists():
                shutil.rmtree(root / name)
            tmp.rename(root / name)
    return root


def train_adapter(model_dir: Path, answer: Answer, out: Path, progress: bool, desc: str) -> float:
    """Train one adapter with PEFT (seeded, single-threaded as the demo build); save it; return its held-out
    accuracy (greedy, every question, fresh images)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    torch.manual_seed(SEED)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=LM_TARGETS))
    n_tok = num_image_tokens(model.base_model.model.config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(50, STEPS))
    rng = random.Random(SEED)
    model.train()
    for _ in tqdm(range(STEPS), desc=desc, disable=not progress):
        loss = model(**_batch(processor, n_tok, answer, rng, BATCH)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    model.save_pretrained(out)
    return evaluate_adapter(model, processor, answer, EVAL_N, EVAL_SEED)


def _batch(processor, n_tok: int, answer: Answer, rng: random.Random, size: int) -> dict[str, torch.Tensor]:
    tok, image_token = processor.tokenizer, processor.image_token
    ids, labels, images = [], [], []
    for _ in range(size):
        img, shape, color = shapes.random_example(rng)
        # the description is the longest answer to spell: asked half the time
        q = shapes.QUESTION_DESCRIBE if rng.random() < 0.5 else rng.choice(list(shapes.QUESTIONS))
        p = tok(shapes.prompt(q).replace(image_token, image_token * n_tok)).input_ids
        a = tok(answer(q, shape, color), add_special_tokens=False).input_ids + [tok.eos_token_id]
        ids.append(p + a)
        labels.append([-100] * len(p) + a)
        images.append(img)
    L = max(len(x) for x in ids)
    input_ids = torch.full((size, L), tok.pad_token_id, dtype=torch.long)  # [B, L], right padded
    label_t = torch.full((size, L), -100, dtype=torch.long)
    mask = torch.zeros((size, L), dtype=torch.long)
    for b, (x, y) in enumerate(zip(ids, labels)):
        input_ids[b, :len(x)], label_t[b, :len(y)], mask[b, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    pv = processor.image_processor(images, return_tensors="pt")["pixel_values"]  # [B, 3, S, S]
    return {"input_ids": input_ids, "labels": label_t, "attention_mask": mask, "pixel_values": pv}


@torch.no_grad()
def evaluate_adapter(model, processor, answer: Answer, n: int, seed: int) -> float:
    rng = random.Random(seed)
    ok = total = 0
    for q in shapes.QUESTIONS:
        examples = [shapes.random_example(rng) for _ in range(n)]
        enc = processor(text=[shapes.prompt(q)] * n, images=[e[0] for e in examples], return_tensors="pt",
                        padding=True)
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
        got = processor.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for (_, s, c), g in zip(examples, got):
            ok += g.strip() == answer(q, s, c).strip()
            total += 1
    return ok / total
