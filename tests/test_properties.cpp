// Property tests at scale: thousands of seeded random layers per policy, on edge shapes (L = w + 1, n_kept = w,
// n_kept = L, Hkv = 1, H = Hkv, G = 8, d = 1) and adversarial values (all-equal attention, one-hot attention, zero
// values, huge and tiny magnitudes, denormals), in float and double. Every case must give a well-formed Selection
// that keeps its budget contract, the window, everything when n_kept = L, and the same answer twice. Non-finite
// inputs must be refused with kvevict::invalid_argument naming the entry.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/cases.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_properties {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::sz;
using kvevict_test::VLayer;

namespace {

enum class Values { normal, equal_attention, one_hot_attention, zero_values, huge, tiny, denormal };
const char* to_string(Values v) {
  switch (v) {
    case Values::normal:
      return "normal";
    case Values::equal_attention:
      return "equal attention";
    case Values::one_hot_attention:
      return "one-hot attention";
    case Values::zero_values:
      return "zero values";
    case Values::huge:
      return "huge magnitudes";
    case Values::tiny:
      return "tiny magnitudes";
    case Values::denormal:
      return "denormal values";
  }
  return "?";
}

/// Where a policy's budget is exact.
enum class Contract { per_head, per_layer };

/// An edge shape (cycled through by `which`) or a random small one.
Shape edge_shape(int which, Rng& rng) {
  const auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Shape s;
  s.Hkv = 1 << pick(0, 2);
  s.H = s.Hkv * (1 << pick(0, 2));
  s.w = pick(1, 6);
  s.L = s.w + pick(1, 40);
  s.d = pick(1, 8);
  switch (which % 6) {
    case 0:
      s.L = s.w + 1;
      break;  // one prefix token
    case 1:
      s.Hkv = 1;
      s.H = pick(1, 4);
      break;  // a single KV head (MQA)
    case 2:
      s.H = s.Hkv;
      break;  // no grouping (MHA)
    case 3:
      s.Hkv = pick(1, 2);
      s.H = 8 * s.Hkv;
      break;  // G = 8
    case 4:
      s.d = 1;
      break;  // head_dim 1
    default:
      break;  // random
  }
  return s;
}

/// A budget that is an edge case as often as not: w, L, w + 1, 1, or a random one (all <= L).
std::int64_t edge_budget(const Shape& s, Rng& rng) {
  const std::int64_t choices[] = {s.w, s.L, std::min<std::int64_t>(s.w + 1, s.L), 1,
                                  std::uniform_int_distribution<std::int64_t>(1, s.L)(rng)};
  return choices[std::uniform_int_distribution<int>(0, 4)(rng)];
}

VLayer adversarial_layer(const Shape& s, int D, Values kind, Rng& rng) {
  VLayer l = kvevict_test::random_vlayer(s, D, rng);
  const auto scale = [](std::vector<double>& x, double f) {
    for (double& v : x) v *= f;
  };
  switch (kind) {
    case Values::normal:
      break;
    case Values::equal_attention:
      std::fill(l.q.begin(), l.q.end(), 0.0);
      break;  // every logit 0
    case Values::one_hot_attention: {
      // Each query row points hard at one random key of its KV head: softmax ~ one-hot.
      const int G = s.G();
      for (int h = 0; h < s.H; ++h)
        for (int r = 0; r < s.w; ++r) {
          const int j = std::uniform_int_distribution<int>(0, s.L - 1)(rng);
          for (int c = 0; c < s.d; ++c)
            l.q[(sz(h) * sz(s.w) + sz(r)) * sz(s.d) + sz(c)] =
                60.0 * l.k[(sz(h / G) * sz(s.L) + sz(j)) * sz(s.d) + sz(c)];
        }
      break;
    }
    case Values::zero_values:
      std::fill(l.v.begin(), l.v.end(), 0.0);
      break;
    case Values::huge:
      scale(l.k, 1e6), scale(l.q, 1e6), scale(l.v, 1e15), scale(l.w_o, 1e10);
      break;
    case Values::tiny:
      scale(l.k, 1e-25), scale(l.q, 1e-25), scale(l.v, 1e-30), scale(l.w_o, 1e-8);
      break;
    case Values::denormal:
      scale(l.v, 1e-40), scale(l.q, 1e-3);
      break;  // float denormals in the values
  }
  return l;
}

/// Checks one selection; returns what is wrong (empty when sound).
std::string selection_errors(const Selection& sel, const Shape& s, std::int64_t n_kept, Contract contract,
                             bool keeps_window) {
  std::string err = kvevict_test::structure_errors(sel, s.Hkv, s.L);
  if (!err.empty()) return err;
  Index total = 0;
  for (Index h = 0; h < s.Hkv; ++h) {
    total += sel.length(h);
    if (contract == Contract::per_head && sel.length(h) != n_kept)
      return "head " + std::to_string(h) + " keeps " + std::to_string(sel.length(h));
    if (keeps_window && n_kept >= s.w)
      for (Index j = s.L - s.w; j < s.L; ++j)
        if (!sel.kept(h, j)) return "window token " + std::to_string(j) + " of head " + std::to_string(h) + " evicted";
    if (n_kept == s.L && sel.length(h) != s.L) return "n_kept = L but head " + std::to_string(h) + " evicts";
  }
  if (total != s.Hkv * n_kept) return "layer keeps " + std::to_string(total) + " != Hkv * n_kept";
  return {};
}

/// Runs `errors_of()` (what is wrong with one case, empty when sound) and reports a failure or an exception as a
/// test failure naming the case; returns whether the case failed.
template <class F>
bool case_failed(const std::string& where, F&& errors_of) {
  try {
    const std::string err = errors_of();
    if (err.empty()) return false;
    FAIL_CHECK(where << ": " << err);
  } catch (const std::exception& e) {
    FAIL_CHECK(where << ": threw " << e.what());
  }
  return true;
}

/// Runs `cases` random layers through `select` in T; `what` names the policy in failure messages.
template <class T, class Policy>
void check_policy(const char* what, Contract contract, bool keeps_window, int cases, std::uint64_t seed) {
  Rng rng(seed);
  int failures = 0;
  for (int c = 0; c < cases && failures < 5; ++c) {
    const Shape s = edge_shape(c, rng);
    const int D = std::uniform_int_distribution<int>(1, 12)(rng);
    const auto kind = static_cast<Values>(c % 7);
    const VLayer l = adversarial_layer(s, D, kind, rng);
    const std::int64_t n_kept = edge_budget(s, rng);
    const auto layout = c % 2 ? Layout::heads_major : Layout::tokens_major;
    auto stored = kvevict_test::store_v<T>(l, layout);
    typename Policy::Params p;  // the preset's defaults
    p.window = s.w;
    const Policy configured(p);
    const std::string where = std::string(what) + " case " + std::to_string(c) + ": " + kvevict_test::describe(s) +
                              " D=" + std::to_string(D) + " n_kept=" + std::to_string(n_kept) + " " + to_string(kind) +
                              (std::is_same_v<T, float> ? " float" : " double");
    failures += case_failed(where, [&] {
      const Selection a = configured.select(stored.in, Budget::tokens(n_kept));
      const Selection b = configured.select(stored.in, Budget::tokens(n_kept));
      std::string err = selection_errors(a, s, n_kept, contract, keeps_window);
      if (err.empty() && (a.indices() != b.indices() || a.offsets() != b.offsets())) err = "not deterministic";
      return err;
    });
  }
}

template <class T>
void check_layer_global(int cases, std::uint64_t seed) {
  Rng rng(seed);
  int failures = 0;
  for (int c = 0; c < cases && failures < 5; ++c) {
    const Shape s = edge_shape(c, rng);
    const int D = std::uniform_int_distribution<int>(1, 12)(rng);
    const auto kind = static_cast<Values>(c % 7);
    const int n_layers = std::uniform_int_distribution<int>(1, 3)(rng);
    std::vector<kvevict_test::VStored<T>> stored;
    std::vector<kvevict::LayerInputs<T>> inputs;
    for (int i = 0; i < n_layers; ++i) {
      stored.push_back(kvevict_test::store_v<T>(adversarial_layer(s, D, kind, rng), Layout::heads_major));
      inputs.push_back(stored.back().in);
    }
    const std::int64_t n_kept = edge_budget(s, rng);
    kvevict::LayerDefensiveKV::Params p;
    p.window = s.w;
    const kvevict::LayerDefensiveKV policy(p);
    const std::string where = "layer-defensivekv case " + std::to_string(c) + ": " + kvevict_test::describe(s) +
                              " layers=" + std::to_string(n_layers) + " n_kept=" + std::to_string(n_kept) + " " +
                              to_string(kind);
    failures += case_failed(where, [&] {
      const auto a = policy.select(inputs, Budget::tokens(n_kept));
      const auto b = policy.select(inputs, Budget::tokens(n_kept));
      std::string err;
      Index total = 0;
      for (std::size_t i = 0; i < a.size() && err.empty(); ++i) {
        err = kvevict_test::structure_errors(a[i], s.Hkv, s.L);
        if (a[i].indices() != b[i].indices() || a[i].offsets() != b[i].offsets()) err = "not deterministic";
        if (n_kept >= s.w)
          for (Index h = 0; h < s.Hkv && err.empty(); ++h)
            for (Index j = s.L - s.w; j < s.L; ++j)
              if (!a[i].kept(h, j)) err = "window token evicted in layer " + std::to_string(i);
        total += a[i].total();
      }
      if (err.empty() && a.size() != sz(n_layers)) err = "not one selection per layer";
      if (err.empty() && total != n_layers * s.Hkv * n_kept) err = "model keeps " + std::to_string(total);
      return err;
    });
  }
}

constexpr int kCases = kvevict_test::cases(2000);

}  // namespace

