"""The chat page at `/`, driven by a real headless Chromium (Debian's, through Playwright): it
loads, streams a reply, stops a reply mid-way (the request is aborted: every KV block comes back),
keeps the conversation across a reload, shows feedback buttons only when the server learns, and
the screenshot in docs/ is taken from it."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import RunningServer

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):  # the set-up installs it: in CI a missing browser is a failure, not a skip
            pytest.fail("chromium is not installed (scripts/bootstrap.sh installs Debian's)")
        pytest.skip("no chromium on this machine")
    return path


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        yield b
        b.close()


def test_the_page_streams_stops_and_keeps_the_conversation(browser, server: RunningServer) -> None:
    assert httpx.get(server.url + "/", timeout=10).headers["content-type"].startswith("text/html")
    page = browser.new_page(viewport={"width": 1100, "height": 760})
    page.goto(server.url + "/")
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "48")
    page.fill("#input", "Write a haiku about the sea.")
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    page.wait_for_function("document.querySelector('#send').textContent === 'Send'", timeout=60_000)
    first = reply.inner_text()
    assert len(first.strip()) > 10 and page.locator(".msg.user").count() == 1
    assert page.locator("text=👍").count() == 0  # this server does not learn: no feedback buttons

    # a long reply, stopped mid-way: the stream closes, the engine aborts the request
    page.fill("#max_tokens", "2000")
    page.fill("#input", "Tell me a very long story about a lighthouse keeper.")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.msg.assistant')[1]?.textContent.length > 40",
                           timeout=60_000)
    page.click("#send")  # now the stop button
    page.wait_for_function("document.querySelector('#send').textContent === 'Send'", timeout=10_000)
    stats = server.wait_idle(timeout=10)
    assert stats.free_blocks == stats.total_blocks and stats.running == 0
    stopped = page.locator(".msg.assistant").nth(1).inner_text()
    time.sleep(1.0)
    assert page.locator(".msg.assistant").nth(1).inner_text() == stopped  # nothing more arrives

    page.reload()
    page.wait_for_selector(".msg.assistant")
    assert page.locator(".msg.user").count() == 2 and page.locator(".msg.assistant").count() == 2
    assert page.locator(".msg.assistant").first.inner_text().startswith(first.strip().split("\n")[0][:20])
    # docs/chat-page.png is this screenshot; written there only when asked, so a test run leaves the
    # tree clean (RUVLLM_UPDATE_DOCS=1 scripts/test.sh tests/server/test_chat_page.py)
    shot = page.screenshot()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("RUVLLM_UPDATE_DOCS"):
        (DOCS / "chat-page.png").write_bytes(shot)
    page.close()


def test_feedback_buttons_teach_when_the_server_learns(browser, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The page's buttons and what the API does with them: the tiny model serves (the default one
    with LoRA was a second load of the real model, and its float copy for the learner, for a reply
    nobody reads; learning on the real model is tests/e2e/test_learning.py's)."""
    from ruvllm import LLM
    from ruvllm.learning.config import InstantConfig, LearningConfig
    from tests.server.conftest import start_server

    llm = LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=4, quantization="none")
    learning = LearningConfig(instant=InstantConfig(layers=1), root=str(tmp_path / "learned"))
    for running in start_server(llm, learning=learning):
        page = browser.new_page()
        page.goto(running.url + "/")
        page.wait_for_function("document.querySelectorAll('#model option').length > 0")
        page.fill("#temperature", "0")  # greedy: the random model's reply is the same every run
        page.fill("#max_tokens", "12")
        page.fill("#input", "Say hello.")
        page.click("#send")
        page.wait_for_selector("text=👍", timeout=60_000)
        page.click("text=👍")
        page.wait_for_selector(".tools button.chosen", timeout=30_000)  # the API answered 200
        learner = running.app.state.ruvllm.service.learner
        assert learner.adapter_for("default") == "learned:default:v1"
        page.on("dialog", lambda d: d.accept("Hello there, friend."))
        page.click("text=suggest a better answer")
        page.wait_for_function("document.querySelectorAll('.tools button.chosen').length === 1 && "
                               "document.querySelector('.tools button.chosen').textContent.startsWith('suggest')",
                               timeout=30_000)
        assert learner.adapter_for("default") == "learned:default:v2"
        page.close()


def test_the_page_renders_whatever_local_storage_holds(browser, server: RunningServer) -> None:
    """Issue 33: non-string content in localStorage stopped the page from rendering."""
    page = browser.new_page()
    page.goto(server.url + "/")
    page.evaluate("""() => { localStorage.setItem('ruvllm.messages', JSON.stringify([{role: 'user', content: 5},
        null, 7])); localStorage.setItem('ruvllm.temperature', '{"a": 1}'); localStorage.setItem('ruvllm.model', '[1]'); }""")
    page.reload()
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    assert page.locator(".msg").count() == 0 and page.input_value("#temperature") != "[object Object]"
    page.fill("#max_tokens", "4")
    page.fill("#input", "Hi")
    page.click("#send")
    page.wait_for_function("document.querySelector('#send').textContent === 'Send'", timeout=60_000)
    assert page.locator(".msg.user").count() == 1 and page.locator(".msg.assistant").count() == 1
    page.close()
