"""The baseline generation backend: `transformers` `generate()`, one request at a time.

This is what a plain `transformers` python-backend model does. It stays selectable (`llm` parameter
`backend: hf`) as the reference and the benchmark's baseline; the default backend is our engine.
It exposes the same submit / cancel / start / shutdown interface as `triton_vlm.engine.Engine`. LoRA adapters
(the same registry and wire tensors as the engine's, resolved by the llm adapter) run through `peft`
(`baseline/peft.py`).
"""
from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Callable

import torch

from ..engine.model.merge import merge_image_embeds
from ..errors import InvalidArgument, VLMError
from .peft import PeftAdapters
from ..spec import CheckpointError, CheckpointSpec
from ..params import GenerationRequest, GenerationResult, ModelLimits, Sequence_

log = logging.getLogger("triton_vlm")
OnResult = Callable[[GenerationResult], None]


class _StopWords:
    """Stops a row when its tokens end with one of the stop sequences (and everything on cancel)."""

    def __init__(self, stop_words: list[list[int]], cancelled: threading.Event):
        self.stop_words = [torch.tensor(w) for w in stop_words if w]
        self.cancelled = cancelled

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.cancelled.is_set():
            return ~done
        for w in self.stop_words:
            if input_ids.shape[1] >= len(w):
                done |= (input_ids[:, -len(w):] == w.to(input_ids.device)).all(dim=1)
        return done


