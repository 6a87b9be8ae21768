"""The run copy of `model_repository/`: each model's `config.pbtxt` parameters filled in (model path, device,
limits), and `image_embeds` declared in the language model's dtype. A parameter no model declares is refused:
Triton would silently ignore it."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from ..paths import REPO_ROOT
from . import front_half
from .front_half import FrontHalf

DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"

_PARAM_RE = r'(key:\s*"{key}"\s*value:\s*\{{\s*string_value:\s*)"[^"]*"'


def fill_parameters(config_text: str, values: dict[str, str]) -> str:
    """Set `parameters { key: K value: { string_value: "..." } }` entries that exist in a config.pbtxt."""
    for key, value in values.items():
        config_text = re.sub(_PARAM_RE.format(key=re.escape(key)), lambda m: f'{m.group(1)}{json.dumps(str(value))}',
                             config_text)
    return config_text


def declared_parameters(src: Path = DEFAULT_MODEL_REPOSITORY) -> dict[str, set[str]]:
    """model -> the parameter keys its config.pbtxt declares."""
    return {cfg.parent.name: set(re.findall(r'parameters\s*\{\s*key:\s*"([^"]+)"', cfg.read_text()))
            for cfg in sorted(src.glob("*/config.pbtxt"))}


def check_parameters(params: dict[str, dict[str, str]], src: Path = DEFAULT_MODEL_REPOSITORY) -> None:
    """ValueError for a parameter no model declares (it would be silently ignored), listing those that exist."""
    declared = declared_parameters(src)
    every = set().union(*declared.values())
    for model, values in params.items():
        if model != "*" and model not in declared:
            raise ValueError(f"--set {model}.*: there is no model {model!r}; models: {', '.join(declared)}")
        for key in values:
            known = every if model == "*" else declared[model]
            if key not in known:
                where = "any model" if model == "*" else f"model {model!r}"
                listing = "; ".join(f"{m}: {', '.join(sorted(k))}" for m, k in declared.items() if k)
                raise ValueError(f"--set {'' if model == '*' else model + '.'}{key}: {where} declares no parameter "
                                 f"{key!r}. Parameters: {listing}")


def prepare_model_repository(dest: Path, params: dict[str, dict[str, str]], src: Path = DEFAULT_MODEL_REPOSITORY,
                             models: tuple[str, ...] | None = None, renames: dict[str, str] | None = None,
                             front: "FrontHalf | None" = None) -> Path:
    """Copy the model repository to `dest`, filling parameters per model (`params[model][key] = value`;
    `params["*"]` applies to every model that declares the key). A key no model declares is refused. `front`: the
    preprocess / vision instance counts and decode threads (`front_half.apply`; None: as the configs say). `renames`:
    model -> the name it is served under (e.g. `tensorrt_llm` under another name; the others call no renamed
    model, so only a model no other model calls may be renamed: `tensorrt_llm`)."""
    check_parameters(params, src)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for cfg in dest.glob("*/config.pbtxt"):
        model = cfg.parent.name
        if models is not None and model not in models:
            shutil.rmtree(cfg.parent)
            continue
        values = {**params.get("*", {}), **params.get(model, {})}
        text = fill_parameters(cfg.read_text(), values)
        if model in ("vision", "llm"):
            text = embeds_dtype(text, {**params.get("*", {}), **params.get("llm", {})}.get("dtype", "float32"))
        if front is not None:
            text = front_half.apply(text, model, front)
        cfg.write_text(text)
    for model, name in (renames or {}).items():
        rename_model(dest, model, name)
    return dest


RENAMEABLE = ("tensorrt_llm",)  # called by no other model


def rename_model(repo: Path, model: str, name: str) -> None:
    if model not in RENAMEABLE:
        raise ValueError(f"only {', '.join(RENAMEABLE)} can be served under another name, not {model!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", name) or (repo / name).exists():
        raise ValueError(f"model name {name!r} must be letters, digits, '_', '.', '-' and not another model's")
    cfg = repo / model / "config.pbtxt"
    if not cfg.exists():
        return  # not served (models=...)
    cfg.write_text(re.sub(r'^name:\s*"[^"]*"', f'name: "{name}"', cfg.read_text(), count=1, flags=re.M))
    (repo / model).rename(repo / name)


_EMBEDS_TYPE = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}


def embeds_dtype(config_text: str, llm_dtype: str) -> str:
    """`image_embeds` travels from vision to llm in the language model's dtype (half the bytes of FP32 for an
    fp16 model); vision's output and llm's input are declared alike."""
    if llm_dtype not in _EMBEDS_TYPE:
        raise ValueError(f"llm dtype must be one of {', '.join(_EMBEDS_TYPE)}, got {llm_dtype!r}")
    return re.sub(r'(name:\s*"image_embeds"\s*data_type:\s*)TYPE_\w+', rf"\g<1>{_EMBEDS_TYPE[llm_dtype]}",
                  config_text)
