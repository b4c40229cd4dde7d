"""How the metric families are named: `pdserve:` (ours) or `vllm:` (vLLM's names, label names and
buckets, so a dashboard or alert built for vLLM works unchanged), and the histograms' buckets.

The family names are vLLM's in both namings; what changes is the prefix and the label that tells
the engines apart: ours `role` ("prefill", "decode", "colocated"), vLLM's `engine` (holding the
role too, as pdserve has engines of several roles). vLLM's request histograms carry `engine` as
well; the router records them, so theirs is `engine="router"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricPrefix = Literal["pdserve", "vllm"]
ROUTER_ENGINE = "router"  # the `engine` label of the router's request metrics (vllm naming)

# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
# fmt: on


def one_two_five(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    out: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(out)
            out.append(float(step * scale))
        scale *= 10


# Request histogram -> (family, help, "latency" | "tokens" | "n": which buckets)
REQUEST_HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Time to first token", "ttft"),
    "itl": ("inter_token_latency_seconds", "Time between tokens", "itl"),
    "tpot": ("time_per_output_token_seconds", "Mean time per output token of a request", "itl"),
    "e2e": ("e2e_request_latency_seconds", "Request latency", "latency"),
    "queue": ("request_queue_time_seconds",
              "Time from arrival to the hand-off to the worker pools", "latency"),
    "inference": ("request_inference_time_seconds",
                  "Time from the hand-off to the last token", "latency"),
    "prefill": ("request_prefill_time_seconds",
                "Time from the hand-off to the first token", "latency"),
    "decode": ("request_decode_time_seconds", "Time from the first to the last token", "latency"),
    "prompt_tokens": ("request_prompt_tokens", "Prompt tokens of a request", "tokens"),
    "generation_tokens": ("request_generation_tokens", "Tokens generated for a request",
                          "tokens"),
    "n": ("request_params_n", "The n request parameter", "n"),
    "max_tokens": ("request_params_max_tokens", "The max_tokens request parameter", "tokens"),
}


def request_buckets(max_model_len: int) -> dict[str, tuple[float, ...]]:
    """Each request histogram's bucket bounds (token counts up to the model's context)."""
    kinds = {"ttft": TTFT_BUCKETS, "itl": ITL_BUCKETS, "latency": LATENCY_BUCKETS,
             "tokens": one_two_five(max_model_len), "n": N_BUCKETS}
    return {key: kinds[kind] for key, (_, _, kind) in REQUEST_HISTOGRAMS.items()}


@dataclass(frozen=True)
class Naming:
    """Family names and label names of one app's /metrics."""

    prefix: MetricPrefix = "pdserve"

    def __call__(self, family: str) -> str:
        return f"{self.prefix}:{family}"

    @property
    def engine_label(self) -> str:
        """The label that names an engine's role."""
        return "engine" if self.prefix == "vllm" else "role"

    def request_labels(self, model_name: str) -> dict[str, str]:
        """The labels of the router's request metrics."""
        labels = {"model_name": model_name}
        if self.prefix == "vllm":
            labels["engine"] = ROUTER_ENGINE
        return labels
