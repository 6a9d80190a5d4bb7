"""Tenants (issue 16): a request is its API key's tenant's (--api-keys), else its `user`'s, else
"default"'s; each tenant other than "default" has a prefix cache of its own (OpenAI's
`usage.prompt_tokens_details.cached_tokens` shows the hits), through the real `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ruvllm import LLM
from ruvllm.server.tenants import read_api_keys
from tests.server.conftest import MODEL, RunningServer, start_server

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in " \
         "want of a wife. However little known the feelings or views of such a man may be on his first entering"


@pytest.fixture
def server(_shared_llm: LLM, tmp_path: Path) -> Iterator[RunningServer]:
    keys = tmp_path / "keys"
    keys.write_text("# key tenant\nkey-a  acme\nkey-b globex\nkey-c acme\n")
    yield from start_server(_shared_llm, api_keys=read_api_keys(keys))


def _cached(server: RunningServer, key: str, user: str | None = None) -> int:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    extra = {"user": user} if user else {}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, **extra)
    return out.usage.prompt_tokens_details.cached_tokens


def test_each_tenant_has_its_own_prefix_cache(server: RunningServer) -> None:
    assert _cached(server, "key-a") == 0
    assert _cached(server, "key-a") > 0  # the tenant's own blocks
    assert _cached(server, "key-c") > 0  # another key of the same tenant
    assert _cached(server, "key-b") == 0  # another tenant sees none of them
    with pytest.raises(openai.AuthenticationError):
        _cached(server, "key-z")


def test_user_field_names_the_tenant_without_keys(_shared_llm: LLM) -> None:
    for running in start_server(_shared_llm):
        assert _cached(running, "unused") == 0
        assert _cached(running, "unused") > 0  # the default tenant shares
        assert _cached(running, "unused", user="alice") == 0
        assert _cached(running, "unused", user="alice") > 0
        assert _cached(running, "unused", user="bob") == 0


@pytest.mark.parametrize("text,message", [("k1 t1\nk1 t2\n", "listed twice"), ("k1\n", "expected `KEY TENANT`"),
                                          ("# none\n", "no keys")])
def test_bad_key_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "keys").write_text(text)
    with pytest.raises(ValueError, match=message):
        read_api_keys(tmp_path / "keys")


def test_admin_key_is_no_tenant_whatever_its_user(_shared_llm: LLM, tmp_path: Path) -> None:
    """Issue 33, item 13: the admin key (and a shared --api-key beside tenants' keys) with `user: acme`
    is not acme: it never hits acme's prefix cache (nor gets acme's learned adapter)."""
    keys = tmp_path / "keys"
    keys.write_text("key-a acme\n")
    for running in start_server(_shared_llm, api_keys=read_api_keys(keys), admin_key="admin", api_key="shared"):
        assert _cached(running, "key-a") == 0
        assert _cached(running, "key-a") > 0
        assert _cached(running, "admin", user="acme") == 0  # the default tenant's first time
        assert _cached(running, "shared", user="acme") > 0  # the default tenant's too: it shares with admin
