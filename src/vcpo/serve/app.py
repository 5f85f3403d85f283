"""``vcpo serve``: the HF rollout engine behind vLLM's request and response shapes, over FastAPI and uvicorn.

Token ids in, token ids out, each with the log-prob of the distribution it was sampled from and the policy
version that produced it; ``/pause``, ``/resume`` and ``/update_weights`` drive in-flight weight updates.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from vcpo.models.lora import ADAPTER_CONFIG, LoraError, lora_settings
from vcpo.rollout.engine import WeightLoadError
from vcpo.serve.batcher import Batcher, BatchKey, Segment, WeightsDirError, read_weights_dir

MAX_PROMPTS = 4096  # per request: one request cannot hold the whole server's memory hostage


class CompletionRequest(BaseModel):
    """vLLM's ``/v1/completions`` body, restricted to token-id prompts; unknown OpenAI fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[list[int]] | list[int] = Field(min_length=1, max_length=MAX_PROMPTS)
    max_tokens: int = Field(16, ge=0, le=1_000_000)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    logprobs: int | None = Field(None, ge=0, le=0)
    n: int = Field(1, ge=1, le=256)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: Literal[False] = False
    return_token_ids: bool | None = None


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)
    version: int = Field(ge=0, lt=2**63)


def _error(status: int, message: str) -> JSONResponse:
    """vLLM's error body; ``message`` is one line."""
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse({"object": "error", "message": message.splitlines()[0] if message else kind,
                         "type": kind, "param": None, "code": status}, status_code=status)


def _first_validation_error(exc: RequestValidationError) -> str:
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return "the body is not valid JSON"
    if tuple(err.get("loc", ())) == ("body",) and err.get("type") in ("model_attributes_type", "dict_type"):
        return "the body must be a JSON object (sent with Content-Type: application/json)"
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
    return f"{where}: {err.get('msg', 'invalid')}"


def create_app(batcher: Batcher, tokenizer: Any, model_name: str, max_model_len: int | None) -> FastAPI:
    """The ASGI app serving ``batcher``'s engine as ``model_name`` (API.md section 7)."""
    app = FastAPI(title="vcpo serve", docs_url=None, redoc_url=None)
    vocab_size = len(tokenizer)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _first_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"{type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "version": batcher.engine.version, "paused": batcher.paused,
                "generating": batcher.generating}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "vcpo",
                                            "max_model_len": max_model_len}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> dict[str, Any] | JSONResponse:
        prompts = [body.prompt] if body.prompt and isinstance(body.prompt[0], int) else body.prompt
        for i, prompt in enumerate(prompts):
            if not prompt:
                return _error(400, f"prompt[{i}] is empty: every prompt needs at least one token")
            bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
            if bad is not None:
                return _error(400, f"prompt[{i}] holds token id {bad}, outside the vocabulary [0, {vocab_size})")
            if max_model_len is not None and len(prompt) + body.max_tokens > max_model_len:
                return _error(400, f"prompt[{i}]: {len(prompt)} prompt tokens + max_tokens {body.max_tokens} "
                                   f"exceed the model's {max_model_len} positions")
        if body.model is not None and body.model != model_name:
            return _error(404, f"model {body.model!r} is not served here (this server serves {model_name!r})")
        key = BatchKey(temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_tokens,
                       greedy=body.temperature == 0, seed=body.seed)
        flat = [p for p in prompts for _ in range(body.n)]
        segments: list[Segment] = await asyncio.wrap_future(batcher.submit(flat, key))
        return _completion_body(segments, flat, tokenizer, model_name)

    @app.post("/pause")
    async def pause(mode: str = Query("abort")) -> JSONResponse:
        if mode not in ("abort", "wait"):
            return _error(400, f"mode {mode!r} is not supported here: use abort or wait")
        await asyncio.to_thread(batcher.pause, mode == "abort")
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        batcher.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": batcher.paused}

    @app.post("/update_weights", response_model=None)
    async def update_weights(body: UpdateWeightsRequest) -> dict[str, Any] | JSONResponse:
        try:
            state = await asyncio.to_thread(read_weights_dir, body.path)
            adapter = Path(body.path) / ADAPTER_CONFIG  # LoRA: the adapters' tensors alone, and their settings
            lora = lora_settings(body.path) if adapter.is_file() else None
            await asyncio.to_thread(batcher.update_weights, state, body.version, lora)
        except (WeightsDirError, WeightLoadError, LoraError) as exc:
            return _error(400, f"update_weights rejected, weights unchanged: {exc}")
        return {"status": "ok", "version": body.version}

    return app


def _completion_body(segments: list[Segment], prompts: list[list[int]], tokenizer: Any, model: str) -> dict[str, Any]:
    choices = [
        {"index": i, "text": tokenizer.decode(s.token_ids, skip_special_tokens=True), "token_ids": s.token_ids,
         "logprobs": {"token_logprobs": s.logprobs, "tokens": tokenizer.convert_ids_to_tokens(s.token_ids)},
         "finish_reason": s.finish_reason, "versions": s.versions}
        for i, s in enumerate(segments)
    ]
    completion_tokens = sum(len(s.token_ids) for s in segments)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def run_server(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, dtype: str = "float32",
               device: str = "cpu", seed: int = 0, torch_threads: int = 1) -> None:
    """Load ``model_dir`` and serve it until SIGINT/SIGTERM (uvicorn's graceful shutdown)."""
    import uvicorn

    from vcpo.models.loading import load_policy
    from vcpo.rollout.engine import HFRolloutEngine
    from vcpo.runtime import configure_cpu

    configure_cpu(torch_threads)
    model, tokenizer = load_policy(model_dir, dtype, device)
    engine = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    batcher = Batcher(engine, seed=seed)
    max_len = getattr(model.config, "max_position_embeddings", None)
    app = create_app(batcher, tokenizer, Path(model_dir).name, max_len)
    try:
        # A request waiting on a paused server would hold a graceful shutdown forever: give it 5 s.
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    finally:
        batcher.close()
