"""One process's agent machinery: the episode book, the endpoint serving it, and the runner process (restarted after
a collection that left agents running, so that no timed-out agent lives on into the next one)."""

from __future__ import annotations

from typing import Any

from vcpo.agents.endpoint import EndpointServer, create_app
from vcpo.agents.episodes import EpisodeBook
from vcpo.agents.runner import AgentRunner


class AgentSession:
    """The endpoint (started at once) and the runner (started on demand) of an agent task in this process."""

    def __init__(self, agent_path: str, tokenizer: Any, served_model: str, max_new_tokens: int) -> None:
        self.agent_path = agent_path
        self.served_model = served_model
        self.max_new_tokens = max_new_tokens
        self.book = EpisodeBook()
        self.server = EndpointServer(create_app(self.book, tokenizer, served_model, max_new_tokens))
        self._runner: AgentRunner | None = None

    def runner(self) -> AgentRunner:
        if self._runner is None or not self._runner.alive():
            self.stop_runner()
            self._runner = AgentRunner(self.agent_path)
        return self._runner

    def stop_runner(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def close(self) -> None:
        self.stop_runner()
        self.server.close()
