// value/value_norm.hpp: the value term of CriticalKV / DefensiveKV (docs/algorithms.md#value-term), N[h][j] = mean
// over the query heads q of group h of || V[h][j] (W_o^q)^T ||_p, against hand-worked numbers and the float64
// reference; output_projection() and OutputGram; the L2 Gram path ranks and selects exactly as the direct L2
// computation.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_value_norm {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::HeadsView;
using kvevict::Index;
using kvevict::OutputGram;
using kvevict::RowMatrix;
using kvevict::ValueNorm;
using kvevict_test::Kept;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::SelKnobs;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

template <class S, class T>
std::vector<double> library_norms(const kvevict::KVView<const T>& values, const HeadsView<const T>& w_o, Index group,
                                  ValueNorm norm) {
  const OutputGram<S> gram = OutputGram<S>::compute(w_o);
  const RowMatrix<S> n =
      kvevict::extend::value_norms<S>(values, w_o, group, norm, norm == ValueNorm::l2 ? &gram : nullptr);
  std::vector<double> out;
  for (Index r = 0; r < n.rows(); ++r)
    for (Index c = 0; c < n.cols(); ++c) out.push_back(static_cast<double>(n(r, c)));
  return out;
}

// The hand-worked layer: H = 4 query heads, Hkv = 2 (G = 2), head_dim d = 2, hidden D = 2, L = 12 tokens.
// W_o [D = 2, H * d = 8], column block q = W_o^q [2, 2], out[r] = sum_c v[c] W_o^q[r][c]:
//   W_o^0 = [[1, 0], [0, 1]]   -> out = (v0, v1)
//   W_o^1 = [[2, -1], [1, 3]]  -> out = (2 v0 - v1, v0 + 3 v1)
//   W_o^2 = [[1, 1], [0, 0]]   -> out = (v0 + v1, 0)
//   W_o^3 = [[0, 2], [-2, 0]]  -> out = (2 v1, -2 v0)
const std::vector<double> kWo = {1, 0, 2, -1, 1, 1, 0, 2, 0, 1, 1, 3, 0, 0, -2, 0};
// Values [Hkv = 2, L = 12, d = 2].
const std::vector<double> kV = {
    1, 2, -1, 1, 0,  0, 3, 0, 0, -2, 2, 2,  1, -1, -3, 1,  0, 1, 2, -1, 1, 1, -2, -2,  // KV head 0 (query heads 0, 1)
    2, 0, 1,  1, -1, 2, 0, 3, 1, -1, 4, -2, 0, 0,  -1, -1, 3, 1, 0, -1, 2, 2, 1,  -3,  // KV head 1 (query heads 2, 3)
};
// L1, KV head 0: token 0 v = (1, 2): q0 (1, 2) -> 3, q1 (0, 7) -> 7, mean 5; token 1 (-1, 1): q0 2, q1 (-3, 2) 5 ->
// 3.5; token 2 (0, 0) -> 0; token 3 (3, 0): 3 and (6, 3) 9 -> 6; token 7 (-3, 1): 4 and (-7, 0) 7 -> 5.5; ...
// L1, KV head 1: token 0 v = (2, 0): q2 (2, 0) -> 2, q3 (0, -4) -> 4, mean 3; token 2 (-1, 2): q2 (1, 0) 1,
// q3 (4, 2) 6 -> 3.5; token 4 (1, -1): q2 (0, 0) 0, q3 (-2, -2) 4 -> 2; token 9 (0, -1): 1 and 2 -> 1.5; ...
const std::vector<double> kL1 = {5.0, 3.5, 0.0, 6.0, 5.0, 7.0, 3.5, 5.5, 2.5, 4.5, 3.5, 7.0,
                                 3.0, 3.0, 3.5, 4.5, 2.0, 7.0, 0.0, 3.0, 6.0, 1.5, 6.0, 5.0};
