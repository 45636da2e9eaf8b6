"""The learned next-use model behind the ``nextuse`` eviction policy (issue 42).

The policy (``csrc/policy/nextuse.h`` states the rule and every feature) evicts the resident
expert of least value ``q / (dl + c) + beta * r / (dl + L + c)``: ``q`` is a logistic model's
probability that the expert is used the next time its layer runs, ``dl`` the layer steps until
that run (known exactly), ``r`` a long-run use rate.  This module holds the model
(:class:`NextUseModel`: the weights, the layer-to-layer ``cross`` table, ``c`` and ``beta``),
the packaged model trained on DeepSeek-V2-Lite's routing (:func:`default_model`), the
features in numpy for training and measurement (:func:`features_at`, :class:`Walker`), and
the prompt split the trainer and the benchmarks share (:func:`split_requests`).

Train a model for other traces with ``python training/nextuse.py --trace DIR --out FILE``.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["NextUseModel", "TokenPrior", "default_model", "DEFAULT_PATH", "Walker",
           "split_requests", "used_at_next_run", "prior_table_bytes", "FORMAT_VERSION",
           "GAP_CAP"]

#: The flat array's newest format: 3 with several cross tables or their bias, else 2 with
#: token weights (the token prior's), 1 without (NextUseModel.flat).
FORMAT_VERSION = 3
#: The most cross tables (earlier layers) a model may have (csrc/policy/nextuse.h).
MAX_DEPTH = 8
GAP_CAP = 256
#: The packaged model (trained by training/nextuse.py; card beside it).
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "zoo" / "nextuse-dsv2lite" / "model.npz"


@dataclass
class TokenPrior:
    """What a token tells about its own routing before its layers run (issue 42 item 1, "the
    context's token ids"): per token piece of the training prompts, how often it used each
    expert of each layer.  The prior of a token is, per key, the smoothed log ratio

        log((counts[p, l, e] + alpha * m[l, e]) / (n[p] + alpha)) - log(m[l, e])

    with ``m`` the experts' base rates (``marginal``, floored at 1e-4): 0 for a token that says
    nothing, positive where the token makes the expert likelier.  Tokens are the tokenizer's
    pieces (the traces' ``Token`` column; live, ``tokenizer.convert_ids_to_tokens``); a piece
    not in the table has no prior."""

    pieces: list[str]
    counts: np.ndarray    # uint16 [P, L, E]
    n: np.ndarray         # [P] occurrences of each piece
    marginal: np.ndarray  # [L, E] base rate of each expert
    alpha: float = 1.0

    def __post_init__(self) -> None:
        self.pieces = [str(x) for x in self.pieces]
        self.counts = np.asarray(self.counts)
        self.n = np.asarray(self.n, np.int64).reshape(-1)
        self.marginal = np.asarray(self.marginal, np.float64)
        P = len(self.pieces)
        if self.counts.ndim != 3 or self.counts.shape[0] != P or self.n.shape != (P,) or \
                self.marginal.shape != self.counts.shape[1:]:
            raise ValueError(f"token prior: counts {self.counts.shape}, n {self.n.shape} and "
                             f"marginal {self.marginal.shape} do not fit {P} pieces")
        if len(set(self.pieces)) != P:
            raise ValueError("token prior: a piece is listed twice")
        if not self.alpha > 0 or np.any(self.n < 1) or np.any(self.counts < 0) or \
                np.any(self.counts.max(axis=2) > self.n[:, None]):
            raise ValueError("token prior: need alpha > 0, n >= 1 and 0 <= counts <= n")
        self._index = {p: i for i, p in enumerate(self.pieces)}
        self._table: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.counts.shape[1], self.counts.shape[2])

    def ratios(self, counts: np.ndarray, n: np.ndarray) -> np.ndarray:
        """The prior (float32 [..., L * E]) of counts [..., L, E] seen in n [...] tokens."""
        m = np.maximum(self.marginal, 1e-4)
        n = np.asarray(n, np.float64)[..., None, None]
        r = np.log((counts + self.alpha * m) / (n + self.alpha)) - np.log(m)
        return r.reshape(*r.shape[:-2], -1).astype(np.float32)

    def table(self) -> np.ndarray:
        """Every piece's prior, float32 [P, L * E] (the rows :meth:`rows` indexes); computed
        once, read-only."""
        if self._table is None:
            t = np.ascontiguousarray(self.ratios(self.counts.astype(np.float64), self.n))
            t.flags.writeable = False
            self._table = t
        return self._table

    def rows(self, tokens: list[str]) -> np.ndarray:
        """int32 row of each token's piece in :meth:`table`, -1 for a piece not in it."""
        return np.array([self._index.get(t, -1) for t in tokens], np.int32)

    @staticmethod
    def count(tokens: list[str], experts: np.ndarray, num_experts: int) -> "TokenPrior":
        """The table of a trace's tokens and their routing (experts [T, L, K])."""
        T, L, K = experts.shape
        pieces = sorted(set(tokens))
        index = {p: i for i, p in enumerate(pieces)}
        row = np.array([index[t] for t in tokens], np.int64)
        counts = np.zeros((len(pieces), L, num_experts), np.int64)
        np.add.at(counts, (row[:, None, None], np.arange(L)[None, :, None], experts), 1)
        n = np.bincount(row, minlength=len(pieces))
        used = np.zeros((L, num_experts))
        np.add.at(used, (np.arange(L)[None, :, None].repeat(T, 0), experts), 1)
        return TokenPrior(pieces, counts.astype(np.uint16), n, used / max(T, 1))


@dataclass
class NextUseModel:
    """Weights of the ``nextuse`` policy.  ``w_fresh`` (6: bias, last, es, el, gap, cross)
    applies where the cross-layer feature is fresh, ``w_stale`` (5, no cross) elsewhere;
    ``cross[d - 1, l, a, e]`` (float, ``[D, num_layers, num_experts, num_experts]``; a 3-d
    table is D = 1; layers l < d unused) is the evidence that expert ``a`` of layer ``l - d``
    brings for expert ``e`` of layer ``l`` in the same pass, ``cross_bias[l, e]`` (or None:
    zeros) the feature's offset (csrc/policy/nextuse.h); cross None: a model of the temporal
    features alone, for any shape.
    ``w_tok_fresh`` / ``w_tok_stale`` (2 each: bias, prior) add the pass's token prior where
    it is known (``tokens``, a :class:`TokenPrior`, and the policy's ``on_prior``), None: no
    token weights (format 1)."""

    w_fresh: np.ndarray
    w_stale: np.ndarray
    alpha_s: float = 1.0 / 8
    alpha_l: float = 1.0 / 64
    c: float = 1.0
    beta: float = 1.0
    cross: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)
    w_tok_fresh: np.ndarray | None = None
    w_tok_stale: np.ndarray | None = None
    tokens: TokenPrior | None = field(default=None, repr=False)
    cross_bias: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.w_fresh = np.asarray(self.w_fresh, np.float64).reshape(6)
        self.w_stale = np.asarray(self.w_stale, np.float64).reshape(5)
        if (self.w_tok_fresh is None) != (self.w_tok_stale is None):
            raise ValueError("w_tok_fresh and w_tok_stale go together")
        if self.w_tok_fresh is not None:
            self.w_tok_fresh = np.asarray(self.w_tok_fresh, np.float64).reshape(2)
            self.w_tok_stale = np.asarray(self.w_tok_stale, np.float64).reshape(2)
        if self.cross is not None:
            self.cross = np.asarray(self.cross, np.float64)
            if self.cross.ndim == 3:
                self.cross = self.cross[None]
            if self.cross.ndim != 4 or self.cross.shape[2] != self.cross.shape[3] or \
                    not 1 <= self.cross.shape[0] <= MAX_DEPTH:
                raise ValueError(f"cross must be [layers, experts, experts] or [depth <= "
                                 f"{MAX_DEPTH}, layers, experts, experts], got "
                                 f"{self.cross.shape}")
        if self.cross_bias is not None:
            self.cross_bias = np.asarray(self.cross_bias, np.float64)
            if self.cross is None or self.cross_bias.shape != self.cross.shape[1:3]:
                raise ValueError(f"cross_bias {self.cross_bias.shape} needs cross tables of "
                                 f"the same (layers, experts)")
        if self.tokens is not None and self.cross is not None and \
                self.tokens.shape != self.shape:
            raise ValueError(f"the token prior is for {self.tokens.shape} (layers, experts), "
                             f"the cross tables for {self.shape}")
        if not (0 < self.alpha_s <= 1 and 0 < self.alpha_l <= 1 and self.c > 0 and self.beta >= 0):
            raise ValueError(f"need alpha_s, alpha_l in (0, 1], c > 0, beta >= 0; got "
                             f"{self.alpha_s}, {self.alpha_l}, {self.c}, {self.beta}")

    @property
    def shape(self) -> tuple[int, int] | None:
        """(num_layers, num_experts) of the cross table, None without one."""
        return None if self.cross is None else (self.cross.shape[1], self.cross.shape[2])

    @property
    def depth(self) -> int:
        """D, the number of earlier layers the cross feature reads (0 without tables)."""
        return 0 if self.cross is None else self.cross.shape[0]

    def temporal(self) -> "NextUseModel":
        """The same model without its cross table and token prior (any number of layers and
        experts)."""
        return NextUseModel(self.w_fresh, self.w_stale, self.alpha_s, self.alpha_l, self.c,
                            self.beta, None, dict(self.info, cross="dropped"),
                            self.w_tok_fresh, self.w_tok_stale, None, None)

    def flat(self, token_weights: bool = True) -> np.ndarray:
        """The float64 array the C policy takes (``_C.Policy("nextuse", ..., model=)``):
        format 3 with several cross tables or a bias (token weights zero when absent or with
        ``token_weights=False``), else format 2 with token weights, 1 without (or with
        ``token_weights=False``: a policy that ignores the token prior)."""
        tok = [] if self.w_tok_fresh is None or not token_weights else \
            [self.w_tok_fresh, self.w_tok_stale]
        v3 = self.cross is not None and (self.depth > 1 or self.cross_bias is not None)
        if v3 and not tok:
            tok = [np.zeros(2), np.zeros(2)]
        head = np.concatenate([[3 if v3 else 2 if tok else 1], self.w_fresh, self.w_stale,
                               [self.alpha_s, self.alpha_l, self.c, self.beta,
                                float(self.depth) if v3 else float(self.depth > 0)], *tok])
        parts = [head]
        if v3:
            bias = self.cross_bias if self.cross_bias is not None else \
                np.zeros(self.cross.shape[1:3])
            parts.append(bias.reshape(-1))
        if self.cross is not None:
            parts.append(self.cross.reshape(-1))
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float64)

    def save(self, path: str | os.PathLike) -> None:
        kw: dict[str, Any] = dict(w_fresh=self.w_fresh, w_stale=self.w_stale,
                                  scalars=np.array([self.alpha_s, self.alpha_l, self.c, self.beta]),
                                  info=np.array(json.dumps(self.info)))
        if self.cross is not None:
            kw["cross"] = self.cross.astype(np.float16)  # the packaged file stays small
        if self.cross_bias is not None:
            kw["cross_bias"] = self.cross_bias.astype(np.float16)
        if self.w_tok_fresh is not None:
            kw["w_tok"] = np.concatenate([self.w_tok_fresh, self.w_tok_stale])
        if self.tokens is not None:
            t = self.tokens
            kw.update(tok_pieces=np.array(t.pieces, dtype=str), tok_counts=t.counts,
                      tok_n=t.n.astype(np.uint32), tok_marginal=t.marginal,
                      tok_alpha=np.array(t.alpha))
        np.savez_compressed(path, **kw)

    @staticmethod
    def load(path: str | os.PathLike) -> "NextUseModel":
        try:
            with np.load(path) as z:
                s = z["scalars"]
                wt = z["w_tok"] if "w_tok" in z else None
                tok = None
                if "tok_pieces" in z:
                    tok = TokenPrior(list(z["tok_pieces"]), z["tok_counts"], z["tok_n"],
                                     z["tok_marginal"], float(z["tok_alpha"]))
                return NextUseModel(z["w_fresh"], z["w_stale"], float(s[0]), float(s[1]),
                                    float(s[2]), float(s[3]),
                                    z["cross"].astype(np.float64) if "cross" in z else None,
                                    json.loads(str(z["info"])),
                                    None if wt is None else wt[:2],
                                    None if wt is None else wt[2:], tok,
                                    z["cross_bias"].astype(np.float64)
                                    if "cross_bias" in z else None)
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{os.fspath(path)!r} is not a next-use model: {e}") from None


