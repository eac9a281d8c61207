"""The request bodies of the POST routes in ``/openapi.json``.

The routes read the raw body and validate it themselves (strict JSON mode,
400 in the OpenAI envelope; :mod:`megac.server.app`), so FastAPI sees no
body parameter and would publish operations without a ``requestBody``.
This fills each in from the pydantic model the route validates with, so
clients and the schema-driven fuzz (tests/server/test_fuzz_openapi.py)
see the real request shapes.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

#: where a model's JSON schema lives in the OpenAPI document
REF = "#/components/schemas/{model}"


def publish_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """``app.openapi()`` with ``POST path`` taking a JSON ``bodies[path]``."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template=REF)
                schemas.update(body.pop("$defs", {}))  # nested models, referenced through REF
                schemas[model.__name__] = body
                doc["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
                }
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


__all__ = ["publish_request_bodies"]