// L2: the mean of the group's two Euclidean norms, each sqrt of the sum of squares of the outputs above,
// e.g. KV 0 token 0: (sqrt(1 + 4) + sqrt(0 + 49)) / 2; KV 1 token 5 v = (4, -2): q2 (2, 0), q3 (-4, -8) ->
// (sqrt(4) + sqrt(80)) / 2.
double l2_of(double a, double b) { return (std::sqrt(a) + std::sqrt(b)) / 2.0; }
const std::vector<double> kL2 = {
    l2_of(5, 49), l2_of(2, 13), l2_of(0, 0),  l2_of(9, 45), l2_of(4, 40),  l2_of(8, 68), l2_of(2, 13),  l2_of(10, 49),
    l2_of(1, 10), l2_of(5, 26), l2_of(2, 17), l2_of(8, 68), l2_of(4, 16),  l2_of(4, 8),  l2_of(1, 20),  l2_of(9, 36),
    l2_of(0, 8),  l2_of(4, 80), l2_of(0, 0),  l2_of(4, 8),  l2_of(16, 40), l2_of(1, 4),  l2_of(16, 32), l2_of(4, 40),
};

}  // namespace

TEST_CASE("output_projection views W_o (D x H * d) per query head without copying", "[value_norm]") {
  const auto w = kvevict::output_projection<const double>(kWo.data(), 2, 4, 2);
  CHECK(w.heads() == 4);
  CHECK(w.rows() == 2);
  CHECK(w.cols() == 2);
  CHECK(w.head_stride() == 2);
  CHECK(w.row_stride() == 8);
  CHECK(w.data() == kWo.data());
  // W_o^1 = [[2, -1], [1, 3]], W_o^3 = [[0, 2], [-2, 0]].
  CHECK(w.head(1)(0, 0) == 2);
  CHECK(w.head(1)(0, 1) == -1);
  CHECK(w.head(1)(1, 0) == 1);
  CHECK(w.head(1)(1, 1) == 3);
  CHECK(w.head(3)(0, 1) == 2);
  CHECK(w.head(3)(1, 0) == -2);
  CHECK(w.row(2, 1) == kWo.data() + 8 + 4);
  CHECK(std::string(kvevict::to_string(ValueNorm::l1)) == "l1");
  CHECK(std::string(kvevict::to_string(ValueNorm::l2)) == "l2");
}

TEST_CASE("OutputGram holds W_o^q^T W_o^q per query head", "[value_norm]") {
  const auto w = kvevict::output_projection<const double>(kWo.data(), 2, 4, 2);
  const OutputGram<double> g = OutputGram<double>::compute(w);
  REQUIRE(g.per_head.size() == 4);
  // q0 identity -> I; q1 [[2, -1], [1, 3]] -> [[5, 1], [1, 10]]; q2 [[1, 1], [0, 0]] -> [[1, 1], [1, 1]];
  // q3 [[0, 2], [-2, 0]] -> [[4, 0], [0, 4]].
  const double want[4][4] = {{1, 0, 0, 1}, {5, 1, 1, 10}, {1, 1, 1, 1}, {4, 0, 0, 4}};
  for (int q = 0; q < 4; ++q) {
    REQUIRE(g.per_head[sz(q)].rows() == 2);
    REQUIRE(g.per_head[sz(q)].cols() == 2);
    for (int i = 0; i < 4; ++i) CHECK(g.per_head[sz(q)](i / 2, i % 2) == want[q][i]);
  }
  const OutputGram<float> gf = OutputGram<float>::compute(w);
  CHECK(gf.per_head[1](1, 1) == 10.0f);
}