TEMPLATE_TEST_CASE("properties: every policy on edge shapes and adversarial values", "[properties]", float, double) {
  using T = TestType;
  check_policy<T, kvevict::SnapKV>("snapkv", Contract::per_head, true, kCases, 101);
  check_policy<T, kvevict::AdaKV>("adakv", Contract::per_layer, true, kCases, 102);
  check_policy<T, kvevict::CriticalKV>("criticalkv", Contract::per_layer, true, kCases, 103);
  check_policy<T, kvevict::CriticalSnapKV>("criticalkv-snapkv", Contract::per_head, true, kCases, 104);
  check_policy<T, kvevict::DefensiveKV>("defensivekv", Contract::per_layer, true, kCases, 105);
  check_policy<T, kvevict::AdaKVDefensive>("adakv-defensive", Contract::per_layer, true, kCases, 106);
  check_policy<T, kvevict::TOVA>("tova", Contract::per_head, true, kCases, 109);
  check_policy<T, kvevict::KNorm>("knorm", Contract::per_head, true, kCases, 110);
  check_policy<T, kvevict::KeyDiff>("keydiff", Contract::per_head, true, kCases, 111);
  check_layer_global<T>(kCases, 107);
}

TEST_CASE("properties: StreamingLLM keeps the sinks and the most recent tokens on every shape", "[properties]") {
  Rng rng(108);
  for (int c = 0; c < kCases; ++c) {
    const Shape s = edge_shape(c, rng);
    const std::int64_t n_kept = edge_budget(s, rng);
    const kvevict::StreamingLLM policy;
    const std::vector<float> keys(static_cast<std::size_t>(s.Hkv * s.L), 0.0f);  // only their shape is read
    kvevict::LayerInputs<float> in;
    in.keys = kvevict::kv_heads_major<const float>(keys.data(), s.Hkv, s.L, 1);
    const Selection sel = policy.select(in, Budget::tokens(n_kept));
    INFO(kvevict_test::describe(s) << " n_kept=" << n_kept);
    REQUIRE(kvevict_test::structure_errors(sel, s.Hkv, s.L).empty());
    const std::int64_t sinks = std::min<std::int64_t>(4, n_kept);
    for (Index h = 0; h < s.Hkv; ++h) {
      REQUIRE(sel.length(h) == n_kept);
      for (Index j = 0; j < sinks; ++j) REQUIRE(sel.kept(h, j));
      for (Index j = s.L - (n_kept - sinks); j < s.L; ++j) REQUIRE(sel.kept(h, j));
    }
  }
}

