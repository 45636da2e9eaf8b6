"""Train the learned next-use model of the ``nextuse`` eviction policy (issue 42) on routing
traces, split by prompt, and write it with its card.

    python training/nextuse.py                         # the shared DeepSeek-V2-Lite traces
    python training/nextuse.py --trace DIR --out F.npz # any folder of puffin-layout traces

What it does (csrc/policy/nextuse.h has the rule and the features):
  1. split the prompts: validation = crc32(file name) % 5 == 0 (specmoe.sim.nextuse.split_requests);
     nothing below looks at the validation prompts except the final report;
  2. the token prior (specmoe.sim.nextuse.TokenPrior): per token piece, how often it used each
     expert; and the cross tables (fit_cross): one linear model per layer l of whether each
     expert e is used at l from the same token's experts at layers l - 1 .. l - D (each layer
     as its experts' mean, as the policy reads them) with the token's prior and its expert's
     use by the token before; a multi-label logistic fit by Adam, D chosen among 1..4 by top-k
     recall on a fifth of the training prompts held out (crc32 % 5 == 1 of the training
     names), then refit on all of them; --cross-depth 0 gives the old naive-Bayes table
     (cross_table: log P(e at l | a at l - 1) / P(e at l), add-one smoothed);
  3. walk the training prompts as the policy sees them (one pass per token, layer by layer,
     history carried across prompts as in a replay), sample --sample of the (token, layer)
     points before the layer runs, and record every key's features and whether the key is
     used at its layer's next run; fit two logistic regressions by Newton's method (fresh:
     with the cross feature; stale: without); then, those weights fixed (the model without a
     prior is the same), the token weights (bias, prior) of each on the keys of the token's
     own pass.  A prompt's own tokens are left out of the prior it is sampled with (leave one
     prompt out), so the token weights are fitted on priors as unseen prompts get them;
  4. choose c and beta of the value q / (dl + c) + beta * r / (dl + L + c) on a grid by the
     simulator's demand hit rate at 10 % and 25 % of the experts on the training prompts
     (eviction without the token prior: NextUse's default, the prior serving the learned
     prefetch predictor);
  5. report log loss and AUC of q and the hit rate on the validation prompts, and save.
Seeded; deterministic.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specmoe import _C  # noqa: E402
from specmoe.sim.nextuse import (DEFAULT_PATH, MAX_DEPTH, NextUseModel, TokenPrior,  # noqa: E402
                                 Walker, split_requests, used_at_next_run)
from specmoe.sim.traces import Trace, _prompt_number, load_puffin, shared_trace_dir  # noqa: E402


def trace_files(path: Path) -> list[Path]:
    return sorted([f for f in path.iterdir() if f.name.endswith((".csv", ".csv.gz"))],
                  key=_prompt_number)


def subset(tr: Trace, idx: list[int]) -> Trace:
    return Trace.concat([tr.request(i) for i in idx])


def used_onehot(tr: Trace) -> np.ndarray:
    """float32 [T, L, E]: 1 where token t used expert e at layer l."""
    T, L, _ = tr.experts.shape
    u = np.zeros((T, L, tr.num_experts), np.float32)
    u[np.arange(T)[:, None, None], np.arange(L)[None, :, None], tr.experts] = 1.0
    return u


def cross_table(tr: Trace) -> np.ndarray:
    _, L, K = tr.experts.shape
    E = tr.num_experts
    used = used_onehot(tr)
    cnt = np.einsum("tla,tlb->lab", used[:, :-1], used[:, 1:])  # a at l-1, b at l
    na = used[:, :-1].sum(axis=0)                                # [L-1, E]
    pb = used[:, 1:].mean(axis=0)                                # [L-1, E]
    cond = (cnt + 1.0) / (na[:, :, None] + E / K)
    out = np.zeros((L, E, E))
    out[1:] = np.log(cond / (pb[:, None, :] + 1e-4))
    return out


def dense_priors(priors: tuple[np.ndarray, np.ndarray] | None, T: int, L: int,
                 E: int) -> np.ndarray:
    """float32 [T, L, E] of (table, rows) priors, 0 where a token has none."""
    out = np.zeros((T, L, E), np.float32)
    if priors is not None:
        ok = priors[1] >= 0
        out[ok] = priors[0][priors[1][ok]].reshape(-1, L, E)
    return out


def _cross_inputs(u: np.ndarray, depth: int) -> np.ndarray:
    """float32 [L - 1, T, depth * E]: for layer l = 1 .. L - 1 the mean one-hot routing of
    layers l - 1 .. l - depth (zeros before layer 0), what nextuse.h's cross feature reads."""
    T, L, E = u.shape
    mean = u / np.maximum(u.sum(axis=2, keepdims=True), 1.0)
    X = np.zeros((L - 1, T, depth * E), np.float32)
    for l in range(1, L):
        for d in range(1, min(depth, l) + 1):
            X[l - 1, :, (d - 1) * E:d * E] = mean[:, l - d]
    return X


