"""pdserve workers: the engine, the prefill and decode roles, and their Serve deployments.

`from workers import LLM, LoRARequest, SamplingParams, StructuredOutputs` is the offline API;
imported lazily so that light users of `workers.protocol` (the router) do not load the model
code.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "GenerationOutput", "LoRARequest", "SamplingParams", "StructuredOutputs"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "GenerationOutput"):
        from workers import llm

        return getattr(llm, name)
    if name in ("LoRARequest", "SamplingParams", "StructuredOutputs"):
        from workers import protocol

        return getattr(protocol, name)
    raise AttributeError(name)
