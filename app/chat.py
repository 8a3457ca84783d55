"""The chat logic every front end shares: prompt building, streaming an answer, saving it.

The Gradio UI, the `/chat` endpoint and the OpenAI route all go through `ChatService`, so
they build prompts, apply settings, take turns on the one engine and record answers the
same way. Settings are checked in one place: `Options.settings` hands the values as typed
to `gumiho_core.settings.settings_from_fields`, whose GumihoError names the bad field.
"""
from __future__ import annotations

import math
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from gumiho_core import ContextTooLong, DoneEvent, GenerationSettings, GumihoError, StepEvent, TreeSettings, loading
from gumiho_core.settings import settings_from_fields

from .render import step_from_event
from .store import ExportFolder, Store, StoreError


# The Settings panel's ranges, and what every front end (UI, /chat, OpenAI) accepts, so a
# number typed past a slider's end is refused in words rather than answered as noise.
# Temperature stops at 2 as OpenAI's does: past it a small model's answer is noise. Max new
# tokens stops at the model's context (ChatService.max_new_tokens_limit).
TEMPERATURE_MAX = 2.0
TOP_P_MIN = 0.01  # the slider's start; the engine takes anything above 0


@dataclass
class Options:
    """What the user set for one answer, as typed (a form's or a JSON body's values).

    Nothing is checked here: `settings` turns the values into the engine's settings, and
    that is where a bad one is refused.
    """

    system: str = ""
    speculative: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256

    def settings(self, tree: TreeSettings | None = None, max_new_tokens_limit: int | None = None) -> GenerationSettings:
        """The engine's settings for these options; a one-line GumihoError naming a bad field."""
        settings = settings_from_fields(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            speculative=self.speculative, tree=tree,
            # ChatService.fit drops whole turns first; the engine must never cut a prompt mid-template.
            on_overflow="error",
        )
        if settings.sampling.temperature > TEMPERATURE_MAX:
            raise GumihoError(f"temperature must be at most {TEMPERATURE_MAX:g} (got {self.temperature})")
        if max_new_tokens_limit is not None and settings.max_new_tokens > max_new_tokens_limit:
            raise GumihoError(f"max new tokens must be at most {max_new_tokens_limit}, the model's context "
                              f"(got {settings.max_new_tokens})")
        return settings


# C0 and C1 control characters except tab and newline; DEL; lone surrogates (undecodable bytes).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text) -> str:
    """User text made safe for the tokenizer and the database: valid UTF-8, no control characters.

    Bytes are decoded as UTF-8 with U+FFFD for what is not; CR / CRLF become newlines;
    other control characters are removed; tab and newline stay.
    """
    if text is None:
        return ""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    text = str(text).replace("\r\n", "\n").replace("\r", "\n")
    text = _SURROGATE.sub("\ufffd", text)
    return _CONTROL.sub("", text)


class FairQueue:
    """A first-come first-served queue for the one engine: who is generating, who waits.

    `threading.Lock` is not fair and cannot say how many are ahead; this can, so the UI
    shows "waiting: 1 ahead" and two clients are answered strictly one after the other.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: list[int] = []
        self._next = 0

    def join(self) -> int:
        with self._cond:
            ticket = self._next
            self._next += 1
            self._queue.append(ticket)
            return ticket

    def ahead(self, ticket: int) -> int:
        with self._cond:
            return self._queue.index(ticket) if ticket in self._queue else 0

    def wait(self, ticket: int, timeout: float) -> bool:
        """True once `ticket` is first in line; False after `timeout` seconds of waiting."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queue[0] == ticket, timeout=timeout)

    def leave(self, ticket: int) -> None:
        with self._cond:
            if ticket in self._queue:
                self._queue.remove(ticket)
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)


@dataclass
class Answer:
    """An answer as it grows; `done` once the engine finished (or failed)."""

    steps: list[dict] = field(default_factory=list)
    text: str = ""
    stats: dict | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    waiting: int = 0  # requests ahead of this one in the queue (0 once it is generating)
    notice: str = ""  # e.g. which old turns were left out to fit the context
    prompt_tokens: int = 0  # the prompt as the engine got it, after fitting

    def as_message(self) -> dict:
        return {"role": "assistant", "text": self.text, "steps": self.steps, "stats": self.stats,
                "finish_reason": self.finish_reason, "error": self.error}


