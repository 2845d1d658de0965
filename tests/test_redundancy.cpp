// The key-redundancy term (R-KV, docs/algorithms.md#redundancy): the worked example's numbers (derived by hand from
// the definition), its effect on a key-only policy, the RKV preset's defaults and the refusals. The float64 layout
// reference (tests/test_layout_reference.cpp) checks it on ragged layers under every sharing, block and reduction.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>
#include <kvevict/kvevict.hpp>

#include "support/matchers.hpp"
#include "support/reference_ragged.hpp"

namespace test_redundancy {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict_test::MessageContains;

namespace {

template <class T>
kvevict::LayerInputs<T> keys_only(const std::vector<T>& k, Index Hkv, Index L, Index d) {
  kvevict::LayerInputs<T> in;
  in.keys = kvevict::kv_heads_major<const T>(k.data(), Hkv, L, d);
  return in;
}

std::vector<Index> kept_rows(const kvevict::Selection& s) { return {s.head(0).begin(), s.head(0).end()}; }

}  // namespace

TEMPLATE_TEST_CASE("redundancy: the worked example of docs/algorithms.md#redundancy", "[redundancy]", float, double) {
  using T = TestType;
  // One KV head, d = 2: three near-copies (1, 0), (1, 0.1), (1, -0.1), then (0, 1.05) and (0, -1).
  const std::vector<T> k = {1, 0, 1, T(0.1), 1, T(-0.1), 0, T(1.05), 0, -1};
  const auto in = keys_only(k, 1, 5, 2);
  kvevict::extend::LayerShape shape;
  shape.kv_heads = 1;
  shape.query_heads = 1;
  shape.group = 1;
  shape.tokens = 5;
  shape.head_dim = 2;
  const auto r = kvevict::extend::key_redundancy<T>(in, shape);
  // m = (0.398015, 0.199007, 0, -0.2, -0.2): rows 1 and 2 spare each other, row 0 spares 2, so of the three copies
  // the newest (2) counts no resemblance and the oldest (0) two.
  const std::vector<double> want = {0.278473946, 0.228221596, 0.187037595, 0.153133431, 0.153133431};
  const double tol = std::is_same_v<T, float> ? 1e-6 : 1e-9;
  for (Index j = 0; j < 5; ++j) CHECK(std::abs(static_cast<double>(r(0, j)) - want[static_cast<std::size_t>(j)]) < tol);

  // K-norm keeps the smallest keys: (1, 0) first. With redundancy 0.5 the scores are 0.5 (-||k||) - 0.5 R:
  // -0.6392, -0.6166, -0.5960, -0.6016 | window, so the newest copy (2), then (0, 1.05), rank first.
  kvevict::KNorm::Params p;
  const kvevict::KNorm knorm(p);
  p.redundancy = 0.5;
  const kvevict::KNorm weighed(p);
  CHECK(kept_rows(knorm.select<T>(in, Budget::tokens(2))) == std::vector<Index>{0, 4});
  CHECK(kept_rows(weighed.select<T>(in, Budget::tokens(2))) == std::vector<Index>{2, 4});
  CHECK(kept_rows(knorm.select<T>(in, Budget::tokens(3))) == std::vector<Index>{0, 2, 4});
  CHECK(kept_rows(weighed.select<T>(in, Budget::tokens(3))) == std::vector<Index>{2, 3, 4});
}

TEST_CASE("redundancy: long heads (several blocks of rows), near-copies and a zero key, as the float64 reference",
          "[redundancy]") {
  std::mt19937_64 rng(2505);
  std::normal_distribution<double> normal;
  for (const Index L : {Index(1), Index(2), Index(255), Index(257), Index(600)}) {
    const Index Hkv = 2, d = 8;
    kvevict_ref::ragged::Layer layer;
    layer.Hkv = Hkv;
    layer.d = static_cast<int>(d);
    std::vector<double> k(static_cast<std::size_t>(Hkv * L * d));
    for (double& x : k) x = normal(rng);
    for (Index j = 3; j < L; j += 7)  // near-copies of earlier keys, and a zero key
      for (Index h = 0; h < Hkv; ++h)
        for (Index c = 0; c < d; ++c) {
          const auto at = [&](Index row) { return static_cast<std::size_t>((h * L + row) * d + c); };
          k[at(j)] = j == 10 ? 0.0 : k[at(j / 2)] + 0.05 * normal(rng);
        }
    for (Index h = 0; h < Hkv; ++h) {
      kvevict_ref::ragged::Head head;
      head.keys.assign(k.begin() + h * L * d, k.begin() + (h + 1) * L * d);
      for (Index j = 0; j < L; ++j) head.pos.push_back(j);
      layer.heads.push_back(head);
    }
    const auto want = kvevict_ref::ragged::key_redundancy(layer);
    const auto in = keys_only(k, Hkv, L, d);
    kvevict::extend::LayerShape shape;
    shape.kv_heads = Hkv;
    shape.query_heads = Hkv;
    shape.group = 1;
    shape.tokens = L;
    shape.head_dim = d;
    const auto got = kvevict::extend::key_redundancy<double>(in, shape);
    double worst = 0.0;
    for (Index h = 0; h < Hkv; ++h)
      for (Index j = 0; j < L; ++j)
        worst = std::max(worst, std::abs(got(h, j) - want[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)]) /
                                    want[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)]);
    INFO("L " << L);
    CHECK(worst < 1e-12);
  }
}

TEST_CASE("redundancy: the RKV preset and its knob in the catalogue", "[redundancy]") {
  const kvevict::RKV rkv;
  CHECK(rkv.params().window == 8);
  CHECK(rkv.params().kernel == 7);
  CHECK(rkv.params().pooling == kvevict::Pooling::max);
  CHECK(rkv.params().redundancy == 0.93);
  CHECK(kvevict::SnapKV{}.params().redundancy == 0.0);
  bool found = false;
  kvevict::catalogue::visit("rkv", [&](const auto& e) {
    found = true;
    const auto knobs = e.knobs();
    CHECK(std::find(knobs.begin(), knobs.end(), "redundancy") != knobs.end());
    kvevict::Knobs off;
    off.redundancy = 0.0;
    CHECK(e.make(off).params().redundancy == 0.0);
  });
  CHECK(found);
  kvevict::catalogue::visit("streamingllm", [&](const auto& e) {
    const auto knobs = e.knobs();
    CHECK(std::find(knobs.begin(), knobs.end(), "redundancy") == knobs.end());
  });
}

TEST_CASE("redundancy: outside 0 to 1 (1 excluded), or on a positional policy, is refused by name",
          "[redundancy][errors]") {
  for (double bad : {1.0, -0.25, 2.0, std::numeric_limits<double>::quiet_NaN()}) {
    kvevict::SnapKV::Params p;
    p.redundancy = bad;
    CHECK_THROWS_MATCHES(kvevict::SnapKV(p), kvevict::invalid_argument,
                         MessageContains("SnapKV::Params") && MessageContains("redundancy must be in [0, 1), got"));
  }
  kvevict::StreamingLLM::Params sp;
  sp.redundancy = 0.5;
  CHECK_THROWS_MATCHES(kvevict::StreamingLLM(sp), kvevict::invalid_argument,
                       MessageContains("a positional policy has no scores to weigh: redundancy must be 0, got 0.5"));
}

}  // namespace test_redundancy