TEST_CASE("value_norms on a hand-worked 2-KV-head, 12-token layer (L1, L2, GQA group mean)", "[value_norm]") {
  const auto w = kvevict::output_projection<const double>(kWo.data(), 2, 4, 2);
  const auto v = kvevict::kv_heads_major<const double>(kV.data(), 2, 12, 2);
  // The reference agrees with the hand-worked numbers (so the random sweeps below compare against the same thing).
  CHECK(kvevict_test::compare_close(kvevict_ref::value_norms(kV, kWo, 4, 2, 12, 2, 2, 1), kL1, 0, 1e-15) == "");
  CHECK(kvevict_test::compare_close(kvevict_ref::value_norms(kV, kWo, 4, 2, 12, 2, 2, 2), kL2, 1e-15, 1e-15) == "");

  CHECK(kvevict_test::compare_close(library_norms<double>(v, w, 2, ValueNorm::l1), kL1, 0, 0) == "");
  CHECK(kvevict_test::compare_close(library_norms<double>(v, w, 2, ValueNorm::l2), kL2, 1e-15, 1e-15) == "");
  // Tokens-major values: the same numbers.
  const std::vector<double> vt = kvevict_test::to_tokens_major(kV, 2, 12, 2);
  const auto vtm = kvevict::kv_tokens_major<const double>(vt.data(), 12, 2, 2);
  CHECK(kvevict_test::compare_close(library_norms<double>(vtm, w, 2, ValueNorm::l1), kL1, 0, 0) == "");
  CHECK(kvevict_test::compare_close(library_norms<double>(vtm, w, 2, ValueNorm::l2), kL2, 1e-15, 1e-15) == "");
  // Float storage and arithmetic: small integers are exact in float; the L2 square roots to float precision.
  const std::vector<float> vf = kvevict_test::cast_to<float>(kV), wf = kvevict_test::cast_to<float>(kWo);
  const auto vfv = kvevict::kv_heads_major<const float>(vf.data(), 2, 12, 2);
  const auto wfv = kvevict::output_projection<const float>(wf.data(), 2, 4, 2);
  CHECK(kvevict_test::compare_close(library_norms<float>(vfv, wfv, 2, ValueNorm::l1), kL1, 0, 0) == "");
  CHECK(kvevict_test::compare_close(library_norms<float>(vfv, wfv, 2, ValueNorm::l2), kL2, 1e-6, 1e-6) == "");
  // Double arithmetic over float storage: exact for L1.
  CHECK(kvevict_test::compare_close(library_norms<double>(vfv, wfv, 2, ValueNorm::l1), kL1, 0, 0) == "");

  // G = 1 (every query head its own KV head) over the same W_o: N[q][j] is one head's norm, no mean.
  // Values [4, 3, 2]: KV head q's tokens are kV's KV head (q / 2) tokens 0..2.
  std::vector<double> v4;
  for (int q = 0; q < 4; ++q) v4.insert(v4.end(), kV.begin() + (q / 2) * 24, kV.begin() + (q / 2) * 24 + 6);
  const auto v4v = kvevict::kv_heads_major<const double>(v4.data(), 4, 3, 2);
  // q0: (1,2) 3, (-1,1) 2, 0; q1: (0,7) 7, (-3,2) 5, 0; q2: (2,0) 2, (2,0) 2, (1,0) 1; q3: (0,-4) 4, (2,-2) 4, (4,2) 6.
  CHECK(library_norms<double>(v4v, w, 1, ValueNorm::l1) == std::vector<double>{3, 2, 0, 7, 5, 0, 2, 2, 1, 4, 4, 6});
}

TEST_CASE("value_norms over a padded W_o (row pitch > H * d) equal the dense ones", "[value_norm]") {
  Rng rng(401);
  const int H = 4, d = 8, D = 12, pitch = H * d + 5, L = 40, Hkv = 2;
  const std::vector<double> dense = kvevict_test::normal_vector(sz(D * H * d), rng);
  std::vector<double> padded(sz(D * pitch), std::nan(""));  // the padding is never read
  for (int r = 0; r < D; ++r)
    std::copy(dense.begin() + r * H * d, dense.begin() + (r + 1) * H * d, padded.begin() + r * pitch);
  const std::vector<double> v = kvevict_test::normal_vector(sz(Hkv * L * d), rng);
  const auto vv = kvevict::kv_heads_major<const double>(v.data(), Hkv, L, d);
  const auto wd = kvevict::output_projection<const double>(dense.data(), D, H, d);
  const HeadsView<const double> wp(padded.data(), H, D, d, d, pitch);
  for (ValueNorm norm : {ValueNorm::l1, ValueNorm::l2})
    CHECK(library_norms<double>(vv, wp, 2, norm) == library_norms<double>(vv, wd, 2, norm));
}

