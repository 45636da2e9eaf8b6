"""The slowdown budget over a server's short requests: what Cascade's exploration costs per
request and over the server's life, with a modelled cost (no model is run).

    python benchmarks/spec_budget.py --json [--requests 40] [--tokens 32]

Model (documented, not measured here; the defaults are the hybrid server's figures measured
on Zen 1 on 2026-12-06, issue 39): a plain step costs ``--t-plain`` seconds; an iteration
verifying K drafts costs K * ``--t-draft`` (drafting) + ``--t-verify0`` + K *
``--t-verify1`` (verifying K + 1 tokens); each draft token is accepted with probability
``--p-accept`` (each controller's draws from a generator seeded with ``--seed``), a
rejection ending the run of accepted ones.  One controller serves ``--requests`` requests of
``--tokens`` tokens each, ``begin_request`` between them, as a kept server worker does.

Two drafters: ``hopeless`` (the defaults: the hybrid's self-draft, which never pays) and
``paying`` (``--paying-draft`` seconds per draft token, acceptance ``--paying-accept``,
verification ``--paying-verify0`` + K * ``--paying-verify1``: a read-bound step, an n-gram
drafter), so that what the budget costs a drafter that pays is reported beside what it saves.

Reported per controller (``cascade`` with the package's default budget, ``cascade-nobudget``,
``plain``) and drafter: per request, its time over plain decoding's (``slowdown_runs``), the
worst request, and the cumulative ratio after 1, 3, 10 and all requests; and the controller's
own (L, T) at the end.  ``PYTHONPATH`` picks the package, so two checkouts compare:
``PYTHONPATH=/tmp/wt-base python benchmarks/spec_budget.py --json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(HERE.parent))

import hostinfo  # noqa: E402
import specmoe  # noqa: E402
from specmoe.speculation.controllers import Cascade  # noqa: E402


def serve(ctl: Optional[Cascade], a: argparse.Namespace, t_draft: float, p: float,
          v0: float, v1: float, rng: np.random.Generator) -> dict:
    """Requests through one controller (None: plain decoding); per-request seconds."""
    per_req = []
    for _ in range(a.requests):
        if ctl is not None:
            ctl.begin_request()
        made, t_req = 0, 0.0
        while made < a.tokens:
            k = ctl.next_k() if ctl is not None else 0
            k = min(k, a.tokens - made - 1)  # no draft past the request's last token
            ok = rng.random(max(k, 1)) < p  # (a plain step draws one too: seeded streams)
            acc = k if ok.all() else int(np.argmin(ok))  # the first rejection ends the run
            t = a.t_plain if k == 0 else k * t_draft + v0 + k * v1
            if ctl is not None:
                ctl.observe(k, acc, t)
            made += acc + 1
            t_req += t
        per_req.append(t_req)
    out = {"seconds_runs": [round(x, 5) for x in per_req]}
    if ctl is not None:
        loss, total = ctl.spent
        out["spent_L_T"] = [round(loss, 5), round(total, 5)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--t-plain", type=float, default=0.012)
    ap.add_argument("--t-draft", type=float, default=0.021, help="s per self-drafted token")
    ap.add_argument("--t-verify0", type=float, default=0.030)
    ap.add_argument("--t-verify1", type=float, default=0.007)
    ap.add_argument("--p-accept", type=float, default=0.3)
    ap.add_argument("--paying-draft", type=float, default=0.001)
    ap.add_argument("--paying-accept", type=float, default=0.8)
    ap.add_argument("--paying-verify0", type=float, default=0.012)
    ap.add_argument("--paying-verify1", type=float, default=0.002)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    plain_t = None
    rows = []
    for drafter, t_draft, p, v0, v1 in (
            ("hopeless", a.t_draft, a.p_accept, a.t_verify0, a.t_verify1),
            ("paying", a.paying_draft, a.paying_accept, a.paying_verify0, a.paying_verify1)):
        for name in ("plain", "cascade", "cascade-nobudget"):
            ctl = None if name == "plain" else Cascade(
                budget=None if name.endswith("nobudget") else 0.05)
            r = serve(ctl, a, t_draft, p, v0, v1, np.random.default_rng(a.seed))
            if name == "plain":
                plain_t = r["seconds_runs"]
            assert plain_t is not None
            ratio = [x / y for x, y in zip(r["seconds_runs"], plain_t)]
            cum = {str(n): round(sum(r["seconds_runs"][:n]) / sum(plain_t[:n]), 4)
                   for n in (1, 3, 10, a.requests) if n <= a.requests}
            rows.append({"drafter": drafter, "name": name,
                         "slowdown_runs": [round(x, 4) for x in ratio],
                         "worst_request": round(max(ratio), 4),
                         "requests_over_1.05": sum(x > 1.05 for x in ratio),
                         "cumulative_after": cum, **{k: v for k, v in r.items()
                                                     if k != "seconds_runs"}})
    out = {"config": {**{k: v for k, v in vars(a).items() if k != "json"},
                      "package": os.path.dirname(specmoe.__file__),
                      "model": "modelled costs, no model run (see the docstring)",
                      "machine": hostinfo.cpu()},
           "rows": rows}
    if a.json:
        print(json.dumps(out))
        return
    for r in rows:
        print(f"{r['drafter']:9s} {r['name']:17s} worst {r['worst_request']:.3f} "
              f"over 5%: {r['requests_over_1.05']:3d}  cumulative {r['cumulative_after']}")


if __name__ == "__main__":
    main()
