"""The chat page at / (tierlm/server/static/chat.html) in a real headless Chromium, driven by
selenium, against a server on a thread of this process serving a tiny model; and the page and
/stats over plain HTTP.

The browser is Debian's `chromium` and `chromium-driver` (scripts/install_browser.sh installs them
during `make setup`); the browser tests skip, saying so, only where they are not installed.
"""

from __future__ import annotations

import re
import shutil
import time
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import httpx
import pytest

from tests.tiny import make_model, write_profile
from tierlm.profile import load_profile
from tierlm.runtime.session import open_session
from tierlm.server.options import ServerOptions
from tierlm.server.run import BackgroundServer

KEY = "page-key"
CHAT = "/v1/chat/completions"
MAX_TOKENS = 24
WAIT_S = 60
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-page")
    make_model(root / "tiny-chat")
    profile = load_profile(str(write_profile(root / "page.toml", context_length=512, batch_size=2)))
    return open_session(str(root / "tiny-chat"), profile, device="cpu", dtype="fp32")


@contextmanager
def serving(session, **options):
    """A server with test hooks on (to slow decoding down); yields (url, httpx client)."""
    with BackgroundServer(session, ServerOptions(debug_hooks=True, access_log=False, **options)) as server:
        headers = {"Authorization": f"Bearer {options['api_key']}"} if options.get("api_key") else {}
        with httpx.Client(base_url=server.url, timeout=60, headers=headers) as client:
            yield server.url, client


@pytest.fixture(scope="module")
def server(session):
    with serving(session) as running:
        yield running


