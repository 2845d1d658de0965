// Self-check of the selector part of tests/support/reference.hpp (value term, defensive aggregation,
// cumulative-mass forcing, CriticalKV, DefensiveKV, Layer-DefensiveKV) on small hand-worked examples.
// Every expected number below was computed by hand from docs/algorithms.md#aggregation to docs/algorithms.md#ties.
#include "support/reference.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace test_reference_selfcheck_selectors {  // this file's scope in unity builds (tests/CMakeLists.txt)

namespace {

using kvevict_ref::Kept;
using kvevict_ref::Pool;
using Idx = std::vector<std::int64_t>;
using Forced = std::vector<std::vector<std::int64_t>>;
using Catch::Matchers::VectorContains;

// Matches a vector of want's size whose entries are each within tol of want's (Catch's Approx with its relative
// part off). On a mismatch Catch prints both vectors, at full precision (its default for double is 10 digits).
auto near(const std::vector<double>& want, double tol = 1e-12) {
  Catch::StringMaker<double>::precision = 17;
  return Catch::Matchers::Approx(want).margin(tol).epsilon(0.0);
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#value-term: value norms. d = 2, D = 2, H = 2 query heads. W_o [D][H*d]:
//   W_o = [[1, 0, 2, -1],
//          [0, 1, 1,  3]]   -> W_o^0 = [[1,0],[0,1]] (identity), W_o^1 = [[2,-1],[1,3]].
// out[r] = sum_c v[c] * W_o^q[r][c].
TEST_CASE("reference value_norms: L1 and L2 through W_o", "[reference]") {
  const std::vector<double> w_o = {1, 0, 2, -1, 0, 1, 1, 3};
  // Hkv = 1 (G = 2), L = 2: V = [[1, 2], [-1, 1]].
  //   token 0: head 0 -> (1, 2): L1 3, L2 sqrt5;   head 1 -> (2-2, 1+6) = (0, 7): L1 7, L2 7.
  //   token 1: head 0 -> (-1, 1): L1 2, L2 sqrt2;  head 1 -> (-2-1, -1+3) = (-3, 2): L1 5, L2 sqrt13.
  {
    const std::vector<double> v = {1, 2, -1, 1};
    CHECK_THAT(kvevict_ref::value_norms(v, w_o, 2, 1, 2, 2, 2, 1), near({5.0, 3.5}));
    CHECK_THAT(kvevict_ref::value_norms(v, w_o, 2, 1, 2, 2, 2, 2),
               near({(std::sqrt(5.0) + 7.0) / 2, (std::sqrt(2.0) + std::sqrt(13.0)) / 2}));
  }
  // Hkv = 2 (G = 1): KV head 0 = [[1, 2], [-1, 1]] with W_o^0, KV head 1 = [[0, 1], [1, 1]] with W_o^1.
  //   KV 1 token 0: (0*2 + 1*(-1), 0*1 + 1*3) = (-1, 3): L1 4, L2 sqrt10;
  //   KV 1 token 1: (2 - 1, 1 + 3) = (1, 4): L1 5, L2 sqrt17.
  {
    const std::vector<double> v = {1, 2, -1, 1, 0, 1, 1, 1};
    CHECK_THAT(kvevict_ref::value_norms(v, w_o, 2, 2, 2, 2, 2, 1), near({3.0, 2.0, 4.0, 5.0}));
    CHECK_THAT(kvevict_ref::value_norms(v, w_o, 2, 2, 2, 2, 2, 2),
               near({std::sqrt(5.0), std::sqrt(2.0), std::sqrt(10.0), std::sqrt(17.0)}));
  }
}

// ---------------------------------------------------------------------------------------------
// Defensive aggregation (docs/algorithms.md#aggregation). H = 4, Hkv = 2 (G = 2), w = 2, L = 6, P = 4, avg pooling
// k = 3.
TEST_CASE("reference defensive_scores: renormalised max over heads and rows", "[reference]") {
  const std::vector<double> attn = {
      // q0 (KV 0)
      0.4, 0.0, 0.0, 0.2, 0.4, 0.0,  // pooled [.4,.4,.2,.2]/3 sum .4, mass .6 -> x1.5 -> [.2,.2,.1,.1]
      0.0, 0.3, 0.3, 0.0, 0.2, 0.2,  // pooled [.1,.2,.2,.1] sum .6 = mass        -> [.1,.2,.2,.1]
      // q1 (KV 0)
      0.0, 0.0, 0.9, 0.0, 0.1, 0.0,  // pooled [0,.3,.3,.3] sum .9 = mass         -> [0,.3,.3,.3]
      0.0, 0.0, 0.0, 0.0, 0.5, 0.5,  // pooled sum 0                              -> zeros
      // q2 (KV 1)
      1.0, 0.0, 0.0, 0.0, 0.0, 0.0,    // pooled [1/3,1/3,0,0] sum 2/3, mass 1      -> [.5,.5,0,0]
      0.0, 0.0, 0.0, 0.5, 0.25, 0.25,  // pooled [0,0,.5/3,.5/3] sum 1/3, mass .5   -> [0,0,.25,.25]
      // q3 (KV 1)
      0.1, 0.1, 0.1, 0.1, 0.6, 0.0,  // pooled [.2/3,.1,.1,.2/3] sum 1/3, mass .4 -> [.08,.12,.12,.08]
      0.0, 0.2, 0.0, 0.0, 0.4, 0.4,  // pooled [.2/3,.2/3,.2/3,0] sum .2 = mass   -> same
  };
  // M[0] = max = [.2, .3, .3, .3] (mean .275); M[1] = [.5, .5, .25, .25] (mean .375).
  CHECK_THAT(kvevict_ref::defensive_scores(attn, 4, 2, 2, 6, 3, Pool::avg, false),
             near({0.2, 0.3, 0.3, 0.3, 0.5, 0.5, 0.25, 0.25}));
  CHECK_THAT(kvevict_ref::defensive_scores(attn, 4, 2, 2, 6, 3, Pool::avg, true),
             near({0.275, 0.3, 0.3, 0.3, 0.5, 0.5, 0.375, 0.375}));
  // Renormalisation: kernel 1 pools nothing, so M = raw max over heads/rows of the prefix block.
  CHECK_THAT(kvevict_ref::defensive_scores(attn, 4, 2, 2, 6, 1, Pool::avg, false),
             near({0.4, 0.3, 0.9, 0.2, 1.0, 0.2, 0.1, 0.5}));
  // Renormalisation with max pooling: one row [.4, 0, 0, .2 | .4] (w = 1, L = 5):
  // pooled [.4, .4, .2, .2] sum 1.2, mass .6 -> x0.5 -> [.2, .2, .1, .1]; floor at the mean .15.
  const std::vector<double> one = {0.4, 0.0, 0.0, 0.2, 0.4};
  CHECK_THAT(kvevict_ref::defensive_scores(one, 1, 1, 1, 5, 3, Pool::max, false), near({0.2, 0.2, 0.1, 0.1}));
  CHECK_THAT(kvevict_ref::defensive_scores(one, 1, 1, 1, 5, 3, Pool::max, true), near({0.2, 0.2, 0.15, 0.15}));
  // Same row with avg pooling: pooled [.4,.4,.2,.2]/3, sum .4 -> x1.5 -> [.2,.2,.1,.1] (sum = mass .6).
  CHECK_THAT(kvevict_ref::defensive_scores(one, 1, 1, 1, 5, 3, Pool::avg, false), near({0.2, 0.2, 0.1, 0.1}));
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#forcing: cumulative-mass forcing. H = 4, Hkv = 2 (G = 2), w = 4, L = 12, P = 8. Every row of a
// head is the same; its window mass sits on key 8 (visible to all 4 window rows). Values are multiples of 1/32 so that
// sums and means are exact and ties in p are exact ties.
std::vector<double> mass_attn() {
  const std::vector<std::vector<double>> rows = {
      // q0: prefix 23/32, window 9/32
      {1, 10, 2, 3, 0, 4, 1, 2, 9, 0, 0, 0},
      // q1: prefix 23/32, window 9/32
      {1, 10, 0, 1, 0, 8, 3, 0, 9, 0, 0, 0},
      // q2: prefix 22/32, window 10/32
      {6, 0, 0, 0, 0, 0, 0, 16, 10, 0, 0, 0},
      // q3: prefix 24/32, window 8/32
      {10, 0, 4, 0, 0, 0, 6, 4, 8, 0, 0, 0},
  };
  std::vector<double> attn;
  for (const auto& r : rows)
    for (int i = 0; i < 4; ++i)
      for (double x : r) attn.push_back(x / 32.0);
  return attn;
}

TEST_CASE("reference mass_forced: corrected and under quirks", "[reference]") {
  const std::vector<double> attn = mass_attn();
  // KV 0: ave = [1,10,1,2,0,6,2,1]/32 (sum 23/32) -> p = [1,10,1,2,0,6,2,1]/23
  //   order (p desc, ties -> higher position): 1, 5, 6, 3, 7, 2, 0, 4;
  //   c = 10 16 18 20 21 22 23 23 (/23) = .435 .696 .783 .870 .913 .957 1 1.
  // KV 1: ave = [8,0,2,0,0,0,3,10]/32 (sum 23/32) -> order 7, 0, 6, 2, 5, 4, 3, 1;
  //   c = 10 18 21 23 23 23 23 23 (/23) = .435 .783 .913 1 ...
  // corrected window_bias = mean window mass = (9+9+10+8)/4/32 = 9/32 = .28125.
  //   threshold .9 -> tau .61875: KV 0 index 1 -> {1}; KV 1 index 1 -> {7}.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 0.9, 12, false, 0.0) == (Forced{Idx{1}, Idx{7}}));
  //   threshold 1.0 -> tau .71875: KV 0 index 2 -> {1, 5}; KV 1 index 1 -> {7}.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.0, 12, false, 0.0) == (Forced{Idx{1, 5}, Idx{7}}));
  //   cap = max(0, n_kept - w): n_kept 5 -> 1; n_kept 4 or 2 (< w) -> 0.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.0, 5, false, 0.0) == (Forced{Idx{1}, Idx{7}}));
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.0, 4, false, 0.0) == (Forced{Idx{}, Idx{}}));
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.0, 2, false, 0.0) == (Forced{Idx{}, Idx{}}));
  //   threshold 1.1 -> tau .81875: KV 0 index 3 -> {1, 5, 6}; KV 1 index 2 -> {0, 7}; n_kept 6 -> cap 2.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.1, 12, false, 0.0) == (Forced{Idx{1, 5, 6}, Idx{0, 7}}));
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.1, 6, false, 0.0) == (Forced{Idx{1, 5}, Idx{0, 7}}));
  //   tau never reached (threshold 1.5 -> tau 1.21875 > 1): nothing forced.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.5, 12, false, 0.0) == (Forced{Idx{}, Idx{}}));
  //   tau <= the first p (threshold .5 -> tau .21875 < .435): k = 0, the token at the crossing index is
  //   not included, so nothing is forced.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 0.5, 12, false, 0.0) == (Forced{Idx{}, Idx{}}));

  // quirks: window_bias = mean mass on the prefix tokens [4, 8): q0 7, q1 11, q2 16, q3 10 (/32) -> 11/32 = .34375.
  //   threshold 1.0 -> tau .65625: KV 0 index 1 -> {1} (corrected gave {1, 5}); KV 1 {7}. cr = .2: cap = int(2.4) = 2.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.0, 12, true, 0.2) == (Forced{Idx{1}, Idx{7}}));
  //   threshold 1.1 -> tau .75625: KV 0 index 2 -> {1, 5}; KV 1 index 1 -> {7}.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.1, 12, true, 0.2) == (Forced{Idx{1, 5}, Idx{7}}));
  //   threshold 1.2 -> tau .85625: KV 0 index 3, KV 1 index 2; cr = .2 caps KV 0 at 2; cr = 0: cap int(4) = 4.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.2, 12, true, 0.2) == (Forced{Idx{1, 5}, Idx{0, 7}}));
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.2, 12, true, 0.0) == (Forced{Idx{1, 5, 6}, Idx{0, 7}}));
  //   cr = .5: cap = int(0) = 0 -> nothing.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.2, 12, true, 0.5) == (Forced{Idx{}, Idx{}}));
  //   cr = .8: cap = int(8 * 0.2 - 4) = int(-2.4) = -2 -> all but the last 2 of the sorted order:
  //   KV 0: 1,5,6,3,7,2 | 0,4 -> {1,2,3,5,6,7}; KV 1: 7,0,6,2,5,4 | 3,1 -> {0,2,4,5,6,7}.
  const Forced short_ctx = {Idx{1, 2, 3, 5, 6, 7}, Idx{0, 2, 4, 5, 6, 7}};
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 0.9, 2, true, 0.8) == short_ctx);
  //   ... even when tau is never reached (k = 0, min(0, -2) = -2); quirks ignore n_kept.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.5, 2, true, 0.8) == short_ctx);
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.5, 12, true, 0.8) == short_ctx);
  //   cr = 1: cap = int(-4) = -4 -> the first 4 of the order.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 0.9, 2, true, 1.0) == (Forced{Idx{1, 3, 5, 6}, Idx{0, 2, 6, 7}}));

  // A KV head whose prefix mass is 0 forces nothing. H = Hkv = 2, w = 1, L = 4, P = 3.
  //   head 0 row: [0, 0, 0 | 1]; head 1 row: [.2, .3, .1 | .4] -> p = [1/3, 1/2, 1/6], order 1, 0, 2; c = .5, .8333, 1.
  //   corrected bias (1 + .4)/2 = .7; threshold 1.5 -> tau .8 -> head 1 index 1 -> {1}.
  const std::vector<double> z = {0, 0, 0, 1, 0.2, 0.3, 0.1, 0.4};
  CHECK(kvevict_ref::mass_forced(z, 2, 2, 1, 4, 1.5, 4, false, 0.0) == (Forced{Idx{}, Idx{1}}));
  // threshold 0.9 -> tau 0.2 <= .5 at index 0 -> nothing.
  CHECK(kvevict_ref::mass_forced(z, 2, 2, 1, 4, 0.9, 4, false, 0.0) == (Forced{Idx{}, Idx{}}));
  // quirks, cr = 0.8: cap = int(3 * 0.2 - 1) = int(-0.4) = 0 (truncation toward zero, not floor) -> nothing.
  CHECK(kvevict_ref::mass_forced(z, 2, 2, 1, 4, 1.5, 4, true, 0.8) == (Forced{Idx{}, Idx{}}));
  // quirks, cr = 1: cap = -1 -> all but the last of the order, also for the zero-mass head
  // (its order is positions descending 2, 1, 0 -> {1, 2}); head 1 order 1, 0, 2 -> {0, 1}.
  CHECK(kvevict_ref::mass_forced(z, 2, 2, 1, 4, 1.5, 4, true, 1.0) == (Forced{Idx{1, 2}, Idx{0, 1}}));

  // P < w under quirks: bias over prefix [max(0, P - w), P) = all of it; cap = int(2 - 3) = -1 always.
  // H = Hkv = 1, w = 3, L = 5, P = 2; ave = [.8/3, .8/3] -> order 1, 0 -> all but last -> {1}.
  const std::vector<double> tiny = {0.5, 0.3, 0.2, 0.0, 0.0, 0.2, 0.2, 0.2, 0.4, 0.0, 0.1, 0.3, 0.2, 0.2, 0.2};
  CHECK(kvevict_ref::mass_forced(tiny, 1, 1, 3, 5, 0.9, 5, true, 0.0) == Forced{Idx{1}});
  // corrected: bias = window mass (.2 + .6 + .6)/3 = .4667; threshold 1.0 -> tau .5333: c = .5, 1 -> k = 1 {1};
  // cap = max(0, 5 - 3) = 2.
  CHECK(kvevict_ref::mass_forced(tiny, 1, 1, 3, 5, 1.0, 5, false, 0.0) == Forced{Idx{1}});
  // corrected, n_kept = 3 = w -> cap 0.
  CHECK(kvevict_ref::mass_forced(tiny, 1, 1, 3, 5, 1.0, 3, false, 0.0) == Forced{Idx{}});
}

