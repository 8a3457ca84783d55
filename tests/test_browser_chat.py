"""The chat in a real browser: Debian's chromium driven by Playwright.

Two servers: the product itself (`launch.py serve` on the default model, in a subprocess)
and an in-process app on a *scripted* engine whose answers are known in advance, so every
colour, an XSS attempt, a code block and Stop can be checked exactly.
"""
import os
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
    ([("Done.", "target", 0)], ["<|im_end|>"]),
]
# The README's picture: an answer as the default model's might look, every colour the default
# tree produces, and rejected drafts shown (tests/test_browser_chat.py regenerates it each run).
README_SCRIPT = [
    ([("Speculative", "target", 0)], []),
    ([(" decoding", "lookup", 1), (" lets", "target", 0)], [" uses"]),
    ([(" a", "serial", 1), (" small", "serial", 2), (" **", "target", 0)], []),
    ([("draft", "serial", 1), ("**", "serial", 2), (" model", "target", 0)], [" head"]),
    ([(" guess", "serial", 1), (" several", "target", 0)], [" the"]),
    ([(" tokens", "serial", 1), (" ahead", "serial", 2), (".", "target", 0)], []),
    ([(" The", "target", 0)], [" It"]),
    ([(" big", "serial", 1), (" model", "serial", 2), (" checks", "target", 0)], [" then"]),
    ([(" all", "serial", 1), (" the", "serial", 2), (" guesses", "target", 0)], []),
    ([(" in", "serial", 1), (" one", "serial", 2), (" pass", "target", 0)], [" step"]),
    ([(" and", "serial", 1), (" keeps", "target", 0)], [" accepts"]),
    ([(" the", "lookup", 1), (" ones", "lookup", 2), (" it", "target", 0)], []),
    ([(" agrees", "serial", 1), (" with", "serial", 2), (",", "target", 0)], ["."]),
    ([(" so", "serial", 1), (" each", "target", 0)], [" one"]),
    ([(" pass", "lookup", 1), (" yields", "target", 0)], [" gives"]),
    ([(" more", "serial", 1), (" than", "serial", 2), (" one", "target", 0)], []),
    ([(" token", "serial", 1), (".", "serial", 2), ("\n\n", "target", 0)], ["<|im_end|>"]),
    ([("The", "target", 0)], []),
    ([(" answer", "serial", 1), (" is", "serial", 2), (" exactly", "target", 0)], [" the"]),
    ([(" the", "lookup", 1), (" big", "lookup", 2), (" model", "lookup", 3), ("'s", "target", 0)], []),
    ([(" own", "serial", 1), (".", "target", 0)], []),
]


class ScriptedEngine:
    """Stands in for gumiho_core.Engine: replays `script` (`repeats` times, slowly, when `slow` is set)."""

    def __init__(self, target):
        from gumiho_core import new_heads

        self.target, self.heads = target, new_heads(target)
        self.lock = threading.Lock()
        self.slow = False
        self.script = SCRIPT
        self.repeats = 40

    def generate(self, prompt_ids, settings, cancel=None):
        from gumiho_core import DoneEvent, GenerationStats, StepEvent, TokenPiece

        slow = self.slow
        script = self.script * (self.repeats if slow else 1)
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
    service.engine.script = SCRIPT
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
    service.engine.script = SCRIPT
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
    service.engine.script = SCRIPT
    store = service.store
    page.goto(url)
    page.wait_for_selector("#legend")
    title = '<img src=x onerror="window.pwned=2"> first'
    send(page, title)
    page.wait_for_selector("#chat-log .msg.assistant .stats")
    session = next(s for s in store.sessions() if s["title"] == title)
    # The sidebar shows the (hostile) title as text.
    page.locator("#session-list label", has_text="onerror").wait_for()
    assert page.evaluate("() => window.pwned") is None

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
    # The title follows the edited first message.
    entry = page.locator("#session-list label", has_text="edited question")
    entry.wait_for()
    assert store.session(session["id"])["title"] == "edited question"

    # Rename and export work.
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
    # Each row names its session and prompt and where its tokens came from; one line sums up.
    page.wait_for_function("() => document.body.innerText.includes('looked_up_%')"
                           " && document.body.innerText.includes('edited question')")
    assert "speed" in page.locator("#speed-summary").inner_text()
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
    # The answer's new session redraws the sidebar: a click during the redraw can be lost.
    page.locator("#session-list label", has_text="still alive?").wait_for()

    # Delete asks first; the second press removes the session from the store and the sidebar.
    page.locator("#session-list label", has_text="Renamed chat").click()
    page.wait_for_function(f"() => new URL(location.href).searchParams.get('session') == '{session['id']}'")
    page.get_by_role("button", name="Delete").click()
    page.get_by_role("button", name="Confirm delete").wait_for()
    assert "cannot be undone" in page.locator("#status").inner_text()
    assert store.session(session["id"]) is not None
    page.get_by_role("button", name="Confirm delete").click()
    page.wait_for_function("() => !document.querySelector('#session-list').innerText.includes('Renamed chat')")
    assert store.session(session["id"]) is None


