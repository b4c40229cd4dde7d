"""One decode rank's part of reading a prompt's KV from the prefill ranks.

`ReadSpec` is what every rank of a decode group needs to know of one read (rank 0 sends it to
ranks 1..N-1 as it is): the prefill ranks' agents and layouts, the pages on both sides, and the
spare pages it may stage through. Each rank's `KVRead` then picks its own sources
(`head_slices.head_sources`): with equal TP one direct READ of the prefill rank with its heads;
otherwise a READ of each source rank's pages into its share of the spare pages, and, once all
are DONE, a copy of its heads into the prompt's pages (on a GPU the read reports DONE only when
that copy has run, so the spare pages can be reused at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.protocol import KVLayout
from workers.transfer.agent import KVTransferAgent
from workers.transfer.handle import TransferHandle, XferState, combine
from workers.transfer.head_slices import head_sources, is_direct, scatter_heads, staging_pages


@dataclass(frozen=True)
class ReadSpec:
    agent_names: list[str]  # prefill ranks' agents, in rank order
    layouts: list[KVLayout]  # their pages' layouts
    remote_pages: list[int]
    local_pages: list[int]
    spare_pages: list[int]  # local pages to stage through (heterogeneous TP), else empty


class KVRead:
    """Posts this rank's READs (TransferError or ValueError if one cannot be posted: none is
    left posted then); `poll` follows them, `release` frees them, cancelling any in flight."""

    def __init__(self, agent: KVTransferAgent, pages: torch.Tensor, spec: ReadSpec) -> None:
        self.agent, self.pages, self.spec = agent, pages, spec
        local = agent.layout
        self.sources = head_sources(local, spec.layouts)
        self.direct = is_direct(local, spec.layouts, self.sources)
        self.handles: list[TransferHandle] = []
        self._staged: list[list[int]] = []  # each source's spare pages
        self._copied: torch.cuda.Event | bool = False
        try:
            if self.direct:
                rank = self.sources[0].rank
                self.handles.append(
                    agent.read_pages(
                        spec.agent_names[rank],
                        spec.remote_pages,
                        spec.local_pages,
                        remote_layout=spec.layouts[rank],
                    )
                )
                return
            first = 0
            for s in self.sources:
                n = staging_pages(len(spec.remote_pages), spec.layouts[s.rank], local)
                spare = spec.spare_pages[first : first + n]
                first += n
                self._staged.append(spare)
                self.handles.append(
                    agent.read_staged(
                        spec.agent_names[s.rank], spec.remote_pages, spare, spec.layouts[s.rank]
                    )
                )
        except Exception:
            self.release()
            raise

    def poll(self) -> XferState:
        state = combine([self.agent.poll(h) for h in self.handles])
        if state != "DONE" or self.direct:
            return state
        if self._copied is False:
            for s, spare in zip(self.sources, self._staged, strict=True):
                scatter_heads(
                    self.pages, spare, self.spec.local_pages, self.spec.layouts[s.rank],
                    self.agent.layout, s,
                )  # fmt: skip
            self._copied = True
            if self.pages.is_cuda:  # queued behind the step in flight: done when this is
                self._copied = torch.cuda.Event()
                self._copied.record()
        if isinstance(self._copied, torch.cuda.Event) and not self._copied.query():
            return "PROC"
        return "DONE"

    def release(self) -> None:
        for h in self.handles:
            self.agent.release(h)