// ---------------------------------------------------------------------------------------------
// CriticalKV. Hkv = 2, w = 4, L = 12, P = 8, n_kept = 6, eps = 1e-4, ratio 0.5. Layer max of s = 0.5 (h0, j1).
const std::vector<double> kS = {
    0.10, 0.50, 0.05, 0.30, 0.02, 0.20, 0.01, 0.04,  // head 0
    0.40, 0.03, 0.06, 0.08, 0.18, 0.07, 0.09, 0.15,  // head 1
};
const std::vector<double> kN = {
    1,   1, 1, 1, 1, 1, 1, 1, 0.1, 1,   1, 1,  // head 0: window token 8 has a tiny value norm
    0.1, 2, 1, 1, 1, 1, 3, 1, 1,   0.2, 1, 1,  // head 1
};
// Stage-2 scores (s + eps) * N of the prefix:
//   head 0: j1 .5001, j3 .3001, j5 .2001, j0 .1001, j2 .0501, j7 .0401, j4 .0201, j6 .0101
//   head 1: j6 .2703, j4 .1801, j7 .1501, j3 .0801, j5 .0701, j1 .0602, j2 .0601, j0 .04001
// quirks, window: head 0 w8 = .5001 * .1 = .05001 (others .5001); head 1 w8 .5001, w9 .5001 * .2 = .10002.