def fit_cross(u: np.ndarray, prior: np.ndarray, depth: int, l2: float = 1e-4,
              iters: int = 150, lr: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(bias [L, E], tables [depth, L, E, E]) of the logistic model

        P(e at l) = sigmoid(bias[l, e] + sum_d mean_{a at l - d} tables[d - 1, l, a, e]
                            + w_last * u[t - 1, l, e] + w_prior * prior[t, l, e])

    fit on u (one-hot routing [T, L, E], tokens in replay order) by full-batch Adam with an
    L2 penalty on the tables; w_last and w_prior (shared scalars) are fit with them and then
    dropped: the policy's own logistic weighs those features.  Layer 0 is not modelled."""
    T, L, E = u.shape
    X = _cross_inputs(u, depth)
    Y = np.ascontiguousarray(u[:, 1:].transpose(1, 0, 2))
    last = np.zeros_like(u)
    last[1:] = u[:-1]
    Lt = np.ascontiguousarray(last[:, 1:].transpose(1, 0, 2))
    Pt = np.ascontiguousarray(prior[:, 1:].transpose(1, 0, 2))
    W = np.zeros((L - 1, depth * E, E), np.float32)
    b = np.zeros((L - 1, 1, E), np.float32)
    s = np.zeros(2, np.float32)  # w_last, w_prior
    params = [W, b, s]
    mom = [np.zeros_like(p) for p in params]
    var = [np.zeros_like(p) for p in params]
    for it in range(1, iters + 1):
        z = X @ W + b + s[0] * Lt + s[1] * Pt
        g = (1.0 / (1.0 + np.exp(-z)) - Y) / T
        grads = [X.transpose(0, 2, 1) @ g + l2 * W, g.sum(axis=1, keepdims=True),
                 np.array([(g * Lt).sum(), (g * Pt).sum()], np.float32)]
        for p, gr, m, v in zip(params, grads, mom, var):
            m *= 0.9
            m += 0.1 * gr
            v *= 0.999
            v += 0.001 * gr * gr
            p -= lr * (m / (1 - 0.9 ** it)) / (np.sqrt(v / (1 - 0.999 ** it)) + 1e-8)
    bias = np.zeros((L, E))
    bias[1:] = b[:, 0]
    tables = np.zeros((depth, L, E, E))
    for d in range(1, depth + 1):
        tables[d - 1, 1:] = W[:, (d - 1) * E:d * E]
    return bias, tables


def topk_recall(u: np.ndarray, prior: np.ndarray, bias: np.ndarray, tables: np.ndarray,
                k: int) -> float:
    """Share of the used experts (layers 1..) among the top k of the cross feature plus the
    prior, token by token: how well the tables rank the next layer's experts."""
    depth = tables.shape[0]
    X = _cross_inputs(u, depth)
    W = np.concatenate([tables[d, 1:] for d in range(depth)], axis=1).astype(np.float32)
    z = X @ W + bias[1:, None].astype(np.float32) + prior[:, 1:].transpose(1, 0, 2)
    top = np.argsort(-z, axis=2)[:, :, :k]
    Y = u[:, 1:].transpose(1, 0, 2)
    return float(np.take_along_axis(Y, top, axis=2).sum() / Y.sum())


def loo_priors(tr: Trace, tok: TokenPrior) -> tuple[np.ndarray, np.ndarray]:
    """(table float32 [n, L * E], rows int32 [T]) of tr's tokens with each prompt's own
    tokens left out of the counts: row -1 where the piece occurs in no other prompt (tok must
    have been counted on tr).  With a table counted on other prompts, use tok.table() and
    tok.rows() instead."""
    T, L, _ = tr.experts.shape
    E = tr.num_experts
    starts = list(tr.request_starts) + [T]
    rows = np.full(T, -1, np.int32)
    counts, ns = [], []
    nrows = 0
    for r in range(len(starts) - 1):
        a, b = int(starts[r]), int(starts[r + 1])
        own = TokenPrior.count(tr.tokens[a:b], tr.experts[a:b], E)
        idx = tok.rows(own.pieces)
        keep = tok.n[idx] > own.n  # seen in another prompt too
        local = np.full(len(own.pieces), -1, np.int32)
        local[keep] = np.arange(nrows, nrows + int(keep.sum()))
        nrows += int(keep.sum())
        counts.append(tok.counts[idx[keep]].astype(np.int64) - own.counts[keep])
        ns.append(tok.n[idx[keep]] - own.n[keep])
        rows[a:b] = local[own.rows(tr.tokens[a:b])]
    c = np.concatenate(counts) if counts else np.zeros((0, L, E))
    n = np.concatenate(ns) if ns else np.zeros(0)
    return np.ascontiguousarray(tok.ratios(c.astype(np.float64), n)), rows


def samples(tr: Trace, model: NextUseModel, frac: float, rng: np.random.Generator,
            priors: tuple[np.ndarray, np.ndarray] | None = None):
    """Features and labels at a random frac of the (token, layer) points of tr; ``priors``:
    (table, rows) of tr's tokens, or None."""
    T, L, K = tr.experts.shape
    E = tr.num_experts
    w = Walker(L, E, model)
    X, Y, F = [], [], []
    for t in range(T):
        w.begin_pass()
        if priors is not None and priors[1][t] >= 0:
            w.set_prior(priors[0][priors[1][t]])
        for lay in range(L):
            if t + 1 < T and rng.random() < frac:
                f = w.features()
                X.append(f["X"])
                Y.append(used_at_next_run(tr.experts, t, f["inpass"]))
                F.append(f["fresh"])
            w.touch_layer(lay, tr.experts[t, lay])
    return np.concatenate(X), np.concatenate(Y).astype(np.float64), np.concatenate(F)


def fit_logistic(X: np.ndarray, y: np.ndarray, l2: float = 1e-4, iters: int = 30,
                 offset: np.ndarray | float = 0.0) -> np.ndarray:
    """Weights w of P(y) = sigmoid(offset + X @ w) by Newton's method (L2 penalty l2)."""
    w = np.zeros(X.shape[1])
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(offset + X @ w)))
        g = X.T @ (p - y) / len(y) + l2 * w
        H = (X * (p * (1 - p))[:, None]).T @ X / len(y) + l2 * np.eye(len(w))
        step = np.linalg.solve(H, g)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return w


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-9, 1 - 1e-9)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def auc(s: np.ndarray, y: np.ndarray) -> float:
    order = np.argsort(s, kind="stable")
    r = np.empty(len(s))
    r[order] = np.arange(1, len(s) + 1)
    npos = y.sum()
    return float((r[y > 0].sum() - npos * (npos + 1) / 2) / (npos * (len(y) - npos)))


