"""The benchmark-size model: a random-weight LLaVA whose language model is a ~32M-parameter Llama, with the
demo model's vision tower (CLIP 32 px, patch 8 -> 16 image tokens).

`python -m bench.common.model` builds it (cached) and prints its parameter counts. The checkpoint lives under
`$TRITON_VLM_CACHE/bench-llava-<BENCH_VERSION>` (default cache `~/.cache/triton_vlm`); it is rebuilt only when
missing or when `BENCH_VERSION` changes (bump it whenever anything in `BENCH_SPEC` changes).

The tokenizer is the project's offline byte-level BPE (`demo.checkpoint.build_tokenizer`), trained on a
deterministic synthetic corpus of syllable words so that it reaches a realistic vocabulary of `vocab_size`
tokens (the default 384-token demo vocabulary would make the lm_head unrealistically cheap).
A random model emits random tokens, EOS included: the benchmark sends `min_tokens == max_tokens`, so every
request generates exactly `max_tokens` tokens on every backend.
"""
from __future__ import annotations

import argparse
import random
import shutil
import tempfile
from pathlib import Path

from triton_vlm.demo.train import Recipe
from triton_vlm.paths import cache_dir

BENCH_VERSION = "v1"
_DEMO = Recipe()

# Language model: Llama, hidden 512, 8 layers, 8 heads (head_dim 64), 4 KV heads (GQA), SwiGLU 1408, 8192 vocab,
# untied embeddings. Vision: exactly the demo model's tower.
BENCH_SPEC: dict[str, int] = dict(
    text_hidden=512,
    layers=8,
    heads=8,
    kv_heads=4,
    intermediate=1408,
    vocab_size=8192,
    max_position_embeddings=1024,
    image_size=_DEMO.image_size,
    patch_size=_DEMO.patch_size,
    vision_hidden=_DEMO.vision_hidden,
    vision_layers=_DEMO.vision_layers,
    vision_heads=_DEMO.vision_heads,
    vision_intermediate=_DEMO.vision_intermediate,
    seed=1234,
)

PROMPT_WORDS = "USER: <image>\nDescribe the image in detail. ASSISTANT:"
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def vocab_corpus(n_words: int = 60000, seed: int = 0) -> list[str]:
    """Deterministic text for the BPE trainer: syllable pseudo-words (Zipf-ish frequencies) plus the prompt."""
    rng = random.Random(seed)
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS] + [c + v + e for c in _CONSONANTS for v in _VOWELS
                                                                  for e in "nrst"]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(12000)]
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(lexicon))]
    lines, words = [PROMPT_WORDS] * 50, rng.choices(lexicon, weights, k=n_words)
    for i in range(0, n_words, 12):
        lines.append(" ".join(words[i:i + 12]) + rng.choice([".", ",", "?", "!", ""]))
    return lines


def bench_model_dir() -> Path:
    return cache_dir() / f"bench-llava-{BENCH_VERSION}"


def ensure_bench_model(verbose: bool = True) -> Path:
    """Build the benchmark checkpoint once (atomically: built in a temp dir, then renamed); return its dir."""
    out = bench_model_dir()
    if (out / ".complete").exists():
        return out
    from triton_vlm.demo.checkpoint import build_random_llava  # noqa: PLC0415

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    if verbose:
        print(f"bench: building the benchmark model in {out} ...", flush=True)
    build_random_llava(tmp, vocab_texts=vocab_corpus(), **BENCH_SPEC)
    (tmp / ".complete").write_text(BENCH_VERSION)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def parameter_counts(model_dir: Path) -> dict[str, int]:
    """Parameters of the language model, the vision tower and the projector, counted on the checkpoint."""
    from safetensors import safe_open  # noqa: PLC0415

    counts = {"language_model": 0, "vision_tower": 0, "projector": 0, "other": 0}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                key = ("vision_tower" if "vision_tower" in name else "projector" if "projector" in name
                       else "language_model" if ("language_model" in name or "lm_head" in name) else "other")
                counts[key] += n
    counts["total"] = sum(counts.values())
    return counts


def describe(model_dir: Path) -> str:
    import json  # noqa: PLC0415

    c = parameter_counts(model_dir)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    t = cfg["text_config"]
    return (f"bench model {model_dir.name}: Llama {c['language_model'] / 1e6:.1f}M params (hidden {t['hidden_size']}, "
            f"{t['num_hidden_layers']} layers, {t['num_attention_heads']} heads / {t['num_key_value_heads']} kv, "
            f"mlp {t['intermediate_size']}, vocab {t['vocab_size']}) + vision tower "
            f"{c['vision_tower'] / 1e6:.2f}M + projector {c['projector'] / 1e6:.2f}M = {c['total'] / 1e6:.1f}M")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build (cached) and describe the benchmark model.")
    ap.add_argument("--rebuild", action="store_true", help="delete the cached checkpoint first")
    args = ap.parse_args(argv)
    if args.rebuild and bench_model_dir().exists():
        shutil.rmtree(bench_model_dir())
    path = ensure_bench_model()
    print(describe(path))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
