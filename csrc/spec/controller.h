/* Speculation controllers: how many draft tokens K to verify in the next decoding iteration.
 *
 * In an MoE, verifying K draft tokens touches the union of their experts, so speculation that
 * pays on a dense model can slow an MoE down.  A controller watches what each iteration cost
 * and yielded and answers one question: K for the next iteration (0 = plain decoding).
 *
 * One object, one vtable (like policy/policy.h).  The caller's loop is
 *
 *     k = smoe_spec_ctl_next_k(c);                 // pure: does not change state
 *     ... draft up to k tokens, verify them ...
 *     smoe_spec_ctl_observe(c, &(smoe_spec_obs){k_used, accepted, t_iter, ...}, &err);
 *
 * k_used may differ from k (a drafter may find fewer tokens); controllers learn from k_used.
 * Every observe() appends one smoe_spec_rec to the telemetry ring.
 *
 * Definitions used by every controller:
 *   ETR of an iteration      = accepted + 1  (accepted draft tokens plus the bonus token the
 *                              verifier always produces); a plain iteration (K=0) has ETR 1.
 *   t_iter                   = wall seconds of the whole iteration (draft + verify, or the
 *                              plain decode step when K=0).
 *   t_iter_base              = t_iter of plain (K=0) iterations.
 *   utility U                = ETR / (t_iter_spec / t_iter_base): tokens per second relative
 *                              to plain decoding.  U > 1 means speculation pays.
 *
 * gamma-tolerance pruning (smoe_spec_ctl_set_tau):
 *   tau(g) = T(1) / T(g), T(g) = time of one target forward over g tokens at the batch size
 *   in use; g = K + 1 for a speculative iteration with K draft tokens.  The best case of an
 *   iteration with K drafts is all K accepted plus the bonus token, lambda(K) = K + 1 tokens,
 *   with drafting free; its speedup over plain decoding is then lambda(K) * tau(K+1).
 *   K >= 1 is ALLOWED iff (K+1) * tau(K+1) > 1 (strictly).  K whose K+1 lies beyond the
 *   measured range (n values given) cannot be shown to pay and are NOT allowed.  K = 0 is
 *   always allowed.  Before any set_tau call every K in 0..k_max is allowed.
 *   smoe_spec_ctl_next_k() never returns a K that is not allowed: the searching controllers
 *   (cascade, speq) only consider allowed K, and whatever a controller proposes is finally
 *   lowered to the largest allowed K' <= K (smoe_spec_ctl_clamp).
 *
 * Controllers (params in smoe_spec_params; 0 means "default" for every numeric field):
 *
 *  static     K = params.k (clamped).  Telemetry utility: see "instant utility" below.
 *
 *  heuristic  the schedule of transformers' assisted generation ("heuristic"): K starts at
 *             params.initial; after an observed iteration with k_used >= 1 and accepted ==
 *             k_used, K += 2; after one with accepted < k_used, K -= 1; K stays in
 *             [1, k_max].  Iterations with k_used == 0 leave K unchanged.  (transformers
 *             starts at 20 and has no upper bound; we bound by k_max.)
 *
 *  cascade    test-and-set on measured utility.  Phases (smoe_spec_phase):
 *     BASE    base_len iterations at K=0 measure t_iter_base.
 *     TEST    up to `trials` (M, default 4) trials of `trial_len` (t, default 4) iterations
 *             each, one K per trial.  U(K) of a trial = mean(ETR) / (mean(t_iter) / t_base)
 *             over its iterations.
 *     SET     set_len (S, default 16) iterations at the best K of the test phase.
 *     BACKOFF the test phase found no K with U >= 1: K=0 for the current back-off length,
 *             which starts at set_len and doubles after each back-off phase (capped at
 *             backoff_max, default 1024); a test phase that ends with K > 0 resets it.
 *   Open choices, decided here:
 *   - t_base is the median t_iter of the last base_len (default 4) observed iterations with
 *     k_used == 0, whatever phase they fell in (back-off iterations refresh it for free);
 *     the median, not the mean: one plain step slowed down by another process would
 *     inflate every utility of the next test phase and make a K that does not pay look
 *     like it does.
 *     The machine starts in BASE.  At the end of a SET or BACKOFF phase, when at least
 *     base_refresh (default 100) iterations have passed since the last k_used == 0
 *     iteration (index of the iteration just observed minus index of that one >=
 *     base_refresh), or none was ever observed, a BASE phase runs before the next TEST.
 *   - Hill climbing: the first trial runs at the centre c = the best non-zero K of the most
 *     recent test phase that found one that pays (params.initial, default 2, before any).
 *     Not 1: cheap drafters gain more with K while K=1 hovers near U=1 (n-gram lookup on the
 *     zoo pair: 1.02-1.05x plain decoding at K=1, 1.14-1.34x at K=3), so a first trial at 1
 *     fails about half the time and the doubling back-off then keeps a paying drafter off;
 *     a drafter that never pays costs one more trial per test phase (K=2, then K=1).  c is
 *     lowered to an allowed K by smoe_spec_ctl_clamp (or the smallest allowed K > c if none <= c; no
 *     allowed K >= 1 at all -> straight to BACKOFF).  The search direction is up (+1) when
 *     U(c) >= 1, down (-1) otherwise.  Each next trial is the nearest allowed untried K in
 *     the current direction from the best K so far.  When that trial does not beat the best
 *     (strictly greater U), or no such K exists in [1, k_max], the direction flips once (if
 *     not flipped yet) and the search goes on from the best K; after the second failure
 *     or M trials, the test phase ends.
 *   - A trial's U pools its own trial_len iterations with the most recent earlier TEST or SET
 *     iterations at the same K (newest first, up to trial_pool = 12 in all, none older than
 *     base_refresh iterations): U = sum(ETR) / (sum(t_iter) / t_base) over them.  Four
 *     iterations alone decide badly: with a draft accepted 64% of the time whose K=1
 *     iterations cost 1.9 plain steps (true U 0.86), all four are accepted, and U >= 1
 *     measured, 17% of the time; over twelve it is about 3%.  The first trial at a K has
 *     nothing earlier to pool; trial_pool = trial_len gives the plain per-trial estimate.
 *   - Early exits (Cascade section 5.5 lists three): "K=1 already fails": a trial at K=1 with
 *     U(1) < 1 ends the test phase at once; "the current K reaches 0" cannot happen here
 *     (trials run at K >= 1; a phase whose best U < 1 goes to BACKOFF, K=0); "utilities of
 *     successive K converge within 10%": after the second and later trials, when
 *     |U(this trial) - U(previous trial)| <= converge * max(|U(this)|, |U(previous)|)
 *     (converge = 0.10), the test phase ends.  The three are checked in that order after the
 *     best K is updated; the paper's first rule (utility keeps decreasing) is the hill
 *     climbing's second failure below.
 *   - Hopeless trials (decided here; the paper's trials always run t iterations): after
 *     iteration n < trial_len of a trial at K, with E and T the sums of ETR and t_iter over
 *     the trial's own n iterations and t_base known, the trial ends at once when even its best
 *     case cannot pay: (E + (trial_len - n) * (K + 1)) / ((T * trial_len / n) / t_base) < 1
 *     (every remaining iteration accepting all K drafts at the trial's mean time so far).  Its
 *     U is then its running U, E / (T / t_base) (below that bound, so below 1), and the test
 *     phase goes on from finish_trial as after a full trial.  Why: a drafter whose iteration
 *     costs more than K + 1 plain steps can never pay at K, and on the zoo pair (2 cores,
 *     f32, 25 % cache) the draft model's and the int4 self-draft's K=2 iterations cost 3.1-4
 *     plain steps: a full four-iteration trial then cost about 5 plain steps, 8 % of a
 *     64-token request, at every request's first test phase and after every back-off
 *     (benchmarks/speculation.py read Cascade at 0.90 of plain with the draft model on
 *     prose); ended after one iteration it costs about 1.5.
 *     What K costs is the drafter's, model's and machine's, not the request's, so it is also
 *     remembered across requests: when a trial is entered (the first of a test phase or the
 *     next of the hill climbing) and the iterations planned at its K within the last
 *     base_refresh iterations (any request's, at most the pool's 64 newest) have a mean t_iter
 *     of at least K + 1 plain steps, the trial ends at once without an iteration, its U that
 *     best case, (K + 1) / (mean t_iter / t_base) < 1, and the test phase goes on as after it.
 *     With short requests (every one starts a test phase) a drafter that cannot pay then runs
 *     one iteration per K per base_refresh iterations instead of one or two per request.
 *   - Per request (section 5: "for each request, Cascade tracks recent speculation costs and
 *     benefits"): begin_request drops what belongs to the request: the phase, the trial
 *     pools' utilities (records of earlier requests no longer count toward a trial's U; their
 *     iteration times still tell hopeless K, above), the back-off length (back to set_len)
 *     and the hill-climbing centre (back to params.initial), then starts a cycle as at the
 *     end of a SET phase (BASE when t_base is missing or older than base_refresh
 *     iterations, else TEST).  What carries over, on purpose: t_base (the median plain-step
 *     time: a property of the model and machine, not of the request), what each K cost
 *     (above), the tau pruning and the telemetry.  specmoe.generate calls it at the start of
 *     every request.
 *   - Decision: best = the tried K with the largest U; ties go to the smaller K (fewer
 *     experts touched).  U(best) >= 1 -> SET at best (U exactly 1 counts as paying, following
 *     "K=0 when U<1"); otherwise BACKOFF.
 *   - The base confirmed after the trials (decided here; the paper measures t_base in the
 *     first decode iterations and every 100, which assumes a plain step costs the same
 *     before and after the trials).  With the experts offloaded it does not: while the cache
 *     warms at a request's start, plain steps fall to about half (the zoo pair behind an
 *     emulated PCIe link at a 25 % cache: 26, 17, 21.5, 21 ms in the first four decode
 *     iterations, a median of 10.6 ms afterwards), so a t_base from the first iterations
 *     inflates every U of the test phase that follows (measured 1.3-1.7 at K = 2 where plain
 *     decoding was faster; Cascade then set K = 2-3 and read 0.91 of plain, static K = 2
 *     0.96).  So when a test phase would SET (U(best) >= 1) and no k_used == 0 iteration
 *     was observed since the controller's first TEST iteration (or t_base is older than
 *     base_refresh iterations), a BASE phase of base_len iterations runs first (telemetry
 *     phase BASE), and the decision is taken again with b = min(t_base before it, t_base
 *     after it): each tried K's U rescaled as U * (b / the t_base its U was computed with;
 *     unscaled when that was unknown), best and ties as above.  The smaller of the two is
 *     the conservative one whichever way plain steps drift.  Once per controller, not per
 *     request: a later request that starts cold measures its trials against a warm t_base,
 *     which errs the safe way, and each confirmation costs base_len plain iterations where
 *     speculation pays (32-token requests behind the emulated PCIe link, where static K = 2
 *     paid 1.1x: Cascade 0.97 of plain with one per request against 1.0 without).  None
 *     where it does not pay: that test phase goes to BACKOFF, whose plain steps refresh
 *     t_base anyway.  Not solved by it: plain steps right after the trials are slow too
 *     (the trials' experts displaced theirs: 3.3 ms against 2.5 in long plain runs, the
 *     self-draft at the NVMe-CPU link's ratio), so where both bases are inflated the
 *     confirmed U still is, and K = 2 is kept at about 0.9 of plain.
 *   - A trial U that cannot be computed (no k_used == 0 iteration observed yet, so no
 *     t_base) counts as 0.
 *   - Iterations count toward the current phase/trial whatever k_used was; a trial's U uses
 *     the ETR and t_iter actually observed.
 *   - Telemetry utility: in TEST, the running U of the current trial (at its last iteration
 *     the pooled U that decided it); in SET the running U of
 *     the set phase so far; in BASE/BACKOFF t_base/t_iter (the instant utility of a plain
 *     iteration, ~1).
 *
 *  speq       MoE-SpeQ's amortization governor: K = argmax over allowed k in 0..k_max of
 *             E[N(k)] / T_cycle(k).
 *     E[N(k)] = 1 + sum_{i=1..k} prod_{j=1..i} p_j, where p_j is the probability that draft
 *             position j is accepted given positions < j were.  p_j starts at p_init
 *             (default 0.6) and is an EMA (weight alpha, default 0.2) over the positions an
 *             iteration actually decided: positions 1..accepted count as accepted, position
 *             accepted+1 (if <= k_used) as rejected, later positions are not observed.
 *     T_cycle(k) = k * t_draft_tok + t_first + T_verify(k+1) + io_cost[k]  (MoE-SpeQ Eq. 3).
 *             t_first: the first mandatory expert fetch of a cycle, a profiled constant
 *             (params.t_first, default 0); being the same for every k it favours longer
 *             drafts, which amortize it over more tokens.
 *             t_draft_tok: EMA of t_draft / k_used over iterations that report t_draft > 0.
 *             T_verify(g): compute time of a verify over g tokens, sample v = t_iter -
 *             t_draft - t_io (t_io = stall seconds the caller measured on expert loads,
 *             default 0).  With tau set: T_verify(g) = T1 / tau(g), T1 an EMA of v * tau(g).
 *             Without tau: an exponentially weighted (decay 1 - alpha) least-squares line
 *             a + b*g over the samples; b = 0 while fewer than two distinct g were seen.
 *             io_cost[k]: expected seconds of loading the experts the draft predicts for the
 *             k drafts and that are missing from the cache.  Learned from the observations
 *             (decided here; the paper leaves the estimate to the system): n(k), an EMA
 *             (weight 0.2) of experts_loaded over the iterations that verified k drafts, and
 *             t_load, an EMA (0.2) of t_io / experts_loaded over iterations that loaded any;
 *             io_cost[k] = n(k) * t_load, a k never observed extrapolated from the nearest
 *             observed j (ties: the smaller) as n(j) * (k+1)/(j+1) * t_load; 0 while no load
 *             was timed.  Updated after the observation's telemetry utility is computed, so
 *             it applies from the next next_k.  smoe_spec_ctl_set_io_cost replaces the
 *             learned estimate for good (a caller that knows better: sticky until set again).
 *     T_verify is clamped at 0 and T_cycle at 1e-12 s.  Note that once K=0 wins, the
 *     acceptance model no longer learns (no positions are decided); new io_cost or timing
 *     moves it again.
 *     Before the first observation next_k returns clamp(params.initial) (default 1).  Ties of
 *     the objective go to the smaller k.  Telemetry utility: the predicted gain of the K
 *     chosen after the observation, (E[N(K)]/T_cycle(K)) * T_cycle(0).
 *     Probe (decided here; the governor as published has no exploration): once K=0 wins, no
 *     draft position is decided and the acceptance model freezes, so one pessimistic
 *     estimate would keep speculation off for good.  After `probe` (default 16; -1 = never)
 *     consecutive observed iterations with k_used == 0, next_k answers, if within the
 *     slowdown budget (below), the smallest allowed k >= 1 that no observed iteration has
 *     verified (k_used, a batch step's largest), else the best allowed k >= 1 by the same
 *     objective (ties to the smaller k; 0 when no k >= 1 is allowed); any observed iteration
 *     with k_used >= 1 resets the count.  Why the untried k first: io_cost of an unobserved
 *     k is extrapolated in proportion to k+1 from the nearest observed one, so when K = 1
 *     loads more experts per token than plain steps the model prices every larger K from it
 *     and probes K = 1 for good, while loads amortize only from K = 2-3 on (the self-draft
 *     behind an emulated link at R = 15: 15-24 experts an iteration at K = 1, 12 a plain
 *     token, 8.3-9.0 a token at K = 2-3; static K = 2-3 1.25-1.34x plain, the governor 1.02).
 *     The budget bounds what the longer probes cost where no K pays.
 *
 * Batches (smoe_spec_obs.nrows > 0): one observation is one batch step of nrows sequences,
 *   all verified in one forward; row_k[i] drafts verified and row_acc[i] accepted for
 *   sequence i (k = max row_k, accepted as the caller's scalar summary, see py_spec.c).
 *   ETR of the step = mean over rows of (row_acc[i] + 1): the batch's tokens per sequence, so
 *   that against t_base measured at the same batch size, U = ETR / (t_iter / t_base) is the
 *   batch's tokens per second relative to plain batched decoding (Cascade's utility counts
 *   the batch's tokens).  The speq governor and the success model below learn per-position
 *   acceptance from every row.  smoe_spec_ctl_set_batch(c, B) tells the controller the batch
 *   size of the next steps; when it changes, t_base is measured again (the base ring is
 *   emptied) and the controller's per-request state is dropped (begin_request: Cascade
 *   starts a new cycle with a BASE phase), since plain-step time and tau depend on B.
 *
 * Success condition (smoe_spec_ctl_set_success; off until called):
 *   the gamma-tolerance paper's speedup model, section 3.1, equation (1):
 *       S(K) = lambda(K) * tau(K+1) / (1 + K * delta * tau(K+1))
 *   with gamma = K drafts verified over K+1 positions, lambda(K) the expected tokens of a
 *   step (accepted drafts plus the bonus token) and delta = T_D / T(1) the drafter's cost
 *   per draft token relative to a plain step.  Measured here:
 *     lambda(K) = 1 + sum_{i=1..K} prod_{j=1..i} p_j, p_j an EMA (weight alpha, from 1) of the
 *       acceptance of draft position j given positions < j were accepted, over the rows of
 *       every observation (positions 1..acc accepted, acc+1 rejected if drafted); a position
 *       with fewer than min_obs decisions counts p_j = 1 (optimistic until measured);
 *     delta = EMA (weight alpha) of (t_draft / k) / t_base over observations with k >= 1,
 *       t_draft > 0 and t_base known; 0 until then;
 *     tau(g) from set_tau; 1 when no tau is set.
 *   K >= 1 is ALLOWED iff the tau rule above allows it AND S(K) > 1.  With p_j = 1 and
 *   delta = 0, S(K) = (K+1) tau(K+1): the tau rule is the success condition at its best case.
 *   Re-probe (decided here): a measured model can rule every K out and then never learn
 *   again (no K >= 1 runs), so after `probe` (default 64) consecutive observations with
 *   k == 0 while the success model forbids every K that tau allows, the acceptance counts
 *   and delta are forgotten (optimistic again) and the controllers may try K again (Cascade
 *   still at the pace of its back-off).  Each re-probe doubles the run the next one waits
 *   for (probe, 2 probe, 4 probe, ... at most SMOE_SPEC_PROBE_MAX), so a drafter that never
 *   pays costs ever fewer probes; the run goes back to `probe` after an observation with
 *   k >= 1 once position 1 has min_obs decisions and the model still lets some K pay (the
 *   measured model, not its optimistic start).  Why: on the zoo pair a probe of the draft
 *   model costs about two speculative iterations of 1.3 plain steps' loss each, every 64
 *   plain steps, 4 % of decoding, for a drafter that never pays there.
 *   allowed[] is recomputed after every observation, before the controller's own update
 *   sees it.
 *
 * Slowdown budget (decided here; Cascade's one promise is a slowdown of at most 5 % against
 *   plain decoding, abstract and section 7, and every trial, set phase or probe that does not
 *   pay spends from it): every controller keeps
 *       L = sum over observed iterations with k >= 1 and t_base known
 *           of (t_iter - ETR * t_base),
 *   the net time speculation has cost against plain steps of the time t_base (negative when
 *   it gained), t_base read after the observation's own k == 0 update, and T = the sum of
 *   every observed t_iter; and W, the largest loss one such iteration has had (t_iter - ETR *
 *   t_base, 0 before any).  Speculation is WITHIN BUDGET while L + W <= budget * T
 *   (params.budget, default 0.05; negative: off, always within): one more iteration as bad as
 *   the worst so far still keeps the promise.  Only exploration is gated by it, never a K
 *   the controller's own measurement says pays:
 *   - cascade: a test phase starts only within budget; otherwise BACKOFF for
 *     n = ceil((L + W - budget * T) / (budget * t_base)) iterations (n in 1..backoff_max;
 *     base_len when t_base is unknown), the plain steps that bring L back within budget if
 *     they cost t_base each, the doubling back-off length left as it was.  A trial iteration that
 *     leaves the budget ends its trial at once (its U the running U, as a hopeless trial's)
 *     and the test phase with it (the decision as after its last trial); a SET iteration
 *     that leaves it while the set phase's running U is below 1 ends the set phase.
 *   - speq: a probe (below) is made only within budget.
 *   Why: on the zoo pair behind an emulated PCIe link (benchmarks/speculation_offload.py,
 *   32-token requests) the draft model's failing trials at K = 2-3 cost two plain steps
 *   each and Cascade read 0.81-0.87 of plain; a bound on what exploring may cost is what
 *   makes the 5 % hold on short requests, where a per-phase rule cannot amortize.
 *
 * Instant utility (static, heuristic): ETR * t_base / t_iter, with t_base the
 * median of the last base_len k_used == 0 iterations; NaN until one was observed.
 *
 * Not thread-safe: callers serialise all calls on one object.  No global state.
 */