# -- issue 20: the chat as a newcomer meets it ----------------------------------------------------
DOCS_PICTURE = ROOT / "docs" / "images" / "answer.png"


def session_in_address(page) -> str | None:
    return page.evaluate("() => new URL(location.href).searchParams.get('session')")


def test_the_address_keeps_the_session_and_the_readme_picture(page, scripted_server):
    url, service = scripted_server
    service.engine.slow = False
    service.engine.script = README_SCRIPT
    page.set_viewport_size({"width": 900, "height": 900})
    page.goto(url)
    page.wait_for_selector("#legend")
    send(page, "What makes speculative decoding fast?")
    page.wait_for_selector("#chat-log .msg.assistant .stats")
    page.wait_for_function("() => new URL(location.href).searchParams.get('session')")
    sid = int(session_in_address(page))
    assert service.store.session(sid)["title"] == "What makes speculative decoding fast?"

    # Rejected drafts: small raised alternatives, never struck through the line of the answer,
    # special tokens as words.
    page.locator("#show-rej input").check()
    page.wait_for_selector("#chat-log.show-rejected")
    answer = last_answer(page)
    rej = answer.locator("s.rej").first
    token = answer.locator(".tok").first
    style = lambda loc, prop: loc.evaluate(f"e => getComputedStyle(e).{prop}")
    assert style(rej, "verticalAlign") == "super"
    assert float(style(rej, "fontSize")[:-2]) < 0.8 * float(style(token, "fontSize")[:-2])
    assert "⟨end of turn⟩" in answer.inner_text() and "im_end" not in answer.inner_text()

    # The README's picture: the legend and this answer, as the browser draws them.
    top = page.locator("#legend").bounding_box()
    box = answer.bounding_box()
    DOCS_PICTURE.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(DOCS_PICTURE), clip={"x": box["x"] - 8, "y": top["y"] - 6, "width": box["width"] + 16,
                                                "height": box["y"] + box["height"] - top["y"] + 12})

    # A reload comes back to the same chat, colours and stats included.
    page.reload()
    page.wait_for_selector("#chat-log .msg.assistant .stats")
    assert session_in_address(page) == str(sid)
    assert last_answer(page).locator(".tok.o-lookup").count() > 0
    assert "What makes speculative decoding fast?" in page.locator("#chat-log").inner_text()
    # New chat leaves the address; another session has its own; picking one in the sidebar goes back.
    page.get_by_role("button", name="New chat").click()
    page.wait_for_function("() => !new URL(location.href).searchParams.get('session')")
    send(page, "a second chat")
    page.wait_for_function(f"() => !['{sid}', null].includes(new URL(location.href).searchParams.get('session'))")
    page.wait_for_selector("#chat-log .msg.assistant .stats")  # the answer is done: nothing redraws the log now
    page.locator("#session-list label", has_text="What makes speculative").click()
    page.wait_for_function(f"() => new URL(location.href).searchParams.get('session') == '{sid}'")
    # An address whose session is gone says so, and the address forgets it.
    page.goto(url + "?session=987654")
    page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('not found')")
    assert session_in_address(page) is None
    service.engine.script = SCRIPT


def test_the_legend_explains_itself(page, scripted_server):
    url, _ = scripted_server
    page.goto(url)
    page.wait_for_selector("#legend")
    chips = page.locator("#legend .legend-item")
    labels = {chips.nth(i).inner_text(): chips.nth(i) for i in range(chips.count())}
    # The default tree: serial head and context lookup; no MLP depths, no FTA (marked off).
    for label in ("serial head", "context lookup", "target", "rejected draft"):
        assert "off" not in labels[label].get_attribute("class"), label
    for label in ("MLP heads", "FTA"):
        assert "off" in labels[label].get_attribute("class") and "Off" in labels[label].get_attribute("title")
        assert float(labels[label].evaluate("e => getComputedStyle(e).opacity")) < 1
    for label, chip in labels.items():
        tip = chip.get_attribute("title")
        assert tip and "\n" not in tip and len(tip) < 140, label
    # The rejected-draft chip does not look like the target's own (plain) chip.
    colour = lambda label: labels[label].locator("> *").evaluate("e => getComputedStyle(e).backgroundColor")
    assert colour("rejected draft") != colour("target")


