"""`GET /openapi.json`: FastAPI's schema of the routes, with the request bodies the
handlers parse themselves (they read raw bytes, so FastAPI cannot see them) filled in from
the pydantic models, and the bearer-token scheme."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .protocol import ChatCompletionRequest, CompletionRequest
from .utility import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

BODIES = {
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/v1/completions": (CompletionRequest,),
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/detokenize": (DetokenizeRequest,),
}


def install(app: FastAPI, version: str) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app, version)
        return app.openapi_schema

    app.openapi = openapi


def build_schema(app: FastAPI, version: str) -> dict:
    schema = get_openapi(title="dsv4", version=version, routes=app.routes,
                         description="An OpenAI-compatible server for DeepSeek-V4")
    components = schema.setdefault("components", {})
    models = components.setdefault("schemas", {})
    for path, bodies in BODIES.items():
        refs = [_add_model(models, body) for body in bodies]
        body = refs[0] if len(refs) == 1 else {"anyOf": refs}
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": body}}}
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearer": []}]
    return schema


def _add_model(models: dict, model) -> dict:
    js = model.model_json_schema(ref_template="#/components/schemas/{model}")
    models.update(js.pop("$defs", {}))
    models[model.__name__] = js
    return {"$ref": f"#/components/schemas/{model.__name__}"}