#ifndef SMOE_SPEC_CONTROLLER_H
#define SMOE_SPEC_CONTROLLER_H

#include "../common.h"

#define SMOE_SPEC_KMAX 64        /* largest k_max accepted */
#define SMOE_SPEC_TAU_MAX 65     /* tau(1..SMOE_SPEC_TAU_MAX) may be given */
#define SMOE_SPEC_PROBE_MAX 4096 /* the longest run of blocked plain steps between re-probes */

typedef enum smoe_spec_phase {
    SMOE_SPEC_PHASE_NONE = 0,    /* controllers without phases */
    SMOE_SPEC_PHASE_BASE = 1,
    SMOE_SPEC_PHASE_TEST = 2,
    SMOE_SPEC_PHASE_SET = 3,
    SMOE_SPEC_PHASE_BACKOFF = 4
} smoe_spec_phase;

/* One observed iteration (input of observe). */
typedef struct smoe_spec_obs {
    int32_t k;              /* draft tokens verified, 0..k_max */
    int32_t accepted;       /* accepted drafts, 0..k */
    double t_iter;          /* seconds, finite and > 0 */
    int64_t experts_loaded; /* experts loaded from the slow tier during the iteration, >= 0 */
    double t_draft;         /* seconds of t_iter spent drafting, 0 <= t_draft <= t_iter (0: unknown) */
    double t_io;            /* seconds of t_iter stalled on expert loads, 0 <= t_io <= t_iter */
    int32_t nrows;          /* 0: one sequence; else a batch step of nrows sequences */
    const int32_t *row_k;   /* [nrows] drafts verified per sequence, 0..k (borrowed) */
    const int32_t *row_acc; /* [nrows] drafts accepted per sequence, 0..row_k[i] (borrowed) */
} smoe_spec_obs;

