"""--api-key: every route but /health needs the key (issue 12's auth matrix), and the operator can
open chosen routes."""

from __future__ import annotations

import functools

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
    return _client(url).request(method, path, json=body, headers=headers)


@functools.cache
def _client(url: str) -> httpx.Client:
    """One a server for the matrix's ~90 requests: each new client builds an SSL context (~54 ms of
    CPU; tests/server/conftest.py)."""
    return httpx.Client(base_url=url, timeout=60)


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


# Roles (issue 33, items 3 and 13): the admin routes are the operator's; tenants' keys get 403, and
# so does everyone on a server with tenants' keys and no admin key; the `learned:` names are reserved.
ADMIN = "admin-key"
TENANTS = (("key-a", "alice"), ("key-b", "bob"))
ADMIN_ROUTES = [("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
                ("/v1/unload_lora_adapter", {"lora_name": "x"})]


@pytest.fixture(scope="module")
def roles(_shared_llm: LLM):
    yield from start_server(_shared_llm, api_key=KEY, admin_key=ADMIN, api_keys=TENANTS)


@pytest.mark.parametrize("who,status,code", [("none", 401, "invalid_api_key"), ("key-a", 403, "admin_only"),
                                             (KEY, 403, "admin_only"), (ADMIN, None, None)])
@pytest.mark.parametrize("path,body", ADMIN_ROUTES, ids=[r[0] for r in ADMIN_ROUTES])
def test_admin_routes_need_the_admin_key(roles: RunningServer, path, body, who, status, code) -> None:
    r = _send(roles.url, "POST", path, body, None if who == "none" else f"Bearer {who}")
    if status is None:  # through to the route: this server has no LoRA (load), nothing is loaded (unload)
        assert r.status_code in (400, 404) and r.json()["error"]["code"] in ("lora_disabled", "model_not_found")
        return
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text


@pytest.mark.parametrize("path,body", ADMIN_ROUTES, ids=[r[0] for r in ADMIN_ROUTES])
def test_learned_names_are_reserved_even_for_the_admin(roles: RunningServer, path, body) -> None:
    r = _send(roles.url, "POST", path, {**body, "lora_name": "learned:alice:v19"}, f"Bearer {ADMIN}")
    assert r.status_code == 403 and r.json()["error"]["code"] == "reserved_name"
    assert "'learned:'" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body", ADMIN_ROUTES, ids=[r[0] for r in ADMIN_ROUTES])
def test_single_api_key_is_the_admin(keyed: RunningServer, path, body) -> None:
    r = _send(keyed.url, "POST", path, body, AUTHS["right"])
    assert r.status_code in (400, 404) and r.json()["error"]["code"] != "admin_only"


def test_tenant_keys_without_an_admin_key_close_the_admin_routes(_shared_llm: LLM) -> None:
    for srv in start_server(_shared_llm, api_keys=TENANTS):
        for path, body in ADMIN_ROUTES:
            r = _send(srv.url, "POST", path, body, "Bearer key-a")
            assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]


def test_admin_key_alone_guards_the_admin_routes_only(_shared_llm: LLM) -> None:
    for srv in start_server(_shared_llm, admin_key=ADMIN):
        assert _send(srv.url, "GET", "/v1/models", None, "Bearer unused").status_code == 200
        r = _send(srv.url, "POST", *ADMIN_ROUTES[1], "Bearer unused")
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
        assert _send(srv.url, "POST", *ADMIN_ROUTES[1], f"Bearer {ADMIN}").status_code == 404
