"""The rollout servers one process talks to: every HTTP call with a timeout and bounded retries, servers that stop
answering set aside (the others continue), and the pause -> update -> resume of a weight update on each.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from vcpo.errors import RunFailed
from vcpo.rollout.server_kinds import Call, ServerResponseError, server_api


class ServerError(RunFailed):
    """Rollout servers cannot serve the run (all down, or one refused a request); one line naming the server.
    The trainer checkpoints its finished steps and the command exits 1."""


class ServerDown(ServerError):
    """One server did not answer within its timeout, ``retries`` times over."""


class ServerPool:
    """HTTP access to ``urls`` of one ``kind``; a server that stays down is skipped from then on.

    Only a server that does not answer is down: transport errors (refused or reset connections, timeouts) are
    retried ``retries`` times with a doubling backoff, then the server is marked down (a warning line on stderr).
    A server that answers with an error status (4xx or 5xx) refused deterministically: one ``ServerError`` at once,
    naming the server, the route and the server's own message.
    """

    def __init__(self, urls: list[str], kind: str = "vcpo", *, model: str | None = None, lora: bool = False,
                 connect_timeout_s: float = 5.0, request_timeout_s: float = 600.0, control_timeout_s: float = 120.0,
                 retries: int = 2, retry_backoff_s: float = 0.5, transport: httpx.BaseTransport | None = None) -> None:
        if not urls:
            raise ServerError("rollout.server.urls is empty: name at least one server")
        self.urls = [u.rstrip("/") for u in urls]
        self.api = server_api(kind, model, lora)
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self._down: set[str] = set()
        self._versions: dict[str, str | None] = {}
        self._lock = threading.Lock()
        # ``transport``: tests answer with recorded vLLM / SGLang shapes (httpx.MockTransport)
        self._client = httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
                                    transport=transport)

    def live(self) -> list[str]:
        with self._lock:
            live = [u for u in self.urls if u not in self._down]
        if not live:
            raise ServerError(f"every rollout server is down ({', '.join(self.urls)})")
        return live

    def mark_down(self, url: str, reason: str) -> None:
        with self._lock:
            if url in self._down:
                return
            self._down.add(url)
            left = len(self.urls) - len(self._down)
        print(f"warning: rollout server {url} is down ({reason}); skipped from now on, {left} left", file=sys.stderr)

    def call(self, url: str, call: Call, timeout_s: float | None = None) -> Any:
        """The JSON answer of ``call`` on ``url``; raises ``ServerDown`` (after the retries) or ``ServerError``."""
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                response = self._client.request(call.method, url + call.path, json=call.json, params=call.params,
                                                timeout=timeout_s or self.request_timeout_s)
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                continue
            if response.status_code == 404 and call.missing_ok:
                return None
            if response.status_code >= 400:
                raise ServerError(f"rollout server {url} ({self.api.kind}) refused {call.route} "
                                  f"(HTTP {response.status_code}): {_message(response)}")
            if not call.answers_json:
                return None
            try:
                body = response.json()
            except ValueError:
                raise ServerError(f"rollout server {url} answered {call.route} with something other than "
                                  f"JSON") from None
            try:
                self.api.check(call, body)
            except ServerResponseError as exc:
                raise ServerError(f"rollout server {url}: {exc}") from None
            return body
        self.mark_down(url, reason)
        raise ServerDown(f"rollout server {url} is down: {reason}")

    def update_all(self, path: str, version: int, abort: bool = True) -> None:
        """Every live server pauses (in-flight requests aborted, or finished when not ``abort``), loads ``path`` as
        ``version`` and resumes (also after a failed pause or update: a failed update never leaves a server paused).
        Servers found down are skipped; any other failure raises once every server has resumed."""
        def update_one(url: str) -> None:
            self.check_version(url)
            try:
                for call in self.api.pause(abort):
                    self.call(url, call, self.control_timeout_s)
                for call in self.api.update(path, version):
                    self.call(url, call, self.control_timeout_s)
            except BaseException:
                self._resume_after_failure(url)
                raise
            for call in self.api.resume():
                self.call(url, call, self.control_timeout_s)

        live = self.live()
        with ThreadPoolExecutor(len(live)) as pool:
            futures = [pool.submit(update_one, url) for url in live]
        errors = [f.exception() for f in futures if f.exception() is not None]
        hard = [e for e in errors if not isinstance(e, ServerDown)]
        if hard:
            raise hard[0]
        self.live()  # raises when the update found every server down

    def _resume_after_failure(self, url: str) -> None:
        """Resume ``url`` after a failed pause or update, best effort: the update's own error is the one reported,
        and a server that went down stays down. Transport errors are retried like any call (a server may close its
        connection after an error answer), without marking the server down."""
        for call in self.api.resume():
            for attempt in range(self.retries + 1):
                if attempt:
                    time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
                try:
                    self._client.request(call.method, url + call.path, json=call.json, params=call.params,
                                         timeout=self.control_timeout_s)
                    break
                except httpx.TransportError:
                    continue

    def check_version(self, url: str) -> None:
        """Ask ``url`` once for its version (vLLM's ``/version``) and raise one line when its kind does not support
        it; kinds without a version route pass."""
        if url in self._versions:
            return
        probe = self.api.version_call()
        if probe is None:
            self._versions[url] = None
            return
        try:
            self._versions[url] = self.api.check_version(self.call(url, probe, self.control_timeout_s))
        except ServerResponseError as exc:
            raise ServerError(f"rollout server {url}: {exc}") from None

    def version_of(self, url: str) -> str | None:
        """The server version ``check_version`` read (None when not asked or the kind has none)."""
        return self._versions.get(url)

    def close(self) -> None:
        self._client.close()


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0][:200] if response.text.strip() else "(empty)"
    if isinstance(body, dict):
        msg = body.get("message") or body.get("detail") or body.get("error") or body
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
        return str(msg).splitlines()[0][:300] if str(msg) else "(empty)"
    return str(body)[:200]