/* ETR of an observation: accepted + 1, or the mean of row_acc + 1 over a batch step. */
double smoe_spec_obs_etr(const smoe_spec_obs *o);

/* One telemetry record. */
typedef struct smoe_spec_rec {
    uint64_t iter;          /* 0-based index of the observation */
    int32_t k;              /* k_used */
    int32_t accepted;
    double t_iter;
    double utility;         /* controller's utility estimate after this iteration (see above) */
    int32_t phase;          /* smoe_spec_phase during which the iteration ran */
    int32_t k_planned;      /* what next_k() answered before the iteration */
    int64_t experts_loaded;
} smoe_spec_rec;

typedef struct smoe_spec_params {
    int32_t k_max;          /* largest K, 1..SMOE_SPEC_KMAX (default 8) */
    int32_t k;              /* static: K (0 allowed; default 0 means K = 0) */
    int32_t initial;        /* heuristic: first K (default 5); cascade: first centre (default
                               2); speq: K before the first observation (default 1) */
    /* cascade */
    int32_t trials;         /* M (default 4) */
    int32_t trial_len;      /* t (default 4) */
    int32_t set_len;        /* S (default 16) */
    int32_t backoff_max;    /* cap of the back-off length (default 1024) */
    int32_t base_len;       /* K=0 iterations whose median is t_base (default 4) */
    int32_t base_refresh;   /* iterations between base measurements (default 100) */
    int32_t trial_pool;     /* cascade: iterations at a K behind a trial's U (default 12, <= 64) */
    double converge;        /* cascade: a test phase ends when two successive trials' U differ
                               by at most this fraction of the larger (default 0.10; -1 never) */
    /* speq */
    double alpha;           /* EMA weight in (0, 1] (default 0.2) */
    double p_init;          /* initial per-position acceptance in [0, 1] (default 0.6) */
    int32_t probe;          /* speq: K=0 iterations before a k >= 1 probe (default 16; -1 never) */
    double t_first;         /* speq: seconds of the first mandatory expert fetch (default 0) */
    /* all */
    double budget;          /* slowdown budget, a fraction of the observed time (default 0.05;
                               negative: off) */
    uint32_t telemetry_cap; /* ring capacity in records (default 65536, at most 2^26) */
} smoe_spec_params;