_PACKAGED: dict[str, NextUseModel] = {}


def default_model(num_layers: int, num_experts: int) -> NextUseModel:
    """The packaged model (DeepSeek-V2-Lite's 26 MoE layers x 64 experts); for another shape
    its temporal part alone (the cross table belongs to one model's layers).  Loaded once per
    process (with its token prior's table computed once): treat it as read-only."""
    key = os.fspath(DEFAULT_PATH)
    m = _PACKAGED.get(key)
    if m is None:
        m = _PACKAGED[key] = NextUseModel.load(DEFAULT_PATH)
    return m if m.shape == (num_layers, num_experts) else m.temporal()


def prior_table_bytes(num_layers: int, num_experts: int) -> int:
    """Bytes the packaged model's token-prior table (float32 [pieces, L * E], 25 MB for
    DeepSeek-V2-Lite) will add to this process when an engine of this shape first uses the
    ``learned`` predictor; 0 for another shape (no prior) or once the table is built (it is
    then held already, and a memory plan measures it with the rest of the process)."""
    tp = default_model(num_layers, num_experts).tokens
    if tp is None or tp.shape != (num_layers, num_experts) or tp._table is not None:
        return 0
    return len(tp.pieces) * num_layers * num_experts * 4


def split_requests(names: list[str], val_mod: int = 5) -> tuple[list[int], list[int]]:
    """(train, validation) request indices of traces named ``names`` (file names, in request
    order): validation = crc32(name) % val_mod == 0, so a prompt's side never depends on which
    other prompts are present."""
    val = [i for i, n in enumerate(names) if zlib.crc32(n.encode()) % val_mod == 0]
    vs = set(val)
    return [i for i in range(len(names)) if i not in vs], val


