"""The OpenAI-compatible endpoint agents call during training: ``/episodes/<id>/v1/chat/completions`` and
``/episodes/<id>/v1/completions`` on 127.0.0.1, over FastAPI and uvicorn (``vcpo serve``'s stack).

Each call is tied to its episode by the id in the base URL. The endpoint builds the prompt ids (``vcpo.agents.chat``),
files the call for the collector, which samples it with the run's rollout engine, records the exact ids, log-probs and
versions, and answers in OpenAI's shapes (streamed as server-sent events when asked). vcpo's own fields ride along:
each choice's ``token_ids``, ``prompt_token_ids`` and ``versions``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from vcpo.agents.chat import Prompt, PromptError, chat_prompt, completion_prompt, parse_tool_calls
from vcpo.agents.episodes import Call, EpisodeBook, EpisodeDropped, PendingCall
from vcpo.types import Generation

HOST = "127.0.0.1"
_STOP_S = 5.0
KEEP_ALIVE_S = 600.0  # seconds an idle agent connection stays open (uvicorn closes it after 5 by default)


class ChatRequest(BaseModel):
    """OpenAI's chat completion body; sampling fields other than the token budget are the run's, not the agent's."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1)
    logprobs: bool = False
    stream: bool = False


class CompletionRequest(BaseModel):
    """OpenAI's legacy completion body: one prompt, text or token ids."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int]
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1)
    logprobs: int | None = Field(None, ge=0, le=1)
    stream: bool = False


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message.splitlines()[0] if message else kind, "type": kind,
                                   "param": None, "code": status}}, status_code=status)


def create_app(book: EpisodeBook, tokenizer: Any, model_name: str, max_new_tokens: int) -> FastAPI:
    """The endpoint's ASGI app: calls of ``book``'s running episodes, sampled at most ``max_new_tokens`` a call."""
    app = FastAPI(title="vcpo agent endpoint", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        return _error(400, f"{where}: {err.get('msg', 'invalid')}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.get("/episodes/{episode_id}/v1/models")
    async def models(episode_id: str) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "vcpo"}]}

    async def sample(episode_id: str, body: ChatRequest | CompletionRequest, build: Any
                     ) -> tuple[Prompt, Generation] | JSONResponse:
        if body.model is not None and body.model != model_name:
            return _error(404, f"model {body.model!r} is not served here (this endpoint serves {model_name!r})")
        try:
            previous = book.last_call(episode_id)
            prompt = await asyncio.to_thread(build, previous)
            limit = min(getattr(body, "max_completion_tokens", None) or body.max_tokens or max_new_tokens,
                        max_new_tokens)
            pending = PendingCall(episode_id, prompt.ids, limit)
            book.submit(pending)
            return prompt, await asyncio.wrap_future(pending.future)
        except EpisodeDropped as e:
            return _error(410, str(e), "episode_dropped")
        except PromptError as e:
            return _error(400, str(e))

    @app.post("/episodes/{episode_id}/v1/chat/completions", response_model=None)
    async def chat(episode_id: str, body: ChatRequest) -> Any:
        out = await sample(episode_id, body, lambda prev: chat_prompt(tokenizer, body.messages, body.tools, prev))
        if isinstance(out, JSONResponse):
            return out
        prompt, gen = out
        text = tokenizer.decode(gen.response_ids, skip_special_tokens=True)
        content, tool_calls = parse_tool_calls(text, bool(body.tools))
        try:
            book.record(episode_id, _call(prompt, gen, content or "", len(tool_calls)), len(tool_calls))
        except EpisodeDropped as e:
            return _error(410, str(e), "episode_dropped")
        finish = "tool_calls" if tool_calls else ("stop" if gen.finished else "length")
        message = {"role": "assistant", "content": content} | ({"tool_calls": tool_calls} if tool_calls else {})
        choice = {"index": 0, "message": message, "finish_reason": finish, **_provenance(prompt, gen)}
        if body.logprobs:
            choice["logprobs"] = {"content": _token_logprobs(tokenizer, gen)}
        head = _head("chat.completion", model_name, prompt, gen)
        if body.stream:
            return StreamingResponse(_chat_events(head, choice), media_type="text/event-stream")
        return head | {"choices": [choice]}

    @app.post("/episodes/{episode_id}/v1/completions", response_model=None)
    async def completions(episode_id: str, body: CompletionRequest) -> Any:
        if isinstance(body.prompt, list) and not all(0 <= t < len(tokenizer) for t in body.prompt):
            return _error(400, f"prompt holds a token id outside the vocabulary [0, {len(tokenizer)})")
        if not body.prompt:
            return _error(400, "prompt is empty")
        out = await sample(episode_id, body, lambda prev: completion_prompt(tokenizer, body.prompt, prev))
        if isinstance(out, JSONResponse):
            return out
        prompt, gen = out
        text = tokenizer.decode(gen.response_ids, skip_special_tokens=True)
        try:
            book.record(episode_id, _call(prompt, gen, text, 0), 0)
        except EpisodeDropped as e:
            return _error(410, str(e), "episode_dropped")
        choice = {"index": 0, "text": text, "finish_reason": "stop" if gen.finished else "length",
                  **_provenance(prompt, gen)}
        if body.logprobs is not None:
            choice["logprobs"] = {"tokens": tokenizer.convert_ids_to_tokens(gen.response_ids),
                                  "token_logprobs": gen.behavior_logprobs}
        head = _head("text_completion", model_name, prompt, gen)
        if body.stream:
            return StreamingResponse(_completion_events(head, choice), media_type="text/event-stream")
        return head | {"choices": [choice]}

    return app


def _call(prompt: Prompt, gen: Generation, reply_text: str, tool_calls: int) -> Call:
    return Call(prompt.ids, list(gen.response_ids), list(gen.behavior_logprobs), list(gen.versions), gen.finished,
                prompt.spliced, reply_text, tool_calls, prompt.messages, prompt.tools, prompt.text)


def _provenance(prompt: Prompt, gen: Generation) -> dict[str, Any]:
    """vcpo's fields on a choice: the exact prompt ids sampled from, the sampled ids and each token's version."""
    return {"prompt_token_ids": prompt.ids, "token_ids": list(gen.response_ids), "versions": list(gen.versions)}


def _token_logprobs(tokenizer: Any, gen: Generation) -> list[dict[str, Any]]:
    tokens = tokenizer.convert_ids_to_tokens(gen.response_ids)
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, gen.behavior_logprobs, strict=True)]


def _head(kind: str, model: str, prompt: Prompt, gen: Generation) -> dict[str, Any]:
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model,
            "usage": {"prompt_tokens": len(prompt.ids), "completion_tokens": len(gen.response_ids),
                      "total_tokens": len(prompt.ids) + len(gen.response_ids)}}


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _chat_events(head: dict[str, Any], choice: dict[str, Any]) -> AsyncIterator[str]:
    """The answer as chat chunks (the engine samples a call whole, so they follow it): the role, the content, the
    tool calls (each with its index), then the finish reason with vcpo's fields, then ``[DONE]``."""
    base = head | {"object": "chat.completion.chunk"}
    base.pop("usage")
    message = choice["message"]
    yield _event(base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]})
    if message.get("content"):
        yield _event(base | {"choices": [{"index": 0, "delta": {"content": message["content"]},
                                          "finish_reason": None}]})
    calls = [{"index": i, **c} for i, c in enumerate(message.get("tool_calls", []))]
    if calls:
        yield _event(base | {"choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]})
    last = {k: v for k, v in choice.items() if k != "message"} | {"delta": {}}
    yield _event(base | {"choices": [last], "usage": head["usage"]})
    yield "data: [DONE]\n\n"


async def _completion_events(head: dict[str, Any], choice: dict[str, Any]) -> AsyncIterator[str]:
    text = {k: v for k, v in choice.items() if k not in ("finish_reason",)} | {"finish_reason": None}
    yield _event(head | {"choices": [text]})
    yield _event(head | {"choices": [{"index": 0, "text": "", "finish_reason": choice["finish_reason"]}]})
    yield "data: [DONE]\n\n"


class EndpointServer:
    """The endpoint app served by uvicorn on a thread of this process, on a free port of 127.0.0.1."""

    def __init__(self, app: FastAPI) -> None:
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((HOST, 0))
        self.port = int(self._socket.getsockname()[1])
        # An agent's connection idles while it runs a tool between calls; uvicorn's default 5 s keep-alive would
        # close it under the client, whose next call then fails (a connection error the agent cannot tell apart).
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1,
                                lifespan="off", timeout_keep_alive=KEEP_ALIVE_S)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True,
                                        name="vcpo-agent-endpoint")
        self._thread.start()
        deadline = time.monotonic() + _STOP_S * 6
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent endpoint did not start")
            time.sleep(0.01)

    def base_url(self, episode_id: str) -> str:
        return f"http://{HOST}:{self.port}/episodes/{episode_id}/v1"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(_STOP_S)
        self._socket.close()
