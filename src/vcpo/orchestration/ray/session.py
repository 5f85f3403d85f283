"""The Ray session of one run: started (locally, bound to localhost) or joined, always shut down, and remote calls
that end after a timeout in one clear line instead of hanging."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from vcpo.config import Config, ConfigError
from vcpo.orchestration.base import BackendError


def import_ray():
    """Ray, or one line naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ConfigError('async.backend=ray needs Ray: pip install -e ".[ray]"') from None
    return ray


class RaySession:
    """``with RaySession(config):`` a local Ray instance (``ray.address`` null) or the cluster at the address."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.ray = import_ray()

    def num_cpus(self) -> float:
        """The local instance's CPUs: the configured number, else what the actors ask for."""
        rc, workers, learners = self.config.ray, self.config.async_.num_workers, self.config.trainer.num_learners
        if rc.num_cpus is not None:
            return rc.num_cpus
        return max(1, int(workers * rc.worker_num_cpus + learners * rc.learner_num_cpus + 0.999))

    def __enter__(self) -> RaySession:
        rc = self.config.ray
        quiet = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False,
                 "configure_logging": True}
        if self.ray.is_initialized():  # a caller (a test, a notebook) already holds a session: use it
            self.owned = False
            return self
        self.owned = True
        # ray.init installs its own SIGTERM handler in the driver; vcpo's (checkpoint the last finished step, exit
        # 143) must stay in charge, so the handlers in place before are put back once Ray is up, and after shutdown.
        self.handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            if rc.address is None:
                resources = rc.demands(self.config.async_.num_workers, self.config.trainer.num_learners)
                # "local": a new instance of its own, never a cluster found through RAY_ADDRESS or the address file
                # that `ray start` and ray.cluster_utils write, which ray.init() would otherwise join
                self.ray.init(address="local", num_cpus=self.num_cpus(), resources=resources,
                              _node_ip_address="127.0.0.1", **quiet)
            else:
                self.ray.init(address=rc.address, **quiet)
        except ConnectionError as exc:
            raise ConfigError(f"ray.address={rc.address!r}: cannot join the Ray cluster ({exc})") from None
        finally:
            self._restore_handlers()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.owned:
            self.ray.shutdown()
            self._restore_handlers()

    def _restore_handlers(self) -> None:
        for sig, handler in self.handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def get(refs, timeout_s: float, what: str, key: str = "ray.timeout_s"):
    """``ray.get`` with a deadline: past it, one line naming the call and ``key``, the key that sets the limit."""
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise BackendError(f"{what} did not answer within {key}={timeout_s:g} s") from None


def error_line(error: BaseException) -> str:
    """``Type: first line`` of an error (torch.distributed's and Ray's messages run to many lines), at most 200
    characters of text."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


class RemoteFailed(Exception):
    """The remote call at position ``index`` of a ``gather`` raised ``error`` (a Ray error)."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(str(error))
        self.index, self.error = index, error


def gather(refs: list, timeout_s: float, what: str, refuse: Callable[[Any], str | None] = lambda _: None,
           key: str = "ray.timeout_s") -> list:
    """Every answer of ``refs`` in order, within ``timeout_s`` (set by ``key``) in all; the first call to fail ends
    the wait at once (``RemoteFailed``), as does an answer that ``refuse`` gives a reason for (one line naming
    ``what``)."""
    import ray

    deadline, waiting = time.monotonic() + timeout_s, list(refs)
    while waiting:
        done, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise BackendError(f"{what} did not finish within {key}={timeout_s:g} s")
        try:
            answer = ray.get(done[0])
        except ray.exceptions.RayError as exc:
            raise RemoteFailed(refs.index(done[0]), exc) from None
        if (reason := refuse(answer)) is not None:
            raise BackendError(f"{what} failed: {reason}")
    return ray.get(refs)
