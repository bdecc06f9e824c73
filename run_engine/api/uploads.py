"""Payloads uploaded before the trigger that names them, as Trigger.dev's SDK sends a payload of 128
KiB or more (its ``conditionallyExportPacket``): ``PUT /api/v2/packets/{name}`` answers
``{presignedUrl, storagePath}``; the SDK PUTs the JSON to that URL (of this server, signed, good for
:data:`URL_TTL_S`, no credential needed: as it would to object storage), then triggers with
``payloadType: "application/store"`` and the storage path as the payload. The trigger reads the
packet (:func:`unpack`: one query for a whole batch) and the run stores it as its payload, within
the payload limit as any other. Packets are kept an hour (``PACKET_TTL_S``), then deleted by the
leader's retention pass."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.context import ApiContext, ctx_of
from run_engine.api.http import MAX_REQUEST_BYTES, ApiError, decode_payloads, json_response, read_body
from run_engine.api.inputs import is_number
from run_engine.api.models import TriggerOptions
from run_engine.api.openapi import Query, operation
from run_engine.api.public_tokens import forbidden
from run_engine.api.shape_stream import STORE
from run_engine.engine import PACKET_BYTES_PER_ENV

#: the packet types a trigger takes: JSON and superjson are decoded, text is kept as a string (what
#: the SDK sends for a string payload)
TYPES = ("application/json", "application/super+json", "text/plain")
#: what the uploaded payloads one request names may add up to (each counted as often as it is named):
#: the request body's own limit, as when the payloads are inline
NAMED_BYTES = MAX_REQUEST_BYTES
URL_TTL_S = 900
MAX_NAME = 512


def _may_upload(scopes: frozenset[str] | None) -> bool:
    """A secret key may; a public token only when it may trigger something."""
    return scopes is None or any(s in ("admin", "write:all") or s.startswith(("trigger:tasks", "batchTrigger:tasks"))
                                 for s in scopes)


@operation("A URL to upload a payload to before a trigger names it (Trigger.dev's createUploadPayloadUrl)",
           S.PacketUpload, security="apiKeyOrPublicToken")
async def upload_url(request: Request) -> Response:
    ctx = ctx_of(request)
    # a one-time token is spent by the trigger the upload is for, not here (as Trigger.dev does).
    # No run token: an executor's outputs are never uploaded (a completion takes them inline)
    auth = await ctx.env_auth(request, public=True, spend=False)
    if not _may_upload(auth.scopes):
        raise forbidden()
    name = request.path_params["name"]
    if (not name or len(name) > MAX_NAME or not name.isprintable()
            or any(part in (".", "..") for part in name.split("/"))):  # a URL client would rewrite those
        raise ApiError(400, "invalid_input", f"name: 1..{MAX_NAME} printable characters, no . or .. segment")
    path = f"uploads/{secrets.token_hex(12)}/{name}"  # never another upload's, whatever the name
    expires = int(ctx.engine.now()) + URL_TTL_S
    signature = ctx.tokens.packet_signature("put", f"{auth.env_id}/{path}", expires)
    url = (f"{ctx.public_url}/api/v1/packet-uploads/{auth.env_id}/{quote(path, safe='/')}"
           f"?expires={expires}&signature={signature}")
    return json_response({"presignedUrl": url, "storagePath": path})


@operation("Upload a payload to a URL an upload request signed (no credential; the body is the JSON)", None,
           security="none", any_body=True,
           query=(Query("expires", {"type": "string", "maxLength": 20}),
                  Query("signature", {"type": "string", "maxLength": 128})))
async def upload(request: Request) -> Response:
    ctx = ctx_of(request)
    env_id, path = request.path_params["env_id"], request.path_params["path"]
    expires, signature = request.query_params.get("expires", ""), request.query_params.get("signature", "")
    if (not is_number(expires) or len(expires) > 20
            or not ctx.tokens.packet_ok("put", f"{env_id}/{path}", int(expires), signature, ctx.engine.now())):
        raise ApiError(403, "forbidden", "invalid or expired upload URL")
    await ctx.check_limit(f"env:{env_id}")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in TYPES:
        raise ApiError(400, "invalid_input", f"Content-Type: one of {', '.join(TYPES)}")
    # the payload limit applies to the decoded payload at the trigger; superjson's meta is on top
    raw = await read_body(request, 2 * ctx.engine.settings.max_payload_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "invalid_input", "body: not UTF-8") from None
    if "\x00" in text:
        raise ApiError(400, "invalid_input", "body: a NUL character cannot be stored")
    if not await ctx.engine.put_packet(env_id, path, content_type, text):
        raise ApiError(429, "rate_limited", f"the uploaded payloads waiting for their triggers already take "
                                            f"{PACKET_BYTES_PER_ENV} bytes in this environment: trigger them, or "
                                            "wait for them to expire (an hour)")
    return Response(status_code=200)


async def unpack(ctx: ApiContext, env_id: str, items: Sequence[tuple[Any, TriggerOptions | None]],
                 fields: Sequence[str], failed: dict[int, ApiError] | None = None,
                 ) -> list[tuple[Any, TriggerOptions | None]]:
    """``items`` (payload, options) with each ``application/store`` payload replaced by the packet
    uploaded at its path (and its type): 400 naming the field when there is none in the
    environment (never another environment's, whatever the path); then each payload sent as JSON
    text decoded (:func:`decode_payload`: a large one off the event loop). With ``failed``, an
    item's own error is put there by its position instead (the item is answered as it was given)
    and the others go on; what the request names in all (:data:`NAMED_BYTES`) is still its own."""
    out = await _unpack(ctx, env_id, items, fields, failed)
    decoded = await decode_payloads([(None, None, "") if failed and i in failed else
                                     (payload, options.payloadType if options is not None else None,
                                      f"{fields[i]}payload") for i, (payload, options) in enumerate(out)],
                                    ctx.engine.settings.max_payload_bytes, failed)
    return [(out[i][0] if failed and i in failed else payload, options)
            for i, (payload, (_, options)) in enumerate(zip(decoded, out, strict=True))]


async def _unpack(ctx: ApiContext, env_id: str, items: Sequence[tuple[Any, TriggerOptions | None]],
                  fields: Sequence[str], failed: dict[int, ApiError] | None,
                  ) -> list[tuple[Any, TriggerOptions | None]]:
    stored = {i: payload for i, (payload, options) in enumerate(items)
              if options is not None and options.payloadType == STORE}
    if not stored:
        return list(items)

    def fail(i: int, error: ApiError) -> None:
        if failed is None:
            raise error
        failed[i] = error

    for i, payload in list(stored.items()):
        if not isinstance(payload, str) or not payload or len(payload) > 2 * MAX_NAME:
            fail(i, ApiError(400, "invalid_input", f"{fields[i]}payload: an application/store payload is the "
                                                   "storagePath of an upload (PUT /api/v2/packets/{name})"))
            del stored[i]
    found = await ctx.engine.uploaded_packets(env_id, sorted(set(stored.values())))
    out = list(items)
    named = 0
    for i, path in stored.items():
        packet = found.get(path)
        options = items[i][1]
        if packet is None or options is None:
            fail(i, ApiError(400, "invalid_input", f"{fields[i]}payload: no uploaded packet at {path[:200]!r} in "
                                                   "this environment (PUT /api/v2/packets/{name} first; kept an "
                                                   "hour)"))
            continue
        # one small request naming the same 3 MiB packet a thousand times must not decode 3 GB
        named += len(packet.data)
        if named > NAMED_BYTES:
            raise ApiError(413, "payload_too_large", f"{fields[i]}payload: the uploaded payloads this request "
                                                     f"names add up to more than {NAMED_BYTES} bytes")
        out[i] = (packet.data, options.model_copy(update={"payloadType": packet.content_type}))
    return out


ROUTES = [
    Route("/api/v2/packets/{name:path}", upload_url, methods=["PUT"]),
    Route("/api/v1/packet-uploads/{env_id}/{path:path}", upload, methods=["PUT"]),
]
