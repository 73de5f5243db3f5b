"""CUDA-graph machinery: bucket choice, deferred capture, shared pool, replay, eager fallback."""

from graphs.runner import DEFAULT_BUCKETS, GraphRunner, GraphStats, StandInGraph

__all__ = ["DEFAULT_BUCKETS", "GraphRunner", "GraphStats", "StandInGraph"]
