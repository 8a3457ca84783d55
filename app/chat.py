"""The chat logic every front end shares: prompt building, streaming an answer, saving it.

The Gradio UI, the `/chat` endpoint and the OpenAI route all go through `ChatService`, so
they build prompts, apply settings and record answers the same way.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from collections.abc import Iterator

from gumiho_core import DoneEvent, GenerationSettings, GumihoError, SamplingSettings, StepEvent

from .render import step_from_event
from .store import Store


@dataclass
class Options:
    """What the user set in the panel, for one answer."""

    system: str = ""
    speculative: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256

    def settings(self) -> GenerationSettings:
        return GenerationSettings(
            max_new_tokens=int(self.max_new_tokens),
            speculative=bool(self.speculative),
            sampling=SamplingSettings(temperature=float(self.temperature), top_p=float(self.top_p)),
            on_overflow="truncate",  # a long chat drops its oldest turns rather than refusing
        )


@dataclass
class Answer:
    """An answer as it grows; `done` once the engine finished (or failed)."""

    steps: list[dict] = field(default_factory=list)
    text: str = ""
    stats: dict | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False

    def as_message(self) -> dict:
        return {"role": "assistant", "text": self.text, "steps": self.steps, "stats": self.stats,
                "finish_reason": self.finish_reason, "error": self.error}


class ChatService:
    def __init__(self, engine, store: Store | None, model_name: str = "default", heads_note: str = ""):
        self.engine = engine
        self.store = store
        self.model_name = model_name
        self.heads_note = heads_note

    @property
    def has_heads(self) -> bool:
        return self.engine.heads is not None

    def prompt_ids(self, system: str, history: list[dict]) -> list[int]:
        """The whole conversation through the model's chat template (multi-turn context)."""
        messages = [{"role": "system", "content": system}] if system.strip() else []
        messages += [{"role": m["role"], "content": m["text"]} for m in history if m["role"] in ("user", "assistant")]
        return self.engine.target.chat_prompt(messages)

    def stream(self, history: list[dict], options: Options, cancel: threading.Event | None = None) -> Iterator[Answer]:
        """Yield the growing Answer after each target pass; the last one has done=True.

        Never raises for generation problems: a GumihoError (or any failure) ends the
        answer with `error` set and whatever text came before it kept.
        """
        answer = Answer()
        try:
            if options.speculative and not self.has_heads:
                raise GumihoError("speculative decoding needs draft heads, and none are loaded")
            prompt = self.prompt_ids(options.system, history)
            for event in self.engine.generate(prompt, options.settings(), cancel=cancel):
                if isinstance(event, StepEvent):
                    answer.steps.append(step_from_event(event))
                    answer.text += event.text
                    yield answer
                elif isinstance(event, DoneEvent):
                    answer.text = event.text  # the engine's text honours stop strings exactly
                    answer.stats = event.stats.to_dict()
                    answer.finish_reason = event.finish_reason
        except GumihoError as exc:
            answer.error, answer.finish_reason = str(exc), "error"
        except Exception as exc:  # the app must survive a failing generation
            answer.error, answer.finish_reason = f"generation failed: {type(exc).__name__}: {exc}", "error"
        answer.done = True
        yield answer

    def save_answer(self, session_id: int, answer: Answer, speculative: bool) -> int:
        """Store an answer (complete or partial) and its stats; returns the message id."""
        message_id = self.store.add_message(
            session_id, "assistant", answer.text, steps=answer.steps, speculative=speculative,
            finish_reason=answer.finish_reason,
        )
        if answer.stats:
            self.store.add_stats(session_id, message_id, answer.stats, answer.finish_reason or "", model=self.model_name)
        return message_id

    def compare(self, history: list[dict], options: Options) -> tuple[Answer, Answer]:
        """The same prompt, greedy, speculation off then on. Returns (plain, gumiho)."""
        greedy = Options(system=options.system, temperature=0.0, top_p=1.0, max_new_tokens=options.max_new_tokens)
        plain = _last(self.stream(history, Options(**{**greedy.__dict__, "speculative": False})))
        gumiho = _last(self.stream(history, Options(**{**greedy.__dict__, "speculative": True})))
        return plain, gumiho


def _last(answers: Iterator[Answer]) -> Answer:
    answer = None
    for answer in answers:
        pass
    return answer