typedef struct smoe_spec_ctl smoe_spec_ctl;

typedef struct smoe_spec_ctl_ops {
    const char *name;
    int (*init)(smoe_spec_ctl *c, const smoe_spec_params *p, smoe_err *err);
    void (*free)(smoe_spec_ctl *c);
    /* K for the next iteration; must not change state.  Result is clamped by the caller. */
    int32_t (*next_k)(const smoe_spec_ctl *c);
    /* Learn from one validated observation; *phase gets the phase the iteration ran in;
     * returns the telemetry utility. */
    double (*observe)(smoe_spec_ctl *c, const smoe_spec_obs *o, int32_t *phase);
    /* Current phase (smoe_spec_phase), for telemetry and inspection. */
    int32_t (*phase)(const smoe_spec_ctl *c);
    /* A new request starts (NULL: the controller keeps no per-request state). */
    void (*begin_request)(smoe_spec_ctl *c);
} smoe_spec_ctl_ops;

struct smoe_spec_ctl {
    const smoe_spec_ctl_ops *ops;
    void *state;                           /* owned by the implementation */
    smoe_spec_params params;               /* defaults filled in */
    /* gamma-tolerance */
    int32_t ntau;                          /* 0: no tau set */
    double tau[SMOE_SPEC_TAU_MAX + 1];     /* tau[g], g = 1..ntau */
    uint8_t allowed[SMOE_SPEC_KMAX + 1];   /* allowed[k], k = 0..k_max */
    uint8_t tau_ok[SMOE_SPEC_KMAX + 1];    /* the tau rule alone */
    /* success model (see "Success condition" above) */
    int32_t succ_on, succ_min, succ_probe;
    double acc_p[SMOE_SPEC_KMAX + 1];      /* acc_p[j], j = 1..k_max */
    int64_t acc_n[SMOE_SPEC_KMAX + 1];     /* decisions seen at position j */
    double delta;
    int32_t has_delta;
    uint64_t succ_zero_run;                /* consecutive k == 0 observations while blocked */
    uint64_t succ_probe_cur;               /* blocked k == 0 observations before the next
                                            * re-probe: succ_probe, doubled by each re-probe */
    int32_t batch;                         /* batch size of the coming steps (1 default) */
    /* speq's per-k expected I/O seconds, learned (speq.c) until set_io_cost (io_given) */
    double io_cost[SMOE_SPEC_KMAX + 1];
    int32_t io_given;
    /* plain-iteration timing shared by all controllers (last base_len k == 0 iterations);
     * base_ring holds 2 * base_len doubles, the second half scratch for the median */
    double *base_ring;
    int32_t base_n, base_pos;
    uint64_t last_base_iter;               /* iteration index of the last k == 0 observation */
    /* the slowdown budget (see above): L, T and W */
    double spec_loss, t_total, loss_max;
    /* telemetry ring */
    smoe_spec_rec *ring;
    uint32_t ring_cap;
    uint64_t n_obs;                        /* total observations; ring holds the last min(n, cap) */
};

