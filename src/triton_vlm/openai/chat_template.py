"""OpenAI chat messages -> the prompt, with the checkpoint's own chat template applied by `transformers`.

Where the template comes from, first found: `--chat-template FILE` (Jinja text, or JSON with a
"chat_template" key), the processor's (`chat_template.jinja`, `chat_template.json`, or `processor_config.json`'s
"chat_template" in the checkpoint folder), the tokenizer's (`tokenizer_config.json`). A checkpoint with none
serves no chat: `/v1/chat/completions` answers 400 saying to use `/v1/completions` or pass a template.

Messages reach the template as `transformers`' processors expect them: content a list of parts,
`{"type": "text", "text": ...}` and `{"type": "image"}`, so the template puts each image where it renders it
(llava-1.5: `USER: <image>\\n... ASSISTANT:`). Templates written for string content (they never look at a
part's `type`) get the text with one `<image>\\n` per image in its place. The rendered prompt carries one
`<image>` marker per image, in order; the images go to the ensemble's `images` input.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..preprocess.prompt import IMAGE_MARKER, INLINE_IMAGE, find_malformed_inline
from .errors import bad_request

VIDEO = object()  # a video part of a `Turn` (Qwen2-VL's templates render {"type": "video"})
# A template that reads a part's type works on lists of parts (vLLM's "openai" content format).
_PARTS_FORMAT = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b|selectattr\(\s*['"]type['"]""")


@dataclass
class Turn:
    """One message, normalised: role (developer -> system) and its parts: str for text, None for an image, VIDEO
    for a video."""

    role: str
    parts: list[Optional[str]]
    extra: dict = field(default_factory=dict)  # `tool_calls` (assistant), `tool_call_id` (tool), as HF takes them


def load_template(model_dir: Path, override: Optional[Path], tokenizer) -> tuple[Optional[str], str]:
    """(template source or None, where it came from)."""
    if override is not None:
        text = Path(override).read_text()
        try:
            obj = json.loads(text)
            if isinstance(obj, dict) and isinstance(obj.get("chat_template"), str):
                return obj["chat_template"], str(override)
        except ValueError:
            pass
        return text, str(override)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), str(jinja)
    for name in ("chat_template.json", "processor_config.json"):
        f = model_dir / name
        if f.is_file():
            try:
                template = json.loads(f.read_text()).get("chat_template")
            except ValueError:
                template = None
            if isinstance(template, str) and template:
                return template, str(f)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    if isinstance(template, str) and template:
        return template, "the tokenizer's chat_template"
    return None, ""


class ChatTemplate:
    def __init__(self, source: str, tokenizer, origin: str = "", markers: tuple[str, ...] = (IMAGE_MARKER,),
                 video_markers: tuple[str, ...] = ()):
        """`markers`: what stands for an image in a rendered prompt (`<image>`, and a family's own format such as
        Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`, which its template writes)."""
        self.source, self.tokenizer, self.origin, self.markers = source, tokenizer, origin, markers
        self.video_markers = video_markers
        self.parts_format = bool(_PARTS_FORMAT.search(source))
        bos = getattr(tokenizer, "bos_token", None)
        self.bos = bos if isinstance(bos, str) and bos else None

    def _content(self, turn: Turn):
        if self.parts_format:
            return [{"type": "image"} if p is None else {"type": "video"} if p is VIDEO else
                    {"type": "text", "text": p} for p in turn.parts]
        return "".join(IMAGE_MARKER + "\n" if p is None else "<video>\n" if p is VIDEO else p for p in turn.parts)

    def render(self, turns: list[Turn], n_images: int, *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Optional[list[dict]] = None, n_videos: int = 0) -> str:
        """The prompt text with one `<image>` marker per image (checked: a template that drops or repeats images
        is refused). The tokenizer's BOS is removed from the front: the ensemble's tokenizer adds it. `tools`
        (OpenAI's function definitions) reach the template as `transformers` passes them (a template that does
        not read them ignores them)."""
        conversation = [{"role": t.role, "content": self._content(t), **t.extra} for t in turns]
        if continue_final_message and turns[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              param="continue_final_message")
        try:
            prompt = self.tokenizer.apply_chat_template(
                conversation, tools=tools or None, chat_template=self.source, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message)
        except Exception as e:  # jinja errors (raise_exception in the template, bad roles) are the request's
            raise bad_request(f"the chat template refused the messages: {e}", param="messages") from None
        if self.bos and prompt.startswith(self.bos):
            prompt = prompt[len(self.bos):]
        found = sum(prompt.count(m) for m in self.markers)
        if found != n_images:
            raise bad_request(f"the chat template ({self.origin}) placed {found} {' / '.join(self.markers)} markers "
                              f"for {n_images} images", param="messages")
        found = sum(prompt.count(m) for m in self.video_markers)
        if found != n_videos:
            raise bad_request(f"the chat template ({self.origin}) placed {found} video markers for {n_videos} "
                              "videos", param="messages")
        return prompt


def check_text(text: str, where: str, markers: tuple[str, ...] = (IMAGE_MARKER,)) -> str:
    """Message text may not carry image markers or inline image tags: images come only as image_url parts."""
    if any(m in text for m in markers) or INLINE_IMAGE.search(text) or find_malformed_inline(text) is not None:
        raise bad_request(f"{where} contains an image marker ({' / '.join(markers)}) or an inline <img> tag; send "
                          "images as image_url content parts", param="messages")
    return text
