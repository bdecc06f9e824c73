"""A run's payload or output by reference, as Trigger.dev's SDK fetches a packet it was sent as
``application/store`` (a realtime shape sends a large one so: :mod:`run_engine.api.shape_stream`).

``GET /api/v1/runs/{runId}/packets/{payload|output}`` (the SDK's ``getRunPacketUrl``) and ``GET
/api/v1/packets/{runId}/{field}.json`` (its older ``getPayloadUrl``, which it falls back to) answer
``{presignedUrl}``: a URL of this server, signed and good for :data:`URL_TTL_S`, that serves the
packet's JSON text without a credential (the SDK fetches it with none, as it would from object
storage). Each fetch counts against the environment's request rate."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.context import ApiContext, ctx_of
from run_engine.api.http import ApiError, json_response
from run_engine.api.inputs import is_number, looks_like_id
from run_engine.api.openapi import Query, operation
from run_engine.api.public import can_read
from run_engine.api.public_tokens import forbidden

FIELDS = ("payload", "output")
#: how long a packet URL serves its packet
URL_TTL_S = 900
_PATH = re.compile(r"(?P<run>[^/]{1,64})/(?P<field>payload|output)\.json")


async def _presign(request: Request, run_id: str, field: str) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, public=True)
    run = await ctx.engine.get_run(run_id, auth.env_id, light=True) if looks_like_id(run_id, "run") else None
    if run is None or field not in FIELDS:
        raise ApiError(404, "not_found", "packet not found")
    if not can_read(auth, run):
        raise forbidden()
    return json_response({"presignedUrl": packet_url(ctx, auth.env_id, run_id, field)})


def packet_url(ctx: ApiContext, env_id: str, run_id: str, field: str) -> str:
    expires = int(ctx.engine.now()) + URL_TTL_S
    signature = ctx.tokens.packet_signature("get", f"{env_id}/{run_id}/{field}", expires)
    return f"{ctx.public_url}/api/v1/packet-downloads/{env_id}/{run_id}/{field}?expires={expires}&signature={signature}"


@operation("A URL that serves a run's payload or output (Trigger.dev's getRunPacketUrl)", S.PacketUrl,
           security="apiKeyOrPublicToken")
async def run_packet_url(request: Request) -> Response:
    return await _presign(request, request.path_params["run_id"], request.path_params["field"])


@operation("A URL that serves the packet at a path `<runId>/<payload|output>.json` (Trigger.dev's getPayloadUrl)",
           S.PacketUrl, security="apiKeyOrPublicToken")
async def packet_path_url(request: Request) -> Response:
    found = _PATH.fullmatch(request.path_params["path"])
    if found is None:
        raise ApiError(404, "not_found", "packet not found")
    return await _presign(request, found["run"], found["field"])


@operation("A run's payload or output as JSON, by a URL a packet request signed (no credential)", None,
           security="none", query=(Query("expires", {"type": "string", "maxLength": 20}),
                                   Query("signature", {"type": "string", "maxLength": 128})))
async def download(request: Request) -> Response:
    ctx = ctx_of(request)
    env_id, run_id, field = (request.path_params[k] for k in ("env_id", "run_id", "field"))
    expires, signature = request.query_params.get("expires", ""), request.query_params.get("signature", "")
    if (not is_number(expires) or len(expires) > 20 or field not in FIELDS
            or not ctx.tokens.packet_ok("get", f"{env_id}/{run_id}/{field}", int(expires), signature,
                                        ctx.engine.now())):
        raise ApiError(403, "forbidden", "invalid or expired packet URL")
    await ctx.check_limit(f"env:{env_id}")
    text = await ctx.engine.packet_text(env_id, run_id, field)
    if text is None:
        raise ApiError(404, "not_found", "packet not found")
    return Response(text, media_type="application/json", headers={"Cache-Control": "private, no-store"})


ROUTES = [
    Route("/api/v1/runs/{run_id}/packets/{field}", run_packet_url, methods=["GET"]),
    Route("/api/v1/packets/{path:path}", packet_path_url, methods=["GET"]),
    Route("/api/v1/packet-downloads/{env_id}/{run_id}/{field}", download, methods=["GET"]),
]