extern const smoe_spec_ctl_ops smoe_spec_static;
extern const smoe_spec_ctl_ops smoe_spec_heuristic;
extern const smoe_spec_ctl_ops smoe_spec_cascade;
extern const smoe_spec_ctl_ops smoe_spec_speq;

/* "static", "heuristic", "cascade", "speq"; NULL when unknown. */
const smoe_spec_ctl_ops *smoe_spec_ctl_find(const char *name);

/* Validate params, fill defaults, allocate; *out owned by the caller (smoe_spec_ctl_destroy). */
int smoe_spec_ctl_create(smoe_spec_ctl **out, const smoe_spec_ctl_ops *ops,
                         const smoe_spec_params *params, smoe_err *err);
void smoe_spec_ctl_destroy(smoe_spec_ctl *c);

/* A new request starts: the controller drops its per-request state (cascade: see above;
 * the others keep theirs: the heuristic's K, as transformers keeps num_assistant_tokens
 * across calls, and speq's acceptance and timing models, which describe the model pair). */
void smoe_spec_ctl_begin_request(smoe_spec_ctl *c);

/* K for the next iteration (allowed, 0..k_max).  Pure. */
int32_t smoe_spec_ctl_next_k(const smoe_spec_ctl *c);

/* Validate o (SMOE_EINVAL naming the bad field: negative or too large k, accepted outside
 * 0..k, non-finite or non-positive t_iter, bad t_draft/t_io, negative experts_loaded), then
 * learn and append a telemetry record. */