TEST_CASE("reference criticalkv: adaptive and uniform, corrected and under quirks", "[reference]") {
  // Adaptive, alpha 0.2: n_safe = int(1.2) = 1 -> token 11 of each head (the window carries the layer max and
  // wins the tie by position) -> DBL_MAX. Flat top-12: 2 DBL_MAX, seven 0.5 entries (window 8..10 of both
  // heads, then (h0, 1)), .40 (h1, 0), .30 (h0, 3), .20 (h0, 5) -> b = (7, 5).
  // Stage 1: int(3.5) = 3 -> h0 {11, 10, 9}; int(2.5) = 2 -> h1 {11, 10}.
  // Stage 2 corrected: h0 needs 4: w8 (rank first), j1, j3, j5; h1 needs 3: w9, w8, j6.
  CHECK(kvevict_ref::criticalkv(kS, kN, 2, 4, 12, 6, true, 0.2, 1e-4, 0.5, false) ==
        (Kept{Idx{1, 3, 5, 8, 9, 10, 11}, Idx{6, 8, 9, 10, 11}}));
  // Stage 2 quirks: the window competes. h0: j1 .5001, j3 .3001, j5 .2001, j0 .1001 beat w8 .05001;
  // h1: w8 .5001, j6 .2703, j4 .1801 beat w9 .10002 (and j0, the best base score, loses in both modes).
  CHECK(kvevict_ref::criticalkv(kS, kN, 2, 4, 12, 6, true, 0.2, 1e-4, 0.5, true) ==
        (Kept{Idx{0, 1, 3, 5, 9, 10, 11}, Idx{4, 6, 8, 10, 11}}));
  // alpha = 1: n_safe = 6: each head's top 6 of the padded row is DBL_MAX (h0 {8..11, 1, 3}, h1 {8..11, 0, 4});
  // b = (6, 6); stage 1 takes 11, 10, 9; safeguard entries rank first in stage 2 (even h1 j0 with N = .1,
  // and under quirks even the window) -> SnapKV's choice.
  const Kept safe_all = {Idx{1, 3, 8, 9, 10, 11}, Idx{0, 4, 8, 9, 10, 11}};
  CHECK(kvevict_ref::criticalkv(kS, kN, 2, 4, 12, 6, true, 1.0, 1e-4, 0.5, false) == safe_all);
  CHECK(kvevict_ref::criticalkv(kS, kN, 2, 4, 12, 6, true, 1.0, 1e-4, 0.5, true) == safe_all);
  CHECK(safe_all == kvevict_ref::snapkv(kS, 2, 4, 12, 6));

  // Uniform (SnapKV base): b = 6 each, stage 1 int(3) = 3 -> {11, 10, 9}; stage 2 needs 3.
  //   corrected: h0 w8, j1, j3; h1 w8, j6, j4.   quirks: h0 j1, j3, j5 (w8 .05001 loses); h1 w8, j6, j4.
  CHECK(kvevict_ref::criticalkv(kS, kN, 2, 4, 12, 6, false, 0.2, 1e-4, 0.5, false) ==
        (Kept{Idx{1, 3, 8, 9, 10, 11}, Idx{4, 6, 8, 9, 10, 11}}));
  CHECK(kvevict_ref::criticalkv(kS, kN, 2, 4, 12, 6, false, 0.2, 1e-4, 0.5, true) ==
        (Kept{Idx{1, 3, 5, 9, 10, 11}, Idx{4, 6, 8, 9, 10, 11}}));
  // ratio 1: stage 1 only = SnapKV; ratio 0: stage 2 only (corrected: window first, then by s').
  CHECK(kvevict_ref::criticalkv(kS, kN, 2, 4, 12, 6, false, 0.2, 1e-4, 1.0, true) ==
        kvevict_ref::snapkv(kS, 2, 4, 12, 6));
  CHECK(kvevict_ref::criticalkv(kS, kN, 2, 4, 12, 6, false, 0.2, 1e-4, 0.0, false) ==
        (Kept{Idx{1, 3, 8, 9, 10, 11}, Idx{4, 6, 8, 9, 10, 11}}));
  // ratio 0, quirks: h0 by s' = j1 .5001, w9 w10 w11 .5001 (ties -> higher position first: 11, 10, 9 before 1),
  // then j3 .3001 -> {1, 3, 9, 10, 11} + one more: j5 .2001. h1: w8 w10 w11 .5001, j6 .2703, j4 .1801, j7 .1501.
  CHECK(kvevict_ref::criticalkv(kS, kN, 2, 4, 12, 6, false, 0.2, 1e-4, 0.0, true) ==
        (Kept{Idx{1, 3, 5, 9, 10, 11}, Idx{4, 6, 7, 8, 10, 11}}));
  // n_kept < w, uniform, corrected: stage 1 int(1.5) = 1 -> {11}; stage 2 needs 2: window 10, 9 (DBL_MAX, by position).
  CHECK(kvevict_ref::criticalkv(kS, kN, 2, 4, 12, 3, false, 0.2, 1e-4, 0.5, false) ==
        (Kept{Idx{9, 10, 11}, Idx{9, 10, 11}}));
}

