"""The agent panel in Debian's chromium (Playwright), against the real server, the embedded SmolLM2 and the real
mcp-server-time: add a server by JSON and toggle auto-approve, run a task, fix the model's call (edit it, or
write the call it should have made), see the real result, teach the skill (job progress, verified badge), then
approve the call the model now makes by itself; phone width. Screenshots go to tests/artifacts/."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "mcp"))
from agent_helpers import PY_SERVER, time_server  # noqa: E402

from dark import OnlineLLM  # noqa: E402
from dark.server import ServerSettings, create_app  # noqa: E402
from browser_support import ARTIFACTS, require_chromium  # noqa: E402
from dark.server.testing import ServerThread  # noqa: E402

KEY = "browser-agent-key"
SECRET = "sk-browser-SECRET-91"
TASK = "What time is it in Tokyo right now?"
LAST_RUN = ".agent-run:last-child"

require_chromium()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with OnlineLLM(data_dir=tmp_path_factory.mktemp("ui-agent-data")) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm, tmp_path_factory):
    mcp_file = tmp_path_factory.mktemp("ui-agent-mcp") / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {"time": {**time_server(), "env": {"TIME_TOKEN": SECRET}}}}))
    settings = ServerSettings(api_key=KEY, default_max_tokens=48, mcp_config=mcp_file)
    with ServerThread(create_app(llm, settings)) as server:
        yield server


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    context.add_init_script(f"localStorage.setItem('dark.apiKey', {json.dumps(KEY)})")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(60_000)
    yield page
    context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def wait_for_user_or_end(page) -> str:
    page.wait_for_selector(f"{LAST_RUN}:is([data-state=awaiting_approval], [data-state=done], [data-state=max_steps])",
                           timeout=120_000)
    return page.get_attribute(LAST_RUN, "data-state")


def run_task(page) -> str:
    page.fill("#agent-input", TASK)
    page.keyboard.press("Enter")
    page.wait_for_selector(f"{LAST_RUN} .agent-turn")
    return wait_for_user_or_end(page)


def reject_the_rest(page) -> None:
    """Whatever else the model proposes after the result, until it answers (the reason prompt is accepted by
    the test's dialog handler)."""
    while wait_for_user_or_end(page) == "awaiting_approval":
        page.click(f"{LAST_RUN} .tool-call[data-status=pending] .reject, "
                   f"{LAST_RUN} .tool-call[data-status=invalid] .reject")
        page.wait_for_timeout(200)


def test_agent_panel_edit_run_teach_approve(server, page):
    page.on("dialog", lambda d: d.accept("not needed"))
    page.goto(server.url)
    page.wait_for_selector("#connection[data-state=online]")
    page.click("#agent-button")
    page.wait_for_selector("#agent-view:not([hidden])")
    if not page.is_visible("#mcp-list"):
        page.click("#agent-servers summary")
    assert not page.is_visible("#messages")
    page.wait_for_selector(".mcp-server[data-name=time][data-state=ready]")
    assert "get_current_time" in page.inner_text(".mcp-server[data-name=time] .mcp-tools summary")

    # add a server by JSON, switch auto-approve on for it, and leave it out of the task
    page.fill("#mcp-name", "py")
    page.fill("#mcp-config", "{not json")
    page.click("#mcp-add button[type=submit]")
    assert "not valid JSON" in page.inner_text("#mcp-error")
    page.fill("#mcp-config", json.dumps({"command": sys.executable, "args": [str(PY_SERVER)]}))
    page.click("#mcp-add button[type=submit]")
    page.wait_for_selector(".mcp-server[data-name=py][data-state=ready]")
    page.check(".mcp-server[data-name=py] .auto-approve")
    page.wait_for_function("() => document.querySelector('.mcp-server[data-name=py] .auto-approve').checked")
    page.uncheck(".mcp-server[data-name=py] .use-server")
    assert SECRET not in page.content()

    # the base model: it answers without a call (write the call in) or proposes a wrong one (edit it)
    state = run_task(page)
    assert "base model" in page.inner_text(f"{LAST_RUN} .meta")
    if state == "awaiting_approval":
        page.click(f"{LAST_RUN} .tool-call:is([data-status=pending], [data-status=invalid]) .edit")
        submit = ".call-edit .run-edited"
    else:
        page.click(f"{LAST_RUN} .write-call")
        submit = ".call-edit .run-edited"
    page.select_option(f"{LAST_RUN} .call-edit .edit-name", "get_current_time")
    page.fill(f"{LAST_RUN} .call-edit .edit-args", '{"timezone": "Asia/Tokyo"')
    page.click(f"{LAST_RUN} {submit}")
    assert "not valid JSON" in page.inner_text(f"{LAST_RUN} .call-edit .edit-error")
    page.fill(f"{LAST_RUN} .call-edit .edit-args", '{"zone": "Asia/Tokyo"}')
    page.click(f"{LAST_RUN} {submit}")           # valid JSON, but not the tool's schema: the server says why
    page.wait_for_selector(f"{LAST_RUN} .call-edit .edit-error:not([hidden])")
    assert "timezone" in page.inner_text(f"{LAST_RUN} .call-edit .edit-error")
    page.fill(f"{LAST_RUN} .call-edit .edit-args", '{"timezone": "Asia/Tokyo"}')
    page.click(f"{LAST_RUN} {submit}")
    done = page.wait_for_selector(f"{LAST_RUN} .tool-call[data-status=done] pre.result")
    assert json.loads(done.inner_text())["timezone"] == "Asia/Tokyo"         # it ran on the real server
    reject_the_rest(page)
    page.screenshot(path=str(ARTIFACTS / "ui-agent-corrected.png"))

    # teach: the job's progress, then the verified badge
    page.click(f"{LAST_RUN} .teach-agent")
    page.wait_for_selector(f"{LAST_RUN} .job[data-state=running], {LAST_RUN} .job[data-state=done]")
    page.wait_for_selector(f"{LAST_RUN} .job[data-state=done]", timeout=180_000)
    assert "Learned: mcp-time v1" in page.inner_text(f"{LAST_RUN} .job")
    assert page.inner_text(f"{LAST_RUN} .job .badge") == "verified ✓"

    # the same task again makes the call itself: approve it as it is, and the result goes back to the model
    page.click(f"{LAST_RUN} .run-again")
    page.wait_for_selector(".agent-run:nth-child(3) .agent-turn")      # the empty note, then two runs
    assert wait_for_user_or_end(page) == "awaiting_approval"
    assert "skill mcp-time" in page.inner_text(f"{LAST_RUN} .meta")
    call = page.wait_for_selector(f"{LAST_RUN} .tool-call[data-status=pending]")
    assert call.query_selector(".call-name").inner_text() == "get_current_time"
    assert json.loads(call.query_selector("pre.args").inner_text()) == {"timezone": "Asia/Tokyo"}
    page.click(f"{LAST_RUN} .tool-call[data-status=pending] .approve")
    result = page.wait_for_selector(f"{LAST_RUN} .tool-call[data-status=done] pre.result")
    assert json.loads(result.inner_text())["timezone"] == "Asia/Tokyo"
    assert page.query_selector_all(f"{LAST_RUN} .tool-call pre img, {LAST_RUN} .tool-call pre script") == []
    if wait_for_user_or_end(page) == "awaiting_approval":   # it wants another call: stop the run there
        page.click(f"{LAST_RUN} .stop-run")
        page.wait_for_selector(f"{LAST_RUN}[data-state=cancelled]")
        assert page.query_selector(f"{LAST_RUN} .tool-call[data-status=pending] .approve") is None
    page.screenshot(path=str(ARTIFACTS / "ui-agent.png"), full_page=True)

    # phone width: nothing scrolls sideways
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(200)
    width = page.evaluate("() => document.documentElement.scrollWidth")
    assert width <= 390, f"the agent panel scrolls sideways at phone width ({width}px)"
    assert page.is_visible("#agent-input") and page.is_visible("#agent-button")
    page.screenshot(path=str(ARTIFACTS / "ui-agent-phone.png"))
