"""GET /metrics (Prometheus text format) and /version."""

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request, Response

from server.metrics import CONTENT_TYPE
from server.responses import VersionResponse

router = APIRouter()


def server_version() -> str:
    try:
        return version("llmserve")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+source"


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/version", response_model=VersionResponse)
async def get_version() -> VersionResponse:
    return VersionResponse(version=server_version())
