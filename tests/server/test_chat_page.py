"""The chat page at `/`, driven in headless Chromium (Selenium) against the tiny server.

Skipped, with the reason, where Selenium or Chromium and its driver are not installed
(`scripts/setup.sh --test` installs them on Debian). The page's answers are checked against the
same requests made directly, so "the adapter changes the answer" means the answer it should.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fixtures import TinyServer, steps_wait_for_a_cancel, wait_until

from graftlm.server.app import ServerThread, create_app
from graftlm.server.state import ServerState

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.common.by import By  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)
PAGE_S = 120  # how long the page may take to show something (a hang's bound)


def _find(names: tuple[str, ...]) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    binary, driver = _find(BROWSERS), _find(DRIVERS)
    if binary is None or driver is None:
        pytest.skip(
            "no Chromium and chromedriver on PATH (scripts/setup.sh --test installs Debian's "
            "chromium and chromium-driver)"
        )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,800")
    d = webdriver.Chrome(service=Service(driver), options=options)
    d.set_script_timeout(30)
    try:
        yield d
    finally:
        d.quit()


def _open(browser: Any, url: str) -> None:
    browser.get(url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(url + "/")
    wait_until(
        lambda: "adapter" in browser.find_element(By.ID, "status").text, PAGE_S, "the status"
    )


def _set(browser: Any, selector: str, value: str, event: str = "change") -> None:
    browser.execute_script(
        "const e = document.querySelector(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event(arguments[2]));",
        selector,
        value,
        event,
    )


def _settings(browser: Any, **values: str) -> None:
    for key, value in values.items():
        _set(browser, f"#{key}", value)


def _send(browser: Any, text: str) -> None:
    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()
    wait_until(
        lambda: browser.execute_script("return document.body.dataset.busy") == "0",
        PAGE_S,
        "the page to be idle",
    )


def _replies(browser: Any) -> list[str]:
    return [
        str(browser.execute_script("return arguments[0].textContent", e))
        for e in browser.find_elements(By.CSS_SELECTOR, ".column .message.assistant")
    ]


def _direct(
    server: TinyServer, text: str, lora: list[dict[str, Any]] | None = None, model: str = ""
) -> str:
    """The answer to the same request made without the page: by `lora`, or by `model`."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 12,
    }
    body |= {"lora": lora} if lora is not None else {"model": model}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_page_streams_and_the_adapter_picker_changes_the_answer(
    browser: Any, server: TinyServer
) -> None:
    _open(browser, server.url)
    options = [
        o.text for o in browser.find_elements(By.CSS_SELECTOR, ".column select.model option")
    ]
    assert options[0] == "tiny" and {"alpha", "beta"} <= set(options)
    sliders = browser.find_elements(By.CSS_SELECTOR, ".column .adapter input[type=range]")
    assert [s.get_attribute("data-id") for s in sliders] == ["0"]  # a0, pinned at scale 0
    _settings(browser, temperature="0", max_tokens="12")

    _send(browser, "Hello")
    base = _direct(server, "Hello", [{"id": 0, "scale": 0.0}])
    assert _replies(browser) == [base] and base
    assert "tok/s" in browser.find_element(By.CSS_SELECTOR, ".speed").text

    browser.find_element(By.ID, "new-chat").click()
    _set(browser, ".column .adapter input[type=range]", "1", event="input")
    _send(browser, "Hello")
    adapted = _direct(server, "Hello", [{"id": 0, "scale": 1.0}])
    assert adapted != base
    assert _replies(browser) == [adapted]

    # the conversation survives a reload (localStorage)
    browser.refresh()
    wait_until(lambda: _replies(browser) == [adapted], PAGE_S, "the history after a reload")


def test_compare_streams_two_settings_side_by_side(browser: Any, server: TinyServer) -> None:
    _open(browser, server.url)
    _settings(browser, temperature="0", max_tokens="12")
    _set(browser, "#mode", "compare")
    wait_until(
        lambda: len(browser.find_elements(By.CSS_SELECTOR, ".column")) == 2, PAGE_S, "two columns"
    )
    _set(browser, ".column[data-index='1'] .adapter input[type=range]", "1", event="input")
    _send(browser, "Hi there")
    want = [
        _direct(server, "Hi there", [{"id": 0, "scale": 0.0}]),
        _direct(server, "Hi there", [{"id": 0, "scale": 1.0}]),
    ]
    assert want[0] != want[1]
    assert _replies(browser) == want
    assert len(browser.find_elements(By.CSS_SELECTOR, ".speed")) == 2


