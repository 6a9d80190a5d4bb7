"""--api-key: every route but /health needs the key (issue 12's auth matrix), and the operator can
open chosen routes."""

from __future__ import annotations

import httpx
import pytest

from ruvllm import LLM
from tests.server.conftest import MODEL, RunningServer, start_server

KEY = "sekrit-key"
ROUTES = [
    ("GET", "/metrics", None), ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/docs", None), ("GET", "/openapi.json", None), ("GET", "/redoc", None),
    ("GET", "/v1/nothing", None),  # unknown routes too: no probing what exists without the key
]
AUTHS = {"none": None, "wrong": f"Bearer {KEY}x", "short": "Bearer s", "no scheme": KEY,
         "right": f"Bearer {KEY}", "lowercase scheme": f"bearer {KEY}", "upper scheme": f"BEARER {KEY}"}


@pytest.fixture(scope="module")
def keyed(_shared_llm: LLM):
    yield from start_server(_shared_llm, api_key=KEY)


def _send(url: str, method: str, path: str, body, auth: str | None) -> httpx.Response:
    headers = {"Authorization": auth} if auth is not None else {}
    with httpx.Client(base_url=url, timeout=60) as c:
        return c.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("auth", list(AUTHS))
@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_auth_matrix(keyed: RunningServer, method, path, body, auth) -> None:
    r = _send(keyed.url, method, path, body, AUTHS[auth])
    if auth in ("right", "lowercase scheme", "upper scheme"):
        assert r.status_code == (404 if path == "/v1/nothing" else 200), r.text
        return
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("auth", ["none", "wrong"])
def test_health_needs_no_key(keyed: RunningServer, auth) -> None:
    assert _send(keyed.url, "GET", "/health", None, AUTHS[auth]).status_code == 200


def test_models_root_is_the_served_name_not_a_path(keyed: RunningServer) -> None:
    data = _send(keyed.url, "GET", "/v1/models", None, AUTHS["right"]).json()["data"][0]
    assert data["root"] == MODEL


def test_operator_opens_chosen_routes(_shared_llm: LLM) -> None:
    for srv in start_server(_shared_llm, api_key=KEY, routes_without_key=("/metrics",)):
        assert _send(srv.url, "GET", "/metrics", None, None).status_code == 200
        assert _send(srv.url, "GET", "/v1/models", None, None).status_code == 401
        assert _send(srv.url, "GET", "/openapi.json", None, None).status_code == 401
