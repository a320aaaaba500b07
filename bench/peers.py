"""Peer figures (LMCache, SGLang, torch) recorded on the same kind of machine, matched to bench cases.

``peers.json`` holds rows measured outside this repository's bench with the
peers' own kernels (its header says when, where and how).  A row matches a
case with the same shape, token count, direction and mode (all layers or
layer by layer), and where the row says so, buffer layout and page size.
Comparisons use % of each run's own limit, since the limits of two runs
differ a little.
"""

from __future__ import annotations

import json
import os

PEERS_PATH = os.path.join(os.path.dirname(__file__), "peers.json")


class Peers:
    def __init__(self, doc: dict):
        self.source = doc["source"]
        self.rows = doc["rows"]

    def matching(self, case) -> list[dict]:
        """Peer rows doing the same job as ``case`` (a :class:`kvlayout.bench.cases.Case`)."""
        if case.max_ctas or case.engine != "kernel":
            return []
        return [r for r in self.rows
                if (r["shape"], r["T"], r["direction"], r["layerwise"]) == (case.shape, case.T, case.direction,
                                                                           case.layerwise)
                and (r["buffer_layouts"] is None or case.buffer_layout in r["buffer_layouts"])
                and (r["page_size"] is None or r["page_size"] == case.page_size)]


def load_peers(path: str = PEERS_PATH) -> Peers:
    with open(path) as f:
        return Peers(json.load(f))
