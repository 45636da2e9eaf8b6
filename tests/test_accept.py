"""The speculative-decoding acceptance rule (_C.spec_accept / specmoe.speculation.verify.accept).

Checked three ways:
* exactly, against the plain-numpy reference below (written from the rule's statement in the
  task and csrc/spec/verify.h, not from the C code), for greedy and for sampling with fixed
  uniforms, including zeros in p and q, one-hot proposals (q=None) and boundary uniforms;
* statistically: the point of the rule is that every emitted token follows the TARGET
  distribution whatever the draft distribution.  With synthetic rows that are independent per
  position, emitted token m (given that the first m drafts were accepted) must be distributed
  as p[m]; a chi-square goodness-of-fit test at significance 0.001 checks it, and the same
  test is shown to REJECT two deliberately broken rules (so it has power);
* every validation error.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import numpy as np
import pytest

from specmoe import _C
from specmoe.speculation.verify import accept

# ------------------------------------------------------------------------------------------
# numpy reference


def ref_sample(w: np.ndarray, x: float) -> Optional[int]:
    """Inverse CDF over float64 weights: the smallest j with w[j] > 0 and cumsum[j] > x*total,
    total being the sequential sum (the last cumsum); None when total is 0."""
    c = np.cumsum(w)
    total = c[-1]
    if not total > 0:
        return None
    hit = np.flatnonzero((w > 0) & (c > x * total))
    if hit.size:
        return int(hit[0])
    return int(np.flatnonzero(w > 0)[-1])  # x*total rounded up to total


def ref_accept(p: np.ndarray, draft: np.ndarray, q: Optional[np.ndarray],
               u: Optional[np.ndarray]) -> Tuple[int, int]:
    k = len(draft)
    if u is None:
        n = 0
        while n < k and draft[n] == int(np.argmax(p[n])):
            n += 1
        return n, int(np.argmax(p[n]))
    for i in range(k):
        d = int(draft[i])
        pd = float(p[i, d])
        if q is None:
            qrow = np.zeros(p.shape[1])
            qrow[d] = 1.0
        else:
            qrow = q[i].astype(np.float64)
        qd = float(qrow[d])
        ok = (u[i, 0] < pd / qd) if qd > 0 else (pd > 0)
        if ok:
            continue
        resid = np.maximum(p[i].astype(np.float64) - qrow, 0.0)
        t = ref_sample(resid, float(u[i, 1]))
        if t is None:
            t = ref_sample(p[i].astype(np.float64), float(u[i, 1]))
        return i, t
    return k, ref_sample(p[k].astype(np.float64), float(u[k, 1]))


def rand_rows(rng: np.random.Generator, rows: int, v: int, zero_frac: float = 0.0) -> np.ndarray:
    """float32 probability rows, with about zero_frac exact zeros (never a whole row)."""
    x = rng.gamma(0.7, size=(rows, v))
    if zero_frac > 0:
        mask = rng.random((rows, v)) < zero_frac
        mask[np.arange(rows), rng.integers(0, v, rows)] = False
        x[mask] = 0.0
    return (x / x.sum(axis=1, keepdims=True)).astype(np.float32)


# ------------------------------------------------------------------------------------------
# 1. greedy


@pytest.mark.parametrize("v", [1, 2, 7, 1000])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_accepts_the_argmax_prefix(v: int, k: int) -> None:
    rng = np.random.default_rng(100 + 10 * v + k)
    for trial in range(20):
        p = rand_rows(rng, k + 1, v, zero_frac=0.3 if trial % 2 else 0.0)
        best = p.argmax(axis=1)
        for j in range(k + 1):  # drafts match the argmax for the first j positions
            draft = rng.integers(0, v, size=k).astype(np.int64)
            draft[:j] = best[:j]
            if j < k:
                if v == 1:
                    continue  # every id is the argmax
                draft[j] = (best[j] + 1 + rng.integers(0, v - 1)) % v
            n, nxt = _C.spec_accept(p, draft)
            assert (n, nxt) == (j, int(best[j]))
            assert (n, nxt) == ref_accept(p, draft, None, None)
            assert _C.spec_accept(p, draft, check=False) == (j, int(best[j]))
            # q is ignored in greedy mode
            q = rand_rows(rng, k, v) if k else None
            assert accept(p, draft, q) == (j, int(best[j]))


def test_greedy_ties_go_to_the_lowest_id_and_k0() -> None:
    p = np.array([[0.4, 0.2, 0.4], [0.0, 0.5, 0.5], [0.25, 0.25, 0.5]], np.float32)
    assert _C.spec_accept(p, [0, 1]) == (2, 2)
    assert _C.spec_accept(p, [2, 1]) == (0, 0)
    assert _C.spec_accept(p, [0, 2]) == (1, 1)
    assert _C.spec_accept(p[:1].copy(), []) == (0, 0)
    assert _C.spec_accept(p[1:2].copy(), np.zeros(0, np.int64)) == (0, 1)
    n, t = accept(p[:1].copy(), [])
    assert type(n) is int and type(t) is int


# ------------------------------------------------------------------------------------------
# 2. sampling, exact against the reference for fixed uniforms


@pytest.mark.parametrize("v", [1, 2, 6, 50, 700])
def test_sampling_matches_reference(v: int) -> None:
    rng = np.random.default_rng(7 + v)
    seen_n = set()
    for trial in range(300):
        k = int(rng.integers(0, 6))
        zp, zq = [(0.0, 0.0), (0.4, 0.0), (0.0, 0.4), (0.5, 0.5)][trial % 4]
        p = rand_rows(rng, k + 1, v, zp)
        one_hot = trial % 3 == 0
        q = None if one_hot else rand_rows(rng, k, v, zq)
        if q is not None and trial % 7 == 0:
            q = (0.5 * q + 0.5 * p[:k]).astype(np.float32)  # close to p: long accepted runs
        if one_hot or trial % 5 == 0:
            draft = rng.integers(0, v, size=k)  # any id, including p=0 and q=0 ids
        else:
            w = q.astype(np.float64)
            draft = np.array([rng.choice(v, p=w[i] / w[i].sum()) for i in range(k)],
                             dtype=np.int64)
        u = rng.random((k + 1, 2))
        if trial % 11 == 0:
            u[rng.random((k + 1, 2)) < 0.3] = 0.0
        if trial % 13 == 0:
            u[rng.random((k + 1, 2)) < 0.3] = np.nextafter(1.0, 0.0)
        got = _C.spec_accept(p, draft.astype(np.int64), q, u)
        want = ref_accept(p, draft, q, u)
        assert got == want, (trial, k, got, want)
        assert _C.spec_accept(p, draft, q, u, check=False) == want
        n, t = got
        assert p[n, t] > 0  # never a zero-probability token
        seen_n.add(n)
    assert len(seen_n) >= (2 if v > 1 else 1)


def test_sampling_edge_cases() -> None:
    p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], np.float32)
    # one-hot proposal: ratio p[d] = 0.5; acceptance is strict u < ratio
    assert _C.spec_accept(p, [0], None, np.array([[0.5, 0.0], [0.0, 0.0]])) == (0, 1)
    assert _C.spec_accept(p, [0], None, np.array([[0.4999, 0.0], [0.0, 0.0]])) == (1, 0)
    # p = 0 at the draft: always rejected, even with u = 0; residual = p here
    assert _C.spec_accept(p, [2], None, np.array([[0.0, 0.6], [0.0, 0.0]])) == (0, 1)
    # p = q = 0 at the draft: rejected; residual is all zero (p == q) -> sample from p
    q = p[:1].copy()
    assert _C.spec_accept(p, [2], q, np.array([[0.0, 0.3], [0.5, 0.5]])) == (0, 0)
    assert _C.spec_accept(p, [2], q, np.array([[0.0, 0.7], [0.5, 0.5]])) == (0, 1)
    # q = 0 < p at the draft: accepted (ratio +inf); bonus from p[1]
    q0 = np.array([[0.0, 0.0, 1.0]], np.float32)
    assert _C.spec_accept(p, [1], q0, np.array([[0.9999, 0.5], [0.5, 0.0]])) == (1, 0)
    assert _C.spec_accept(p, [1], q0, np.array([[0.9999, 0.5], [0.5, 0.99]])) == (1, 2)
    # inverse CDF with a zero entry in the middle: [0.2, 0, 0.8]; v*total = 0.2 -> not id 0
    # (cumsum must EXCEED), and never the zero id 1
    r = np.array([[0.2, 0.0, 0.8]], np.float32)
    assert _C.spec_accept(r, [], None, np.array([[0.0, 0.0]])) == (0, 0)
    assert ref_accept(r, np.zeros(0, np.int64), None, np.array([[0.0, 0.2]]))[1] == \
        _C.spec_accept(r, [], None, np.array([[0.0, 0.2]]))[1]
    assert _C.spec_accept(r, [], None, np.array([[0.0, np.nextafter(1.0, 0.0)]])) == (0, 2)
    # all K accepted with K = 3, identical p and q: ratio 1 > any u
    pp = rand_rows(np.random.default_rng(3), 4, 5)
    assert _C.spec_accept(pp, [1, 2, 3], pp[:3].copy(), np.full((4, 2), 0.999))[0] == 3


def test_large_vocab_releases_gil_path_matches_reference() -> None:
    rng = np.random.default_rng(11)
    v, k = 70000, 2  # (2K+1)*V above the GIL-release threshold
    for trial in range(4):
        p = rand_rows(rng, k + 1, v, 0.2)
        q = rand_rows(rng, k, v, 0.2) if trial % 2 else None
        draft = rng.integers(0, v, size=k)
        draft[0] = int(np.argmax(p[0]))
        u = rng.random((k + 1, 2))
        assert _C.spec_accept(p, draft, q, u) == ref_accept(p, draft, q, u)
        assert _C.spec_accept(p, draft, q) == ref_accept(p, draft, q, None)


# ------------------------------------------------------------------------------------------
# 3. statistics: emitted tokens follow the target distribution

Z_999 = 3.090232306167813  # standard normal quantile at 0.999 (checked below with erfc)


def chi2_critical(df: int) -> float:
    """Upper 0.001 point of chi-square(df) by the Wilson-Hilferty (1931) cube-root normal
    approximation: df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3, z = Phi^-1(0.999)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_999 * math.sqrt(a)) ** 3


