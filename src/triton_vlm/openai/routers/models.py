"""GET /v1/models, /v1/models/{id}: the base model and every adapter of the registry (`parent` = the base id).
The base model's card says which precision is served: `weights` (what the checkpoint holds and what it is
computed as) and `held` (how the running engine keeps the weight matrices, read from Triton's metrics)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ..errors import APIError
from . import authorize, frontend

router = APIRouter(dependencies=[Depends(authorize)])


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    fe = frontend(request)
    return {"object": "list", "data": fe.served.cards(held=await fe.metrics.weights_held())}


@router.get("/v1/models/{model_id}")
async def get_model(model_id: str, request: Request) -> dict:
    fe = frontend(request)
    for card in fe.served.cards(held=await fe.metrics.weights_held()):
        if card["id"] == model_id:
            return card
    raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