TEST_CASE("value_norms match the float64 reference on random layers (L1 blocked, L2 through the Gram matrix)",
          "[value_norm]") {
  Rng rng(402);
  // L crosses the L1 block of 128 rows (127, 128, 129, 300, 2000); D differs from d and from H * d.
  const Shape shapes[] = {{1, 1, 4, 2, 16},  {2, 1, 4, 127, 16},  {4, 2, 4, 128, 64}, {8, 2, 32, 129, 16},
                          {8, 8, 4, 70, 16}, {4, 4, 32, 200, 64}, {8, 1, 4, 90, 64},  {2, 1, 4, 2000, 16}};
  const int hidden[] = {3, 16, 24, 24, 8, 12, 40, 8};
  int i = 0;
  for (const Shape& s : shapes) {
    const int D = hidden[i++];
    INFO(kvevict_test::describe(s) << " D=" << D);
    const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, D, rng);
    const auto hm = kvevict_test::store_v<double>(l, Layout::heads_major);
    const auto tm = kvevict_test::store_v<double>(l, Layout::tokens_major);
    for (ValueNorm norm : {ValueNorm::l1, ValueNorm::l2}) {
      INFO("norm " << kvevict::to_string(norm));
      const std::vector<double> want =
          kvevict_ref::value_norms(l.v, l.w_o, s.H, s.Hkv, s.L, s.d, D, norm == ValueNorm::l1 ? 1 : 2);
      // Double: summation order only (the Gram form squares, sums and takes the root: a few ulps more).
      const double rtol = norm == ValueNorm::l1 ? 1e-13 : 1e-11;
      CHECK(kvevict_test::compare_close(library_norms<double>(hm.in.values, hm.in.w_o, s.G(), norm), want, rtol,
                                        1e-300) == "");
      CHECK(kvevict_test::compare_close(library_norms<double>(tm.in.values, tm.in.w_o, s.G(), norm), want, rtol,
                                        1e-300) == "");
      // Float storage, float arithmetic.
      const auto fl = kvevict_test::store_v<float>(l, i % 2 ? Layout::heads_major : Layout::tokens_major);
      CHECK(kvevict_test::compare_close(library_norms<float>(fl.in.values, fl.in.w_o, s.G(), norm), want, 2e-4, 1e-6) ==
            "");
    }
  }
}

TEST_CASE("value_norms: N of a zero value row is 0, and N scales with |c| for V -> c V", "[value_norm]") {
  Rng rng(403);
  const Shape s{4, 2, 4, 30, 16};
  kvevict_test::VLayer l = kvevict_test::random_vlayer(s, 20, rng);
  std::fill(l.v.begin() + 5 * s.d, l.v.begin() + 6 * s.d, 0.0);  // KV head 0, token 5
  const auto a = kvevict_test::store_v<double>(l, Layout::heads_major);
  kvevict_test::VLayer scaled = l;
  for (double& x : scaled.v) x *= -4.0;
  const auto b = kvevict_test::store_v<double>(scaled, Layout::heads_major);
  for (ValueNorm norm : {ValueNorm::l1, ValueNorm::l2}) {
    const std::vector<double> n = library_norms<double>(a.in.values, a.in.w_o, 2, norm);
    CHECK(n[5] == 0.0);
    for (double x : n) CHECK(x >= 0.0);
    std::vector<double> n4 = library_norms<double>(b.in.values, b.in.w_o, 2, norm);
    for (double& x : n4) x /= 4.0;
    CHECK(kvevict_test::compare_close(n4, n, 1e-12, 1e-300) == "");
  }
}

