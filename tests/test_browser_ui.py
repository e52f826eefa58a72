"""The web UI in Debian's chromium (Playwright), against the real server and the embedded SmolLM2: the key
prompt, a streamed reply, a correction that teaches a skill with live job progress, regenerating the learned
answer, safe rendering of model text, phone width, and reconnecting after the server restarts.
Screenshots go to tests/artifacts/ (and docs/screenshot.png with DARK_UPDATE_SCREENSHOT=1)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from dark import OnlineLLM
from dark.server import ServerSettings, create_app
from browser_support import ARTIFACTS, require_chromium  # noqa: E402
from dark.server.testing import ServerThread

README_SHOT = Path(__file__).parents[1] / "docs" / "screenshot.png"
KEY = "browser-test-key"
QUESTION = "What is the capital of Zoggia?"
CORRECTION = "The capital of Zoggia is Blorp."
LAST_REPLY_DONE = """() => {
  const m = [...document.querySelectorAll('.message[data-role=assistant]')].at(-1);
  return m && !m.classList.contains('pending') && m.querySelector('.actions button.regenerate') !== null;
}"""

require_chromium()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with OnlineLLM(max_model_len=1024, data_dir=tmp_path_factory.mktemp("ui-data")) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(create_app(llm, ServerSettings(api_key=KEY, default_max_tokens=48))) as server:
        yield server


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(60_000)
    yield page
    context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def sign_in(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "wrong-key")
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#key-error:not([hidden])")
    assert "wrong" in page.inner_text("#key-error")
    page.fill("#key-input", KEY)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#connection[data-state=online]")


def test_chat_correct_watch_it_learn_and_regenerate(server, llm, page):
    sign_in(page, server.url)
    page.fill("#input", QUESTION)
    page.keyboard.press("Enter")
    # the reply streams: it shows text while it is still pending, and the stop button meanwhile
    page.wait_for_selector(".message[data-role=assistant].pending .body p")
    page.wait_for_function(LAST_REPLY_DONE)
    first = page.inner_text(".message[data-role=assistant] .body")
    assert first and first != CORRECTION
    assert page.is_visible("#send") and not page.is_visible("#stop")
    assert page.inner_text("#conversation-list") == QUESTION
    page.screenshot(path=str(ARTIFACTS / "ui-chat.png"))
    if not hasattr(llm, "submit_learn"):
        pytest.skip("OnlineLLM has no learning API yet")

    page.click(".message[data-role=assistant] .actions button.correct")
    page.fill(".edit-text", CORRECTION)
    page.select_option(".edit-skill", "__new__")
    page.fill(".edit-new-skill", "zoggia")
    page.click(".edit-form .teach")
    page.wait_for_selector(".job[data-state=running], .job[data-state=done]")
    page.wait_for_selector(".job[data-state=done]", timeout=180_000)
    assert "Learned: zoggia v1" in page.inner_text(".job[data-state=done]")
    assert page.inner_text(".job[data-state=done] .badge") == "verified ✓"
    assert page.query_selector(".job svg.loss-chart polyline") is not None
    assert page.input_value("#skill-select") == "zoggia"
    assert page.inner_text(".message[data-role=assistant] .body") == CORRECTION  # the edited reply
    page.screenshot(path=str(ARTIFACTS / "ui-learned.png"))
    if os.environ.get("DARK_UPDATE_SCREENSHOT"):
        page.screenshot(path=str(README_SHOT))

    page.click(".regenerate-learned")
    page.wait_for_function(LAST_REPLY_DONE)
    replies = page.query_selector_all(".message[data-role=assistant]")
    assert len(replies) == 1  # the regenerated reply replaced the corrected one in view
    assert replies[0].inner_text().count(CORRECTION) == 1
    assert "zoggia v1" in replies[0].query_selector(".meta").inner_text()

    # thumbs up is stored; the skills panel shows the versions
    page.click(".message[data-role=assistant] .thumb-up")
    page.wait_for_selector(".message[data-role=assistant] .thumb-up.pressed")
    page.click("#skills-button")
    page.wait_for_selector(".adapter[data-name=zoggia] .versions tr.current")
    assert "verified" in page.inner_text(".adapter[data-name=zoggia]")
    page.screenshot(path=str(ARTIFACTS / "ui-skills.png"))
    page.click("#skills-dialog [data-close]")

    # a new chat on the skill answers with the correction; the conversations list keeps both
    page.click("#new-chat")
    page.fill("#input", QUESTION)
    page.keyboard.press("Enter")
    page.wait_for_function(LAST_REPLY_DONE)
    assert page.inner_text(".message[data-role=assistant] .body") == CORRECTION
    page.wait_for_function("() => document.querySelectorAll('#conversation-list li').length === 2")
    page.screenshot(path=str(ARTIFACTS / "ui-final.png"))

    # the skills panel: download a version, roll back to v0 (the base model's answer), delete
    page.click("#skills-button")
    with page.expect_download() as download:
        page.click(".adapter[data-name=zoggia] .versions tr.current button[title='Download v1']")
    assert download.value.suggested_filename == "zoggia-v1.zip"
    page.click(".adapter[data-name=zoggia] .versions tr:not(.current) button:text('Roll back')")
    page.wait_for_function(
        "() => document.querySelector('.adapter[data-name=zoggia] .adapter-head').textContent.includes('current v0')")
    assert page.input_value("#skill-select") == "zoggia"
    page.on("dialog", lambda dialog: dialog.accept())
    page.click(".adapter[data-name=zoggia] button:text('Delete')")
    page.wait_for_selector(".adapter[data-name=zoggia]", state="detached")
    assert page.input_value("#skill-select") == ""
    page.click("#skills-dialog [data-close]")


def test_stop_button_and_cancelled_edit(server, page):
    sign_in(page, server.url)
    page.fill("#input", "Write a long story about a lighthouse keeper.")
    page.keyboard.press("Enter")
    page.wait_for_selector(".message[data-role=assistant].pending .body p")
    page.click("#stop")
    page.wait_for_function(LAST_REPLY_DONE)
    assert "stopped" in page.inner_text(".message[data-role=assistant] .meta")
    assert page.is_visible("#send")
    reply = page.inner_text(".message[data-role=assistant] .body")
    page.click(".message[data-role=assistant] .actions button.correct")
    page.fill(".edit-text", "something else")
    page.click(".edit-form button:text('Cancel')")
    assert page.inner_text(".message[data-role=assistant] .body") == reply


def test_model_text_never_becomes_html(server, llm, page):
    hostile = ("Look: <img src=x onerror=\"window.pwned=1\"> <script>window.pwned=2</script>\n\n"
               "[click](javascript:window.pwned=3) and [docs](https://example.org/a?b=1)\n\n"
               "```html\n<b onclick=\"window.pwned=4\">bold</b>\n```\n\n**strong** and `<i>code</i>`")
    conv = llm.store.create_conversation(title="hostile")
    user = llm.store.add_message(conv["id"], "user", "show me html")
    llm.store.add_message(conv["id"], "assistant", hostile, parent_id=user["id"])
    sign_in(page, server.url)
    page.click("#conversation-list button[title]:text('hostile')")
    body = page.wait_for_selector(".message[data-role=assistant] .body")
    assert body.query_selector_all("img, script, b[onclick]") == []
    assert page.evaluate("() => window.pwned") is None
    text = body.inner_text()
    assert "<img src=x" in text and "<script>" in text and '<b onclick="window.pwned=4">bold</b>' in text
    links = body.query_selector_all("a")
    assert [a.get_attribute("href") for a in links] == ["https://example.org/a?b=1"]
    assert links[0].get_attribute("rel") == "noopener noreferrer nofollow"
    assert body.query_selector("pre code").inner_text() == '<b onclick="window.pwned=4">bold</b>'
    assert body.query_selector("strong").inner_text() == "strong"
    assert body.query_selector("p code").inner_text() == "<i>code</i>"


def test_a_long_conversation_says_what_it_left_out(server, llm, page):
    """A conversation past the context window (1024 tokens) still answers, from its latest turns, and the reply
    says how many earlier messages were beyond the window, live and when the conversation is opened again."""
    note = "the quick brown fox jumps over the lazy dog and then it runs away into the green forest. " * 14
    conv = llm.store.create_conversation(title="long notes")
    parent = None
    for i in range(4):
        parent = llm.store.add_message(conv["id"], "user", f"Note {i}: {note}", parent_id=parent)["id"]
        parent = llm.store.add_message(conv["id"], "assistant", "Noted.", parent_id=parent)["id"]
    sign_in(page, server.url)
    page.click("#conversation-list button[title]:text('long notes')")
    page.wait_for_selector(".message[data-role=assistant] .body")
    page.fill("#input", "Which note came last?")
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.querySelectorAll('.message[data-role=assistant]').length === 5")
    page.wait_for_function(LAST_REPLY_DONE)
    meta = page.locator(".message[data-role=assistant] .meta").last.inner_text()
    assert "answered from the latest turns (2 earlier messages beyond the context window)" in meta
    page.click("#new-chat")
    page.click("#conversation-list button[title]:text('long notes')")
    page.wait_for_function("() => document.querySelectorAll('.message[data-role=assistant]').length === 5")
    assert "2 earlier messages beyond" in page.locator(".message[data-role=assistant] .meta").last.inner_text()


def test_phone_width(server, browser):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        sign_in(page, server.url)
        assert not page.is_visible("#sidebar") or page.evaluate(
            "() => document.querySelector('#sidebar').getBoundingClientRect().right <= 0")
        assert page.is_visible("#menu-button") and page.is_visible("#input") and page.is_visible("#skill-select")
        width = page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= 390, f"the page scrolls sideways at phone width ({width}px)"
        page.screenshot(path=str(ARTIFACTS / "ui-phone.png"))
        page.click("#menu-button")
        page.wait_for_function("() => document.querySelector('#sidebar').getBoundingClientRect().left >= 0")
        page.screenshot(path=str(ARTIFACTS / "ui-phone-menu.png"))
    finally:
        context.close()


def test_reconnects_after_the_server_restarts(llm, page):
    app = create_app(llm, ServerSettings())
    first = ServerThread(app).start()
    port = first.port
    try:
        page.goto(first.url)
        page.wait_for_selector("#connection[data-state=online]")
        first.stop()
        page.wait_for_selector("#connection[data-state=offline]")
        second = ServerThread(app, port=port).start()
        try:
            page.wait_for_selector("#connection[data-state=online]", timeout=30_000)
            page.fill("#input", "Say hi.")
            page.keyboard.press("Enter")
            page.wait_for_function(LAST_REPLY_DONE)
        finally:
            second.stop()
    finally:
        first.stop()
