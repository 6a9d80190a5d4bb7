"""Every generation route's body, mutated field by field, against a running ruvllm server: each field
of a valid body (its top level, its first message, Ollama's options) removed or replaced by values of
other types and sizes, and the fields the dialects know added with the same values. What must hold:
no 5xx, no timeout, every 4xx a JSON error body; and afterwards the engine idle with every KV block
back (read from /metrics). `--stream` sends the streaming routes' bodies streaming and reads each
stream to its end: a 200 must end as its dialect ends a stream, with no error event. The test suite
checks the bad-input table (tests/server/test_bad_input.py and each dialect's client tests); run this
for the broad sweep and record what it prints in docs/server.md.

    ruvllm serve --served-model-name m --max-context 256 --port 8131 &
    python benchmarks/fuzz_routes.py --url http://127.0.0.1:8131 --model m [--stream]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator

import httpx

# A valid body for each route; "M" is replaced by --model.
SEEDS: dict[str, dict] = {
    "/v1/chat/completions": {"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"model": "M", "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": "M", "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": "M", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "M", "messages": [{"role": "user", "content": "hi"}]},
    "/api/chat": {"model": "M", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                  "options": {"num_predict": 4}},
    "/api/generate": {"model": "M", "prompt": "hi", "stream": False, "options": {"num_predict": 4}},
    "/api/embed": {"model": "M", "input": "hi"},
    "/api/embeddings": {"model": "M", "prompt": "hi"},
    "/v1/embeddings": {"model": "M", "input": "hi"},
    "/api/show": {"model": "M"},
    "/tokenize": {"model": "M", "prompt": "hi"},
    "/detokenize": {"model": "M", "tokens": [1, 2]},
    "/v1/rerank": {"model": "M", "query": "a", "documents": ["b", "c"]},
    "/v1/score": {"model": "M", "text_1": "a", "text_2": "b"},
}
# Values of every JSON type, at their edges: integers past 32 and 64 bits, a float that overflows
# most arithmetic, an empty and a long string, a NUL, nested lists and objects.
VALUES: list[object] = [None, True, -1, 0, 1, 2**31, 10**20, -10**20, 1.5, -0.5, 1e308, "", "x", "\u0000", "ééé",
                        [], [1], ["a"], [[1, 2]], [{}], [{"type": "text", "text": "hi"}], {}, {"a": 1},
                        {"type": "text"}, "x" * 5000]
# Fields of the dialects (OpenAI's, the Responses API's, Anthropic's, Ollama's), added where a seed lacks them.
EXTRA_FIELDS = ("stream", "n", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "stop",
                "seed", "temperature", "top_p", "top_k", "format", "think", "system", "stream_options",
                "logit_bias", "echo", "best_of", "suffix", "user", "metadata", "instructions",
                "previous_response_id", "text", "keep_alive", "options", "images", "raw", "template", "context",
                "truncate", "dimensions", "encoding_format")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "images", "thinking")
OPTION_FIELDS = ("num_predict", "temperature", "top_k", "top_p", "seed", "stop", "num_ctx", "repeat_penalty", "min_p")


def _with(seed: dict, path: tuple, value: object) -> dict:
    body = copy.deepcopy(seed)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


def mutations(seed: dict) -> Iterator[dict]:
    for key in seed:
        yield {k: v for k, v in copy.deepcopy(seed).items() if k != key}
        for value in VALUES:
            yield _with(seed, (key,), value)
    for key in EXTRA_FIELDS:
        if key not in seed:
            for value in VALUES:
                yield _with(seed, (key,), value)
    for parent, keys in (("messages", MESSAGE_FIELDS), ("options", OPTION_FIELDS)):
        if parent in seed:
            for key in keys:
                for value in VALUES:
                    yield _with(seed, (parent, 0, key) if parent == "messages" else (parent, key), value)


# What ends a whole stream in each streaming dialect (--stream): a 200 stream without one of these, or
# with an error event, failed after its headers were sent. (A response's `"error": null` is no error.)
_DONE = ("data: [DONE]",)
_OLLAMA_DONE = ('"done":true', '"done": true')
STREAM_ENDS = {"/v1/chat/completions": _DONE, "/v1/completions": _DONE,
               "/v1/responses": ("event: response.completed", "event: response.incomplete"),
               "/v1/messages": ("event: message_stop",), "/api/chat": _OLLAMA_DONE, "/api/generate": _OLLAMA_DONE}
STREAM_ERRORS = ("event: error", "response.failed", '"error":{', '"error": {')


def _send(client: httpx.Client, route: str, body: dict) -> str:
    """The outcome's class: 2xx, 4xx, 5xx, timeout, transport, non-JSON 4xx, broken stream."""
    try:
        if body.get("stream") is True:  # read the stream to its end: a failure may come mid-stream
            with client.stream("POST", route, json=body) as r:
                text = "".join(r.iter_text())
            if r.status_code == 200 and route in STREAM_ENDS and (
                    not any(e in text for e in STREAM_ENDS[route]) or any(e in text for e in STREAM_ERRORS)):
                return "broken stream"
        else:
            r = client.post(route, json=body)
            text = r.text
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError:
        return "transport"
    if r.status_code >= 500:
        return "5xx"
    if r.status_code >= 400:
        try:
            json.loads(text)
        except ValueError:
            return "non-JSON 4xx"
        return "4xx"
    return "2xx"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, help="the served model's name")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take")
    ap.add_argument("--stream", action="store_true",
                    help="only the streaming routes, each body streaming, each stream read to its end")
    args = ap.parse_args()
    seeds = {r: {**b, "stream": True} for r, b in SEEDS.items() if r in STREAM_ENDS} if args.stream else SEEDS
    outcomes: dict[str, Counter] = {}
    failures: list[tuple[str, str, str]] = []
    start = time.monotonic()
    with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
        for route, seed in seeds.items():
            seed = _with(seed, ("model",), args.model)
            counts = outcomes.setdefault(route, Counter())
            for body in mutations(seed):
                outcome = _send(client, route, body)
                counts[outcome] += 1
                if outcome not in ("2xx", "4xx"):
                    failures.append((route, outcome, json.dumps(body)[:200]))
        health = client.get("/health").status_code
        metrics = client.get("/metrics").text
    print(f"{sum(sum(c.values()) for c in outcomes.values())} requests in {time.monotonic() - start:.0f} s")
    print("| route | requests | 2xx | 4xx | 5xx, timeouts, transport errors, non-JSON 4xx, broken streams |")
    print("|---|---|---|---|---|")
    for route, counts in outcomes.items():
        other = sum(v for k, v in counts.items() if k not in ("2xx", "4xx"))
        print(f"| {route} | {sum(counts.values())} | {counts['2xx']} | {counts['4xx']} | {other} |")
    print(f"/health afterwards: {health}")
    gauges = ("ruvllm:num_requests_running", "ruvllm:num_requests_waiting", "ruvllm:kv_cache_usage_perc")
    for line in metrics.splitlines():
        if line.startswith(gauges):
            print(line)
    for failure in failures:
        print("FAILED", *failure)
    return 1 if failures or health != 200 else 0


if __name__ == "__main__":
    sys.exit(main())