def hit_rate(tr: Trace, model: NextUseModel, cap: float,
             priors: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """Demand hit rate of the policy on tr at cap of the experts, the passes given ``priors``
    (table, rows) or none."""
    L, E = tr.num_layers, tr.num_experts
    nslots = max(1, int(round(cap * L * E)))
    pol = _C.Policy("nextuse", nslots, L, E, model=model.flat())
    kw = {} if priors is None else {"prior_table": priors[0], "prior_rows": priors[1]}
    r = _C.simulate(tr.experts, E, pol, nslots, expert_bytes=1.0, fast_bw=1.0, link_bw=1.0,
                    link_latency_s=0.0, **kw)
    return r["hits"] / r["accesses"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=None, help="folder of puffin-layout traces "
                    "(default: the shared DeepSeek-V2-Lite traces)")
    ap.add_argument("--out", type=Path, default=DEFAULT_PATH)
    ap.add_argument("--sample", type=float, default=0.03,
                    help="fraction of (token, layer) points sampled for the regression")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cross-depth", type=int, default=None,
                    help="earlier layers the cross feature reads (default: chosen among 1..4 "
                         "on held-out training prompts; 0: the one naive-Bayes table)")
    a = ap.parse_args()
    if a.cross_depth is not None and not 0 <= a.cross_depth <= MAX_DEPTH:
        ap.error(f"--cross-depth must be in 0..{MAX_DEPTH}, got {a.cross_depth}")
    path = a.trace or shared_trace_dir()
    files = trace_files(path)
    names = [f.name for f in files]
    t0 = time.time()
    tr = load_puffin(path)
    if tr.num_requests != len(files):
        sys.exit(f"{path}: {len(files)} files but {tr.num_requests} requests")
    tr_idx, va_idx = split_requests(names)
    train, val = subset(tr, tr_idx), subset(tr, va_idx)
    L, E = tr.num_layers, tr.num_experts
    print(f"{len(tr_idx)} training prompts ({train.num_tokens} tokens), {len(va_idx)} "
          f"validation prompts ({val.num_tokens} tokens)", flush=True)

    tok = TokenPrior.count(train.tokens, train.experts, E) if train.tokens else None
    train_priors = None if tok is None else loo_priors(train, tok)
    val_priors = None if tok is None else (tok.table(), tok.rows(val.tokens))
    depth, depth_scores = a.cross_depth, {}
    if depth is None:  # chosen on a fifth of the training prompts, never the validation ones
        tr_names = [names[i] for i in tr_idx]
        inner = [i for i, n in enumerate(tr_names) if zlib.crc32(n.encode()) % 5 == 1]
        held = set(inner)
        fit_idx = [i for i in range(len(tr_names)) if i not in held]
        fit_tr, hold_tr = subset(train, fit_idx), subset(train, inner)
        ftok = TokenPrior.count(fit_tr.tokens, fit_tr.experts, E) if tok else None
        fp = dense_priors(None if ftok is None else loo_priors(fit_tr, ftok),
                          fit_tr.num_tokens, L, E)
        hp = dense_priors(None if ftok is None else (ftok.table(), ftok.rows(hold_tr.tokens)),
                          hold_tr.num_tokens, L, E)
        uf, uh = used_onehot(fit_tr), used_onehot(hold_tr)
        for d in (1, 2, 3, 4):
            depth_scores[d] = topk_recall(uh, hp, *fit_cross(uf, fp, d), tr.top_k)
            print(f"  cross depth {d}: held-out top-{tr.top_k} recall "
                  f"{depth_scores[d]:.4f}", flush=True)
        depth = max(depth_scores, key=lambda d: depth_scores[d])
    if depth == 0:
        base = NextUseModel(np.zeros(6), np.zeros(5), cross=cross_table(train))
    else:
        bias, tables = fit_cross(used_onehot(train),
                                 dense_priors(train_priors, train.num_tokens, L, E), depth)
        base = NextUseModel(np.zeros(6), np.zeros(5), cross=tables, cross_bias=bias)
    print(f"cross depth {depth} ({time.time() - t0:.0f} s)", flush=True)
    rng = np.random.default_rng(a.seed)
    X, y, fresh = samples(train, base, a.sample, rng, train_priors)
    wf = fit_logistic(X[fresh][:, :6], y[fresh])
    ws = fit_logistic(X[~fresh][:, :5], y[~fresh])
    wtf = wts = None
    if tok is not None:  # second stage: the token weights on the base model's z
        has = X[:, 6] > 0
        zb = np.where(fresh, X[:, :6] @ wf, X[:, :5] @ ws)
        sel_f, sel_s = has & fresh, has & ~fresh
        wtf = fit_logistic(X[sel_f][:, 6:8], y[sel_f], offset=zb[sel_f])
        wts = fit_logistic(X[sel_s][:, 6:8], y[sel_s], offset=zb[sel_s])
    print(f"{len(y)} samples ({fresh.mean():.3f} fresh); w_fresh {np.round(wf, 3)}, "
          f"w_stale {np.round(ws, 3)}, token weights {wtf} / {wts}", flush=True)

    # c and beta on the training prompts (never the validation ones)
    grid = [(c, b) for c in (1.0, 2.0, 4.0) for b in (0.0, 0.5, 1.0, 2.0)]
    scores = {}
    for c, b in grid:
        m = NextUseModel(wf, ws, c=c, beta=b, cross=base.cross, w_tok_fresh=wtf,
                         w_tok_stale=wts, cross_bias=base.cross_bias)
        scores[(c, b)] = [hit_rate(train, m, cap) for cap in (0.10, 0.25)]
        print(f"  c={c} beta={b}: train hit rate 10% {scores[(c, b)][0]:.4f}, 25% "
              f"{scores[(c, b)][1]:.4f}", flush=True)
    c, b = max(grid, key=lambda k: sum(scores[k]))

    Xv, yv, fv = samples(val, base, 0.25, np.random.default_rng(a.seed + 1), val_priors)
    zv = np.where(fv, Xv[:, :6] @ wf, Xv[:, :5] @ ws)
    extra = {}
    if tok is not None:
        hv = Xv[:, 6] > 0
        zt = np.where(fv, wtf[0] + wtf[1] * Xv[:, 7], wts[0] + wts[1] * Xv[:, 7])
        extra = {"keys_with_prior": float(hv.mean()),
                 "auc_keys_with_prior_without_it": auc(zv[hv], yv[hv])}
        zv = np.where(hv, zv + zt, zv)
        extra["auc_keys_with_prior"] = auc(zv[hv], yv[hv])
    qv = 1.0 / (1.0 + np.exp(-zv))
    report = {"log_loss": log_loss(qv, yv), "auc": auc(zv, yv),
              "base_rate": float(yv.mean()),
              "log_loss_constant": log_loss(np.full_like(yv, yv.mean()), yv),
              "auc_fresh": auc(zv[fv], yv[fv]), "auc_stale": auc(zv[~fv], yv[~fv]), **extra}
    model = NextUseModel(wf, ws, c=c, beta=b, cross=base.cross, w_tok_fresh=wtf,
                         w_tok_stale=wts, tokens=tok, cross_bias=base.cross_bias, info={
        "trained_on": f"{tr.model or 'routing traces'}: {path.name}, {len(tr_idx)} of "
                      f"{len(files)} prompts (validation: crc32(file name) % 5 == 0)",
        "layers": L, "experts": E, "train_tokens": train.num_tokens,
        "val_tokens": val.num_tokens, "samples": int(len(y)), "seed": a.seed,
        "cross_depth": depth,
        "cross_depth_held_out_recall": {str(k): v for k, v in depth_scores.items()},
        "grid_train_hit_rate": {f"c={k[0]},beta={k[1]}": v for k, v in scores.items()},
        "validation": report})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    model.save(a.out)
    saved = NextUseModel.load(a.out)  # what the package loads (cross in f16)
    model.info["validation"]["hit_rate"] = {f"{int(cap * 100)}%": hit_rate(val, saved, cap)
                                            for cap in (0.05, 0.10, 0.25)}
    if tok is not None:  # the ablation: eviction given the token prior too
        model.info["validation"]["hit_rate_with_token_prior"] = {
            f"{int(cap * 100)}%": hit_rate(val, saved, cap, val_priors)
            for cap in (0.05, 0.10, 0.25)}
    model.info["train_seconds"] = round(time.time() - t0, 1)
    model.save(a.out)
    print(json.dumps({"c": c, "beta": b, **model.info["validation"]}, indent=1))


if __name__ == "__main__":
    main()
