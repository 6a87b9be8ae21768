"""Nothing in a checkpoint's config that changes the math is ignored (`checkpoint_fields`, `quant.config`).

The walk: every field transformers' config classes of the served families define is allow-listed as harmless,
implemented, or checked (refused unless its value is implemented), so a field a new transformers adds fails here
instead of being ignored. Refusals are checked at `CheckpointSpec.load` and through the launcher (`make serve`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from triton_vlm import checkpoint_fields as cf
from triton_vlm.spec import CheckpointError, CheckpointSpec


def _classes() -> list[tuple[str, type]]:
    """(scope, config class) of every served family (`families.FAMILIES`: a family added later is walked too),
    with the text models and towers a LLaVA may hold (its sub-configs are any `AutoConfig`)."""
    import transformers
    from transformers import CLIPVisionConfig, LlamaConfig, MistralConfig, Qwen2Config, SiglipVisionConfig  # noqa: PLC0415

    from triton_vlm.families import FAMILIES

    out = [("text", c) for c in (LlamaConfig, MistralConfig, Qwen2Config)]
    out += [("vision", c) for c in (CLIPVisionConfig, SiglipVisionConfig)]
    for family in FAMILIES.values():
        top = getattr(transformers, family.model_class).config_class
        out.append(("top", top))
        for key, scope in (("text_config", "text"), ("vision_config", "vision")):
            sub = top.sub_configs.get(key)
            if sub is not None and sub is not transformers.AutoConfig:
                out.append((scope, sub))
    return out


def test_every_field_of_the_served_config_classes_is_classified():
    """A field no table names would be ignored by the engine: the served families' classes must have none."""
    classes = _classes()
    assert {c.__name__ for _, c in classes} >= {"LlavaConfig", "LlavaNextConfig", "Qwen2VLConfig",
                                                "Qwen2_5_VLTextConfig", "Qwen2_5_VLVisionConfig"}
    unclassified = {}
    for scope, cls in classes:
        names = {f.name for f in dataclasses.fields(cls)} | set(cls().to_dict())
        missing = sorted(n for n in names - cf.classified(scope) if not n.startswith("_"))
        if missing:
            unclassified[cls.__name__] = missing
    assert not unclassified, f"config fields neither harmless, implemented nor checked: {unclassified}"
    for scope, (harmless, implemented, checked) in cf.SCOPES.items():  # each field in one table only
        assert not (set(harmless) & set(implemented)) and not (set(harmless) & set(checked)) \
            and not (set(implemented) & set(checked)), scope


def test_the_default_configs_of_the_served_classes_pass():
    for scope, cls in _classes():  # a vision config is checked as its top config's vision_config
        if scope != "vision":
            cf.check_fields(cls())


@pytest.mark.parametrize("kwargs,message", [
    ({"final_logit_softcapping": 30.0}, "config.json: final_logit_softcapping = 30.0 changes the math and is not "
                                        "implemented for model_type 'llama'"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0 changes the math"),
    ({"layer_types": ["full_attention", "chunked_attention"], "num_hidden_layers": 2},
     "config.json: layer_types = ['full_attention', 'chunked_attention'] is not supported; supported: "
     "'full_attention', 'sliding_attention' and (hybrid models: spec._hybrid) 'linear_attention' layers"),
])
def test_a_field_that_changes_the_math_is_refused_by_name(kwargs, message):
    from transformers import LlamaConfig

    with pytest.raises(cf.Unservable, match=_re(message)):
        cf.check_fields(LlamaConfig(**kwargs))


def test_a_field_no_table_knows_is_refused_unless_default(monkeypatch):
    """What a newer transformers adds: at its default it is the old math; any other value is refused."""
    from transformers import LlamaConfig

    monkeypatch.setattr(cf, "TEXT_HARMLESS", cf.TEXT_HARMLESS - {"pretraining_tp"})
    monkeypatch.setitem(cf.SCOPES, "text", (cf.TEXT_HARMLESS, cf.TEXT_IMPLEMENTED, cf.TEXT_CHECKED))
    cf.check_fields(LlamaConfig())
    with pytest.raises(cf.Unservable, match=_re("config.json: pretraining_tp = 2 is a field this engine does "
                                                  "not know (transformers' LlamaConfig defines it, default 1)")):
        cf.check_fields(LlamaConfig(pretraining_tp=2))


def test_a_vision_tower_rope_type_other_than_axial_is_refused():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig()
    cfg.vision_config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(cf.Unservable, match="config.json vision_config: rope_parameters = .*'yarn'"):
        cf.check_fields(cfg)


def _re(text: str) -> str:
    import re

    return re.escape(text)


def tiny_checkpoint(tmp_path, **extra) -> str:
    """A config-only tiny LLaVA checkpoint (enough for CheckpointSpec.load and the launcher's check)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    cfg = LlavaConfig(text_config=LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, vocab_size=128, eos_token_id=2).to_dict(),
                      vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=28, patch_size=14).to_dict())
    cfg.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text()) | extra
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


UNSUPPORTED_QUANT = {"quant_method": "gptq", "bits": 4, "group_size": 128}


def test_an_unsupported_quantization_is_refused_at_load(tmp_path):
    CheckpointSpec.load(tiny_checkpoint(tmp_path / "plain"))
    with pytest.raises(CheckpointError, match=_re(f"{tmp_path / 'q'}: config.json quantization_config.quant_method "
                                                  "= 'gptq' is not supported; supported: ")):
        CheckpointSpec.load(tiny_checkpoint(tmp_path / "q", quantization_config=UNSUPPORTED_QUANT))


def test_a_text_config_soft_cap_is_refused_at_load(tmp_path):
    d = tiny_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["text_config"]["final_logit_softcapping"] = 30.0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=_re(f"{d}: config.json text_config: final_logit_softcapping = 30.0 "
                                                  "changes the math")):
        CheckpointSpec.load(d)


@pytest.mark.server
def test_make_serve_refuses_a_quantized_checkpoint_it_cannot_read(tmp_path):
    """`MODEL=<dir> make serve` on a quantization the engine does not read: refused before tritonserver starts,
    the field and value named (it used to start and answer with the scales ignored)."""
    model = tiny_checkpoint(tmp_path / "q", quantization_config=UNSUPPORTED_QUANT)
    env = dict(os.environ, MODEL=model)
    proc = subprocess.run([sys.executable, "-m", "triton_vlm.server", "--openai-port", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert (f"triton-vlm: cannot serve {model}: config.json quantization_config.quant_method = 'gptq' is not "
            "supported") in proc.stderr, proc.stderr
    assert "starting tritonserver" not in proc.stdout
