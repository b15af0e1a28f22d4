"""Server metrics in the Prometheus text exposition format (``GET /metrics``), without a client library.

Counters (requests, observations, model calls, errors by kind), a histogram of observations per model
call, and latency quantiles (p50 / p90 / p99 over the last ``window`` requests, in seconds, measured
from the moment a request is decoded to the moment its reply is ready). Updated from the event loop and
the model thread, hence the lock.
"""

from __future__ import annotations

import threading
from collections import Counter, deque

import numpy as np

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUANTILES = (0.5, 0.9, 0.99)


class ServerMetrics:
    def __init__(self, window: int = 10_000):
        self._lock = threading.Lock()
        self.requests = 0
        self.observations = 0
        self.model_calls = 0
        self.errors: Counter[str] = Counter()
        self.connections = 0
        self._batch_counts = [0] * (len(BATCH_BUCKETS) + 1)  # last: +Inf
        self._batch_sum = 0
        self._latency: deque[float] = deque(maxlen=window)
        self._latency_sum = 0.0
        self._latency_count = 0

    def request_done(self, n_obs: int, latency_s: float) -> None:
        with self._lock:
            self.requests += 1
            self.observations += n_obs
            self._latency.append(latency_s)
            self._latency_sum += latency_s
            self._latency_count += 1

    def model_call(self, batch_size: int) -> None:
        with self._lock:
            self.model_calls += 1
            self._batch_sum += batch_size
            i = next((i for i, b in enumerate(BATCH_BUCKETS) if batch_size <= b), len(BATCH_BUCKETS))
            self._batch_counts[i] += 1

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def connection(self, delta: int) -> None:
        with self._lock:
            self.connections += delta

    def latency_quantiles(self) -> dict[float, float]:
        with self._lock:
            lat = np.asarray(self._latency)
        if not len(lat):
            return {q: float("nan") for q in QUANTILES}
        return {q: float(v) for q, v in zip(QUANTILES, np.quantile(lat, QUANTILES))}

    def render(self) -> str:
        """The whole exposition, ``text/plain; version=0.0.4``."""
        quant = self.latency_quantiles()
        with self._lock:
            lines = [
                "# HELP wamkit_requests_total Requests answered with actions or frames.",
                "# TYPE wamkit_requests_total counter",
                f"wamkit_requests_total {self.requests}",
                "# HELP wamkit_observations_total Observations answered (a batched request counts B).",
                "# TYPE wamkit_observations_total counter",
                f"wamkit_observations_total {self.observations}",
                "# HELP wamkit_model_calls_total Calls of the model's predict.",
                "# TYPE wamkit_model_calls_total counter",
                f"wamkit_model_calls_total {self.model_calls}",
                "# HELP wamkit_errors_total Requests answered with an error frame, by kind.",
                "# TYPE wamkit_errors_total counter",
            ]
            for kind in sorted(self.errors) or ["request"]:
                lines.append(f'wamkit_errors_total{{kind="{kind}"}} {self.errors.get(kind, 0)}')
            lines += [
                "# HELP wamkit_connections Open websocket connections.",
                "# TYPE wamkit_connections gauge",
                f"wamkit_connections {self.connections}",
                "# HELP wamkit_batch_size Observations per model call.",
                "# TYPE wamkit_batch_size histogram",
            ]
            cum = 0
            for bound, count in zip([*map(str, BATCH_BUCKETS), "+Inf"], self._batch_counts):
                cum += count
                lines.append(f'wamkit_batch_size_bucket{{le="{bound}"}} {cum}')
            lines += [
                f"wamkit_batch_size_sum {self._batch_sum}",
                f"wamkit_batch_size_count {self.model_calls}",
                "# HELP wamkit_request_latency_seconds Decode-to-reply latency of recent requests.",
                "# TYPE wamkit_request_latency_seconds summary",
            ]
            lines += [f'wamkit_request_latency_seconds{{quantile="{q}"}} {v:.6g}' for q, v in quant.items()]
            lines += [
                f"wamkit_request_latency_seconds_sum {self._latency_sum:.6g}",
                f"wamkit_request_latency_seconds_count {self._latency_count}",
            ]
        return "\n".join(lines) + "\n"
