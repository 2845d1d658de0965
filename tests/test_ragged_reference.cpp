// Every policy on ragged layers with original positions (docs/algorithms.md#ragged) against the independent
// float64 reference of tests/support/reference_ragged.hpp, index for index, in every layout and with the capacity
// beyond each head's entries full of NaN.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "support/ragged_inputs.hpp"
#include "support/random_inputs.hpp"
#include "support/reference_ragged.hpp"

namespace test_ragged_reference {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Ragged;
using kvevict_test::Rng;
using kvevict_test::rows_of;
namespace ref = kvevict_ref::ragged;

namespace {

std::string show(const ref::KeptRows& k) {
  std::string out;
  for (const auto& head : k) {
    out += "{";
    for (std::int64_t j : head) out += std::to_string(j) + " ";
    out += "} ";
  }
  return out;
}

template <class P>
P with(typename P::Params p, int w, kvevict::Pooling pool, int kernel) {
  p.window = w;
  p.pooling = pool;
  p.kernel = kernel;
  return P(p);
}

kvevict_ref::Pool ref_pool(kvevict::Pooling p) {
  return p == kvevict::Pooling::avg ? kvevict_ref::Pool::avg : kvevict_ref::Pool::max;
}

#define KVEVICT_CHECK_KEPT(got, want)      \
  do {                                     \
    const ref::KeptRows g_ = rows_of(got); \
    const ref::KeptRows w_ = (want);       \
    INFO("got  " << show(g_));             \
    INFO("want " << show(w_));             \
    CHECK(g_ == w_);                       \
  } while (false)

}  // namespace

TEST_CASE("ragged reference: every per-layer policy, random ragged layers", "[ragged][reference]") {
  Rng rng(801);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int trial = 0; trial < 24; ++trial) {
    const int Hkv = 1 + trial % 4, G = 1 + (trial / 4) % 2, w = 1 + trial % 5, d = 4 + 4 * (trial % 3);
    Ragged r = kvevict_test::random_ragged(rng, Hkv * G, Hkv, w, d, 24 + 3 * trial, 0.25 + 0.03 * trial);
    if (trial % 6 == 5) std::fill(r.q.begin(), r.q.end(), 0.0);  // uniform attention: ties everywhere
    const auto stored = kvevict_test::store<double>(r, kvevict_test::longest(r) + 2, trial % 2 == 1, nan, 100 * trial);
    const std::vector<std::int64_t> lengths = ref::lengths(r);
    Index entries = 0;
    for (std::int64_t l : lengths) entries += l;
    const kvevict::Pooling pool = trial % 3 == 0 ? kvevict::Pooling::max : kvevict::Pooling::avg;
    const int kernel = trial % 3 == 0 ? 7 : (trial % 3 == 1 ? 5 : 3);
    const kvevict_ref::Pool rp = ref_pool(pool);
    std::vector<std::int64_t> budgets = {1, w, entries / Hkv / 2, entries / Hkv};
    budgets.push_back(ref::n_kept_keep_ratio(lengths, 0.3));
    for (const std::int64_t n : budgets) {
      if (n < 1) continue;
      INFO("trial " << trial << " Hkv " << Hkv << " G " << G << " w " << w << " n " << n);
      const Budget b = Budget::tokens(n);
      KVEVICT_CHECK_KEPT(with<kvevict::SnapKV>({}, w, pool, kernel).select<double>(stored.in, b),
                         ref::snapkv(r, n, kernel, rp));
      KVEVICT_CHECK_KEPT(with<kvevict::AdaKV>({}, w, pool, kernel).select<double>(stored.in, b),
                         ref::adakv(r, n, 0.2, kernel, rp));
      {
        kvevict::AdaKV::Params p;
        p.variant = kvevict::HeadAdaptiveAllocation::Variant::original;
        p.alpha = 0.5;
        KVEVICT_CHECK_KEPT(with<kvevict::AdaKV>(p, w, pool, kernel).select<double>(stored.in, b),
                           ref::adakv_original(r, n, 0.5, kernel, rp));
      }
      KVEVICT_CHECK_KEPT(kvevict::StreamingLLM().select(stored.in, b), ref::streamingllm(lengths, n, 4));
      for (const kvevict::ValueNorm norm : {kvevict::ValueNorm::l1, kvevict::ValueNorm::l2}) {
        const int p_norm = norm == kvevict::ValueNorm::l1 ? 1 : 2;
        INFO("value norm " << p_norm);
        ref::CriticalParams cp;
        cp.value_norm = p_norm;
        cp.kernel = kernel;
        cp.pool = rp;
        kvevict::CriticalKV::Params ck;
        ck.value_norm = norm;
        KVEVICT_CHECK_KEPT(with<kvevict::CriticalKV>(ck, w, pool, kernel).select<double>(stored.in, b),
                           ref::criticalkv(r, n, cp));
        cp.adaptive = false;
        kvevict::CriticalSnapKV::Params cs;
        cs.value_norm = norm;
        KVEVICT_CHECK_KEPT(with<kvevict::CriticalSnapKV>(cs, w, pool, kernel).select<double>(stored.in, b),
                           ref::criticalkv(r, n, cp));
        ref::DefensiveParams dp;
        dp.value_norm = p_norm;
        dp.kernel = kernel;
        dp.pool = rp;
        kvevict::DefensiveKV::Params dk;
        dk.value_norm = norm;
        KVEVICT_CHECK_KEPT(with<kvevict::DefensiveKV>(dk, w, pool, kernel).select<double>(stored.in, b),
                           ref::defensivekv(r, n, dp));
      }
      ref::DefensiveParams ablation;
      ablation.value_term = false;
      ablation.mass_forcing = false;
      ablation.alpha = 0.2;
      ablation.kernel = kernel;
      ablation.pool = rp;
      KVEVICT_CHECK_KEPT(with<kvevict::AdaKVDefensive>({}, w, pool, kernel).select<double>(stored.in, b),
                         ref::defensivekv(r, n, ablation));
    }
  }
}