int smoe_spec_ctl_observe(smoe_spec_ctl *c, const smoe_spec_obs *o, smoe_err *err);

/* tau[i] = tau(i+1) for i = 0..n-1, each finite and > 0, 1 <= n <= SMOE_SPEC_TAU_MAX.
 * n == 0 clears the pruning (every K allowed). */
int smoe_spec_ctl_set_tau(smoe_spec_ctl *c, const double *tau, int32_t n, smoe_err *err);

/* Switch the success-condition pruning on (on = 1; min_obs >= 1 decisions per position
 * before its acceptance counts, probe >= 1 blocked k == 0 steps before a re-probe) or off
 * (on = 0, back to the tau rule alone). */
int smoe_spec_ctl_set_success(smoe_spec_ctl *c, int on, int32_t min_obs, int32_t probe,
                              smoe_err *err);

/* The success model's lambda(k) and S(k) (k = 0..k_max; S(0) = 1) and delta; NaN when k is
 * out of range. */
double smoe_spec_ctl_lambda(const smoe_spec_ctl *c, int32_t k);
double smoe_spec_ctl_speedup(const smoe_spec_ctl *c, int32_t k);

/* Batch size of the next steps (>= 1); see "Batches" above. */
int smoe_spec_ctl_set_batch(smoe_spec_ctl *c, int32_t batch, smoe_err *err);

