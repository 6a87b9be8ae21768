"""LoRA adapters on the `transformers` baseline through `peft`: the reference our engine is measured against.

Every adapter a request resolves to (a registry adapter or wire tensors, as `lora.format.Adapter`) is added to
one `peft` LoRA model under its own name: `LoraConfig` targets exactly the language-model projections it adapts
(ranks per module through `rank_pattern`), the A / B weights are copied in and each module's `scaling` is set
to the adapter's scale, so PEFT computes `base(x) + lora_B(lora_A(x)) * scaling` with the same numbers as the
adapter's file. A request then runs with its adapter active, or with adapters disabled (the base model). At
most `max_adapters` are kept (least recently used deleted).
"""
from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from typing import Optional

import torch

from ..lora.format import Adapter

_LM_LAYER = re.compile(r"(?:^|\.)language_model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)$")


class PeftAdapters:
    def __init__(self, model: torch.nn.Module, max_adapters: int = 32):
        self.model = model  # LlavaForConditionalGeneration; peft injects its LoRA layers in place
        self.max_adapters = max_adapters
        self.peft = None  # the PeftModel once the first adapter arrives
        self._names: "OrderedDict[int, tuple[Adapter, str]]" = OrderedDict()  # id(adapter) -> (adapter, name)
        self._modules = {(int(m.group(1)), m.group(2)): name for name, _ in model.named_modules()
                         if (m := _LM_LAYER.search(name))}
        self._serial = 0

    @contextlib.contextmanager
    def active(self, adapter: Optional[Adapter]):
        """Run the body with `adapter` active (None: every adapter disabled)."""
        if adapter is None:
            with self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext():
                yield
            return
        name = self._name(adapter)
        self.peft.base_model.set_adapter(name)
        yield

    def _name(self, adapter: Adapter) -> str:
        hit = self._names.get(id(adapter))
        if hit is not None and hit[0] is adapter:
            self._names.move_to_end(id(adapter))
            return hit[1]
        self._serial += 1
        name = f"a{self._serial}"
        self._add(adapter, name)
        self._names[id(adapter)] = (adapter, name)
        while len(self._names) > self.max_adapters:
            _, (_, old) = self._names.popitem(last=False)
            self.peft.base_model.delete_adapter(old)
        return name

    def _add(self, adapter: Adapter, name: str) -> None:
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415

        targets = {key: self._modules[key] for key in adapter.modules}
        cfg = LoraConfig(r=adapter.max_rank, lora_alpha=adapter.max_rank, lora_dropout=0.0,
                         target_modules="|".join(re.escape(n) for n in targets.values()),
                         rank_pattern={re.escape(n): adapter.modules[k].rank for k, n in targets.items()})
        if self.peft is None:
            self.peft = get_peft_model(self.model, cfg, adapter_name=name)
        else:
            self.peft.add_adapter(name, cfg)
        layers = dict(self.model.named_modules())
        with torch.no_grad():
            for key, full in targets.items():
                m, layer = adapter.modules[key], layers[full]
                layer.lora_A[name].weight.copy_(m.a)  # [r, in]
                layer.lora_B[name].weight.copy_(m.b)  # [out, r]
                layer.scaling[name] = m.scale
        self.model.eval()
