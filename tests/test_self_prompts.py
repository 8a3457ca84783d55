"""`train-data --self-prompts`: user prompts sampled from the target itself."""
from __future__ import annotations

import pytest

from gumiho_core import train_data
from gumiho_core.errors import GumihoError
from gumiho_core.train_data import self_prompts_for, self_written_prompts, user_turn_opening
from tiny import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def test_prompts_are_distinct_finished_turns_and_reproducible(target):
    a = self_written_prompts(target, 6, seed=1, batch_size=8, max_tokens=32, progress=False)
    assert len(a) == 6 and all(len(turns) == 1 for turns in a)
    assert len({turns[0] for turns in a}) == 6
    assert all(len(turns[0].split()) >= 3 for turns in a)
    assert a == self_written_prompts(target, 6, seed=1, batch_size=8, max_tokens=32, progress=False)
    assert a != self_written_prompts(target, 6, seed=2, batch_size=8, max_tokens=32, progress=False)


def test_opening_is_where_the_user_message_goes(target):
    # No chat template here: the plain "user: ..." fallback of Target.chat_prompt.
    assert target.chat_prompt([{"role": "user", "content": "w7 w8"}])[: len(user_turn_opening(target))] == \
        user_turn_opening(target)


def test_a_model_that_cannot_end_a_turn_is_refused():
    with pytest.raises(GumihoError, match="no end-of-sequence token"):
        self_written_prompts(tiny_target(seed=0, eos=False), 2, progress=False)


def test_prompts_are_sampled_once_then_read_back(target, tmp_path, monkeypatch):
    first = self_prompts_for(target, tmp_path, 5, seed=3, batch_size=8)
    assert (tmp_path / train_data.SELF_PROMPTS).is_file()

    def no_sampling(*args, **kwargs):
        raise AssertionError("a resumed run must not sample its prompts again")

    monkeypatch.setattr(train_data, "self_written_prompts", no_sampling)
    assert self_prompts_for(target, tmp_path, 5, seed=3, batch_size=8) == first
    assert self_prompts_for(target, tmp_path, 3, seed=3, batch_size=8) == first[:3]