TEST_CASE("the L2 Gram path ranks every head's tokens exactly as the direct L2 computation", "[value_norm]") {
  Rng rng(404);
  for (int t = 0; t < 8; ++t) {
    const Shape s = kvevict_test::random_shape(rng, 400);
    const int D = 8 + 8 * (t % 4);
    INFO(kvevict_test::describe(s) << " D=" << D);
    const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, D, rng);
    const auto st = kvevict_test::store_v<double>(l, Layout::heads_major);
    const std::vector<double> gram = library_norms<double>(st.in.values, st.in.w_o, s.G(), ValueNorm::l2);
    const std::vector<double> direct = kvevict_ref::value_norms(l.v, l.w_o, s.H, s.Hkv, s.L, s.d, D, 2);
    for (int h = 0; h < s.Hkv; ++h) {
      std::vector<int> a(sz(s.L)), b(sz(s.L));
      std::iota(a.begin(), a.end(), 0);
      std::iota(b.begin(), b.end(), 0);
      auto by = [&](const std::vector<double>& n) {
        return [&n, h, L = s.L](int x, int y) {
          const double nx = n[sz(h * L + x)], ny = n[sz(h * L + y)];
          return nx != ny ? nx > ny : x > y;
        };
      };
      std::sort(a.begin(), a.end(), by(gram));
      std::sort(b.begin(), b.end(), by(direct));
      CHECK(a == b);
    }
  }
}

TEST_CASE("the L2 Gram path selects exactly as the reference's direct L2 norms (CriticalKV, DefensiveKV)",
          "[value_norm]") {
  Rng rng(405);
  const Shape shapes[] = {{4, 2, 4, 60, 16}, {8, 2, 32, 70, 64}, {8, 8, 4, 40, 16}, {2, 1, 32, 250, 16}};
  int skipped = 0, cases = 0;
  for (const Shape& s : shapes) {
    const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, 8, rng);
    const std::vector<double> attn = kvevict_test::ref_attention(l);
    const auto st = kvevict_test::store_v<double>(l, Layout::tokens_major);
    SelKnobs k;
    k.norm = ValueNorm::l2;
    const kvevict_test::RefLayer r = kvevict_test::ref_layer(l, attn, k);
    SelKnobs kd = k;
    kd.alpha = 0.0;
    const auto critical = kvevict_test::make_policy<kvevict::CriticalKV>(s, k);
    const auto critical_snap = kvevict_test::make_policy<kvevict::CriticalSnapKV>(s, k);
    const auto defensive = kvevict_test::make_policy<kvevict::DefensiveKV>(s, kd);
    const bool near_tie = kvevict_test::mass_margin(attn, s, k.threshold, false) < 1e-9;
    const std::vector<std::int64_t> budgets = kvevict_test::some_budgets(s, rng, 4);
    for (std::int64_t n : budgets) {
      INFO(kvevict_test::describe(s) << " n_kept=" << n);
      const Budget b = Budget::tokens(n);
      CHECK(kvevict_test::first_difference(kvevict_test::kept_of(critical.select<double>(st.in, b)),
                                           kvevict_test::expect_critical(r, s, n, true, k)) == "");
      CHECK(kvevict_test::first_difference(kvevict_test::kept_of(critical_snap.select<double>(st.in, b)),
                                           kvevict_test::expect_critical(r, s, n, false, k)) == "");
      ++cases;
      if (near_tie) {
        ++skipped;
        continue;
      }
      const kvevict_test::Forced f = kvevict_test::ref_forced(r, s, kd, n, 0.0);
      CHECK(kvevict_test::first_difference(
                kvevict_test::kept_of(defensive.select<double>(st.in, b)),
                kvevict_test::expect_defensive(r, f, s, n, kvevict_test::DefBase::flat, kd, 0.0)) == "");
    }
  }
  CHECK(skipped * 10 <= cases);
}

}  // namespace test_value_norm
