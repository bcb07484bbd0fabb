"""The warm-up requests a server sends itself before it says it is ready
(dsv4/serve/http/warm_request.py): they run end to end, the request metrics start after them,
and a failing one is reported without stopping the start."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from dsv4.serve.http import warm_request
from dsv4.serve.http.metrics import ServerMetrics

pytest_plugins = ["serve.server_fixtures"]


def test_metrics_start_after_the_warm_up(fake_server_factory, metric, monkeypatch):
    sent = []
    real = warm_request.warm_bodies
    monkeypatch.setattr(warm_request, "warm_bodies", lambda model: sent.extend(real(model)) or sent)
    server = fake_server_factory()
    assert [path for path, _ in sent] == ["/v1/completions", "/v1/chat/completions", "/v1/chat/completions"]
    assert sent[2][1]["response_format"] == {"type": "json_object"}
    import httpx
    with httpx.Client(base_url=server.base_url, timeout=30, trust_env=False) as client:
        before = client.get("/metrics").text
        assert metric(before, "dsv4:time_to_first_token_seconds_count") == 0.0
        assert metric(before, "dsv4:request_success_total", finished_reason="length") == 0.0
        r = client.post("/v1/completions", json={"model": "dsv4-test", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        after = client.get("/metrics").text
    assert metric(after, "dsv4:time_to_first_token_seconds_count") == 1.0
    assert metric(after, "dsv4:request_success_total", finished_reason="length") == 1.0


class _State:
    api_key, model_names, info = "k", ["m"], type("Info", (), {"num_pages": 4})()
    metrics = ServerMetrics("m", 4)


def test_a_failing_warm_up_is_reported_not_fatal(capsys):
    app = FastAPI()
    seen = []

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def broken(request: dict) -> JSONResponse:
        seen.append(request["model"])
        return JSONResponse({"error": {"message": "no"}}, status_code=500)

    state = _State()
    before = state.metrics
    assert asyncio.run(warm_request.warm_up(app, state)) is False
    assert seen == ["m", "m", "m"]
    assert "warm-up request to /v1/completions failed" in capsys.readouterr().err
    assert state.metrics is not before               # fresh metrics even so