TEMPLATE_TEST_CASE("properties: NaN or Inf anywhere in the inputs is refused with a message naming the entry",
                   "[properties][errors]", float, double) {
  using T = TestType;
  Rng rng(109);
  const T poisons[] = {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                       -std::numeric_limits<T>::infinity()};
  for (int c = 0; c < 600; ++c) {
    const Shape s = edge_shape(c, rng);
    const VLayer l = adversarial_layer(s, 4, Values::normal, rng);
    auto stored = kvevict_test::store_v<T>(l, Layout::heads_major);
    const int tensor = c % 4;  // q, k, v, w_o
    std::vector<T>& x = tensor == 0 ? stored.q : tensor == 1 ? stored.k : tensor == 2 ? stored.v : stored.w_o;
    x[std::uniform_int_distribution<std::size_t>(0, x.size() - 1)(rng)] = poisons[c % 3];
    const std::int64_t n_kept = std::uniform_int_distribution<std::int64_t>(1, s.L)(rng);
    const char* names[] = {"queries", "keys", "values", "w_o"};
    INFO(kvevict_test::describe(s) << " poisoned " << names[tensor]);
    const auto expect_refusal = [&](auto&& run) {
      try {
        run();
        FAIL("accepted a non-finite " << names[tensor] << " entry");
      } catch (const kvevict::invalid_argument& e) {
        const std::string msg = e.what();
        CHECK(msg.find("not finite") != std::string::npos);
      }
    };
    kvevict::DefensiveKV::Params dp;
    dp.window = s.w;
    expect_refusal([&] { kvevict::DefensiveKV(dp).select(stored.in, Budget::tokens(n_kept)); });
    kvevict::CriticalKV::Params cp;
    cp.window = s.w;
    expect_refusal([&] { kvevict::CriticalKV(cp).select(stored.in, Budget::tokens(n_kept)); });
    kvevict::LayerDefensiveKV::Params lp;
    lp.window = s.w;
    expect_refusal([&] {
      kvevict::LayerDefensiveKV(lp).select(std::vector<kvevict::LayerInputs<T>>{stored.in}, Budget::tokens(n_kept));
    });
    if (tensor <= 1) {  // attention-only policies read queries and keys
      kvevict::SnapKV::Params sp;
      sp.window = s.w;
      expect_refusal([&] { kvevict::SnapKV(sp).select(stored.in, Budget::tokens(n_kept)); });
      kvevict::AdaKV::Params ap;
      ap.window = s.w;
      expect_refusal([&] { kvevict::AdaKV(ap).select(stored.in, Budget::tokens(n_kept)); });
    }
  }
}

