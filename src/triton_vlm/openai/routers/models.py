"""GET /v1/models, /v1/models/{id}: the base model and every adapter of the registry (`parent` = the base id)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ..errors import APIError
from . import authorize, frontend

router = APIRouter(dependencies=[Depends(authorize)])


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": frontend(request).served.cards()}


@router.get("/v1/models/{model_id}")
async def get_model(model_id: str, request: Request) -> dict:
    for card in frontend(request).served.cards():
        if card["id"] == model_id:
            return card
    raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
