"""Ollama's native API through the official `ollama` client and LangChain's ChatOllama (the default
model): listing, show, ps, chat and generate streamed and not (the same text both ways, greedy),
tool calls as typed objects with object arguments, a JSON-schema format, bad input as Ollama's
{"error"} with a 4xx, the root's answer, and /api/pull against a local stand-in for the Hub."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import httpx
import ollama
import pytest

from ruvllm import __version__
from tests.server.conftest import MODEL, RunningServer

GREEDY = {"temperature": 0, "num_predict": 8}
HI = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _call(city: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                             "arguments": {"city": city}}}]}


# One earlier turn with a call (written back into the prompt in the tools' format) and the greedy
# default model calls the tool again, for the new city: the real call path, no grammar forcing it.
ASK_TOOL = [{"role": "user", "content": "Weather in Paris?"}, _call("Paris"), {"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def test_list_show_ps_version(client: ollama.Client, server: RunningServer) -> None:
    (model,) = client.list().models
    assert model.model == MODEL and model.size > 0 and model.digest.startswith("sha256:")
    d = model.details
    assert (d.format, d.family, d.quantization_level) == ("gguf", "llama", "Q4_1") and d.parameter_size == "134.52M"
    info = client.show(MODEL + ":latest")  # a client's `:latest` names the same model
    assert info.capabilities[:2] == ["completion", "tools"]
    assert ("embedding" in info.capabilities) == (httpx.post(server.url + "/api/embed", json={}).status_code != 404)
    assert info.modelinfo["general.architecture"] == "llama" and info.modelinfo["general.parameter_count"] > 1e8
    assert info.modelinfo["llama.context_length"] == server.engine.info.max_seq_len and "im_start" in info.template
    (loaded,) = client.ps().models
    assert loaded.model == MODEL and loaded.context_length == server.engine.info.max_seq_len and loaded.size > 0
    assert httpx.get(server.url + "/api/version").json() == {"version": __version__}


def test_chat_streamed_equals_whole(client: ollama.Client) -> None:
    whole = client.chat(MODEL, messages=HI, options=GREEDY, stream=False)
    parts = list(client.chat(MODEL, messages=HI, options=GREEDY, stream=True))
    assert whole.message.content and "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    for final in (whole, parts[-1]):
        assert final.done_reason == "length" and final.eval_count == 8 and final.prompt_eval_count > 5
        assert final.total_duration >= final.prompt_eval_duration + final.eval_duration > 0
        assert final.load_duration == 0 and final.model == MODEL
        datetime.fromisoformat(final.created_at)
    first = whole.message.content.split()[0]  # a last assistant message is continued, not answered
    more = client.chat(MODEL, messages=HI + [{"role": "assistant", "content": first}], options={**GREEDY, "num_predict": 3})
    assert whole.message.content.startswith(first + more.message.content) and more.message.content.strip()
    # the API streams unless told not to (the Python client always says which)
    raw = httpx.post(client._client.base_url.join("/api/chat"), json={"model": MODEL, "messages": HI, "options": GREEDY})
    assert raw.headers["content-type"] == "application/x-ndjson"
    assert "".join(json.loads(line)["message"]["content"] for line in raw.text.splitlines()) == whole.message.content
    lps = client.chat(MODEL, messages=HI, options={**GREEDY, "num_predict": 2}, stream=False, logprobs=True,
                      top_logprobs=2).logprobs
    assert len(lps) == 2 and whole.message.content.startswith(lps[0].token) and len(lps[0].top_logprobs) == 2


def test_generate_streamed_equals_whole_and_context_continues(client: ollama.Client) -> None:
    whole = client.generate(MODEL, "The capital of France is", options=GREEDY)
    parts = list(client.generate(MODEL, "The capital of France is", options=GREEDY, stream=True))
    assert whole.response and "".join(p.response for p in parts) == whole.response
    assert parts[-1].context == whole.context and len(whole.context) == whole.prompt_eval_count + whole.eval_count
    raw = client.generate(MODEL, "Once upon a time", raw=True, options={**GREEDY, "num_predict": 4})
    more = client.generate(MODEL, "Then", context=raw.context, options={**GREEDY, "num_predict": 2})
    assert more.prompt_eval_count > len(raw.context) and more.context[:len(raw.context)] == raw.context
    assert client.generate(MODEL, "").done_reason == "load"  # an empty prompt only loads the model


def test_tool_calls_are_typed_with_object_arguments(client: ollama.Client) -> None:
    args = dict(messages=ASK_TOOL, tools=TOOLS, options={"temperature": 0, "num_predict": 40})
    whole = client.chat(MODEL, **args)
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Rome"}
    assert whole.message.content == "" and whole.done_reason == "stop"
    parts = list(client.chat(MODEL, stream=True, **args))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Rome"})]
    assert "".join(p.message.content for p in parts) == ""  # the call's text is not also sent as content


def test_format_json_schema(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = client.chat(MODEL, messages=[{"role": "user", "content": "Is water wet?"}], format=schema,
                      options={"temperature": 0, "num_predict": 16})
    assert isinstance(json.loads(out.message.content)["ok"], bool) and out.done_reason == "stop"


@pytest.mark.parametrize("call, status, needle", [
    (lambda c: c.chat("nope", messages=HI), 404, "model 'nope' not found"),
    (lambda c: c.generate("nope", "x"), 404, "model 'nope' not found"),
    (lambda c: c.show("nope"), 404, "model 'nope' not found"),
    (lambda c: c.chat(MODEL, messages=HI, think=True), 400, "does not support thinking"),
    (lambda c: c.chat(MODEL, messages=HI, options={"temperature": -1}), 400, "temperature"),
    (lambda c: c.chat(MODEL, messages=HI, options={"num_predict": 0}), 400, "num_predict"),
    (lambda c: c.chat(MODEL, messages=HI, options={"num_ctx": 4}), 400, "num_ctx"),
    (lambda c: c.chat(MODEL, messages=HI, format={"type": "frobnicate"}), 400, "format"),
    (lambda c: c.chat(MODEL, messages=HI, keep_alive="soon"), 400, "keep_alive"),
    (lambda c: c.chat(MODEL, messages=[{"role": "robot", "content": "x"}]), 400, "role"),
    (lambda c: c.chat(MODEL, messages=HI, tools=[{"type": "function", "function": {}}], stream=True), 400, "tools"),
    (lambda c: c.generate(MODEL, "x", template="{{ .Prompt }}"), 400, "template"),
    (lambda c: c.generate(MODEL, "x", suffix="y"), 400, "suffix"),
    (lambda c: c.generate(MODEL, "x", raw=True, system="s"), 400, "raw"),
    (lambda c: c.generate(MODEL, "x", context=[10**9]), 400, "context"),
])
def test_bad_input_is_ollamas_error(client: ollama.Client, server: RunningServer, call, status, needle) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        result = call(client)
        list(result) if not isinstance(result, ollama.ChatResponse | ollama.GenerateResponse) else None
    assert info.value.status_code == status and needle in info.value.error
    assert server.sequences_admitted == 0


def test_num_ctx_beyond_the_model_is_clamped_and_raw_errors_keep_the_shape(client: ollama.Client,
                                                                           server: RunningServer) -> None:
    out = client.chat(MODEL, messages=HI, options={**GREEDY, "num_predict": 1, "num_ctx": 10**7}, stream=False)
    assert out.eval_count == 1
    bad = httpx.post(server.url + "/api/chat", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    missing = httpx.post(server.url + "/api/chat", json={"messages": HI})
    assert missing.status_code == 400 and "model" in missing.json()["error"]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'endpoint="/api/chat"' in metrics and 'endpoint="/api/generate"' in metrics


def test_root_answers_as_ollama_and_serves_the_page_to_browsers(server: RunningServer) -> None:
    assert httpx.head(server.url + "/").status_code == 200
    page = httpx.get(server.url + "/", headers={"accept": "text/html,application/xhtml+xml"})
    assert page.headers["content-type"].startswith("text/html")
    assert httpx.get(server.url + "/").headers["content-type"].startswith("text/html")  # */*, as before
    with httpx.Client() as c:
        c.headers.pop("accept")  # as Go's HTTP client sends it
        plain = c.get(server.url + "/")
    assert plain.status_code == 200 and plain.text == "Ollama is running"
    assert httpx.get(server.url + "/", headers={"accept": "text/plain"}).text == "Ollama is running"


def test_langchain_chat_ollama(server: RunningServer) -> None:
    langchain_ollama = pytest.importorskip("langchain_ollama")
    from langchain_core.messages import AIMessage, HumanMessage

    llm = langchain_ollama.ChatOllama(base_url=server.url, model=MODEL, temperature=0, num_predict=8)
    msg = llm.invoke("Say hi.")
    assert msg.content and msg.usage_metadata["output_tokens"] == 8
    prior = AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}])
    tooled = langchain_ollama.ChatOllama(base_url=server.url, model=MODEL, temperature=0, num_predict=40).bind_tools(TOOLS)
    out = tooled.invoke([HumanMessage("Weather in Paris?"), prior, HumanMessage("Weather in Rome?")])
    assert [(c["name"], c["args"]) for c in out.tool_calls] == [("get_weather", {"city": "Rome"})]


# ------------------------------------------------------------------ /api/pull against a stand-in Hub


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """tests/unit/test_cli_models.py's local stand-in for the Hugging Face Hub, serving one tiny
    safetensors repository; downloads go to a cache folder of the test's."""
    import threading
    from http.server import ThreadingHTTPServer

    import torch
    from safetensors.torch import save_file

    from tests.unit.test_cli_models import _HubStandIn, _handler, _point_hf_at

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    save_file({"w": torch.zeros(4, 4)}, str(repo / "model.safetensors"))
    standin = _HubStandIn(url="", repos={"ruvllm-test/ollama-pull": repo})
    http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(standin))
    standin.url = f"http://127.0.0.1:{http.server_address[1]}"
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    _point_hf_at(monkeypatch, standin.url)
    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(tmp_path / "cache"))
    yield tmp_path / "cache"
    http.shutdown()
    http.server_close()


def test_pull_downloads_with_progress_and_refuses_what_it_cannot_find(client: ollama.Client, hub: Path) -> None:
    lines = list(client.pull("ruvllm-test/ollama-pull", stream=True))
    statuses = [p.status for p in lines]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    progress = [p for p in lines if p.status == "pulling ruvllm-test/ollama-pull"]
    assert progress and progress[-1].completed == progress[-1].total > 0
    folder = hub / "models" / "ruvllm-test--ollama-pull"
    assert {"config.json", "model.safetensors"} <= {p.name for p in folder.iterdir()}
    assert client.pull("ruvllm-test/ollama-pull").status == "success"  # present: no download
    assert client.pull(MODEL).status == "success"  # the served model is here already
    for name, status in (("ruvllm-test/missing", 404), ("not a model name", 400), (MODEL + ":int8", 400)):
        for stream in (False, True):
            with pytest.raises(ollama.ResponseError) as info:
                list(client.pull(name, stream=True)) if stream else client.pull(name)
            assert info.value.status_code == status, (name, stream, info.value)