// ---------------------------------------------------------------------------------------------
TEST_CASE("reference defensive_value_scores", "[reference]") {
  // Hkv = 2, w = 1, L = 4, P = 3. Per-token sums of N: 4, 4, 0 (-> Nn = 0), window column ignored.
  const std::vector<double> m = {0.2, 0.4, 0.1, 0.3, 0.1, 0.5};
  const std::vector<double> n = {1, 3, 0, 9, 3, 1, 0, 9};
  CHECK_THAT(kvevict_ref::defensive_value_scores(m, n, 2, 1, 4, true), near({0.05, 0.3, 0.0, 0.225, 0.025, 0.0}));
  CHECK_THAT(kvevict_ref::defensive_value_scores(m, n, 2, 1, 4, false), near(m));
}

// ---------------------------------------------------------------------------------------------
TEST_CASE("reference defensivekv on hand-worked scores", "[reference]") {
  // Hkv = 2, w = 4, L = 12, P = 8, n_kept = 6, s' = kS (layer max .5). Forced: h0 {6}, h1 {1, 2} -> .5.
  // Entries at .5: h0 {1, 6, 8..11}, h1 {1, 2, 8..11} = 12 = Hkv * n_kept.
  const Forced f = {Idx{6}, Idx{1, 2}};
  CHECK(kvevict_ref::defensivekv(kS, f, 2, 4, 12, 6, 0.0, false, 0.0) ==
        (Kept{Idx{1, 6, 8, 9, 10, 11}, Idx{1, 2, 8, 9, 10, 11}}));
  // quirks, cr = 0.45: total = int(12 * 0.55 * 2) = int(13.2) = 13 (corrected: 2 * int(6.6) = 12);
  // the 13th entry is .40 (h1, 0).
  CHECK(kvevict_ref::defensivekv(kS, f, 2, 4, 12, 6, 0.0, true, 0.45) ==
        (Kept{Idx{1, 6, 8, 9, 10, 11}, Idx{0, 1, 2, 8, 9, 10, 11}}));
  // No mass forcing: .5 entries h0 {1, 8..11} + h1 {8..11} = 9, then .40 (h1,0), .30 (h0,3), .20 (h0,5).
  const Kept no_force = {Idx{1, 3, 5, 8, 9, 10, 11}, Idx{0, 8, 9, 10, 11}};
  CHECK(kvevict_ref::defensivekv(kS, Forced{}, 2, 4, 12, 6, 0.0, false, 0.0) == no_force);
  CHECK(kvevict_ref::defensivekv(kS, Forced{Idx{}, Idx{}}, 2, 4, 12, 6, 0.0, false, 0.0) == no_force);
  // quirks, cr = 0.8, L = 12: total = int(12 * 0.2 * 2) = int(4.8) = 4: ties at .5 by position, then head:
  // (11,h0) (11,h1) (10,h0) (10,h1) -- forced tokens are cut.
  CHECK(kvevict_ref::defensivekv(kS, f, 2, 4, 12, 2, 0.0, true, 0.8) == (Kept{Idx{10, 11}, Idx{10, 11}}));

  // AdaKV safeguard before the flat top-k: Hkv = 2, w = 1, L = 5, P = 4, n_kept = 2, layer max .9.
  const std::vector<double> s2 = {0.9, 0.8, 0.7, 0.6, 0.1, 0.2, 0.05, 0.3};
  // alpha 0: flat top-4 = .9 at (4,h0) (4,h1) (0,h0), then .8 (1,h0).
  CHECK(kvevict_ref::defensivekv(s2, Forced{}, 2, 1, 5, 2, 0.0, false, 0.0) == (Kept{Idx{0, 1, 4}, Idx{4}}));
  // alpha 1: n_safe = 2 -> h0 {4, 0}, h1 {4, 3} are DBL_MAX and fill the total of 4.
  CHECK(kvevict_ref::defensivekv(s2, Forced{}, 2, 1, 5, 2, 1.0, false, 0.0) == (Kept{Idx{0, 4}, Idx{3, 4}}));
  // alpha 0.5: n_safe = 1 -> only the window token 4, which is kept anyway.
  CHECK(kvevict_ref::defensivekv(s2, Forced{}, 2, 1, 5, 2, 0.5, false, 0.0) == (Kept{Idx{0, 1, 4}, Idx{4}}));

  // Budget totals: L = 1000, cr = 0.8, Hkv = 2: n_kept = int(1000 * 0.2) = 199 -> corrected 398,
  // quirks int(1000 * 0.2 * 2) = int(399.99999999999994) = 399.
  {
    const int L = 1000, w = 32, P = L - w;
    std::vector<double> s(static_cast<std::size_t>(2 * P));
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<double>((i * 37) % 101) / 101.0;
    const std::int64_t n_kept = kvevict_ref::n_kept_from_compression_ratio(L, 0.8);
    CHECK(n_kept == 199);
    const Kept c = kvevict_ref::defensivekv(s, Forced{}, 2, w, L, n_kept, 0.0, false, 0.8);
    const Kept q = kvevict_ref::defensivekv(s, Forced{}, 2, w, L, n_kept, 0.0, true, 0.8);
    CHECK(c[0].size() + c[1].size() == 398u);
    CHECK(q[0].size() + q[1].size() == 399u);
  }
}

