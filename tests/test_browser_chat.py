"""The chat in a real browser: Debian's chromium driven by Playwright.

Two servers: the product itself (`launch.py serve` on the default model, in a subprocess)
and an in-process app on a *scripted* engine whose answers are known in advance, so every
colour, an XSS attempt, a code block and Stop can be checked exactly.
"""
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} missing: run `make browser` "
                       "(apt-get install -y chromium) to enable the browser tests"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc=None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    page = context.new_page()
    page.set_default_timeout(120_000)  # a wait, not a timing check: CI may be busy
    yield page
    context.close()


def send(page, text: str) -> None:
    page.locator("#msg textarea").fill(text)
    page.locator("#send").click()


def last_answer(page):
    return page.locator("#chat-log .msg.assistant").last


def set_max_new_tokens(page, n: int) -> None:
    box = page.locator("#max-new input[type=number]")
    box.fill(str(n))
    box.press("Enter")
    page.wait_for_timeout(300)


# -- the product on the default model ---------------------------------------------------------
@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    port = free_port()
    db = tmp_path_factory.mktemp("real") / "chat.db"
    log = open(db.parent / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "launch.py", "serve", "--port", str(port), "--db", str(db)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/", timeout=300, proc=proc)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


@pytest.mark.slow
def test_real_model_streams_colours_plain_and_sessions(page, real_server):
    page.goto(real_server)
    page.wait_for_selector("#legend")
    assert "serial head" in page.locator("#legend").inner_text()
    set_max_new_tokens(page, 24)

    send(page, "Name three colours.")
    # Streaming: tokens are on the page before the answer's stats line (which comes at the end).
    page.wait_for_function(
        "() => { const a = [...document.querySelectorAll('#chat-log .msg.assistant')].pop();"
        " return a && a.querySelector('.tok') && !a.querySelector('.stats'); }", polling=50)
    page.wait_for_selector("#chat-log .msg.assistant .stats")
    answer = last_answer(page)
    assert answer.locator(".tok").count() >= 2
    assert "Gumiho" in answer.locator(".stats").inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "answer-real-model.png"), full_page=True)

    # Speculation off: the next answer is plain decoding (every token the target's, tau 1).
    page.locator("#spec input").uncheck()
    send(page, "And three animals?")
    page.wait_for_function("() => document.querySelectorAll('#chat-log .msg.assistant .stats').length == 2")
    plain = last_answer(page)
    stats = plain.locator(".stats").inner_text()
    assert stats.startswith("plain") and "τ 1.00" in stats
    assert plain.locator(".tok").count() == plain.locator(".tok.o-target").count() > 0
    assert plain.locator("s.rej").count() == 0

    # Compare: the same prompt with speculation off and on, greedy, identical texts.
    page.locator("#msg textarea").fill("Say yes.")
    page.locator("#compare-btn").click()
    page.wait_for_selector("#compare .verdict")
    assert "identical" in page.locator("#compare .verdict").inner_text()

    # The session survives a reload and reopens from the sidebar.
    page.reload()
    page.wait_for_selector("#legend")
    entry = page.locator("#session-list label", has_text="Name three colours.")
    entry.wait_for()
    entry.click()
    page.wait_for_function("() => document.querySelectorAll('#chat-log .msg.assistant').length == 3")
    assert "And three animals?" in page.locator("#chat-log").inner_text()
    assert page.locator("#chat-log .msg.assistant .tok").count() > 0  # colours redrawn from the store


# -- a scripted engine: exact colours, XSS, code, stop --------------------------------------------
XSS = '<script>window.pwned=1</script><img src=x onerror="window.pwned=1">'
SCRIPT = [  # one StepEvent each: (accepted tokens as (text, origin, depth)), rejected drafts
    ([("Here", "target", 0)], []),
    ([(" is", "serial", 1), (" **", "serial", 2), ("bold", "mlp", 3), ("**", "mlp", 4), (" text", "target", 0)],
     [" bald"]),
    ([(" and ", "mlp", 5), (XSS, "fta", 6), (" again", "lookup", 7), ("\n\n```python\n", "target", 0)],
     ["<b>no</b>"]),
    ([("if a < b:\n", "serial", 1), ("    print(a)\n", "mlp", 7), ("```\n", "target", 0)], [" else"]),
    ([("Done.", "target", 0)], []),
]