TEST_CASE("properties: a value term that overflows float is refused with a message, never a NaN selection",
          "[properties][errors]") {
  Rng rng(110);
  int refused = 0, selected = 0;
  for (int c = 0; c < 200; ++c) {
    const Shape s = edge_shape(c, rng);
    VLayer l = adversarial_layer(s, 6, Values::normal, rng);
    for (double& v : l.v) v *= 1e30;  // finite in float; |v W_o| * attention overflows float
    for (double& v : l.w_o) v *= 1e15;
    const auto stored = kvevict_test::store_v<float>(l, Layout::heads_major);
    const std::int64_t n_kept = edge_budget(s, rng);
    INFO(kvevict_test::describe(s) << " n_kept=" << n_kept);
    const auto run = [&](auto policy) {
      try {
        const Selection sel = policy.select(stored.in, Budget::tokens(n_kept));
        REQUIRE(kvevict_test::structure_errors(sel, s.Hkv, s.L).empty());
        ++selected;
      } catch (const kvevict::invalid_argument& e) {
        const std::string msg = e.what();
        INFO(msg);
        CHECK((msg.find("not finite") != std::string::npos || msg.find("overflow") != std::string::npos));
        ++refused;
      }
    };
    kvevict::CriticalKV::Params cp;
    cp.window = s.w;
    run(kvevict::CriticalKV(cp));
    kvevict::DefensiveKV::Params dp;
    dp.window = s.w;
    run(kvevict::DefensiveKV(dp));
  }
  CHECK(refused + selected == 400);
  WARN("float overflow of the value term: " << refused << " refused, " << selected << " selected");
}

}  // namespace test_properties