def test_chi2_critical_value() -> None:
    assert abs(0.5 * math.erfc(-Z_999 / math.sqrt(2.0)) - 0.999) < 1e-12
    # exact upper 0.001 points from standard tables (e.g. NIST/SEMATECH e-Handbook, 1.3.6.7.4):
    # the approximation is within 2% for the df used here, on the conservative side
    for df, exact in [(3, 16.266), (4, 18.467), (5, 20.515)]:
        c = chi2_critical(df)
        assert exact <= c <= exact * 1.02


def chi2_stat(tokens: np.ndarray, target: np.ndarray) -> Tuple[float, int]:
    """Pearson's statistic of tokens against the distribution target; asserts that no token
    of zero target probability occurs, then uses the positive cells (df = cells - 1)."""
    target = target.astype(np.float64) / float(target.sum())
    counts = np.bincount(tokens, minlength=len(target))
    assert counts[target == 0].sum() == 0, "a zero-probability token was emitted"
    pos = target > 0
    expected = len(tokens) * target[pos]
    assert expected.min() >= 20, "test design: too few expected counts for chi-square"
    stat = float((((counts[pos] - expected) ** 2) / expected).sum())
    return stat, int(pos.sum()) - 1


def fits(tokens: np.ndarray, target: np.ndarray) -> bool:
    """tokens plausibly follow target: no zero-probability token, chi-square below 0.001."""
    if np.bincount(tokens, minlength=len(target))[target == 0].sum() > 0:
        return False
    stat, df = chi2_stat(tokens, target)
    return stat < chi2_critical(df)