def used_at_next_run(experts: np.ndarray, t: int, inpass: np.ndarray) -> np.ndarray:
    """The label q predicts, for every key, from a state within token t's pass: whether the
    key's expert is in its layer's routing at the next run (token t when ``inpass``, else
    t + 1; t + 1 must exist).  ``experts``: a trace's [tokens, layers, top_k] ids."""
    E = len(inpass) // experts.shape[1]
    keys = np.arange(len(inpass))
    tok = np.where(inpass, t, t + 1)
    return (experts[tok, keys // E] == (keys % E)[:, None]).any(axis=1)


class Walker:
    """The policy's feature state (csrc/policy/nextuse.h) over a demand sequence, in numpy:
    call :meth:`begin_pass` at each pass, :meth:`touch_layer` with each layer's experts, and
    :meth:`features` between them for every key at once."""

    def __init__(self, num_layers: int, num_experts: int, model: NextUseModel):
        self.L, self.E, self.m = num_layers, num_experts, model
        n = num_layers * num_experts
        self.used = np.zeros(n, np.int64)
        self.es = np.zeros(n)
        self.el = np.zeros(n)
        self.P = 1
        self.lc = -1
        self.prior: np.ndarray | None = None

    def set_prior(self, prior: np.ndarray | None) -> None:
        """The pass's token prior ([L * E], the policy's on_prior), None: unknown."""
        self.prior = None if prior is None else np.asarray(prior, np.float64).reshape(-1)

    def begin_pass(self) -> None:
        u = (self.used == self.P).astype(np.float64)
        self.es += self.m.alpha_s * (u - self.es)
        self.el += self.m.alpha_l * (u - self.el)
        self.P += 1
        self.lc = -1
        self.prior = None

    def touch_layer(self, layer: int, experts: np.ndarray) -> None:
        self.used[layer * self.E + np.asarray(experts, np.int64)] = self.P
        self.lc = layer

    def features(self) -> dict[str, np.ndarray]:
        """Per key: ``X`` [n, 8] (bias, last, es, el, gap, cross, has_prior, prior; cross 0
        where not fresh, the prior's two 0 where it is absent: not inpass or no prior set),
        ``fresh`` (bool), ``dl``, ``inpass`` (bool), ``q`` (the model's prediction)."""
        L, E, P, lc = self.L, self.E, self.P, self.lc
        keys = np.arange(L * E)
        l = keys // E
        up = self.used
        inpass = (l > lc) | ((l == lc) & (up != P))
        dl = np.where(inpass, np.where(l == lc, 0, l - lc), l - lc + L).astype(np.float64)
        last = ((up > 0) & (up == np.where(inpass, P - 1, P))).astype(np.float64)
        ref = np.where(inpass, P, P + 1)
        gap = np.log(np.where(up > 0, np.clip(ref - up, 1, GAP_CAP), GAP_CAP).astype(np.float64))
        cross = np.zeros(L * E)
        fresh = np.zeros(L * E, bool)
        if self.m.cross is not None:
            for lay in (lc, lc + 1):
                if lay < 1 or lay >= L or not (up[(lay - 1) * E:lay * E] == P).any():
                    continue
                sel = slice(lay * E, (lay + 1) * E)
                fresh[sel] = inpass[sel]
                cross[sel] = self.cross_feature(lay)
        has = inpass & (self.prior is not None)
        prior = np.where(has, 0.0 if self.prior is None else self.prior, 0.0)
        X = np.stack([np.ones(L * E), last, self.es, self.el, gap, cross,
                      has.astype(np.float64), prior], axis=1)
        z = np.where(fresh, X[:, :6] @ self.m.w_fresh, X[:, :5] @ self.m.w_stale)
        if self.m.w_tok_fresh is not None:
            wt = np.where(fresh[:, None], self.m.w_tok_fresh, self.m.w_tok_stale)
            z = z + np.where(has, wt[:, 0] + wt[:, 1] * prior, 0.0)
        return dict(X=X, fresh=fresh, dl=dl, inpass=inpass, q=1.0 / (1.0 + np.exp(-z)))

    def cross_feature(self, layer: int) -> np.ndarray:
        """The cross feature of ``layer``'s experts ([E]) from this pass's touches of the
        layers before it (nextuse.h; the caller checks that layer - 1 has some)."""
        E, m = self.E, self.m
        out = np.zeros(E) if m.cross_bias is None else m.cross_bias[layer].copy()
        for d in range(1, min(m.depth, layer) + 1):
            prev = np.nonzero(self.used[(layer - d) * E:(layer - d + 1) * E] == self.P)[0]
            if len(prev):
                out = out + m.cross[d - 1, layer][prev].sum(axis=0) / len(prev)
        return out
