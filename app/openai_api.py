"""An OpenAI-compatible `POST /v1/chat/completions` beside the Gradio app.

The request body is read and checked here, field by field, not by a pydantic model: the
OpenAI contract is that a parameter is honoured or refused, and a model would quietly drop
fields it does not know, take `true` for 1, and fail on an infinite number (1e400).

Honoured: `model` (the served model's id, or "default"), `messages` (roles system /
developer, user, assistant; content a string or a list of text parts), `temperature`,
`top_p`, `max_tokens` / `max_completion_tokens`, `stop` (a string or up to 4), `seed`
(with sampling and speculation on, refused where the engine's passes are not row-invariant),
`stream` (usage always comes in the last chunk, so `stream_options` is accepted as is),
`user` (accepted, not used). `n`, `frequency_penalty`, `presence_penalty` and `logprobs`
are accepted only at their no-op values (1, 0, 0, false). Anything else is a 400 naming the
field. Extensions: a request field `speculative` (default true); `usage` also carries
`tau`, `forward_passes`, `tokens_per_s` and `ttft_s`.

Errors have OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
Streaming follows OpenAI's server-sent events: `data: {chunk}` lines, then `data: [DONE]`.
Each request and its answer is stored as a session marked "openai" (ChatService.record).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from gumiho_core import GenerationSettings, GumihoError

from .chat import Answer, ChatService, Options, clean_text

PATH = "/v1/chat/completions"
# The engine's reasons mapped to OpenAI's vocabulary.
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 4  # OpenAI's limit on stop sequences
MODEL_ALIAS = "default"  # always names the served model, whatever its id


def _is_zero(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


# Accepted only at the value that changes nothing: any other would change the answer, and this server cannot.
NO_OP = {
    "n": (lambda v: type(v) is int and v == 1, "n must be 1: this server returns one choice per request"),
    "frequency_penalty": (_is_zero, "frequency_penalty is not supported (only 0)"),
    "presence_penalty": (_is_zero, "presence_penalty is not supported (only 0)"),
    "logprobs": (lambda v: v is False, "logprobs are not supported (only false)"),
}
NUMBERS = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "seed")
FIELDS = {"model", "messages", "stop", "stream", "stream_options", "speculative", "user", *NUMBERS, *NO_OP}


class ApiError(Exception):
    """A refused request: answered with OpenAI's error shape and `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass
class ChatRequest:
    """A checked request: the conversation, the user's options, and what only the API has."""

    history: list[dict]
    options: Options
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False


# -- reading a request ------------------------------------------------------------------------------
def parse_request(body, served: str) -> ChatRequest:
    """The request as ChatRequest; an ApiError naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(400, f"unsupported parameter: {unknown[0]} (this server does not implement it)",
                       param=unknown[0])
    given = {k: v for k, v in body.items() if v is not None}  # null means "not given", as OpenAI's clients send it
    _check_model(given.get("model"), served)
    for name, (ok, message) in NO_OP.items():
        if name in given and not ok(given[name]):
            raise ApiError(400, message, param=name)
    for name in NUMBERS:
        if name in given and (isinstance(given[name], bool) or not isinstance(given[name], (int, float))):
            raise ApiError(400, f"{name} must be a number (got {_shown(given[name])})", param=name)
    for name in ("stream", "speculative"):
        if name in given and not isinstance(given[name], bool):
            raise ApiError(400, f"{name} must be true or false (got {_shown(given[name])})", param=name)
    if not isinstance(given.get("stream_options", {}), dict) or not isinstance(given.get("user", ""), str):
        raise ApiError(400, "stream_options must be an object and user a string")
    system, history = _messages(given.get("messages"))
    options = Options(system=system, speculative=given.get("speculative", True),
                      temperature=given.get("temperature", 0.0),  # greedy by default: provably lossless
                      top_p=given.get("top_p", 1.0), max_new_tokens=_max_tokens(given))
    return ChatRequest(history, options, _stop(given.get("stop")), given.get("seed"), given.get("stream", False))


def _check_model(model, served: str) -> None:
    if model is None or model in (served, MODEL_ALIAS):
        return
    if not isinstance(model, str):
        raise ApiError(400, f"model must be a string (got {_shown(model)})", param="model")
    alias = f" (also called {MODEL_ALIAS!r})" if served != MODEL_ALIAS else ""
    raise ApiError(404, f"The model {model!r} does not exist here: this server serves {served!r}{alias}; "
                        "see GET /v1/models", param="model", code="model_not_found")


def _max_tokens(given: dict) -> int:
    both = [given[k] for k in ("max_completion_tokens", "max_tokens") if k in given]
    if len(both) == 2 and both[0] != both[1]:
        raise ApiError(400, "max_tokens and max_completion_tokens differ: give one of them", param="max_tokens")
    return both[0] if both else 256


def _stop(value) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if value is None:
        return ()
    if stops is None or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP} of them "
                            f"(got {_shown(value)})", param="stop")
    return tuple(stops)


def _messages(value) -> tuple[str, list[dict]]:
    """(system prompt, history) from OpenAI messages; every message is checked, none dropped."""
    if not isinstance(value, list):
        raise ApiError(400, "messages must be a list of {role, content} objects", param="messages")
    system, history = [], []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with role and content", param=where)
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise ApiError(400, f"{where}.{extra[0]} is not supported (only role and content)", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)} (got {_shown(role)})",
                           param=f"{where}.role")
        text = clean_text(_content(message.get("content"), where))
        if ROLES[role] == "system":
            system.append(text)
        else:
            history.append({"role": role, "text": text})
    if not any(m["role"] == "user" for m in history):
        raise ApiError(400, "messages must contain at least one user message", param="messages")
    if not history[-1]["text"].strip():
        raise ApiError(400, "the last message is empty", param="messages")
    return "\n".join(system), history


def _content(content, where: str) -> str:
    """A message's text: a string, or OpenAI content parts of type "text" (joined by newlines)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else part
                raise ApiError(400, f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                    f"are supported (got {_shown(kind)})", param=f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts (got {_shown(content)})",
                   param=f"{where}.content")