class ChatService:
    def __init__(self, engine, store: Store | None, model_name: str = "default", heads_note: str = "",
                 tree: TreeSettings | None = None):
        self.engine = engine
        self.store = store
        self.tree = tree  # the draft tree of every answer; None = TreeSettings() defaults
        self.model_name = model_name
        self.heads_note = heads_note
        self.queue = FairQueue()  # UI, /chat and /v1 answers, one at a time
        # Answers in progress (generating or waiting), by their cancel events: shutdown stops them all.
        self._running: set[threading.Event] = set()
        self._running_lock = threading.Lock()
        self.closing = threading.Event()
        self.record_requests = True  # store /chat and OpenAI answers as sessions (create_app's store_api)
        self.exports = ExportFolder()
        self._share: tuple[object, int] = (None, 0)  # (target, template tokens per message): _template_share

    def close(self) -> None:
        """Shutting down: refuse new answers, stop the running one and the waiting ones.

        Each stops as Stop would: its partial answer is kept (and saved by whoever saves it)."""
        self.closing.set()
        with self._running_lock:
            running = list(self._running)
        for cancel in running:
            cancel.set()

    @property
    def has_heads(self) -> bool:
        return self.engine.heads is not None

    @property
    def max_new_tokens_limit(self) -> int:
        """The most new tokens an answer may ask for: the model's whole context."""
        return self.engine.target.max_context

    def settings(self, options: Options) -> GenerationSettings:
        """The engine's settings for `options` with this model's tree and limits (GumihoError if out of range)."""
        return options.settings(self.tree, self.max_new_tokens_limit)

    def prompt_ids(self, system: str, history: list[dict]) -> list[int]:
        """The whole conversation through the model's chat template (multi-turn context)."""
        messages = [{"role": "system", "content": system}] if system.strip() else []
        messages += [{"role": m["role"], "content": m["text"]} for m in history if m["role"] in ("user", "assistant")]
        return self.engine.target.chat_prompt(messages)

    def fit(self, system: str, history: list[dict], max_new_tokens: int) -> tuple[list[int], list[dict], int]:
        """The prompt that fits the context: (prompt ids, history kept, turns dropped).

        Whole turns go, oldest first; the system prompt and the latest user message always
        stay. If even those do not fit, a ContextTooLong says what to shorten.
        Time is linear in the kept part, whatever the history's length: the turns are
        counted newest first (each message's tokens plus the template's share) until the
        context is full, and only a prompt that should fit is put through the template.
        """
        limit, need = self.engine.target.max_context, int(max_new_tokens)
        starts = _turn_starts(history)
        latest = self.prompt_ids(system, history[starts[-1]:])
        if len(latest) + need > limit:
            raise ContextTooLong(
                f"the message is too long for the model: {len(latest)} prompt tokens + {need} new tokens "
                f"exceed its context of {limit} tokens. Shorten the message"
                + (" or the system prompt" if system.strip() else "") + " or lower max new tokens."
            )
        cut = self._oldest_turn_that_fits(history, starts, room=limit - need - len(latest))
        while True:
            kept = history[starts[cut]:]
            prompt = latest if cut == len(starts) - 1 else self.prompt_ids(system, kept)
            if len(prompt) + need <= limit:
                return prompt, kept, cut
            cut += 1  # the count was a few tokens short: one more turn goes (the latest alone fits)

    def _oldest_turn_that_fits(self, history: list[dict], starts: list[int], room: int) -> int:
        """Index into `starts` of the oldest turn that, with all later ones, fits in `room` tokens."""
        share = self._template_share()
        cut = len(starts) - 1
        for turn in range(len(starts) - 2, -1, -1):
            messages = history[starts[turn]:starts[turn + 1]]
            room -= sum(len(self.engine.target.encode(m["text"])) + share for m in messages)
            if room < 0:
                break
            cut = turn
        return cut

    def _template_share(self) -> int:
        """Tokens the chat template adds around one message (role markers, separators), measured once."""
        target = self.engine.target
        if self._share[0] is not target:  # measured again after a model swap
            one = [{"role": "user", "text": "hello"}]
            three = one + [{"role": "assistant", "text": "hello"}, {"role": "user", "text": "hello"}]
            extra = len(self.prompt_ids("", three)) - len(self.prompt_ids("", one)) - 2 * len(target.encode("hello"))
            self._share = (target, max(0, math.ceil(extra / 2)))
        return self._share[1]

    def load_model(self, model: str | None = None, heads: str | None = None) -> None:
        """Answer with `model` (a folder or .gguf; empty = the default) and `heads` from now on.

        Only a load that succeeded changes anything: on any failure (missing, not a model,
        corrupt, heads for another model) a one-line GumihoError says why and the current
        model stays. The draft tree goes back to the defaults, because a tree measured for
        the old heads says nothing about new ones.
        """
        model, heads = (model or "").strip() or None, (heads or "").strip() or None
        try:
            engine, heads_note = loading.load_engine(model, heads)
        except GumihoError:
            raise
        except Exception as exc:
            raise GumihoError(f"could not load {model or 'the default model'}: "
                              f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
        # Swap between answers, never under one that is using the old engine.
        ticket = self.queue.join()
        try:
            self.queue.wait(ticket, timeout=None)
            self.engine, self.heads_note, self.model_name, self.tree = engine, heads_note, model or "default", None
        finally:
            self.queue.leave(ticket)

    def answer(self, history: list[dict], options: Options, cancel: threading.Event | None = None,
               settings: GenerationSettings | None = None) -> Answer:
        """The finished Answer (what `stream` yields last), for callers that do not show it grow."""
        return last(self.stream(history, options, cancel, settings=settings))

    def stream(self, history: list[dict], options: Options, cancel: threading.Event | None = None, *,
               settings: GenerationSettings | None = None, wait_timeout: float = 600.0) -> Iterator[Answer]:
        """Yield the growing Answer after each target pass; the last one has done=True.

        `settings` are `self.settings(options)`, passed in by a caller that built them
        already to check the options before storing anything; built here otherwise.
        Requests are served one at a time, first come first served; while one waits, the
        Answer it yields has `waiting` = how many are ahead. Never raises for generation
        problems: a bad setting, a GumihoError (or any failure) ends the answer with `error`
        set and whatever text came before it kept.
        """
        answer = Answer()
        ticket = None
        cancel = cancel or threading.Event()
        with self._running_lock:
            self._running.add(cancel)
        try:
            settings = settings or self.settings(options)
            if settings.speculative and not self.has_heads:
                raise GumihoError("speculative decoding needs draft heads, and none are loaded")
            if self.closing.is_set():
                raise GumihoError("the server is shutting down; send again once it is back")
            ticket = self.queue.join()
            yield from self._wait_for_turn(ticket, answer, cancel, wait_timeout)
            prompt, kept, dropped = self.fit(options.system, history, settings.max_new_tokens)
            answer.prompt_tokens = len(prompt)
            if dropped:
                total = len([m for m in history if m["role"] == "user"])
                which = "turn 1" if dropped == 1 else f"turns 1–{dropped}"
                answer.notice = (f"The conversation is longer than the model's context: the oldest {which} "
                                 f"(of {total}) {'was' if dropped == 1 else 'were'} left out of the prompt.")
            for event in self.engine.generate(prompt, settings, cancel=cancel):
                if isinstance(event, StepEvent):
                    answer.steps.append(step_from_event(event))
                    answer.text += event.text
                    yield answer
                elif isinstance(event, DoneEvent):
                    answer.text = event.text  # the engine's text honours stop strings exactly
                    answer.stats = event.stats.to_dict()
                    answer.finish_reason = event.finish_reason
        except _Cancelled:
            pass
        except GumihoError as exc:
            answer.error, answer.finish_reason = _one_line(str(exc)), "error"
        except Exception as exc:  # the app must survive a failing generation
            answer.error, answer.finish_reason = _one_line(f"generation failed: {type(exc).__name__}: {exc}"), "error"
        finally:
            with self._running_lock:
                self._running.discard(cancel)
            if ticket is not None:
                self.queue.leave(ticket)
        answer.done = True
        yield answer

    def _wait_for_turn(self, ticket: int, answer: Answer, cancel: threading.Event,
                       wait_timeout: float) -> Iterator[Answer]:
        """Wait until `ticket` is first in line, yielding `answer` whenever the number ahead changes.

        Raises _Cancelled when Stop is pressed meanwhile, GumihoError after `wait_timeout` s.
        """
        waited = 0.0
        while not self.queue.wait(ticket, timeout=0.25):
            waited += 0.25
            if self.closing.is_set():
                raise GumihoError("the server is shutting down; send again once it is back")
            if cancel.is_set():
                answer.waiting, answer.finish_reason = 0, "cancelled"
                raise _Cancelled
            if waited >= wait_timeout:
                raise GumihoError(f"the model stayed busy for {wait_timeout:.0f} s; try again later")
            ahead = self.queue.ahead(ticket)
            if ahead != answer.waiting:
                answer.waiting = ahead
                yield answer
        answer.waiting = 0

    def save_answer(self, session_id: int, answer: Answer, speculative: bool) -> int:
        """Store an answer (complete or partial) and its stats; returns the message id."""
        message_id = self.store.add_message(
            session_id, "assistant", answer.text, steps=answer.steps, speculative=speculative,
            finish_reason=answer.finish_reason,
        )
        if answer.stats:
            self.store.add_stats(session_id, message_id, answer.stats, answer.finish_reason or "", model=self.model_name)
        return message_id

    def record(self, source: str, history: list[dict], options: Options, answer: Answer) -> str | None:
        """Store a /chat or OpenAI request and its answer as a session of its own, marked by `source`.

        One transaction: the whole exchange is stored or none of it. Returns None, or what
        went wrong in words (the answer still reaches its client; the server log says it).
        """
        if self.store is None or not self.record_requests or not answer.steps:
            return None
        title = next((m["text"] for m in reversed(history) if m["role"] == "user"), "")
        try:
            with self.store.writing():
                session_id = self.store.create_session(" ".join(title.split())[:48] or "API request",
                                                       model=self.model_name, heads=self.heads_note,
                                                       settings=options.__dict__, source=source)
                for message in history:
                    self.store.add_message(session_id, message["role"], message["text"])
                self.save_answer(session_id, answer, options.speculative)
        except StoreError as exc:
            problem = f"{exc}: a {source} answer was not saved"
            print(f"warning: {problem}", file=sys.stderr)
            return problem
        return None

    def compare(self, history: list[dict], options: Options) -> tuple[Answer, Answer]:
        """The same prompt, greedy, speculation off then on. Returns (plain, gumiho)."""
        return last(self.compare_stream(history, options))

    def compare_stream(self, history: list[dict], options: Options) -> Iterator[tuple[Answer, Answer]]:
        """`compare` as it runs: (plain, gumiho) after every step of either, plain first.

        The Gumiho answer is an empty Answer until the plain one is done, so a caller can
        show which half is running and how far it got.
        """
        greedy = Options(system=options.system, temperature=0.0, top_p=1.0, max_new_tokens=options.max_new_tokens)
        plain, gumiho = Answer(), Answer()
        for plain in self.stream(history, Options(**{**greedy.__dict__, "speculative": False})):
            yield plain, gumiho
        for gumiho in self.stream(history, Options(**{**greedy.__dict__, "speculative": True})):
            yield plain, gumiho


def _turn_starts(history: list[dict]) -> list[int]:
    """Where each turn begins: at 0, and at every later user message (a turn is a user message
    and the answers up to the next one); the last start is the latest user message."""
    return [0] + [i for i, m in enumerate(history) if m["role"] == "user" and i > 0]


class _Cancelled(Exception):
    """Stopped while still waiting in the queue."""


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 500 else line[:497] + "…"


Item = TypeVar("Item")


def last(items: Iterable[Item]) -> Item | None:
    """Run a stream (answers, a handler's outputs) to its end and return its final item."""
    item = None
    for item in items:
        pass
    return item