class ScriptedEngine:
    """Stands in for gumiho_core.Engine: replays SCRIPT (40 times, slowly, when `slow` is set)."""

    def __init__(self, target):
        from gumiho_core import new_heads

        self.target, self.heads = target, new_heads(target)
        self.lock = threading.Lock()
        self.slow = False

    def generate(self, prompt_ids, settings, cancel=None):
        from gumiho_core import DoneEvent, GenerationStats, StepEvent, TokenPiece

        slow = self.slow
        script = SCRIPT * (40 if slow else 1)
        stats = GenerationStats(speculative=settings.speculative, prompt_tokens=len(prompt_ids))
        text, reason = "", "eos"
        for tokens, rejected in script:
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            if not settings.speculative:
                tokens, rejected = [(t, "target", 0) for t, _, _ in tokens], []
            time.sleep(0.25 if slow else 0.05)
            pieces = [TokenPiece(i, t, o, d) for i, (t, o, d) in enumerate(tokens)]
            stats.forward_passes += 1
            stats.new_tokens += len(pieces)
            text += "".join(t for t, _, _ in tokens)
            yield StepEvent(pieces, [TokenPiece(0, r, "rejected", 0) for r in rejected], 8, 1.0, 2.0)
        stats.total_s, stats.ttft_s = 0.5, 0.05
        stats.accepted_at_depth, stats.offered_at_depth = [4, 2, 1], [5, 4, 2]
        yield DoneEvent(text, list(range(stats.new_tokens)), reason, stats)


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    import uvicorn

    import tiny
    from app.server import create_app

    db = tmp_path_factory.mktemp("scripted") / "chat.db"
    app = create_app(ScriptedEngine(tiny.tiny_target()), db, model_name="scripted")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_http(f"http://127.0.0.1:{port}/", timeout=60)
    yield f"http://127.0.0.1:{port}/", app.state.service
    server.should_exit = True
    thread.join(timeout=10)


def test_colours_xss_code_and_rejected(page, scripted_server):
    url, service = scripted_server
    service.engine.slow = False
    page.goto(url)
    page.wait_for_selector("#legend")
    send(page, "show me")
    page.wait_for_selector("#chat-log .msg.assistant .stats")
    answer = last_answer(page)
    for origin in ("serial", "mlp", "fta", "lookup", "target"):
        assert answer.locator(f".tok.o-{origin}").count() > 0, origin
    assert answer.locator(".tok.o-mlp.d7").count() == 1
    # The XSS attempt is shown as text and never runs.
    assert XSS in answer.inner_text()
    assert page.evaluate("() => window.pwned") is None
    assert page.locator("#chat-log img, #chat-log script").count() == 0
    # Markdown is rendered under the colours: bold, and code keeps its layout in a <pre>.
    assert answer.locator("strong .tok.o-mlp").inner_text() == "bold"
    code = answer.locator("pre code")
    assert code.count() == 1 and "    print(a)" in code.inner_text() and code.locator(".tok").count() >= 2
    # Rejected drafts: hidden, then struck through with the toggle.
    assert not answer.locator("s.rej").first.is_visible()
    page.locator("#show-rej input").check()
    page.wait_for_selector("#chat-log.show-rejected")
    assert last_answer(page).locator("s.rej").first.is_visible()
    assert "<b>no</b>" in last_answer(page).inner_text()  # escaped rejected draft
    ARTIFACTS.mkdir(exist_ok=True)
    last_answer(page).screenshot(path=str(ARTIFACTS / "answer.png"))
    page.screenshot(path=str(ARTIFACTS / "chat-page.png"), full_page=True)
    # Raw tokens: token boundaries exactly, Markdown as typed, code fenced in a <pre>.
    page.locator("#view label", has_text="Raw tokens").click()
    page.wait_for_selector("#chat-log .msg.assistant .prov pre.code")
    assert "**bold**" in last_answer(page).inner_text() and XSS in last_answer(page).inner_text()
    last_answer(page).screenshot(path=str(ARTIFACTS / "answer-raw-tokens.png"))
    # Plain Markdown, no colours, still escaping the model's HTML.
    page.locator("#view label", has_text="Markdown").click()
    page.wait_for_selector("#chat-log .msg.assistant .md:not(.coloured) strong")
    md = last_answer(page)
    assert md.locator("pre code").count() == 1 and XSS in md.inner_text() and md.locator(".tok").count() == 0
    assert page.evaluate("() => window.pwned") is None


