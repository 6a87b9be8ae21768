"""POST /v1/completions: a text prompt (or a list of them) sent to the ensemble as it is; images inline as
`<img src="data:image/...;base64,...">` tags, as the ensemble accepts them; structured outputs as in chat
(structured.py)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ..errors import bad_request
from ..params import make_plan
from ..responses import CompletionFormat
from ..schemas import UNSUPPORTED_COMPLETION, CompletionRequest, unsupported_fields
from ..service import Frontend
from ..structured import apply, request_guide
from ..triton import TritonRequest
from . import authorize, frontend, request_id, serve

router = APIRouter(dependencies=[Depends(authorize)])
MAX_PROMPTS = 64  # prompts of one request (each runs as its own generation, concurrently)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    texts = isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str)
    return await serve(request, "completions", lambda: _complete(frontend(request), body),
                       engine_requests=len(body.prompt) if texts else 1)  # one engine request per prompt


def _prompts(prompt) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    if not all(isinstance(p, str) for p in prompt):
        raise bad_request("prompt as token ids is not supported by this server: send text", param="prompt",
                          code="unsupported_parameter")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} are accepted", param="prompt")
    return list(prompt)


async def _complete(fe: Frontend, body: CompletionRequest):
    bad = unsupported_fields(body, UNSUPPORTED_COMPLETION)
    if bad:
        raise bad_request(f"not supported by this server: {', '.join(bad)}", param=bad[0],
                          code="unsupported_parameter")
    lora_name = fe.served.resolve(body.model)
    prompts = _prompts(body.prompt)
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported by this server (no prompt log probs)",
                          param="echo", code="unsupported_parameter")
    guide = request_guide(body)
    plan = make_plan(body, fe.served.defaults)
    apply(plan.inputs, guide)
    rid = request_id("cmpl", body.request_id)
    jobs = [TritonRequest(rid if len(prompts) == 1 else f"{rid}-{i}", p, [], plan.max_tokens, plan.inputs,
                          plan.stop, lora_name, stream=plan.stream_engine, ignore_eos=plan.ignore_eos)
            for i, p in enumerate(prompts)]
    fmt = CompletionFormat(body.model, rid)
    prefixes = prompts if body.echo else None
    if plan.stream:
        return await fe.stream(fmt, jobs, plan, prefixes)
    return await fe.complete(fmt, jobs, plan, prefixes)
