"""POST /v1/chat/completions: messages -> the checkpoint's chat template -> the ensemble's prompt and images;
`tools` / `tool_choice` and structured outputs -> the ensemble's guided-decoding inputs (tools.py, structured.py)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ...preprocess.prompt import IMAGE_MARKER
from ..chat_template import VIDEO, Turn, check_text
from ..errors import bad_request
from ..params import make_plan
from ..responses import ChatFormat
from ..schemas import UNSUPPORTED_CHAT, ChatCompletionRequest, ChatMessage, ImagePart, VideoPart, unsupported_fields
from ..service import Frontend
from ..structured import apply, request_guide
from ..tools import ToolOutput, history_calls, plan_tools
from ..triton import TritonRequest
from . import authorize, frontend, request_id, serve

router = APIRouter(dependencies=[Depends(authorize)])


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await serve(request, "chat", lambda: _chat(frontend(request), body))


def _turn(i: int, m: ChatMessage, call_ids: set[str],
          markers: tuple[str, ...] = (IMAGE_MARKER,)) -> tuple[Turn, list[str]]:
    """A message's parts (text, or None for an image) and its image URLs, in order. `call_ids`: the ids of the
    tool calls of the assistant messages so far (a tool message must answer one of them, as OpenAI requires);
    `markers`: the checkpoint's image markers, refused in message text."""
    where = f"messages[{i}]"
    role = "system" if m.role == "developer" else m.role
    extra: dict = {}
    if m.tool_calls:
        if role != "assistant":
            raise bad_request(f"{where}.tool_calls: only assistant messages carry tool calls", param="messages")
        extra["tool_calls"] = history_calls(m.tool_calls)
        call_ids.update(c.id for c in m.tool_calls)
    if role == "tool":
        if m.tool_call_id is None or m.tool_call_id not in call_ids:
            raise bad_request(f"{where}: a message of role 'tool' must answer a tool call: its tool_call_id "
                              f"({m.tool_call_id!r}) must be the id of a call in an earlier assistant message's "
                              "tool_calls", param="messages")
        extra["tool_call_id"] = m.tool_call_id
    elif m.tool_call_id is not None:
        raise bad_request(f"{where}.tool_call_id: only tool messages answer tool calls", param="messages")
    if m.content is None:
        if role != "assistant":
            raise bad_request(f"{where}.content is required for role {m.role!r}", param="messages")
        return Turn(role, [], extra), []
    if isinstance(m.content, str):
        return Turn(role, [check_text(m.content, f"{where}.content", markers)], extra), []
    parts, urls = [], []
    for k, part in enumerate(m.content):
        if isinstance(part, (ImagePart, VideoPart)):
            if role != "user":
                raise bad_request(f"{where}.content[{k}]: images and videos are accepted in user messages only",
                                  param="messages")
            is_image = isinstance(part, ImagePart)
            parts.append(None if is_image else VIDEO)
            urls.append(part.image_url.url if is_image else (VIDEO, part.video_url.url))
        else:
            parts.append(check_text(part.text, f"{where}.content[{k}].text", markers))
    return Turn(role, parts, extra), urls


async def _chat(fe: Frontend, body: ChatCompletionRequest):
    bad = unsupported_fields(body, UNSUPPORTED_CHAT)
    if bad:
        raise bad_request(f"not supported by this server: {', '.join(bad)}", param=bad[0],
                          code="unsupported_parameter")
    lora_name = fe.served.resolve(body.model)
    if fe.served.chat is None:
        raise bad_request(f"the model {fe.served.base_id} has no chat template: use /v1/completions with your own "
                          "prompt, or start the front end with --chat-template FILE", param="messages",
                          code="no_chat_template")
    turns, urls, call_ids = [], [], set()
    for i, m in enumerate(body.messages):
        turn, message_urls = _turn(i, m, call_ids, fe.served.markers + fe.served.video_markers)
        turns.append(turn)
        urls += message_urls
    tools = plan_tools(body, fe.tool_call_parser)
    guide = request_guide(body, tools.guide)
    plan = make_plan(body, fe.served.defaults)
    apply(plan.inputs, guide)
    video_urls = [u[1] for u in urls if isinstance(u, tuple)]
    if video_urls and not fe.served.video_markers:
        raise bad_request(f"the model {fe.served.base_id} takes no videos", param="messages")
    images, videos = await fe.media.load_media([u for u in urls if not isinstance(u, tuple)], video_urls)
    prompt = fe.served.chat.render(turns, len(images), add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message, tools=tools.tools,
                                   n_videos=len(videos))
    rid = request_id("chatcmpl", body.request_id)
    job = TritonRequest(rid, prompt, images, plan.max_tokens, plan.inputs, plan.stop, lora_name,
                        stream=plan.stream_engine, ignore_eos=plan.ignore_eos, videos=videos)
    fmt = ChatFormat(body.model, rid, ToolOutput(tools) if tools.mode else None)
    if plan.stream:
        return await fe.stream(fmt, [job], plan)
    return await fe.complete(fmt, [job], plan)

