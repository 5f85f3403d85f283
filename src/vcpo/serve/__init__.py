"""``vcpo serve``: the in-process HF engine behind an HTTP API (FastAPI + uvicorn, the ``serve`` extra)."""

from vcpo.serve.batcher import Batcher, BatchKey, Segment, WeightsDirError, read_weights_dir

__all__ = ["BatchKey", "Batcher", "Segment", "WeightsDirError", "read_weights_dir"]