TEST_CASE("ragged reference: Layer-DefensiveKV over ragged layers of different lengths", "[ragged][reference]") {
  Rng rng(802);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int trial = 0; trial < 10; ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + trial % 2, w = 1 + trial % 4, d = 8, NL = 2 + trial % 3;
    std::vector<Ragged> layers;
    std::vector<kvevict_test::RaggedStored<double>> stored;
    for (int l = 0; l < NL; ++l) {
      layers.push_back(kvevict_test::random_ragged(rng, Hkv * G, Hkv, w, d, 20 + 6 * l, 0.3 + 0.1 * l));
      stored.push_back(kvevict_test::store<double>(layers.back(), kvevict_test::longest(layers.back()) + 1,
                                                   (trial + l) % 2 == 0, nan, 7 * l));
    }
    std::vector<kvevict::LayerInputs<double>> inputs;
    for (const auto& s : stored) inputs.push_back(s.in);
    Index smallest = std::numeric_limits<Index>::max();
    for (const Ragged& r : layers) {
      Index e = 0;
      for (std::int64_t l : ref::lengths(r)) e += l;
      smallest = std::min(smallest, e / Hkv);
    }
    for (const std::int64_t n : {std::int64_t{1}, std::int64_t{w}, static_cast<std::int64_t>(smallest)}) {
      for (const kvevict::ValueNorm norm : {kvevict::ValueNorm::l1, kvevict::ValueNorm::l2}) {
        INFO("trial " << trial << " n " << n << " norm " << kvevict::to_string(norm));
        kvevict::LayerDefensiveKV::Params p;
        p.window = w;
        p.value_norm = norm;
        const std::vector<Selection> got = kvevict::LayerDefensiveKV(p).select<double>(inputs, Budget::tokens(n));
        ref::DefensiveParams dp;
        dp.value_norm = norm == kvevict::ValueNorm::l1 ? 1 : 2;
        const std::vector<ref::KeptRows> want =
            ref::layer_defensivekv(layers, std::vector<std::int64_t>(static_cast<std::size_t>(NL), n), dp);
        REQUIRE(got.size() == want.size());
        for (std::size_t l = 0; l < got.size(); ++l) KVEVICT_CHECK_KEPT(got[l], want[l]);
      }
    }
  }
}

}  // namespace test_ragged_reference
