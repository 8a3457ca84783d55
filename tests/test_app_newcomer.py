"""Issue 20 without a browser: the session address, the retitle after an edit, Delete's
confirmation, the settings' ranges. The browser side is in tests/test_browser_chat.py."""
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