def test_stop_cancels_the_reply_and_the_next_one_works(
    browser: Any,
    server: TinyServer,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    # After 40 steps the engine waits for the cancellation: the reply is still going when Stop
    # is clicked however slow the machine and the browser (5 ms a step was not enough under
    # load), and it holds some 40 tokens then, which as the next turn's prompt stay well inside
    # the 1024-token context (the random model's text re-tokenizes into ~3 times as many tokens:
    # a 700-token reply became a 2000-token prompt, which the next turn was rightly refused for).
    steps_wait_for_a_cancel(server.state.service, monkeypatch, request, free=40)
    _open(browser, server.url)
    _settings(browser, temperature="0", max_tokens="300")
    browser.find_element(By.ID, "input").send_keys("Tell me everything")
    browser.find_element(By.ID, "send").click()
    wait_until(lambda: any(len(r) > 3 for r in _replies(browser)), PAGE_S, "the first pieces")
    browser.find_element(By.ID, "stop").click()
    wait_until(
        lambda: browser.execute_script("return document.body.dataset.busy") == "0",
        PAGE_S,
        "the page to be idle",
    )
    stopped = browser.find_elements(By.CSS_SELECTOR, ".message.assistant.stopped")
    assert len(stopped) == 1
    _settings(browser, max_tokens="4")
    _send(browser, "again")
    error = browser.find_element(By.ID, "error").text
    assert error == "" and len(_replies(browser)) == 2


def test_a_refused_request_shows_the_servers_error(browser: Any, server: TinyServer) -> None:
    _open(browser, server.url)
    _settings(browser, temperature="-1", max_tokens="4")
    _send(browser, "Hello")
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed() and error.text.startswith("400: ") and "temperature" in error.text
    assert _replies(browser) == []  # the turn that did not happen leaves no empty reply


def test_api_key_entered_once_in_the_page(browser: Any, server: TinyServer) -> None:
    config = dataclasses.replace(server.state.config, api_key="sesame")
    state = ServerState(
        config, server.state.service, server.state.registry, server.state.metrics, server.model_path
    )
    with ServerThread(create_app(state)) as srv:
        browser.get(srv.url + "/")
        browser.execute_script("localStorage.clear()")
        browser.get(srv.url + "/")
        error = browser.find_element(By.ID, "error")
        wait_until(lambda: "401" in error.text, PAGE_S, "the 401")
        assert "API key" in error.text and browser.find_element(By.ID, "settings").is_displayed()
        _set(browser, "#api-key", "sesame")
        wait_until(
            lambda: "adapter" in browser.find_element(By.ID, "status").text, PAGE_S, "the status"
        )
        _settings(browser, temperature="0", max_tokens="4")
        _send(browser, "Hello")
        assert len(_replies(browser)) == 1 and error.text == ""
        browser.get(srv.url + "/")  # kept for the next visit
        wait_until(
            lambda: "adapter" in browser.find_element(By.ID, "status").text, PAGE_S, "the status"
        )


def test_the_picker_alone_selects_an_adapter_and_compare_columns_differ(
    browser: Any, server: TinyServer
) -> None:
    """`model` names an adapter that runs at scale 1; the page's sliders of the other adapters
    go in `lora`, the picked one's only once moved (it used to send every slider, and a slider
    at 0 put the picked adapter back to the base)."""
    prompt = next(  # a prompt whose three answers read differently (a random model's bytes)
        p for p in ("Hello", "Hi there", "abc", "What now?", "Tell me", "xyz", "ok", "yes")
        if len({_direct(server, p, model=m) for m in ("tiny", "alpha", "beta")}) == 3
    )  # fmt: skip
    want = {m: _direct(server, prompt, model=m) for m in ("tiny", "alpha", "beta")}
    _open(browser, server.url)
    names = {
        str(browser.execute_script("return arguments[0].firstChild.textContent", e))
        for e in browser.find_elements(By.CSS_SELECTOR, ".column .adapter")
    }
    assert {"alpha", "beta"} <= names
    _settings(browser, temperature="0", max_tokens="12")
    _set(browser, ".column select.model", "alpha")
    slider = browser.find_element(
        By.XPATH, "//label[contains(@class,'adapter')][starts-with(.,'alpha')]/input"
    )
    assert slider.get_attribute("value") == "1"  # the picked adapter's scale, shown
    _send(browser, prompt)
    assert _replies(browser) == [want["alpha"]]

    browser.find_element(By.ID, "new-chat").click()
    _set(browser, "#mode", "compare")
    wait_until(
        lambda: len(browser.find_elements(By.CSS_SELECTOR, ".column")) == 2, PAGE_S, "two columns"
    )
    browser.find_element(By.ID, "add-column").click()
    wait_until(
        lambda: len(browser.find_elements(By.CSS_SELECTOR, ".column")) == 3, PAGE_S, "three columns"
    )
    for index, model in enumerate(("tiny", "alpha", "beta")):
        _set(browser, f".column[data-index='{index}'] select.model", model)
    _send(browser, prompt)
    assert _replies(browser) == [want["tiny"], want["alpha"], want["beta"]]