def _shown(value) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


async def _json_body(request: Request):
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError) as exc:  # not JSON, bad UTF-8, an integer of 5000 digits, 10000 nested [
        raise ApiError(400, f"the request body is not valid JSON ({_shown(str(exc))})") from None


# -- the routes -------------------------------------------------------------------------------------
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


def install(app: FastAPI, service: ChatService, auth: tuple[str, str] | None = None) -> None:
    """The /v1 routes on `app`, and OpenAI-shaped errors for them."""
    app.include_router(make_router(service, auth))
    app.add_exception_handler(ApiError, lambda request, exc: exc.response())


def make_router(service: ChatService, auth: tuple[str, str] | None = None) -> APIRouter:
    def check_auth(request: Request) -> None:
        # A dependency runs before the route reads the body: a stranger learns nothing about parsing.
        if auth and not _authorized(request.headers.get("authorization", ""), *auth):
            raise ApiError(401, "authentication required", code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Basic realm="gumiho-chat"'})

    router = APIRouter(dependencies=[Depends(check_auth)])

    @router.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "owned_by": "local"}]}

    @router.post(PATH)
    async def completions(request: Request):
        req = parse_request(await _json_body(request), service.model_name)
        reply = await run_in_threadpool(Reply.checked, service, req)  # fitting tokenises: off the event loop
        if req.stream:
            return StreamingResponse(reply.chunks(), media_type="text/event-stream")
        return await reply.completion(request)

    # Without these, the Gradio app mounted at "/" would answer other methods with 404.
    @router.api_route(PATH, methods=["GET", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    def wrong_method(request: Request):
        raise ApiError(405, f"{request.method} is not allowed on {PATH}: use POST", headers={"Allow": "POST"})

    return router


# -- answering --------------------------------------------------------------------------------------
@dataclass
class Reply:
    """One checked request, answered whole (`completion`) or as server-sent events (`chunks`).

    The answer is generated in a worker thread of its own; the client's side only reads
    what it produces. When the client goes away (or the server shuts down) `cancel` is set:
    the worker stops at the engine's next step, or leaves the queue if it is still waiting,
    so one dropped client never holds the engine for the others.
    """

    service: ChatService
    req: ChatRequest
    settings: GenerationSettings
    prompt_tokens: int
    base: dict  # id, created, model: the same in every chunk
    cancel: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def checked(cls, service: ChatService, req: ChatRequest) -> "Reply":
        """Settings built and the prompt fitted once, now: every refusal is a 400 before anything runs."""
        try:
            settings = service.settings(req.options).with_(stop_strings=req.stop)
            if req.seed is not None:
                settings = settings.with_(sampling=replace(settings.sampling, seed=req.seed))
                if settings.speculative and not settings.sampling.greedy and \
                        not service.engine.seed_repeats_drafted_sampling:
                    # Here a tree pass may round a row otherwise than a one-token pass: a draw near
                    # a boundary could go the other way, so the same seed would not repeat.
                    raise GumihoError("seed does not make sampling repeatable with speculative decoding on "
                                      'this engine: send "speculative": false with it')
            prompt_tokens = len(service.fit(req.options.system, req.history, settings.max_new_tokens)[0])
        except GumihoError as exc:
            raise ApiError(400, str(exc), param=_param_named(str(exc))) from None
        base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": service.model_name}
        return cls(service, req, settings, prompt_tokens, base)

    async def answers(self) -> AsyncIterator[Answer]:
        """The growing answer, as snapshots, from the worker thread; leaving early sets `cancel`."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def post(item) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
            except RuntimeError:  # the event loop is gone (the server stopped): nobody is reading
                pass

        def work() -> None:
            answer = None
            try:
                for answer in self.service.stream(self.req.history, self.req.options, self.cancel,
                                                  settings=self.settings):
                    post(replace(answer))  # a copy: the worker goes on changing its own
            finally:
                if answer is not None:  # complete or partial, the exchange is kept (before the client hears the end)
                    self.service.record("openai", self.req.history, self.req.options, answer)
                post(None)

        # Not a daemon: at shutdown the process waits the step or two it takes to stop and save.
        threading.Thread(target=work, name="openai-answer").start()
        try:
            while (answer := await inbox.get()) is not None:
                yield answer
        finally:
            self.cancel.set()  # reached on a normal end too, where it changes nothing

    async def completion(self, request: Request) -> dict:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, self.cancel))
        answer = Answer()
        try:
            async for answer in self.answers():
                pass
        finally:
            watcher.cancel()
        if answer.error:
            raise ApiError(503 if self.service.closing.is_set() else 400, answer.error)
        return {
            **self.base, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                         "finish_reason": FINISH.get(answer.finish_reason, "stop")}],
            "usage": _usage(answer.stats, self.prompt_tokens),
        }

    async def chunks(self) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects; `answers` then sets cancel.
        sent = 0
        yield self._event({"role": "assistant", "content": ""}, None)
        async for answer in self.answers():
            if answer.done and (answer.error or self.service.closing.is_set()):
                message = answer.error or "the server is shutting down: the answer was cut short"
                yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
                break
            # With stop strings, the tail that could be the start of one is held back until the next step.
            upto = len(answer.text) if answer.done else max(sent, self._safe_length(answer.text))
            delta, sent = answer.text[sent:upto], upto
            if answer.done:
                yield self._event({"content": delta} if delta else {}, FINISH.get(answer.finish_reason, "stop"),
                                  usage=_usage(answer.stats, self.prompt_tokens))
                break
            if delta:
                yield self._event({"content": delta}, None)
        yield "data: [DONE]\n\n"

    def _safe_length(self, text: str) -> int:
        """How much of a growing answer is sure to stay in the final one. The step that completes
        a stop string still carries it (only the final text is cut), and its last characters
        may be the start of one: neither is sent until the answer is done."""
        stops = self.settings.stop_strings
        found = [at for at in (text.find(s) for s in stops) if at >= 0]
        held_back = max((len(s) - 1 for s in stops), default=0)
        return min([len(text) - held_back, *found])

    def _event(self, delta: dict, finish_reason: str | None, **extra) -> str:
        body = {**self.base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}
        return f"data: {json.dumps(body)}\n\n"


async def _cancel_on_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set `cancel` when the client of a non-streaming request hangs up before its answer."""
    while not cancel.is_set():
        if await request.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(0.25)


def _usage(stats: dict | None, prompt_tokens: int) -> dict:
    stats = stats or {}
    new = stats.get("new_tokens", 0)
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": new, "total_tokens": prompt_tokens + new,
        "tau": stats.get("tau", 0.0), "forward_passes": stats.get("forward_passes", 0),
        "tokens_per_s": stats.get("tokens_per_s", 0.0), "ttft_s": stats.get("ttft_s", 0.0),
        "speculative": stats.get("speculative"),
    }


def _param_named(message: str) -> str | None:
    """Which request field a settings message is about (the engine names its own fields)."""
    for word, param in (("max new tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                        ("speculative", "speculative"), ("seed", "seed"), ("too long", "messages")):
        if word in message:
            return param
    return None
