// Self-check of tests/support/reference.hpp on small hand-worked examples.
// Every expected number below was computed by hand from docs/algorithms.md.
#include "support/reference.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

namespace test_reference_selfcheck {  // this file's scope in unity builds (tests/CMakeLists.txt)

namespace {

using kvevict_ref::Kept;
using kvevict_ref::Pool;
using Idx = std::vector<std::int64_t>;
using Catch::Matchers::VectorContains;

// Matches a vector of want's size whose entries are each within tol of want's (Catch's Approx with its relative
// part off). On a mismatch Catch prints both vectors, at full precision (its default for double is 10 digits).
auto near(const std::vector<double>& want, double tol = 1e-12) {
  Catch::StringMaker<double>::precision = 17;
  return Catch::Matchers::Approx(want).margin(tol).epsilon(0.0);
}

TEST_CASE("reference pool1d: avg counts padding as zeros, max skips it", "[reference]") {
  const std::vector<double> x = {1, 2, 3, 4, 5, 6};
  // avg, kernel 3: padding counts as zeros, divide by 3.
  CHECK_THAT(kvevict_ref::pool1d(x, 3, Pool::avg), near({1.0, 2.0, 3.0, 4.0, 5.0, 11.0 / 3.0}));
  // avg, kernel 5: (1+2+3)/5, (1+2+3+4)/5, 15/5, 20/5, (3+4+5+6)/5, (4+5+6)/5.
  CHECK_THAT(kvevict_ref::pool1d(x, 5, Pool::avg), near({1.2, 2.0, 3.0, 4.0, 3.6, 3.0}));

  const std::vector<double> y = {3, 1, 4, 1, 5, 9};
  CHECK_THAT(kvevict_ref::pool1d(y, 3, Pool::avg), near({4.0 / 3, 8.0 / 3, 2.0, 10.0 / 3, 5.0, 14.0 / 3}));
  CHECK_THAT(kvevict_ref::pool1d(y, 3, Pool::max), near({3, 4, 4, 5, 9, 9}));
  CHECK_THAT(kvevict_ref::pool1d(y, 5, Pool::max), near({4, 4, 5, 9, 9, 9}));
  CHECK_THAT(kvevict_ref::pool1d(y, 1, Pool::avg), near(y));
  CHECK_THAT(kvevict_ref::pool1d(y, 1, Pool::max), near(y));
  // max over in-range neighbours only: padding is not a 0 that could win.
  CHECK_THAT(kvevict_ref::pool1d({-1, -2, -3}, 3, Pool::max), near({-1, -1, -2}));
}

TEST_CASE("reference budgets: n_kept from compression and keep ratios", "[reference]") {
  CHECK(kvevict_ref::n_kept_from_compression_ratio(1000, 0.8) == 199);  // 1000 * 0.19999999999999996
  CHECK(kvevict_ref::n_kept_from_keep_ratio(1000, 0.2) == 200);
  CHECK(kvevict_ref::n_kept_from_compression_ratio(1000, 0.5) == 500);
  CHECK(kvevict_ref::n_kept_from_compression_ratio(37, 0.0) == 37);
  CHECK(kvevict_ref::n_kept_from_keep_ratio(10, 0.25) == 2);  // 2.5 truncated
  CHECK(kvevict_ref::n_kept_from_keep_ratio(10, 1.0) == 10);
}

TEST_CASE("reference window_attention: causal window, GQA and scaling", "[reference]") {
  // GQA: H = 2 query heads share Hkv = 1 KV head; w = 2, L = 3, d = 1 (scale 1).
  // keys 0, 1, 2. Row 0 sits at position 1 (sees keys 0, 1), row 1 at position 2 (sees all).
  {
    const double ln2 = std::log(2.0), ln3 = std::log(3.0);
    const std::vector<double> q = {0.0, 0.0,   // head 0: logits all 0
                                   ln2, ln3};  // head 1: exp(logits) = 1,2 and 1,3,9
    const std::vector<double> k = {0.0, 1.0, 2.0};
    const auto a = kvevict_ref::window_attention(q, k, 2, 1, 2, 3, 1);
    CHECK_THAT(a, near({0.5, 0.5, 0.0,                    // head 0 row 0 (key 2 masked)
                        1.0 / 3, 1.0 / 3, 1.0 / 3,        // head 0 row 1
                        1.0 / 3, 2.0 / 3, 0.0,            // head 1 row 0
                        1.0 / 13, 3.0 / 13, 9.0 / 13}));  // head 1 row 1
  }
  // H = Hkv = 2 (head q uses KV head q), w = 1, L = 2, d = 4 (scale 1/2).
  // q = (1,1,1,1) for both heads; key 1 of KV head 0 is (a,a,a,a) with 4a/2 = ln 3, of KV head 1 with 4a/2 = ln 7.
  {
    const double a0 = std::log(3.0) / 2, a1 = std::log(7.0) / 2;
    const std::vector<double> q = {1, 1, 1, 1, 1, 1, 1, 1};
    const std::vector<double> k = {0, 0, 0, 0, a0, a0, a0, a0,   // KV head 0
                                   0, 0, 0, 0, a1, a1, a1, a1};  // KV head 1
    const auto a = kvevict_ref::window_attention(q, k, 2, 2, 1, 2, 4);
    CHECK_THAT(a, near({0.25, 0.75, 0.125, 0.875}));
  }
}

TEST_CASE("reference mean_scores: group mean and pooling order", "[reference]") {
  // H = 2, w = 2, L = 5, P = 3. Window columns hold 0.9 (must be ignored).
  const std::vector<double> attn = {
      0.2, 0.4, 0.0, 0.9, 0.9,  // head 0 row 0
      0.4, 0.0, 0.2, 0.9, 0.9,  // head 0 row 1   -> s_0 = [0.3, 0.2, 0.1]
      0.0, 0.6, 0.2, 0.9, 0.9,  // head 1 row 0
      0.2, 0.2, 0.0, 0.9, 0.9,  // head 1 row 1   -> s_1 = [0.1, 0.4, 0.1]
  };
  // Hkv = 2: no group mean.
  CHECK_THAT(kvevict_ref::mean_scores(attn, 2, 2, 2, 5, 1, Pool::avg), near({0.3, 0.2, 0.1, 0.1, 0.4, 0.1}));
  // Hkv = 1, kernel 1: group mean [0.2, 0.3, 0.1].
  CHECK_THAT(kvevict_ref::mean_scores(attn, 2, 1, 2, 5, 1, Pool::avg), near({0.2, 0.3, 0.1}));
  // avg k=3: pool(s_0) = [1/6, 0.2, 0.1], pool(s_1) = [1/6, 0.2, 1/6]; mean = [1/6, 0.2, 2/15].
  CHECK_THAT(kvevict_ref::mean_scores(attn, 2, 1, 2, 5, 3, Pool::avg), near({1.0 / 6, 0.2, 2.0 / 15}));
  // max k=3: pool(s_0) = [0.3, 0.3, 0.2], pool(s_1) = [0.4, 0.4, 0.4]; mean = [0.35, 0.35, 0.3]
  // (pooling after the group mean would give [0.3, 0.3, 0.3]: the order matters for max).
  CHECK_THAT(kvevict_ref::mean_scores(attn, 2, 1, 2, 5, 3, Pool::max), near({0.35, 0.35, 0.3}));
}

// 2 KV heads, w = 4, L = 12, P = 8. Layer max 0.9 (head 1, token 3), so the window 8..11 is padded with 0.9.
const std::vector<double> kScores12 = {
    0.10, 0.50, 0.20, 0.05, 0.30, 0.01, 0.02, 0.40,  // head 0
    0.03, 0.70, 0.06, 0.90, 0.65, 0.08, 0.09, 0.60,  // head 1
};

TEST_CASE("reference snapkv on hand-worked scores", "[reference]") {
  // n_kept = 6: window + 2 best prefix. Head 1: token 3 ties the layer max but ranks after the window.
  CHECK(kvevict_ref::snapkv(kScores12, 2, 4, 12, 6) == (Kept{Idx{1, 7, 8, 9, 10, 11}, Idx{1, 3, 8, 9, 10, 11}}));
  CHECK(kvevict_ref::snapkv(kScores12, 2, 4, 12, 5) == (Kept{Idx{1, 8, 9, 10, 11}, Idx{3, 8, 9, 10, 11}}));
  CHECK(kvevict_ref::snapkv(kScores12, 2, 4, 12, 4) == (Kept{Idx{8, 9, 10, 11}, Idx{8, 9, 10, 11}}));
  // n_kept < w: only the most recent n_kept window tokens (head 1's token 3 at 0.9 loses the tie).
  CHECK(kvevict_ref::snapkv(kScores12, 2, 4, 12, 3) == (Kept{Idx{9, 10, 11}, Idx{9, 10, 11}}));
  CHECK(kvevict_ref::snapkv(kScores12, 2, 4, 12, 1) == (Kept{Idx{11}, Idx{11}}));
  // n_kept = L keeps everything.
  const Idx all = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  CHECK(kvevict_ref::snapkv(kScores12, 2, 4, 12, 12) == (Kept{all, all}));

  // Ties go to the more recent token: w = 1, L = 4, P = 3; layer max 0.5 pads token 3.
  const std::vector<double> s = {0.5, 0.1, 0.3,   // head 0
                                 0.2, 0.1, 0.2};  // head 1: tokens 0 and 2 tie at 0.2
  CHECK(kvevict_ref::snapkv(s, 2, 1, 4, 2) == (Kept{Idx{0, 3}, Idx{2, 3}}));
  CHECK(kvevict_ref::snapkv(s, 2, 1, 4, 3) == (Kept{Idx{0, 2, 3}, Idx{0, 2, 3}}));
}

TEST_CASE("reference adakv on hand-worked scores", "[reference]") {
  // n_kept = 6, alpha = 0.2: n_safe = int(1.2) = 1 -> token 11 of each head forced (DBL_MAX).
  // Flat top-12: 2 forced, then the seven 0.9 entries (window 8..10 of both heads, head 1 token 3),
  // then 0.70 (h1,1), 0.65 (h1,4), 0.60 (h1,7). Head 0 gets 4 tokens, head 1 gets 8.
  CHECK(kvevict_ref::adakv(kScores12, 2, 4, 12, 6, 0.2) == (Kept{Idx{8, 9, 10, 11}, Idx{1, 3, 4, 7, 8, 9, 10, 11}}));
  // alpha = 0 (no safeguard) gives the same here.
  CHECK(kvevict_ref::adakv(kScores12, 2, 4, 12, 6, 0.0) == (Kept{Idx{8, 9, 10, 11}, Idx{1, 3, 4, 7, 8, 9, 10, 11}}));
  // alpha = 0.9: n_safe = int(5.4) = 5 -> head 0 forces {8..11, 1}, head 1 forces {8..11, 3};
  // the 2 remaining slots go to 0.70 (h1,1) and 0.65 (h1,4).
  CHECK(kvevict_ref::adakv(kScores12, 2, 4, 12, 6, 0.9) == (Kept{Idx{1, 8, 9, 10, 11}, Idx{1, 3, 4, 8, 9, 10, 11}}));
  // alpha = 1: every head's top n_kept is forced, i.e. uniform SnapKV.
  CHECK(kvevict_ref::adakv(kScores12, 2, 4, 12, 6, 1.0) == kvevict_ref::snapkv(kScores12, 2, 4, 12, 6));
  // n_kept < w: n_safe = int(0.6) = 0; the flat top-6 of the 0.9 ties takes tokens 11, 10, 9 of both heads.
  CHECK(kvevict_ref::adakv(kScores12, 2, 4, 12, 3, 0.2) == (Kept{Idx{9, 10, 11}, Idx{9, 10, 11}}));

  // Tie at the same position across heads goes to the lower KV head: w = 1, L = 4, layer max 0.5.
  // Flat top-4: 0.5 at (h0,3), (h1,3), (h0,0); then 0.3 at token 2 of both heads -> head 0.
  const std::vector<double> s = {0.5, 0.1, 0.3,   // head 0
                                 0.1, 0.2, 0.3};  // head 1
  CHECK(kvevict_ref::adakv(s, 2, 1, 4, 2, 0.0) == (Kept{Idx{0, 2, 3}, Idx{3}}));
}

TEST_CASE("reference adakv_original on hand-worked scores", "[reference]") {
  // n_kept <= w: most recent n_kept tokens per head.
  CHECK(kvevict_ref::adakv_original(kScores12, 2, 4, 12, 4, 0.2) == (Kept{Idx{8, 9, 10, 11}, Idx{8, 9, 10, 11}}));
  CHECK(kvevict_ref::adakv_original(kScores12, 2, 4, 12, 2, 0.2) == (Kept{Idx{10, 11}, Idx{10, 11}}));
  // n_kept = 6, B = 2: flat top-4 prefix = (h1,3) 0.9, (h1,1) 0.7, (h1,4) 0.65, (h1,7) 0.6 -> count = [0, 4].
  // alpha = 0.2: floor(0.4) = 0; b0 - w = round(0) = 0, b1 - w = round(3.2) = 3 (sum 11, not 12).
  CHECK(kvevict_ref::adakv_original(kScores12, 2, 4, 12, 6, 0.2) ==
        (Kept{Idx{8, 9, 10, 11}, Idx{1, 3, 4, 8, 9, 10, 11}}));
  // alpha = 0.5: floor(1.0) = 1; b0 - w = 1 (token 1, 0.5), b1 - w = round(2 + 1) = 3.
  CHECK(kvevict_ref::adakv_original(kScores12, 2, 4, 12, 6, 0.5) ==
        (Kept{Idx{1, 8, 9, 10, 11}, Idx{1, 3, 4, 8, 9, 10, 11}}));
  // n_kept = 5, B = 1: flat top-2 = (h1,3), (h1,1) -> count = [0, 2]. alpha = 0.75: floor(0.75) = 0;
  // b1 - w = round(2 * 0.25) = round(0.5) = 0 (half to even; half-up would keep token 3).
  CHECK(kvevict_ref::adakv_original(kScores12, 2, 4, 12, 5, 0.75) == (Kept{Idx{8, 9, 10, 11}, Idx{8, 9, 10, 11}}));
  // n_kept = 7, B = 3: flat top-6 = the 4 of head 1 above, then (h0,1) 0.5, (h0,7) 0.4 -> count = [2, 4].
  // alpha = 0.75: floor(2.25) = 2; b0 - w = round(0.5 + 2) = 2 (half to even), b1 - w = round(1 + 2) = 3.
  CHECK(kvevict_ref::adakv_original(kScores12, 2, 4, 12, 7, 0.75) ==
        (Kept{Idx{1, 7, 8, 9, 10, 11}, Idx{1, 3, 4, 8, 9, 10, 11}}));
}

TEST_CASE("reference streamingllm: sink and recent tokens", "[reference]") {
  CHECK(kvevict_ref::streamingllm(2, 10, 6, 4) == (Kept{Idx{0, 1, 2, 3, 8, 9}, Idx{0, 1, 2, 3, 8, 9}}));
  CHECK(kvevict_ref::streamingllm(1, 10, 3, 4) == (Kept{Idx{0, 1, 2}}));
  CHECK(kvevict_ref::streamingllm(1, 10, 4, 4) == (Kept{Idx{0, 1, 2, 3}}));
  CHECK(kvevict_ref::streamingllm(1, 10, 5, 4) == (Kept{Idx{0, 1, 2, 3, 9}}));
  CHECK(kvevict_ref::streamingllm(1, 10, 10, 4) == (Kept{Idx{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}}));
  CHECK(kvevict_ref::streamingllm(1, 10, 3, 0) == (Kept{Idx{7, 8, 9}}));
}

TEST_CASE("reference round_half_even", "[reference]") {
  using kvevict_ref::detail::round_half_even;
  CHECK(round_half_even(0.5) == 0.0);
  CHECK(round_half_even(1.5) == 2.0);
  CHECK(round_half_even(2.5) == 2.0);
  CHECK(round_half_even(3.2) == 3.0);
  CHECK(round_half_even(3.7) == 4.0);
  CHECK(round_half_even(4.0) == 4.0);
}

// Property: with n_kept >= w, snapkv keeps the window plus the top (n_kept - w) prefix tokens, and every head
// keeps exactly n_kept; adakv keeps Hkv * n_kept in total with each head at least min(n_safe, L).
TEST_CASE("reference snapkv and adakv: budget and window properties on random scores", "[reference]") {
  std::uint64_t state = 12345;
  auto next = [&state]() {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(state >> 40) / static_cast<double>(1ULL << 24);
  };
  const int Hkv = 3, w = 5, L = 40, P = L - w;
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<double> s(static_cast<std::size_t>(Hkv * P));
    for (double& v : s) v = std::floor(next() * 8.0) / 8.0;  // coarse values: many ties
    for (std::int64_t n_kept = 1; n_kept <= L; ++n_kept) {
      CAPTURE(trial, n_kept);
      const Kept u = kvevict_ref::snapkv(s, Hkv, w, L, n_kept);
      const Kept a = kvevict_ref::adakv(s, Hkv, w, L, n_kept, 0.2);
      std::size_t total = 0;
      for (int h = 0; h < Hkv; ++h) {
        CAPTURE(h);
        const Idx& kh = u[static_cast<std::size_t>(h)];
        REQUIRE(static_cast<std::int64_t>(kh.size()) == n_kept);
        const std::int64_t n_win = n_kept < w ? n_kept : w;
        for (std::int64_t j = L - n_win; j < L; ++j) REQUIRE_THAT(kh, VectorContains(j));
        total += a[static_cast<std::size_t>(h)].size();
        REQUIRE(static_cast<std::int64_t>(a[static_cast<std::size_t>(h)].size()) >=
                static_cast<std::int64_t>(static_cast<double>(n_kept) * 0.2));
      }
      REQUIRE(static_cast<std::int64_t>(total) == Hkv * n_kept);
    }
  }
}

}  // namespace

}  // namespace test_reference_selfcheck
