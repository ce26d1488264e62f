"""GET /v1/models, /v1/models/{id} and /health."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.errors import APIError
from server.responses import ModelCard, ModelList
from server.routes.common import ERROR_RESPONSES, serving

router = APIRouter(responses=ERROR_RESPONSES)


def _card(request: Request) -> ModelCard:
    ctx = serving(request)
    return ModelCard(id=ctx.settings.model_name, created=request.app.state.started_at, max_model_len=ctx.max_model_len)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(request)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    card = _card(request)
    if model_id != card.id:
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
    return card


@router.get("/health", responses={503: ERROR_RESPONSES[503]})
async def health(request: Request) -> JSONResponse:
    """200 when the engine is loaded and its worker thread runs; 503 while loading, after a crash, or draining."""
    state = request.app.state
    if state.async_engine is None:
        raise APIError(
            503,
            f"model failed to load: {state.load_error}" if state.load_error else "the model is still loading",
            code="model_loading",
        )
    stats = state.async_engine.engine.stats()
    if state.async_engine.dead or not stats.is_alive:
        reason = state.async_engine.failure or getattr(stats, "error", None)
        raise APIError(503, "the inference engine has stopped" + (f": {reason}" if reason else ""), code="engine_dead")
    return JSONResponse({"status": "ok", "decode_step": stats.decode_step})