// ---------------------------------------------------------------------------------------------
TEST_CASE("reference layer_defensivekv on hand-worked scores", "[reference]") {
  // NL = 2, Hkv = 1, w = 1, L = 4, P = 3, n_kept = 2.
  // layer 0: s' = [.1, .2, .3] (max .3), forced {0}; layer 1: s' = [.9, .8, .7] (max .9), nothing forced.
  const std::vector<std::vector<double>> sp = {{0.1, 0.2, 0.3}, {0.9, 0.8, 0.7}};
  const std::vector<Forced> f = {Forced{Idx{0}}, Forced{Idx{}}};
  // corrected: +inf at (L0, 0), (L0, 3), (L1, 3), then .9 (L1, 0): total 2 * 1 * 2 = 4.
  CHECK(kvevict_ref::layer_defensivekv(sp, f, 1, 1, 4, 2, false, 0.5) ==
        (std::vector<Kept>{Kept{Idx{0, 3}}, Kept{Idx{0, 3}}}));
  // quirks, cr = 0.5: total int(4 * 0.5 * 1 * 2) = 4. Layer 0's forced token and window carry only .3:
  // layer 1 [.9, .8, .7, .9] takes all 4 slots; layer 0 keeps nothing (the forced token loses).
  CHECK(kvevict_ref::layer_defensivekv(sp, f, 1, 1, 4, 2, true, 0.5) ==
        (std::vector<Kept>{Kept{Idx{}}, Kept{Idx{0, 1, 2, 3}}}));
  // No forcing at all (empty forced list) in corrected mode: inf at the two windows, then .9 (L1,0), .8 (L1,1).
  CHECK(kvevict_ref::layer_defensivekv(sp, {}, 1, 1, 4, 2, false, 0.5) ==
        (std::vector<Kept>{Kept{Idx{3}}, Kept{Idx{0, 1, 3}}}));

  // Ties: NL = 2, Hkv = 2, w = 1, L = 3, P = 2, all s' = .5, quirks, cr = 0.5: total int(3 * .5 * 2 * 2) = 6;
  // all 12 entries tie: position 2 of (L0h0) (L0h1) (L1h0) (L1h1), then position 1 of (L0h0) (L0h1).
  const std::vector<std::vector<double>> flat = {{0.5, 0.5, 0.5, 0.5}, {0.5, 0.5, 0.5, 0.5}};
  CHECK(kvevict_ref::layer_defensivekv(flat, {}, 2, 1, 3, 1, true, 0.5) ==
        (std::vector<Kept>{Kept{Idx{1, 2}, Idx{1, 2}}, Kept{Idx{2}, Idx{2}}}));
  // corrected, n_kept = 1 < w = 2 (L = 4): 16 infinite window entries, total 4 -> position 3 everywhere.
  const std::vector<std::vector<double>> two = {{0.1, 0.2, 0.3, 0.4}, {0.4, 0.3, 0.2, 0.1}};
  CHECK(kvevict_ref::layer_defensivekv(two, {}, 2, 2, 4, 1, false, 0.0) ==
        (std::vector<Kept>{Kept{Idx{3}, Idx{3}}, Kept{Idx{3}, Idx{3}}}));
  // corrected, NL = 1: forced + window (11 entries at +inf) and then the best real entry (h0, 1) at .5 -- the
  // same set as single-layer DefensiveKV, where those 11 entries and (h0, 1) share the layer max .5.
  const Forced f1 = {Idx{6}, Idx{1, 2}};
  const auto one_layer = kvevict_ref::layer_defensivekv({kS}, {f1}, 2, 4, 12, 6, false, 0.0);
  REQUIRE(one_layer.size() == 1u);
  CHECK(one_layer[0] == (Kept{Idx{1, 6, 8, 9, 10, 11}, Idx{1, 2, 8, 9, 10, 11}}));
  CHECK(one_layer[0] == kvevict_ref::defensivekv(kS, f1, 2, 4, 12, 6, 0.0, false, 0.0));
}

