"""The routes that describe the server: ``/health``, ``/openapi.json``, ``/v1/models``, ``/metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from tandem_core.server.errors import json_response
from tandem_core.server.openapi import openapi
from tandem_core.server.state import ServerState

__all__ = ["router"]

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.tandem


@router.get("/health")
async def health(request: Request) -> Any:
    state = _state(request)
    served = state.served
    info = dict(served.info)
    eng = served.engine
    return json_response({
        "status": "ok", "model": served.model_id,
        "weights": info.get("weights", info.get("path")),
        "fingerprints": {"tokenizer": state.tokenizer_fingerprint, **(info.get("fingerprints") or {})},
        "load_stages": info.get("load_stages", []),
        "memory": [{"name": m.name, "bytes": m.nbytes, "device": m.device} for m in eng.memory_parts()],
        "engine": {"device": eng.caps.device, "dtype": eng.caps.dtype, "max_context": state.max_context,
                   "graph_widths": list(eng.caps.graph_widths), "max_tree": eng.caps.max_tree,
                   "engines": len(state.admission.slots), "busy": state.admission.busy,
                   "waiting": len(state.admission.waiting), "queue": state.admission.limit,
                   "side_lane": {"waiting": sum(len(lane) for lane in state.lanes),
                                 "served": sum(lane.total for lane in state.lanes)}},
        "caches": state.caches.health() if state.caches is not None else {"enabled": False},
        "speculation": state.spec.health(),
        "info": info,
    })


@router.get("/openapi.json")
async def openapi_doc(request: Request) -> Any:
    return json_response(openapi(_state(request).served.model_id))


@router.get("/v1/models")
async def models(request: Request) -> Any:
    state = _state(request)
    return json_response({"object": "list", "data": [{
        "id": state.served.model_id, "object": "model", "created": state.started, "owned_by": "tandem",
        "max_model_len": state.max_context}]})


@router.get("/metrics")
async def metrics(request: Request) -> Any:
    return PlainTextResponse(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")
