"""The demo task: one filled coloured shape on a white background, and three questions about it.

Prompts look exactly like `USER: <image>\\nWhat color is the shape? ASSISTANT:`; the trained demo model answers
with a leading space and then EOS: ` red`, ` circle`, ` a red circle`.
"""
from __future__ import annotations

import math
import random
from typing import Callable

from PIL import Image, ImageDraw

from triton_vlm.errors import InvalidArgument

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 200, 20),
}

QUESTION_COLOR = "What color is the shape?"
QUESTION_SHAPE = "What shape is this?"
QUESTION_DESCRIBE = "Describe the image."

# question -> f(shape, color) -> answer text (leading space; EOS follows in the model's output)
QUESTIONS: dict[str, Callable[[str, str], str]] = {
    QUESTION_COLOR: lambda shape, color: f" {color}",
    QUESTION_SHAPE: lambda shape, color: f" {shape}",
    QUESTION_DESCRIBE: lambda shape, color: f" a {color} {shape}",
}

# Two-image questions: f(shapes, colors) of both images -> answer.
TWO_IMAGE_QUESTIONS: dict[str, Callable[[list[str], list[str]], str]] = {
    "What color is the first shape?": lambda shapes, colors: f" {colors[0]}",
    "What color is the second shape?": lambda shapes, colors: f" {colors[1]}",
    "What is the first shape?": lambda shapes, colors: f" {shapes[0]}",
    "What is the second shape?": lambda shapes, colors: f" {shapes[1]}",
}

# Text-only prompts (no image) and their answers.
TEXT_ONLY: dict[str, str] = {
    "Say hello.": " hello",
    "Say goodbye.": " goodbye",
    "What colors do you know?": " red green blue yellow",
    "What shapes do you know?": " circle square triangle",
}


def prompt(question: str, n_images: int = 1) -> str:
    """`USER: <image>\\n{question} ASSISTANT:` with `n_images` image placeholders (0 for text only)."""
    return "USER: " + "<image>\n" * n_images + f"{question} ASSISTANT:"


def answer(question: str, shape: str, color: str) -> str:
    """Expected answer (with its leading space) of a single-image `question`."""
    return QUESTIONS[question](shape, color)


def draw(shape: str, color: str, size: tuple[int, int] = (64, 64),
         rng: random.Random | int | None = None) -> Image.Image:
    """One filled `shape` in `color` on white, random size (40-85% of the short side) and position.

    `size` is (width, height), any size >= 8x8. `rng` is a `random.Random`, an int seed, or None (fresh).
    """
    if shape not in SHAPES:
        raise InvalidArgument(f"unknown shape {shape!r}; allowed: {SHAPES}")
    if color not in COLORS:
        raise InvalidArgument(f"unknown color {color!r}; allowed: {tuple(COLORS)}")
    w, h = int(size[0]), int(size[1])
    if w < 8 or h < 8:
        raise InvalidArgument(f"image size {size} too small; need at least 8x8")
    if not isinstance(rng, random.Random):
        rng = random.Random(rng)
    short = min(w, h)
    s = max(4, round(short * rng.uniform(0.4, 0.85)))  # shape extent in pixels
    x0 = rng.randint(0, w - s)
    y0 = rng.randint(0, h - s)
    img = Image.new("RGB", (w, h), (255, 255, 255))
    d = ImageDraw.Draw(img)
    fill = COLORS[color]
    box = (x0, y0, x0 + s - 1, y0 + s - 1)
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle(box, fill=fill)
    else:  # equilateral-ish triangle pointing up, inscribed in the box
        th = s * math.sqrt(3) / 2
        top = y0 + (s - th) / 2
        d.polygon([(x0 + (s - 1) / 2, top), (x0, top + th), (x0 + s - 1, top + th)], fill=fill)
    return img


def random_example(rng: random.Random, size: tuple[int, int] | None = None) -> tuple[Image.Image, str, str]:
    """(image, shape, color) with random shape/color and, unless given, a random size/aspect ratio."""
    shape = rng.choice(SHAPES)
    color = rng.choice(list(COLORS))
    if size is None:
        size = random_size(rng)
    return draw(shape, color, size, rng), shape, color


def random_size(rng: random.Random) -> tuple[int, int]:
    """A random (width, height) between 16 and 224 px with aspect ratio between 1:2.2 and 2.2:1."""
    short = rng.randint(16, 128)
    ratio = math.exp(rng.uniform(-math.log(2.2), math.log(2.2)))
    w, h = (round(short * ratio), short) if ratio >= 1 else (short, round(short / ratio))
    return max(8, min(w, 224)), max(8, min(h, 224))
