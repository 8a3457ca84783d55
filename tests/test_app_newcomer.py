"""Issue 20 without a browser: the session address, the retitle after an edit, Delete's
confirmation, the settings' ranges. The browser side is in tests/test_browser_chat.py."""
import re
from types import SimpleNamespace

import pytest

from app import handlers
from app.chat import TEMPERATURE_MAX, Options, last
from gumiho_core import GumihoError

from test_app_chat import engine, service  # noqa: F401  (shared fixtures: tiny engine, chat service)
from test_reliability import send


def page_load(service, query: dict):
    return handlers.open_address(service, "colours", False, SimpleNamespace(query_params=query))


def test_the_address_reopens_its_session_with_colours_and_stats(service):
    st = send(service, handlers.new_state(), "w5 w6")[1]
    sid = st["session_id"]
    assert f'data-session="{sid}"' in handlers.draw(st, "colours", False)
    sessions, log, opened, status, _ = page_load(service, {"session": str(sid)})
    assert sessions["value"] == sid and opened["session_id"] == sid and status == ""
    assert f'data-session="{sid}"' in log and 'class="tok' in log and 'class="stats"' in log
    # A deleted or mistyped session: a fresh chat that says so (and clears the address).
    for wanted in ("999", "abc"):
        _, log, fresh, status, _ = page_load(service, {"session": wanted})
        assert fresh["session_id"] is None and "not found" in status and 'data-session=""' in log
    # No session in the address: the chat is left as the page built it.
    _, log, *_ = page_load(service, {})
    assert log is not None and not isinstance(log, str)


def test_the_title_follows_an_edited_first_message_but_not_a_renamed_one(service):
    st = send(service, handlers.new_state(), "w5 first")[1]
    _, st, text, _ = handlers.edit_last(service, st, "colours", False)
    st = send(service, st, "w6 second")[1]
    assert service.store.session(st["session_id"])["title"] == "w6 second"
    service.store.rename_session(st["session_id"], "Mine")
    _, st, _, _ = handlers.edit_last(service, st, "colours", False)
    st = send(service, st, "w7 third")[1]
    assert service.store.session(st["session_id"])["title"] == "Mine"


def test_delete_asks_first_and_deletes_on_the_second_press(service):
    st = send(service, handlers.new_state(), "w5 keep me")[1]
    sid = st["session_id"]
    _, st, _, status, button = handlers.delete(service, sid, st, "colours", False)
    assert "Confirm delete" in status and button["value"] == "Confirm delete"
    assert service.store.session(sid) is not None
    # Opening a session (a new state) forgets the pending delete: the next press asks again.
    st = handlers.open_session(service, sid, "colours", False)[1]
    _, st, _, status, _ = handlers.delete(service, sid, st, "colours", False)
    assert service.store.session(sid) is not None
    _, st, log, status, button = handlers.delete(service, sid, st, "colours", False)
    assert status == "Deleted." and service.store.session(sid) is None and button["value"] == "Delete"
    assert st["session_id"] is None and 'data-session=""' in log


@pytest.mark.parametrize("field,value,word", [("temperature", TEMPERATURE_MAX + 0.01, "at most 2"),
                                              ("max_new_tokens", 10_000, "at most 512")])
def test_values_past_the_sliders_are_refused_in_words(service, field, value, word):
    opts = Options(**{field: value})
    with pytest.raises(GumihoError, match=word):
        service.settings(opts)
    final = last(service.stream([{"role": "user", "text": "w5"}], opts))
    assert final.finish_reason == "error" and word in final.error
    out = send(service, handlers.new_state(), "w5", **{"temp" if field == "temperature" else "n": value})
    assert word in out[3] and service.store.sessions() == []
    service.settings(Options(temperature=TEMPERATURE_MAX, max_new_tokens=service.max_new_tokens_limit))  # the ends are fine


def test_stats_rows_say_where_tokens_came_from_and_the_summary_the_speed_up(service):
    assert "No speed-up to show yet" in handlers.stats_outputs(service)[0]
    st = send(service, handlers.new_state(), "w5 w6 w5 w6")[1]
    st = send(service, st, "w7", spec_on=False)[1]
    summary, _, _, table = handlers.stats_outputs(service)
    assert "the speed of plain decoding on this machine" in summary and "over 1 Gumiho" in summary
    gumiho, plain = table.to_dict("records")
    assert (gumiho["session"], gumiho["prompt"], plain["prompt"]) == ("w5 w6 w5 w6", "w5 w6 w5 w6", "w7")
    assert gumiho["looked_up_%"] + gumiho["heads_%"] + gumiho["target_%"] in (99, 100, 101)
    assert (plain["looked_up_%"], plain["heads_%"], plain["target_%"]) == (0, 0, 100)
    assert list(table["n"]) == [1, 2]


def test_acceptance_bars_are_labelled_and_looked_up_depths_grouped():
    from app import render

    steps = [{"tokens": [["a", "serial", 1], ["b", "serial", 2], ["c", "lookup", 3], ["d", "lookup", 4],
                         ["e", "target", 0]], "rejected": []}]
    stats = {"speculative": True, "tokens_per_s": 9.0, "ttft_s": 0.1, "tau": 5.0, "new_tokens": 5,
             "forward_passes": 1, "acceptance_per_depth": [0.5, 1.0, 1.0, 0.5], "tree": {"depth": 2}}
    html = render.stats_html(stats, "eos", steps)
    titles = re.findall(r'class="bar" title="([^"]+)"', html)
    assert titles == ["depth 1: 50% of drafts accepted (1 tokens)", "depth 2: 100% of drafts accepted (1 tokens)",
                      "depths 3–4 (looked-up chains only): 67% of drafts accepted (2 tokens)"]
    assert "accepted by depth" in html and "40% looked up · 40% heads · 20% target" in html


def test_the_api_keeps_the_same_ranges(engine, tmp_path):
    from fastapi.testclient import TestClient

    from app.server import create_app

    client = TestClient(create_app(engine, tmp_path / "api.db", model_name="tiny"))
    user = [{"role": "user", "content": "w5"}]
    for field, value in (("temperature", 2.5), ("max_tokens", 100_000)):
        r = client.post("/v1/chat/completions", json={"messages": user, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and "at most" in r.text
    assert client.post("/v1/chat/completions", json={"messages": user, "temperature": 2, "max_tokens": 3}).status_code == 200
