"""The OpenAPI document is derived from the routes: every route is in it, with its security,
parameters, body and responses; a route without a declaration cannot be served undocumented."""

from __future__ import annotations

import pytest
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api.app import routes
from run_engine.api.openapi import openapi_document

ROUTES = routes()


def test_every_route_is_documented_with_responses_and_security() -> None:
    doc = openapi_document(ROUTES)
    operations = [(m, p, op) for p, item in doc["paths"].items() for m, op in item.items()]
    assert len(operations) == sum(len(r.methods - {"HEAD"}) for r in ROUTES)
    for method, path, op in operations:
        assert "200" in op["responses"] and op["summary"], (method, path)
        if path.startswith("/engine/"):
            assert op["security"] == [{"workerToken": []}], path
        for name in [seg[1:-1] for seg in path.split("/") if seg.startswith("{")]:
            assert any(p["name"] == name and p["in"] == "path" for p in op["parameters"]), (path, name)
    trigger = doc["paths"]["/api/v1/tasks/{taskId}/trigger"]["post"]
    assert (trigger["requestBody"]["content"]["application/json"]["schema"]
            == {"$ref": "#/components/schemas/TriggerBody"})
    assert (trigger["responses"]["429"]["content"]["application/json"]["schema"]
            == {"$ref": "#/components/schemas/Error"})
    assert {"Run", "Error", "TriggerBody", "Snapshot"} <= set(doc["components"]["schemas"])


def test_a_route_without_a_declaration_is_refused() -> None:
    async def undocumented(request: object) -> Response:
        return Response()

    with pytest.raises(RuntimeError, match="no @operation"):
        openapi_document([*ROUTES, Route("/x", undocumented)])
