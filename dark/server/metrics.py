"""Counters and gauges, written out in the Prometheus text format at /metrics. Thread-safe, no dependency."""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(esc.items())) + "}"


class Metrics:
    WINDOW_S = 60.0  # tokens/s is measured over the last minute

    def __init__(self):
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self._gauges: dict[str, dict[tuple, float]] = defaultdict(dict)
        self._help: dict[str, tuple[str, str]] = {}
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of finished generations
        self.started = time.time()

    def _describe(self, name: str, kind: str, help_text: str) -> None:
        self._help.setdefault(name, (kind, help_text))

    def inc(self, name: str, help_text: str, value: float = 1.0, **labels: str) -> None:
        with self._lock:
            self._describe(name, "counter", help_text)
            self._counters[name][tuple(sorted(labels.items()))] += value

    def set(self, name: str, help_text: str, value: float, **labels: str) -> None:
        with self._lock:
            self._describe(name, "gauge", help_text)
            self._gauges[name][tuple(sorted(labels.items()))] = value

    def add_gauge(self, name: str, help_text: str, delta: float, **labels: str) -> None:
        with self._lock:
            self._describe(name, "gauge", help_text)
            key = tuple(sorted(labels.items()))
            self._gauges[name][key] = self._gauges[name].get(key, 0.0) + delta

    def generation(self, source: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """One finished generation, from the websocket ("ws") or the OpenAI routes ("openai")."""
        self.inc("dark_requests_total", "Generations finished, by source and finish reason",
                 source=source, finish_reason=finish_reason)
        self.inc("dark_prompt_tokens_total", "Prompt tokens read", prompt_tokens)
        self.inc("dark_generated_tokens_total", "Tokens generated", completion_tokens)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, completion_tokens))

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.WINDOW_S:
                self._recent.popleft()
            total = sum(n for _, n in self._recent)
        return total / min(self.WINDOW_S, max(1.0, time.time() - self.started))

    def render(self, extra_gauges: list[tuple[str, str, float, dict]] = ()) -> str:
        """extra_gauges: (name, help, value, labels) read at scrape time (queue depth, adapter versions)."""
        lines = []
        with self._lock:
            counters = {n: dict(v) for n, v in self._counters.items()}
            gauges = {n: dict(v) for n, v in self._gauges.items()}
            helps = dict(self._help)
        for name, help_text, value, labels in [("dark_tokens_per_second", "Generated tokens per second, last minute",
                                                self.tokens_per_second(), {}), *extra_gauges]:
            helps.setdefault(name, ("gauge", help_text))
            gauges.setdefault(name, {})[tuple(sorted(labels.items()))] = value
        for name in sorted(helps):
            kind, help_text = helps[name]
            series = counters.get(name) if kind == "counter" else gauges.get(name)
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for key, value in sorted((series or {}).items()):
                lines.append(f"{name}{_labels(dict(key))} {value:.12g}")
        return "\n".join(lines) + "\n"