V = 6
N = 20000


def stat_rows(seed: int, k: int, peaked: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """p [k+1, V] with one zero per row and the rest >= 0.05; q [k, V] that overlaps p by
    about half, with a zero where p is positive and mass where p is zero.  peaked: p puts
    about half its mass and q about 0.8 on one token (high acceptance of one-hot proposals)."""
    rng = np.random.default_rng(seed)
    p = 0.6 * rng.dirichlet(np.ones(V), size=k + 1) + 0.4 / V
    q = 0.5 * p[:k] + 0.5 * rng.dirichlet(np.ones(V) * 0.5, size=k)
    if peaked:
        top = (np.arange(k + 1) + 4) % V
        p[np.arange(k + 1), top] += 1.0
        q[np.arange(k), top[:k]] += 4.0
    for i in range(k + 1):
        p[i, (i + 1) % V] = 0.0
    for i in range(k):
        q[i, (i + 3) % V] = 0.0
        q[i, (i + 1) % V] += 0.1  # drafts a token the target never emits
    p /= p.sum(axis=1, keepdims=True)
    q /= q.sum(axis=1, keepdims=True)
    return p.astype(np.float32), q.astype(np.float32)


def sample_rows(rng: np.random.Generator, rows: np.ndarray, n: int) -> np.ndarray:
    """n independent draws from each row: [n, rows] int64, by numpy inverse CDF."""
    c = np.cumsum(rows.astype(np.float64), axis=1)
    c /= c[:, -1:]
    x = rng.random((n, rows.shape[0]))
    out = np.empty((n, rows.shape[0]), np.int64)
    for i in range(rows.shape[0]):
        out[:, i] = np.minimum(np.searchsorted(c[i], x[:, i], side="right"), rows.shape[1] - 1)
    return out


def emitted(fn: Callable, p: np.ndarray, drafts: np.ndarray, q: Optional[np.ndarray],
            us: np.ndarray) -> np.ndarray:
    """Run fn per trial; returns [n, k+1] emitted tokens (-1 past the end of an iteration)."""
    n, k = drafts.shape
    out = np.full((n, k + 1), -1, np.int64)
    for t in range(n):
        a, nxt = fn(p, drafts[t], q, us[t])
        out[t, :a] = drafts[t, :a]
        out[t, a] = nxt
    return out


def check_positions(out: np.ndarray, p: np.ndarray) -> None:
    """Emitted token m, over the trials that reached position m, must follow p[m]."""
    k = p.shape[0] - 1
    for m in range(min(k, 2) + 1):
        tok = out[:, m]
        tok = tok[tok >= 0]
        assert len(tok) >= 1500, (m, len(tok))
        stat, df = chi2_stat(tok, p[m])
        assert stat < chi2_critical(df), (m, stat, df, chi2_critical(df))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_emitted_tokens_follow_target_with_draft_distribution(k: int) -> None:
    p, q = stat_rows(1000 + k, k)
    rng = np.random.default_rng(2000 + k)
    drafts = sample_rows(rng, q, N)
    us = rng.random((N, k + 1, 2))
    out = emitted(_C.spec_accept, p, drafts, q, us)
    check_positions(out, p)
    # the draft distribution alone does not fit the target (the test is not trivial)
    assert not fits(drafts[:, 0], p[0])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_emitted_tokens_follow_target_with_deterministic_proposals(k: int) -> None:
    # drafts come from g, but are passed as one-hot proposals (q=None)
    p, g = stat_rows(3000 + k, k, peaked=True)
    rng = np.random.default_rng(4000 + k)
    drafts = sample_rows(rng, g, N)
    us = rng.random((N, k + 1, 2))
    out = emitted(_C.spec_accept, p, drafts, None, us)
    check_positions(out, p)


def test_plain_sampling_k0_follows_target() -> None:
    p, _ = stat_rows(5000, 0)
    rng = np.random.default_rng(5001)
    us = rng.random((N, 1, 2))
    tok = np.array([_C.spec_accept(p, [], None, us[t])[1] for t in range(N)])
    assert fits(tok, p[0])


# broken variants of the first iteration step, vectorised in numpy, to show the test's power


def first_token_variant(p: np.ndarray, q: np.ndarray, d: np.ndarray, u: np.ndarray,
                        accept_rule: str, replacement: str) -> np.ndarray:
    """First emitted token for drafts d ~ q[0] under a chosen (possibly wrong) rule."""
    p0, q0 = p[0].astype(np.float64), q[0].astype(np.float64)
    if accept_rule == "correct":
        with np.errstate(divide="ignore", invalid="ignore"):
            ok = u[:, 0] < np.where(q0[d] > 0, p0[d] / q0[d], np.inf)
        ok &= p0[d] > 0
    else:  # "ignore_q": accept iff u < p(d)
        ok = u[:, 0] < p0[d]
    w = np.maximum(p0 - q0, 0.0) if replacement == "residual" else p0
    c = np.cumsum(w)
    repl = np.searchsorted(c, u[:, 1] * c[-1], side="right")
    return np.where(ok, d, repl)


def test_statistical_check_rejects_broken_rules() -> None:
    p, q = stat_rows(1001, 1)
    rng = np.random.default_rng(2001)
    d = sample_rows(rng, q, N)[:, 0]
    u = rng.random((N, 2))
    assert fits(first_token_variant(p, q, d, u, "correct", "residual"), p[0])
    for rule, repl in [("ignore_q", "residual"), ("correct", "target")]:
        tok = first_token_variant(p, q, d, u, rule, repl)
        target = p[0].astype(np.float64)
        counts = np.bincount(tok, minlength=V)
        # a broken rule either emits a zero-probability token or fails the chi-square
        assert counts[target == 0].sum() > 0 or not fits(tok, target), (rule, repl)
        stat, df = chi2_stat(tok[target[tok] > 0], target)
        assert stat > chi2_critical(df), (rule, repl, stat)
    # and a broken rule run through the same per-trial harness as the C code fails too
    def ignore_q(pp, dr, qq, uu):  # accept iff u < p(d), q ignored
        for i in range(len(dr)):
            if not uu[i, 0] < pp[i, dr[i]]:
                r = np.maximum(pp[i].astype(np.float64) - qq[i], 0.0)
                return i, ref_sample(r, uu[i, 1])
        return len(dr), ref_sample(pp[-1].astype(np.float64), uu[-1, 1])
    n = 5000
    out = emitted(ignore_q, p, sample_rows(rng, q, n), q, rng.random((n, 2, 2)))
    assert not fits(out[:, 0], p[0])
    out = emitted(ref_accept, p, sample_rows(rng, q, n), q, rng.random((n, 2, 2)))
    assert fits(out[:, 0], p[0])


# ------------------------------------------------------------------------------------------
# 4. bad input


def good(k: int = 2, v: int = 5):
    rng = np.random.default_rng(0)
    return (rand_rows(rng, k + 1, v), np.arange(k, dtype=np.int64), rand_rows(rng, k, v),
            rng.random((k + 1, 2)))


@pytest.mark.parametrize("case, exc, match", [
    ("p_list", TypeError, "p must be a numpy.ndarray"),
    ("p_f64", TypeError, "p must have dtype float32"),
    ("p_f16", TypeError, "p must have dtype float32"),
    ("p_swapped", TypeError, "native byte order"),
    ("p_1d", ValueError, "p must be 2-D"),
    ("p_3d", ValueError, "p must be 2-D"),
    ("p_strided", ValueError, "C-contiguous"),
    ("p_fortran", ValueError, "C-contiguous"),
    ("p_rows", ValueError, "p must have K\\+1 rows"),
    ("p_v0", ValueError, "at least one column"),
    ("p_nan", ValueError, r"p\[1, 3\] = nan is not a probability"),
    ("p_inf", ValueError, r"p\[0, 2\] = inf"),
    ("p_neg", ValueError, r"p\[2, 0\] = -0.1"),
    ("p_sum", ValueError, "row 1 of p sums to"),
    ("p_zero_row", ValueError, "row 0 of p sums to 0"),
    ("q_f64", TypeError, "q must have dtype float32"),
    ("q_list", TypeError, "q must be a numpy.ndarray"),
    ("q_rows", ValueError, "q must have shape"),
    ("q_cols", ValueError, "q must have shape"),
    ("q_nan", ValueError, r"q\[0, 1\] = nan"),
    ("q_sum", ValueError, "row 1 of q sums to"),
    ("q_nan_greedy", ValueError, r"q\[0, 1\] = nan"),
    ("d_float", TypeError, "draft must hold integer"),
    ("d_bool", TypeError, "draft must hold integer"),
    ("d_str", TypeError, "draft must hold integer"),
    ("d_2d", ValueError, "draft must be 1-D"),
    ("d_high", ValueError, r"draft\[1\] = 5 is outside the vocabulary \[0, 5\)"),
    ("d_neg", ValueError, r"draft\[0\] = -1 is outside"),
    ("d_u64", ValueError, "is outside the vocabulary"),
    ("u_f32", TypeError, "u must have dtype float64"),
    ("u_rows", ValueError, "u must have shape"),
    ("u_cols", ValueError, "u must have shape"),
    ("u_one", ValueError, r"u\[2, 1\] = 1 is outside \[0, 1\)"),
    ("u_neg", ValueError, r"u\[0, 0\] = -0.25 is outside"),
    ("u_nan", ValueError, r"u\[1, 0\] = nan is outside"),
])
def test_bad_input(case: str, exc: type, match: str) -> None:
    p, d, q, u = good()
    kw: dict = {}
    if case == "p_list":
        p = p.tolist()
    elif case == "p_f64":
        p = p.astype(np.float64)
    elif case == "p_f16":
        p = p.astype(np.float16)
    elif case == "p_swapped":
        p = p.astype(">f4")
    elif case == "p_1d":
        p = p[0].copy()
    elif case == "p_3d":
        p = p[None].copy()
    elif case == "p_strided":
        p = np.repeat(p, 2, axis=1)[:, ::2]
    elif case == "p_fortran":
        p = np.asfortranarray(p)
    elif case == "p_rows":
        p = p[:2].copy()
    elif case == "p_v0":
        p, q, d = np.zeros((3, 0), np.float32), np.zeros((2, 0), np.float32), d
    elif case == "p_nan":
        p[1, 3] = np.nan
    elif case == "p_inf":
        p[0, 2] = np.inf
    elif case == "p_neg":
        p[2, 0] = -0.1
    elif case == "p_sum":
        p[1] *= 1.01
    elif case == "p_zero_row":
        p[0] = 0.0
    elif case == "q_f64":
        q = q.astype(np.float64)
    elif case == "q_list":
        q = q.tolist()
    elif case == "q_rows":
        q = np.vstack([q, q[:1]])
    elif case == "q_cols":
        q = np.ascontiguousarray(q[:, :4])
    elif case == "q_nan":
        q[0, 1] = np.nan
    elif case == "q_sum":
        q[1] = q[1] * 10
    elif case == "q_nan_greedy":
        q[0, 1] = np.nan
        u = None
    elif case == "d_float":
        d = d.astype(np.float64)
    elif case == "d_bool":
        d = np.array([True, False])
    elif case == "d_str":
        d = ["a", "b"]
    elif case == "d_2d":
        d = d[None]
    elif case == "d_high":
        d[1] = 5
    elif case == "d_neg":
        d[0] = -1
    elif case == "d_u64":
        d = np.array([2**63 + 1, 0], np.uint64)
    elif case == "u_f32":
        u = u.astype(np.float32)
    elif case == "u_rows":
        u = u[:2].copy()
    elif case == "u_cols":
        u = np.ascontiguousarray(np.hstack([u, u])[:, :3])
    elif case == "u_one":
        u[2, 1] = 1.0
    elif case == "u_neg":
        u[0, 0] = -0.25
    elif case == "u_nan":
        u[1, 0] = np.nan
    else:
        raise AssertionError(case)
    with pytest.raises(exc, match=match):
        _C.spec_accept(p, d, q, u, **kw)
    with pytest.raises(exc, match=match):
        accept(p, d, q, u)


def test_bad_input_arity_and_good_baseline() -> None:
    p, d, q, u = good()
    assert _C.spec_accept(p, d, q, u) == ref_accept(p, d, q, u)
    assert _C.spec_accept(p=p, draft=list(d), q=q, u=u) == ref_accept(p, d, q, u)
    with pytest.raises(TypeError):
        _C.spec_accept(p)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _C.spec_accept(p, d, q, u, 1)  # type: ignore[call-arg]


def test_check_false_skips_only_the_value_scan() -> None:
    p, d, q, u = good()
    # bad entries pass unnamed, but cannot crash: an id in range or a ValueError
    rng = np.random.default_rng(5)
    for trial in range(200):
        pb, qb = p.copy(), q.copy()
        for a in (pb, qb):
            m = rng.random(a.shape) < 0.3
            a[m] = rng.choice(np.array([np.nan, np.inf, -np.inf, -1.0, 0.0, 7.0], np.float32),
                              size=int(m.sum()))
        for uu in (u, None):
            try:
                n, t = _C.spec_accept(pb, d, qb, uu, check=False)
            except ValueError as e:
                assert "all zero" in str(e)
                continue
            assert 0 <= n <= 2 and 0 <= t < p.shape[1]
    # shapes, dtypes, draft ids and u are still checked
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _C.spec_accept(p, [0, 5], q, u, check=False)
    with pytest.raises(ValueError, match="outside"):
        _C.spec_accept(p, d, q, np.full((3, 2), 1.0), check=False)
    with pytest.raises(TypeError, match="float32"):
        _C.spec_accept(p.astype(np.float64), d, q, u, check=False)
    with pytest.raises(ValueError, match="K\\+1 rows"):
        accept(p[:2].copy(), d, q, u, check=False)
    with pytest.raises(TypeError):
        _C.spec_accept(p, d, q, u, False)  # check is keyword-only


@pytest.mark.parametrize("v", [15, 16, 17, 33, 100, 1001])
def test_argmax_ties_across_vector_lanes(v: int) -> None:
    rng = np.random.default_rng(v)
    for trial in range(50):
        w = rng.integers(0, 4, size=(2, v)).astype(np.float64)  # many ties, some zeros
        w[:, rng.integers(0, v)] += 1.0
        p = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
        best = int(np.argmax(p[0]))
        assert _C.spec_accept(p, [best]) == (1, int(np.argmax(p[1])))
        other = int(np.flatnonzero(p[0] == p[0].max())[-1])
        if other != best:  # a later tie is not the argmax
            assert _C.spec_accept(p, [other]) == (0, best)


@pytest.mark.parametrize("v, pos", [(37, x) for x in (0, 5, 8, 17, 31, 32, 36)] +
                         [(2100, x) for x in (1023, 1024, 1500, 2095, 2096, 2099)])
@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf, -1e-45, -0.5])
def test_bad_entry_anywhere_in_a_row(v: int, pos: int, bad: float) -> None:
    # vector blocks of 16 entries, float partial sums over chunks of 1024, then a scalar tail
    p = rand_rows(np.random.default_rng(pos), 2, v)
    p[1, pos] = bad
    with pytest.raises(ValueError, match=rf"p\[1, {pos}\] = .* is not a probability"):
        _C.spec_accept(p, [0])
    q = rand_rows(np.random.default_rng(pos), 1, v)
    q[0, pos] = bad
    with pytest.raises(ValueError, match=rf"q\[0, {pos}\] = .* is not a probability"):
        _C.spec_accept(rand_rows(np.random.default_rng(1), 2, v), [0], q)


def test_negative_zero_is_a_probability_and_flt_max_fails_the_sum() -> None:
    p = rand_rows(np.random.default_rng(2), 1, 37, zero_frac=0.4)
    zeros = p[0] == 0
    assert zeros[:32].any() and zeros[32:].any()  # in the vector blocks and in the tail
    p[0, zeros] = -0.0
    assert _C.spec_accept(p, [], None, np.array([[0.0, 0.5]])) == \
        ref_accept(p, np.zeros(0, np.int64), None, np.array([[0.0, 0.5]]))
    p[0, 20] = np.finfo(np.float32).max
    with pytest.raises(ValueError, match="row 0 of p sums to"):
        _C.spec_accept(p, [])


def test_row_sum_tolerance_on_a_large_row() -> None:
    p = rand_rows(np.random.default_rng(9), 1, 70001)
    ok = (p.astype(np.float64) * 1.0005).astype(np.float32)
    assert _C.spec_accept(ok, []) == (0, int(np.argmax(ok[0])))
    for f in (1.002, 0.998):
        with pytest.raises(ValueError, match="row 0 of p sums to"):
            _C.spec_accept((p.astype(np.float64) * f).astype(np.float32), [])