// ---------------------------------------------------------------------------------------------
// Properties on random inputs (the whole pipeline: window attention -> scores -> selectors).
//   criticalkv: uniform keeps exactly n_kept per head, adaptive Hkv * n_kept in total; corrected mode keeps the
//     most recent min(n_kept, w) window tokens of every head (uniform).
//   mass_forced (corrected): at most max(0, n_kept - w) forced tokens per head.
//   defensivekv (corrected): Hkv * n_kept in total and, for n_kept >= w, the whole window of every head.
//   layer_defensivekv (corrected): NL * Hkv * n_kept in total and every forced and window token kept (n_kept >= w).
TEST_CASE("reference selectors: budget, window and forcing properties on random inputs", "[reference]") {
  std::uint64_t state = 987654321;
  auto next = [&state]() {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(state >> 40) / static_cast<double>(1ULL << 24) - 0.5;
  };
  const int H = 4, Hkv = 2, w = 4, L = 24, d = 4, D = 6, NL = 2;
  for (int trial = 0; trial < 10; ++trial) {
    std::vector<std::vector<double>> sp(NL);
    std::vector<Forced> fl(NL);
    for (std::int64_t n_kept = 1; n_kept <= L; ++n_kept) {
      CAPTURE(trial, n_kept);
      for (int l = 0; l < NL; ++l) {
        CAPTURE(l);
        std::vector<double> q(static_cast<std::size_t>(H * w * d)), k(static_cast<std::size_t>(Hkv * L * d)),
            v(static_cast<std::size_t>(Hkv * L * d)), wo(static_cast<std::size_t>(D * H * d));
        for (double& x : q) x = 3.0 * next();
        for (double& x : k) x = 3.0 * next();
        for (double& x : v) x = next();
        for (double& x : wo) x = next();
        const auto attn = kvevict_ref::window_attention(q, k, H, Hkv, w, L, d);
        const auto s = kvevict_ref::mean_scores(attn, H, Hkv, w, L, 5, Pool::avg);
        const auto n = kvevict_ref::value_norms(v, wo, H, Hkv, L, d, D, 1);
        const Kept cu = kvevict_ref::criticalkv(s, n, Hkv, w, L, n_kept, false, 0.2, 1e-4, 0.5, false);
        const Kept ca = kvevict_ref::criticalkv(s, n, Hkv, w, L, n_kept, true, 0.2, 1e-4, 0.5, true);
        std::size_t total = 0;
        for (int h = 0; h < Hkv; ++h) {
          const Idx& kh = cu[static_cast<std::size_t>(h)];
          REQUIRE(static_cast<std::int64_t>(kh.size()) == n_kept);
          for (std::int64_t j = L - std::min<std::int64_t>(n_kept, w); j < L; ++j) REQUIRE_THAT(kh, VectorContains(j));
          total += ca[static_cast<std::size_t>(h)].size();
        }
        REQUIRE(static_cast<std::int64_t>(total) == Hkv * n_kept);

        const auto m = kvevict_ref::defensive_scores(attn, H, Hkv, w, L, 5, Pool::avg, true);
        sp[static_cast<std::size_t>(l)] = kvevict_ref::defensive_value_scores(m, n, Hkv, w, L, true);
        fl[static_cast<std::size_t>(l)] = kvevict_ref::mass_forced(attn, H, Hkv, w, L, 0.9, n_kept, false, 0.0);
        for (const auto& f : fl[static_cast<std::size_t>(l)])
          REQUIRE(static_cast<std::int64_t>(f.size()) <= std::max<std::int64_t>(0, n_kept - w));
        const Kept dk = kvevict_ref::defensivekv(sp[static_cast<std::size_t>(l)], fl[static_cast<std::size_t>(l)], Hkv,
                                                 w, L, n_kept, 0.0, false, 0.0);
        total = 0;
        for (const auto& kh : dk) {
          total += kh.size();
          if (n_kept >= w)
            for (std::int64_t j = L - w; j < L; ++j) REQUIRE_THAT(kh, VectorContains(j));
        }
        REQUIRE(static_cast<std::int64_t>(total) == Hkv * n_kept);
      }
      const auto lk = kvevict_ref::layer_defensivekv(sp, fl, Hkv, w, L, n_kept, false, 0.0);
      std::size_t total = 0;
      for (int l = 0; l < NL; ++l)
        for (int h = 0; h < Hkv; ++h) {
          CAPTURE(l, h);
          const Idx& kh = lk[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
          total += kh.size();
          if (n_kept < w) continue;
          for (std::int64_t j = L - w; j < L; ++j) REQUIRE_THAT(kh, VectorContains(j));
          for (std::int64_t j : fl[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)])
            REQUIRE_THAT(kh, VectorContains(j));
        }
      REQUIRE(static_cast<std::int64_t>(total) == NL * Hkv * n_kept);
    }
  }
}

}  // namespace

}  // namespace test_reference_selfcheck_selectors