def test_stop_keeps_partial_answer(page, scripted_server):
    url, service = scripted_server
    store = service.store
    service.engine.slow = True
    page.goto(url)
    page.wait_for_selector("#legend")
    send(page, "slow please")
    page.wait_for_function("() => document.querySelectorAll('#chat-log .msg.assistant .tok').length > 6")
    page.locator("#stop").click()
    page.wait_for_selector("#chat-log .msg.assistant .note")
    assert "stopped" in last_answer(page).inner_text()
    session = next(s for s in store.sessions() if s["title"] == "slow please")
    [_, answer] = store.messages(session["id"])
    assert answer["finish_reason"] == "cancelled" and answer["text"].startswith("Here is")
    assert len(answer["text"]) < len("".join(t for toks, _ in SCRIPT for t, _, _ in toks)) * 40


def test_edit_regenerate_sidebar_export_stats_and_model_errors(page, scripted_server):
    url, service = scripted_server
    service.engine.slow = False
    store = service.store
    page.goto(url)
    page.wait_for_selector("#legend")
    title = '<img src=x onerror="window.pwned=2"> first'
    send(page, title)
    page.wait_for_selector("#chat-log .msg.assistant .stats")
    session = next(s for s in store.sessions() if s["title"] == title)

    # Regenerate replaces the answer (one answer stored, not two).
    page.locator("#regen").click()
    page.wait_for_timeout(500)
    page.wait_for_selector("#chat-log .msg.assistant .stats")
    assert [m["role"] for m in store.messages(session["id"])] == ["user", "assistant"]

    # Edit last: the message goes back into the box; sending it again replaces the turn.
    page.locator("#edit").click()
    page.wait_for_function("() => document.querySelector('#msg textarea').value.includes('first')")
    assert page.locator("#chat-log .msg").count() == 0
    send(page, "edited question")
    page.wait_for_selector("#chat-log .msg.assistant .stats")
    assert [m["text"] for m in store.messages(session["id"])][0] == "edited question"

    # The sidebar shows the (hostile) title as text; rename and export work.
    entry = page.locator("#session-list label", has_text="onerror")
    entry.wait_for()
    assert page.evaluate("() => window.pwned") is None
    entry.click()
    page.locator("#rename-box textarea, #rename-box input").first.fill("Renamed chat")
    page.get_by_role("button", name="Rename").click()
    page.locator("#session-list label", has_text="Renamed chat").wait_for()
    assert store.session(session["id"])["title"] == "Renamed chat"
    page.get_by_role("button", name="Export JSON").click()
    link = page.locator('#export-file a[download="Renamed-chat.json"]')
    link.wait_for()
    exported = page.request.get(link.get_attribute("href")).json()
    assert exported["session"]["title"] == "Renamed chat" and len(exported["messages"]) == 2

    # Clear starts a fresh chat; the stats tab plots the stored answers.
    page.locator("#clear").click()
    page.wait_for_selector("#chat-log .empty")
    page.get_by_role("tab", name="Stats").click()
    page.get_by_role("button", name="Refresh").click()
    page.wait_for_function("() => document.body.innerText.includes('tokens/s per answer')")
    page.wait_for_timeout(500)
    page.screenshot(path=str(ARTIFACTS / "stats-tab.png"), full_page=True)

    # A model folder that does not exist: a one-line error in the UI, the app keeps working.
    page.get_by_role("tab", name="Chat").click()
    page.get_by_text("Model", exact=True).click()
    box = page.locator("#model-path input")
    box.fill("/no/such/model")
    box.press("Enter")
    page.get_by_role("button", name="Load model").click()
    page.wait_for_function("() => document.body.innerText.includes('error:')")
    send(page, "still alive?")
    page.wait_for_selector("#chat-log .msg.assistant .stats")

    # Delete removes the session from the store and the sidebar.
    page.locator("#session-list label", has_text="Renamed chat").click()
    page.get_by_role("button", name="Delete").click()
    page.wait_for_function("() => !document.querySelector('#session-list').innerText.includes('Renamed chat')")
    assert store.session(session["id"]) is None