def test_numbers_stay_within_their_sliders(page, scripted_server):
    url, service = scripted_server
    page.goto(url)
    page.wait_for_selector("#legend")
    for elem, typed, kept in (("#temperature", "5", 2.0), ("#top-p", "0", 0.01), ("#max-new", "99999", 512),
                              ("#max-new", "-3", 1)):
        box = page.locator(f"{elem} input[type=number]")
        assert float(box.get_attribute("max")) >= kept
        box.fill(typed)
        box.press("Enter")
        page.wait_for_function(f"() => parseFloat(document.querySelector('{elem} input[type=number]').value) == {kept}")
        # The slider itself agrees with its box.
        page.wait_for_function(f"() => parseFloat(document.querySelector('{elem} input[type=range]').value) == {kept}")
    assert service.max_new_tokens_limit == 512  # the slider's end is the model's context


def test_compare_shows_both_answers_side_by_side_while_it_runs(page, scripted_server):
    url, service = scripted_server
    service.engine.script, service.engine.repeats = SCRIPT[:3], 3
    service.engine.slow = True
    try:
        page.goto(url)
        page.wait_for_selector("#legend")
        page.locator("#msg textarea").fill("compare me")
        page.locator("#compare-btn").click()
        # Progress: the plain side says how far it got while it runs.
        page.wait_for_function("() => (document.querySelector('#compare .compare-col') || {}).innerText"
                               "?.includes('running…')", polling=50)
        page.wait_for_selector("#compare .verdict", timeout=180_000)
        cols = page.locator("#compare .compare-col")
        assert cols.count() == 2
        left, right = cols.nth(0), cols.nth(1)
        assert "Plain decoding" in left.inner_text() and "Gumiho" in right.inner_text()
        assert "tok/s" in left.locator(".compare-speed").inner_text()
        assert "tok/s" in right.locator(".compare-speed").inner_text()
        assert "identical" in page.locator("#compare .verdict").inner_text()
        assert left.locator(".tok.o-target").count() > 0 and right.locator(".tok.o-serial").count() > 0
        a, b = left.bounding_box(), right.bounding_box()
        assert abs(a["y"] - b["y"]) < 2 and b["x"] >= a["x"] + a["width"]  # side by side
        page.locator("#compare").screenshot(path=str(ARTIFACTS / "compare.png"))
    finally:
        service.engine.slow, service.engine.script, service.engine.repeats = False, SCRIPT, 40


def test_a_400_px_window(page, scripted_server):
    url, service = scripted_server
    service.engine.slow = False
    page.set_viewport_size({"width": 400, "height": 800})
    page.goto(url)
    page.wait_for_selector("#legend")
    send(page, "narrow")
    page.wait_for_selector("#chat-log .msg.assistant .stats")
    # The sidebar does not cover the chat: what is drawn at the answer's centre is the answer.
    answer = last_answer(page)
    box = answer.bounding_box()
    hit = page.evaluate("([x, y]) => !!document.elementFromPoint(x, y)?.closest('#chat-log')",
                        [box["x"] + box["width"] / 2, box["y"] + min(box["height"] / 2, 20)])
    assert hit and box["x"] >= 0 and box["x"] + box["width"] <= 400
    # No label is cut: every label's text fits its box, and nothing makes the page scroll sideways.
    # (An accordion's header is left out: Gradio draws its chevron past the text box, by design.)
    cut = page.evaluate("""() => [...document.querySelectorAll('label, button:not(.label-wrap), .legend-item')]
        .filter(e => e.offsetParent && e.scrollWidth > e.clientWidth + 1)
        .map(e => [e.innerText.slice(0, 30), e.tagName, e.scrollWidth, e.clientWidth])""")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-400px.png"), full_page=True)
    assert cut == []
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 400


def test_the_model_picker_names_its_empty_choice_and_keeps_what_is_typed(page, tmp_path, monkeypatch):
    import uvicorn

    import tiny
    from app import models
    from app.server import create_app
    from gumiho_core import GumihoError

    monkeypatch.setattr(models, "model_choices", lambda: ["/models/smol-big", "/models/smol-bigger"])
    app = create_app(ScriptedEngine(tiny.tiny_target()), tmp_path / "c.db", model_name="scripted")
    asked = []

    def load_model(model=None, heads=None):  # what the Load button asked for, refused in one line
        asked.append(model)
        raise GumihoError(f"model path not found: {model}")

    app.state.service.load_model = load_model
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_http(f"http://127.0.0.1:{port}/", timeout=60)
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_selector("#legend")
        page.get_by_text("Model", exact=True).click()
        box = page.locator("#model-path input")
        assert box.input_value() == "(the default model)"
        for enter in (False, True):  # a prefix of two suggestions, loaded with and without Enter first
            box.fill("/models/smol")
            if enter:
                box.press("Enter")
            before = len(asked)
            page.get_by_role("button", name="Load model").click()
            deadline = time.time() + 60
            while len(asked) == before and time.time() < deadline:
                page.wait_for_timeout(100)
            assert asked[before:] == ["/models/smol"] and box.input_value() == "/models/smol"
        page.wait_for_function("() => document.body.innerText.includes('error: model path not found')")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
