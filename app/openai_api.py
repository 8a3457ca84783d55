"""An OpenAI-compatible `POST /v1/chat/completions` beside the Gradio app.

Extensions to the OpenAI shape: a request field `speculative` (default true), and in the
response `usage` also carries `tau`, `forward_passes`, `tokens_per_s` and `ttft_s`.
Streaming follows OpenAI's server-sent events: `data: {chunk}` lines, then `data: [DONE]`.
"""
from __future__ import annotations

import base64
import binascii
import json
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gumiho_core import GenerationSettings, GumihoError

from .chat import ChatService, Options, clean_text

# The engine's reasons mapped to OpenAI's vocabulary.
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[ChatMessage]
    temperature: float = 0.0  # greedy by default: that is when speculation is provably lossless
    top_p: float = 1.0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    speculative: bool = True


def _usage(stats: dict | None, prompt_tokens: int) -> dict:
    stats = stats or {}
    new = stats.get("new_tokens", 0)
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": new, "total_tokens": prompt_tokens + new,
        "tau": stats.get("tau", 0.0), "forward_passes": stats.get("forward_passes", 0),
        "tokens_per_s": stats.get("tokens_per_s", 0.0), "ttft_s": stats.get("ttft_s", 0.0),
        "speculative": stats.get("speculative"),
    }


def _authorized(header: str, user: str, password: str) -> bool:
    """HTTP basic `user:password`, or a bearer token equal to the password (or `user:password`)."""
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() == "basic":
        try:
            value = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
    elif scheme.lower() != "bearer":
        return False
    given_user, sep, given_password = value.partition(":")
    if not sep:  # a bare bearer token is the password
        given_user, given_password = user, value
    ok_user = secrets.compare_digest(given_user.encode(), user.encode())
    ok_password = secrets.compare_digest(given_password.encode(), password.encode())
    return ok_user and ok_password


def make_router(service: ChatService, auth: tuple[str, str] | None = None) -> APIRouter:
    def check_auth(request: Request) -> None:
        if auth and not _authorized(request.headers.get("authorization", ""), *auth):
            raise HTTPException(401, "authentication required", headers={"WWW-Authenticate": 'Basic realm="gumiho-chat"'})

    router = APIRouter(dependencies=[Depends(check_auth)])

    @router.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "owned_by": "local"}]}

    @router.post("/v1/chat/completions")
    def completions(req: ChatRequest):
        history, opts = _conversation(req)
        try:
            settings = opts.settings(service.tree)  # built once: every refusal is a 400 before anything runs
            prompt_tokens = len(service.fit(opts.system, history, settings.max_new_tokens)[0])
        except GumihoError as exc:
            raise HTTPException(400, str(exc)) from None
        reply = Reply(service, history, opts, settings, prompt_tokens,
                      {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                       "model": req.model or service.model_name})
        if not req.stream:
            return reply.completion()
        return StreamingResponse(reply.chunks(), media_type="text/event-stream")

    return router


def _conversation(req: ChatRequest) -> tuple[list[dict], Options]:
    """The request as chat history and Options (values as sent: Options.settings checks them)."""
    system = clean_text("\n".join(m.content for m in req.messages if m.role == "system"))
    history = [{"role": m.role, "text": clean_text(m.content)} for m in req.messages if m.role in ("user", "assistant")]
    if not any(m["role"] == "user" for m in history):
        raise HTTPException(400, "messages must contain at least one user message")
    if not history[-1]["text"].strip():
        raise HTTPException(400, "the last message is empty")
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return history, Options(system=system, speculative=req.speculative, temperature=req.temperature,
                            top_p=req.top_p, max_new_tokens=256 if max_new is None else max_new)


@dataclass
class Reply:
    """One checked request, answered whole (`completion`) or as server-sent events (`chunks`)."""

    service: ChatService
    history: list[dict]
    options: Options
    settings: GenerationSettings
    prompt_tokens: int
    base: dict  # id, created, model: the same in every chunk

    def completion(self) -> dict:
        answer = self.service.answer(self.history, self.options, settings=self.settings)
        if answer.error:
            raise HTTPException(400, answer.error)
        return {
            **self.base, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                         "finish_reason": FINISH.get(answer.finish_reason, "stop")}],
            "usage": _usage(answer.stats, self.prompt_tokens),
        }

    def chunks(self) -> Iterator[str]:
        # Starlette closes this generator when the client disconnects; the engine then
        # stops at its next step and releases its lock.
        cancel = threading.Event()
        sent = 0
        try:
            yield self._event({"role": "assistant", "content": ""}, None)
            for answer in self.service.stream(self.history, self.options, cancel=cancel, settings=self.settings):
                if answer.done and answer.error:
                    yield f"data: {json.dumps({'error': {'message': answer.error}})}\n\n"
                    break
                delta, sent = answer.text[sent:], len(answer.text)
                if answer.done:
                    yield self._event({"content": delta} if delta else {}, FINISH.get(answer.finish_reason, "stop"),
                                      usage=_usage(answer.stats, self.prompt_tokens))
                    break
                if delta:
                    yield self._event({"content": delta}, None)
            yield "data: [DONE]\n\n"
        finally:
            cancel.set()

    def _event(self, delta: dict, finish_reason: str | None, **extra) -> str:
        body = {**self.base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}
        return f"data: {json.dumps(body)}\n\n"