def api_reply(client, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """The non-streamed reply at temperature 0: what the page's streamed one must equal."""
    response = client.post(CHAT, json={"messages": messages, "temperature": 0, "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    return response.json()


def slow_decoding(client, seconds: float) -> None:
    response = client.post("/debug/worker", json={"action": "delay", "seconds": seconds})
    assert response.status_code == 200, response.text


# ---- the page over HTTP ----


def test_page_ships_in_the_package_and_loads_nothing_from_elsewhere():
    page = resources.files("tierlm.server").joinpath("static").joinpath("chat.html")
    assert page.is_file()
    text = page.read_text(encoding="utf-8")
    assert "<script>" in text and 'id="prompt"' in text
    # No CDN, no web fonts, no remote anything: every src/href/url() is local or data:.
    remote = re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*(?:https?:)?//|@import""", text)
    assert remote == []
    assert "innerHTML" not in text and "insertAdjacentHTML" not in text  # model output goes in as text


def test_root_serves_the_page_without_the_key_and_stats_with_it(session):
    with serving(session, api_key=KEY) as (url, client):
        page = httpx.get(url + "/", timeout=30)  # no Authorization header
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.content == resources.files("tierlm.server").joinpath("static").joinpath("chat.html").read_bytes()
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert httpx.head(url + "/", timeout=30).status_code == 200  # Ollama's CLI checks a server so
        assert httpx.get(url + "/stats", timeout=30).status_code == 401  # the page's calls need it

        api_reply(client, [{"role": "user", "content": "hello"}])
        deadline = time.monotonic() + 10  # the reply reaches the client just before its slot is freed
        while (stats := client.get("/stats").json())["requests"]["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
    placement = session.loaded.placement
    assert stats["model"] == "tiny-chat"
    assert sum(stats["placement"]["blocks"].values()) == len(placement.blocks)
    assert stats["placement"]["weight_bytes"] == placement.block_bytes_by_tier()
    assert stats["memory"]["resident_bytes"] > 0
    assert stats["memory"]["ram_budget_bytes"] == placement.budgets["device"]  # CPU: one RAM tier
    assert stats["speed"]["decode_tokens_per_s"] > 0  # the reply above ran decode steps
    assert stats["requests"] == {"active": 0, "queued": 0, "slots": 2, "parallel": 8}


# ---- the page in a browser ----


def browser_binary() -> str | None:
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


@pytest.fixture(scope="module")
def browser():
    binary = browser_binary()
    if binary is None or not Path(CHROMEDRIVER).is_file():
        pytest.skip("no Chromium/chromedriver here: run `make setup` as root on Debian/Ubuntu, or "
                    "`apt-get install chromium chromium-driver` (scripts/install_browser.sh)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a dev extra: pip install -e '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--no-first-run", "--disable-extensions", "--window-size=1200,900"):
        options.add_argument(flag)
    # An explicit driver path: selenium-manager (which downloads drivers) never runs.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SE_OFFLINE", "true")
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


def wait(driver, predicate, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: predicate(d), message=what)


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def open_page(driver, url: str) -> None:
    driver.get(url + "/")
    wait(driver, lambda d: js(d, "return document.getElementById('model').options.length") > 0
         or js(d, "return document.getElementById('error').textContent"), "the page to reach the server")


def settings(driver, *, temperature: float = 0, max_tokens: int = MAX_TOKENS, system: str = "") -> None:
    js(driver, """
        document.getElementById('temperature').value = arguments[0];
        document.getElementById('max-tokens').value = arguments[1];
        document.getElementById('system-prompt').value = arguments[2];""", str(temperature), str(max_tokens), system)


def send(driver, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def click(driver, element_id: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, element_id).click()


def messages(driver) -> list[tuple[str, str, str]]:
    """(role, text, state) of each message shown, the text exactly as in the page."""
    return [tuple(m) for m in js(driver, """
        return [...document.querySelectorAll('#messages .message')].map(m =>
            [m.dataset.role, m.querySelector('.content').textContent, m.dataset.state || '']);""")]


def reply_done(driver) -> str:
    """Waits for the last assistant message to end (and the page to be idle); returns its text."""
    wait(driver, lambda d: js(d, "return document.body.dataset.busy") == "false"
         and messages(d) and messages(d)[-1][0] == "assistant" and messages(d)[-1][2] == "done",
         "the reply to end")
    return messages(driver)[-1][1]


def record_growth(driver) -> None:
    """From now on, the page keeps the length of the last assistant message at every change."""
    js(driver, """
        window.lengths = [];
        new MutationObserver(() => {
            const all = document.querySelectorAll('#messages .message.assistant .content');
            if (all.length) window.lengths.push(all[all.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});""")


@pytest.mark.e2e
def test_typed_message_gets_a_streamed_reply_equal_to_the_api_one(browser, server):
    url, client = server
    open_page(browser, url)
    assert js(browser, "return document.getElementById('key-section').hidden") is True  # no key asked for
    assert js(browser, "return document.getElementById('model').value") == "tiny-chat"
    settings(browser)
    text = "hello world"  # the tiny model's reply to it streams in a dozen pieces
    expected = api_reply(client, [{"role": "user", "content": text}])
    record_growth(browser)
    slow_decoding(client, 0.05)  # so the tokens arrive over time, not in one network read
    try:
        send(browser, text)
        reply = reply_done(browser)
    finally:
        slow_decoding(client, 0)
    assert messages(browser)[0][:2] == ("user", text)
    assert reply == expected["choices"][0]["message"]["content"] and reply
    lengths = js(browser, "return window.lengths")
    growth = sorted(set(lengths))
    assert len(growth) >= 4, lengths  # appeared piece by piece
    assert lengths == sorted(lengths) and growth[-1] == len(reply)
    # The page's own speed line counts the tokens the server reported.
    tokens = expected["usage"]["completion_tokens"]
    wait(browser, lambda d: js(d, "return document.getElementById('stat-reply').textContent")
         .startswith(f"{tokens} tokens"), "the reply's token count")


@pytest.mark.e2e
def test_stats_are_shown_and_refreshed(browser, server):
    url, client = server
    first_turn = [{"role": "user", "content": "name a colour"}]
    reply = api_reply(client, first_turn)["choices"][0]["message"]
    api_reply(client, [*first_turn, reply, {"role": "user", "content": "and another"}])  # reuses the first's slot
    open_page(browser, url)
    read = "return [document.getElementById('stats').dataset.updated, " \
           "document.getElementById('stat-decode').textContent, document.getElementById('stat-placement').textContent]"
    wait(browser, lambda d: js(d, read)[0], "the first /stats")
    first, decode, placement = js(browser, read)
    stats = client.get("/stats").json()
    assert re.fullmatch(r"\d+\.\d tok/s.*", decode)
    for tier, count in stats["placement"]["blocks"].items():
        assert f"{count} blocks (" in placement and f") on {tier}" in placement
    assert "planned" in placement
    assert "of" in js(browser, "return document.getElementById('stat-memory').textContent")  # vs the budget
    wait(browser, lambda d: js(d, read)[0] != first, "/stats to be read again")
    # Prefix reuse and what each slot holds, as /stats says (no request runs meanwhile: the figures stay put).
    reuse, held = stats["prefix_reuse"], [str(slot["tokens"]) for slot in stats["kv_cache"]["slots"] if slot["tokens"]]
    assert reuse["reused_tokens"] > 0
    percent = int(100 * reuse["hit_rate"] + 0.5)  # as Math.round
    shown = f"{percent}% ({reuse['reused_tokens']} of {reuse['prompt_tokens']} prompt tokens)"
    assert js(browser, "return document.getElementById('stat-reuse').textContent") == shown
    kv = js(browser, "return document.getElementById('stat-kv').textContent")
    spill = stats["kv_cache"]["spill"]
    idle = spill["conversations"] + (spill["disk"]["conversations"] if spill["disk"] else 0)
    pages = stats["kv_cache"]["pages"]
    pool = (f"; {pages['used']} of {pages['total']} pages of 16 tokens in use ({pages['shared']} shared, "
            f"{pages['idle']} kept for idle conversations)")
    assert re.search(rf"; {idle} idle conversations kept \([\d.]+ [KMG]?i?B\){re.escape(pool)}; conversations hold "
                     rf"{', '.join(held)} tokens$", kv), kv
    assert pages["used"] > 0 and held
    requests = js(browser, "return document.getElementById('stat-requests').textContent")
    assert requests == f"0 active (up to {stats['requests']['parallel']} at once), 0 queued"
    assert kv.startswith(f"{stats['kv_cache']['format']}, {stats['kv_cache']['context']} tokens of context: ")


@pytest.mark.e2e
def test_stop_regenerate_and_reset(browser, server):
    url, client = server
    open_page(browser, url)
    settings(browser)
    text = "how are you?"
    full = api_reply(client, [{"role": "user", "content": text}])["choices"][0]["message"]["content"]
    slow_decoding(client, 0.2)
    try:
        send(browser, text)
        wait(browser, lambda d: len(messages(d)) == 2 and messages(d)[1][1], "the reply to begin")
        click(browser, "stop")
        stopped = reply_done(browser)
    finally:
        slow_decoding(client, 0)
    assert full.startswith(stopped) and len(stopped) < len(full)
    assert js(browser, "return document.querySelector('#messages .message.assistant .note').textContent") == "(stopped)"

    click(browser, "regenerate")  # replaces the stopped reply with a whole one
    assert reply_done(browser) == full
    assert [m[:2] for m in messages(browser)] == [("user", text), ("assistant", full)]

    click(browser, "reset")
    assert messages(browser) == []
    # The next reply is to this message alone: the conversation was forgotten, not just hidden.
    other = "<b>hello</b> world"  # shown as typed: never parsed as HTML
    send(browser, other)
    assert reply_done(browser) == api_reply(client, [{"role": "user", "content": other}])["choices"][0]["message"]["content"]
    assert [m[:2] for m in messages(browser)][0] == ("user", other) and len(messages(browser)) == 2
    assert js(browser, "return document.querySelectorAll('#messages b').length") == 0


@pytest.mark.e2e
def test_server_with_a_key_refuses_until_the_key_is_entered(browser, session):
    with serving(session, api_key=KEY) as (url, client):
        open_page(browser, url)
        error = "return document.getElementById('error').textContent"
        assert js(browser, "return document.getElementById('key-section').hidden") is False
        assert "needs an API key" in js(browser, error)
        settings(browser)
        text = "hello there"
        send(browser, text)
        wait(browser, lambda d: js(d, "return document.body.dataset.busy") == "false", "the refusal")
        assert "needs an API key (401)" in js(browser, error)
        assert messages(browser) == [("user", text, "")]  # no reply

        key = browser.find_element("id", "api-key")
        key.send_keys("wrong-key")
        click(browser, "save-key")
        wait(browser, lambda d: "refused this API key" in js(d, error), "the wrong key refused")

        key.clear()
        key.send_keys(KEY)
        click(browser, "save-key")
        wait(browser, lambda d: js(d, error) == "", "the key accepted")
        assert js(browser, "return sessionStorage.getItem('tierlm.apiKey')") == KEY
        click(browser, "regenerate")  # asks again for the refused message
        reply = reply_done(browser)
        assert reply == api_reply(client, [{"role": "user", "content": text}])["choices"][0]["message"]["content"]
        wait(browser, lambda d: js(d, "return document.getElementById('stats').dataset.updated"), "/stats with the key")