class PresenceFrequencyPenalty:
    """OpenAI's presence / frequency penalties as a transformers LogitsProcessor (HF has none): the same
    expression as the engine's (`engine.logits.presence_frequency_penalty`), over the ids after the prompt.
    `generate()` puts custom processors after its own (repetition penalty ... min new tokens), before the
    sampling warpers; the engine applies them right after the repetition penalty, which gives the same scores
    (see `engine/search/logits.py`)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, float(presence), float(frequency)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from ..engine.search.logits import presence_frequency_penalty  # noqa: PLC0415

        return presence_frequency_penalty(input_ids[:, self.prompt_len:], scores, self.presence, self.frequency)


def penalty_processors(prompt_len: int, presence: float, frequency: float) -> list:
    """[PresenceFrequencyPenalty] when either penalty is set, else [] (for `generate(logits_processor=...)`)."""
    if presence == 0.0 and frequency == 0.0:
        return []
    return [PresenceFrequencyPenalty(prompt_len, presence, frequency)]


class HFGenerator:
    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: str = "float32"):
        import transformers  # noqa: PLC0415

        from ..families import family_of  # noqa: PLC0415

        self.device = torch.device(device)
        family = family_of(CheckpointSpec.load(model_dir))
        if family.mrope:  # generate() from merged embeddings would need the grids' 3-D positions passed in
            raise CheckpointError(f"llm backend 'hf' does not serve {family.name} (M-RoPE positions from image "
                                  "embeddings); use backend 'engine', which is exact to transformers for it")
        model_class = getattr(transformers, family.model_class)  # the family's
        self.model = model_class.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        cfg = self.model.config
        self.image_token_id = int(cfg.image_token_id)
        spec = CheckpointSpec.load(model_dir)  # the same end ids and context as every other process
        self.eos_ids = list(spec.eos_ids)
        self.pad_id = self.model.generation_config.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.limits = ModelLimits(vocab_size=spec.text.vocab_size, context_length=spec.context_length,
                                  eos_ids=spec.eos_ids)
        self.lora = PeftAdapters(self.model)
        self._queue: queue.Queue = queue.Queue()
        self._cancelled: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # --- the backend interface ---------------------------------------------------------------------------
    def submit(self, req: GenerationRequest, on_result: OnResult) -> None:
        req.validate(self.limits)
        if req.params.guided is not None:
            raise InvalidArgument("guided_decoding_guide_type: the transformers baseline backend does not constrain "
                                  "decoding; serve with backend 'engine'")
        with self._lock:
            self._cancelled[req.request_id] = threading.Event()
        self._queue.put((req, on_result))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            ev = self._cancelled.get(request_id)
        if ev is not None:
            ev.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="hf-generate", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            req, on_result = item
            try:
                self.run(req, on_result)
            except Exception as e:  # noqa: BLE001 - reported to the request, the loop goes on
                if not isinstance(e, VLMError):
                    log.exception("generation failed")
                on_result(GenerationResult(req.request_id, [], True, error=e))
            finally:
                with self._lock:
                    self._cancelled.pop(req.request_id, None)

    # --- one request -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, req: GenerationRequest, on_result: OnResult) -> None:
        p = req.params
        ids = torch.tensor(req.input_ids, dtype=torch.long, device=self.device)  # [T]
        embeds = self.model.get_input_embeddings()(ids)  # [T, hidden]
        img = None if req.image_embeds is None else torch.as_tensor(req.image_embeds)
        embeds = merge_image_embeds(ids, embeds, img, self.image_token_id)
        eos_ids = list(p.end_ids) or self.eos_ids
        cancelled = self._cancelled.get(req.request_id) or threading.Event()
        with self.lora.active(req.adapter):
            out = self._generate(req, ids, embeds, eos_ids, cancelled, on_result)
        if cancelled.is_set():
            return
        on_result(GenerationResult(req.request_id, self._sequences(req, out, eos_ids), True))

    def _generate(self, req: GenerationRequest, ids, embeds, eos_ids: list[int], cancelled, on_result):
        from transformers import LogitsProcessorList, StoppingCriteriaList  # noqa: PLC0415

        p = req.params
        sample = dict(do_sample=True, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p) if p.do_sample \
            else dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        if p.do_sample:
            torch.manual_seed(p.seed if p.seed is not None else torch.seed())
        return self.model.generate(
            input_ids=ids[None], inputs_embeds=embeds[None], attention_mask=torch.ones_like(ids)[None],
            max_new_tokens=p.max_tokens, min_new_tokens=p.min_tokens or None, num_beams=p.beam_width,
            num_return_sequences=p.num_return_sequences, length_penalty=p.length_penalty,
            early_stopping=p.early_stopping, repetition_penalty=p.repetition_penalty,
            no_repeat_ngram_size=p.no_repeat_ngram_size or None, bad_words_ids=req.bad_words_ids or None,
            eos_token_id=eos_ids, pad_token_id=self.pad_id, output_scores=True, output_logits=True,
            return_dict_in_generate=True, streamer=self._streamer(req, on_result),
            stopping_criteria=StoppingCriteriaList([_StopWords(req.stop_words_ids, cancelled)]),
            logits_processor=LogitsProcessorList(
                penalty_processors(len(req.input_ids), p.presence_penalty, p.frequency_penalty)), **sample)

    def _streamer(self, req: GenerationRequest, on_result: OnResult):
        """A transformers streamer sending each new token as a streamed piece (greedy / sampling, one sequence)."""
        p = req.params
        if not (p.stream and p.beam_width == 1 and p.num_return_sequences == 1):
            return None
        from transformers.generation.streamers import BaseStreamer  # noqa: PLC0415

        from ..engine.search.detok import IncrementalDetokenizer  # noqa: PLC0415

        detok = IncrementalDetokenizer(self.tokenizer)
        rid = req.request_id

        class _Streamer(BaseStreamer):
            first = True

            def put(self, value):
                if self.first:  # the prompt
                    self.first = False
                    return
                toks = [int(t) for t in value.reshape(-1)]
                on_result(GenerationResult(rid, [Sequence_(toks, detok.push(toks))], False))

            def end(self):
                pass

        return _Streamer()

    def _sequences(self, req: GenerationRequest, out, eos_ids: list[int]) -> list[Sequence_]:
        """generate()'s output -> the returned sequences, each cut at its EOS or stop word, with scores."""
        new = out.sequences[:, len(req.input_ids):]  # [n, new]
        top = None
        if req.params.beam_width > 1:
            step_lp = self.model.compute_transition_scores(out.sequences, out.scores, out.beam_indices,
                                                           normalize_logits=False)
            cums = out.sequences_scores.tolist()
        else:
            logits = torch.stack(out.logits, dim=1).float()  # [n, new, vocab]
            logp = torch.log_softmax(logits, -1)
            step_lp = logp.gather(-1, new[..., None]).squeeze(-1)
            cums = None
            if req.params.top_log_probs:
                top = torch.topk(logp, req.params.top_log_probs, dim=-1)  # [n, new, k] each, best first
        seqs = []
        for i in range(new.shape[0]):
            toks = new[i].tolist()
            n = len(toks)
            for j, t in enumerate(toks):  # a row ends at EOS or a stop word; HF pads after it
                if t in eos_ids or any(w and toks[max(0, j + 1 - len(w)):j + 1] == w for w in req.stop_words_ids):
                    n = j + 1
                    break
            toks = toks[:n]
            lps = step_lp[i, :n].tolist()
            cum = cums[i] if cums is not None else float(sum(lps))
            seq = Sequence_(toks, self.tokenizer.decode(toks, skip_special_tokens=True), cum, lps)
            if top is not None:
                seq.top_log_probs, seq.top_ids = top.values[i, :n].tolist(), top.indices[i, :n].tolist()
            seqs.append(seq)
        return seqs