/* cost[k] for k = 0..n-1 (finite, >= 0), n <= k_max + 1; entries beyond n become 0. */
int smoe_spec_ctl_set_io_cost(smoe_spec_ctl *c, const double *cost, int32_t n, smoe_err *err);

/* Largest allowed K' <= k (0 when none). */
int32_t smoe_spec_ctl_clamp(const smoe_spec_ctl *c, int32_t k);
static inline int smoe_spec_ctl_allowed(const smoe_spec_ctl *c, int32_t k) {
    return k >= 0 && k <= c->params.k_max && c->allowed[k];
}

/* The `phase` op of controllers without phases. */
int32_t smoe_spec_ctl_no_phase(const smoe_spec_ctl *c);

/* Median t_iter of the last base_len k == 0 iterations; NaN when none was observed. */
double smoe_spec_ctl_base(const smoe_spec_ctl *c);

/* Within the slowdown budget: L + W <= budget * T (always when the budget is off). */
int smoe_spec_ctl_within_budget(const smoe_spec_ctl *c);

/* Plain iterations of t_base each that bring L back within budget (1..backoff_max; base_len
 * when t_base is unknown); 0 when already within. */
int32_t smoe_spec_ctl_budget_wait(const smoe_spec_ctl *c);

/* Copy the telemetry (oldest first) into out[0..min(n_obs, cap)-1]; returns the count. */
uint32_t smoe_spec_ctl_telemetry(const smoe_spec_ctl *c, smoe_spec_rec *out);

/* speq introspection (tests, notebooks): E[N(k)] and T_cycle(k) of the current model.
 * Return NaN for other controllers or k out of range. */
double smoe_spec_speq_expected_tokens(const smoe_spec_ctl *c, int32_t k);
double smoe_spec_speq_cycle_time(const smoe_spec_ctl *c, int32_t k);
/* T_cycle(k)'s terms in seconds (Eq. 3; their sum, floored at 1e-12, is the cycle time):
 * parts[0] drafting k tokens, [1] the first mandatory expert fetch (t_first), [2] verifying
 * k + 1 tokens, [3] loading the experts the draft adds (io_cost[k]).  The amortization
 * roofline (Sec. 3.2.1) splits them into compute ([0] + [2]) and synchronous I/O ([1] + [3]).
 * Returns -1 (parts untouched) for another controller or k out of range. */
int smoe_spec_speq_cycle_parts(const smoe_spec_ctl *c, int32_t k, double parts[4]);

#endif
