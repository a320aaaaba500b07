"""Peer figures (LMCache, SGLang) measured outside this bench, matched to bench cases, compared per timing.

``peers.json`` holds ``sources`` (each with its date, machine, method and the
copy limits of its run) and ``rows``: one peer doing one job, with a figure
in each of two timings (either may be ``null``: not measured that way):

* ``overlapped_gbps``: the call was issued while the device was still busy,
  so the host's issue time is hidden; it compares with kvlayout's
  *kernel-only* figure;
* ``idle_gbps``: the device was idle before the call, so host issue time
  counts; it compares with kvlayout's *end-to-end* figure.

A row matches a case with the same shape, token count, direction, mode (all
layers or layer by layer) and SM budget (``max_ctas``; 0: the default), and,
where the row names them, device layouts, buffer layouts and page size.
Comparisons use % of each run's own limit, since the limits of two runs
differ a little.  The comparison is made when a report is written, so a
committed record is always judged against the current peer figures.
"""

from __future__ import annotations

import json
import os

from .cases import DIAGNOSTIC_CALLS

PEERS_PATH = os.path.join(os.path.dirname(__file__), "peers.json")

# (timing of the peer figure, kvlayout's figure it is compared with, the row keys of the comparison)
TIMINGS = (("overlapped", "kernel_gbps", "kernel"), ("idle", "gbps", "end_to_end"))

# keys the older records stored at measurement time (one peer figure against the end-to-end time); a report
# drops them and compares again
STALE_ROW_KEYS = ("peer", "peer_gbps", "peer_pct", "vs_peer", "vs_peer_kernel")


def limit_key(direction: str) -> str:
    """The limit a peer figure of ``direction`` is a share of: the pinned 256 MiB copy or the device copy."""
    return {"to_host": "D2H_256MiB", "from_host": "H2D_256MiB"}.get(direction, "D2D")


class Peers:
    def __init__(self, doc: dict):
        self.sources = {s["id"]: s for s in doc["sources"]}
        self.rows = doc["rows"]
        for r in self.rows:
            if r["source"] not in self.sources:
                raise ValueError(f"peers.json: row {r['shape']} T={r['T']} {r['direction']} names an unknown "
                                 f"source {r['source']!r}")

    def matching(self, case) -> list[dict]:
        """Peer rows doing the same job as ``case`` (a :class:`kvlayout.bench.cases.Case` or a result row)."""
        get = case.get if isinstance(case, dict) else lambda k, default=None: getattr(case, k, default)
        if (get("engine", "kernel") not in ("kernel", "staged") or get("empty", False)
                or get("call") in DIAGNOSTIC_CALLS):
            return []    # (diagnostics beside the default call: staged issued directly, in calls of new lengths,
            #              in slot-sized chunks or with its graph launched on the device, the kernel with other
            #              cache hints or in its other host launch shape, either engine between caches bound
            #              anew at each call)
        return [r for r in self.rows
                if (r["shape"], r["T"], r["direction"], r["layerwise"], r["max_ctas"])
                == (get("shape"), get("T"), get("direction"), get("layerwise"), get("max_ctas") or 0)
                and (r["device_layouts"] is None or get("device_layout") in r["device_layouts"])
                and (r["buffer_layouts"] is None or get("buffer_layout") in r["buffer_layouts"])
                and (r["page_size"] is None or r["page_size"] == get("page_size"))]

    def pct(self, row: dict, timing: str) -> float | None:
        """A peer row's figure in ``timing`` ("overlapped" or "idle") as % of its own run's limit."""
        gbps = row[f"{timing}_gbps"]
        if gbps is None:
            return None
        return 100 * gbps / self.sources[row["source"]]["limits"][limit_key(row["direction"])]

    def compare(self, result: dict) -> dict:
        """The comparison of one bench result row with the best peer, per timing.

        Returns, for each timing that both sides have (``kernel``: kvlayout's
        kernel-only figure against the peers' overlapped one; ``end_to_end``:
        kvlayout's end-to-end figure against the peers' idle one):
        ``peer_<k>`` ("who: op"), ``peer_<k>_gbps``, ``peer_<k>_pct`` (% of
        the peer run's limit), ``peer_<k>_source``, ``x_peer_<k>`` (kvlayout's
        % of its limit / the peer's) and ``vs_peer_<k>`` ("ahead" or "behind").
        """
        out = {}
        if "limit_gbps" not in result:
            return out
        matches = self.matching(result)
        for timing, ours_key, k in TIMINGS:
            if result.get(ours_key) is None:
                continue
            scored = [(self.pct(r, timing), r) for r in matches if r[f"{timing}_gbps"] is not None]
            if not scored:
                continue
            pct, best = max(scored, key=lambda s: s[0])
            ours = 100 * result[ours_key] / result["limit_gbps"]
            out.update({f"peer_{k}": f"{best['peer']}: {best['op']}", f"peer_{k}_gbps": best[f"{timing}_gbps"],
                        f"peer_{k}_pct": pct, f"peer_{k}_source": best["source"], f"x_peer_{k}": ours / pct,
                        f"vs_peer_{k}": "ahead" if ours >= pct else "behind"})
        return out

    def annotate(self, doc: dict) -> dict:
        """``doc`` with every result row compared afresh (stale comparisons of older records dropped); the
        peers ran on CUDA devices, so the rows of a run on another device are compared with nothing."""
        cuda = str(doc.get("environment", {}).get("device", "")).startswith("cuda")
        rows = []
        for r in doc["results"]:
            r = {k: v for k, v in r.items() if k not in STALE_ROW_KEYS and not k.startswith(("peer_", "x_peer_",
                                                                                           "vs_peer_"))}
            if cuda:
                r.update(self.compare(r))
            rows.append(r)
        used = sorted({r[f"peer_{k}_source"] for r in rows for _, _, k in TIMINGS if f"peer_{k}_source" in r})
        return dict(doc, results=rows, peer_sources=[self.sources[s] for s in used])


def load_peers(path: str = PEERS_PATH) -> Peers:
    with open(path) as f:
        return Peers(json.load(f))
