// Every error path of the public entry points throws kvevict::invalid_argument with a message naming the field and
// the value; NaN / Inf inputs give a "not finite" error, never a crash or a silent selection.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <limits>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"

namespace test_errors {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::HeadsView;
using kvevict::Index;
using kvevict::LayerInputs;
using kvevict::Pooling;
using kvevict_test::Layout;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

template <class P>
P with_window(Index w, Index kernel = 5, Pooling pooling = Pooling::avg) {
  typename P::Params p;
  p.window = w;
  p.kernel = kernel;
  p.pooling = pooling;
  return P(p);
}

kvevict::AdaKV original_adakv(Index w, Index kernel, Pooling pooling) {
  kvevict::AdaKV::Params p;
  p.window = w;
  p.kernel = kernel;
  p.pooling = pooling;
  p.variant = kvevict::HeadAdaptiveAllocation::Variant::original;
  return kvevict::AdaKV(p);
}

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

}  // namespace

TEST_CASE("window >= context length", "[errors]") {
  Rng rng(111);
  const Shape s{4, 2, 40, 32, 16};  // queries for a 40-token window, 32 keys
  std::vector<float> q(sz(s.H * s.w * s.d), 0.5f), k(sz(s.Hkv * s.L * s.d), 0.5f);
  LayerInputs<float> in;
  in.queries = HeadsView<const float>::heads_major(q.data(), s.H, s.w, s.d);
  in.keys = kvevict::kv_heads_major<const float>(k.data(), s.Hkv, s.L, s.d);
  const auto snap = with_window<kvevict::SnapKV>(40);
  REQUIRE_THROWS_MATCHES(
      snap.select(in, Budget::tokens(8)), kvevict::invalid_argument,
      MessageContains("kvevict::SnapKV::select: window (40) must be smaller than the context length (32)"));
  REQUIRE_THROWS_MATCHES(with_window<kvevict::AdaKV>(40).select(in, Budget::tokens(8)), kvevict::invalid_argument,
                         MessageContains("window (40) must be smaller than the context length (32)"));
  // window == L leaves no prefix: also an error.
  in.queries = HeadsView<const float>::heads_major(q.data(), s.H, 32, s.d);
  REQUIRE_THROWS_MATCHES(with_window<kvevict::SnapKV>(32).select(in, Budget::tokens(8)), kvevict::invalid_argument,
                         MessageContains("window (32) must be smaller than the context length (32)"));
  // The default window (32) on a short prompt.
  REQUIRE_THROWS_MATCHES(kvevict::AdaKV().select(in, Budget::tokens(8)), kvevict::invalid_argument,
                         MessageContains("window (32) must be smaller than the context length (32)"));
}

TEST_CASE("window < 1, even or non-positive kernel, alpha out of range: rejected at construction", "[errors]") {
  for (Index w : {0, -3}) {
    kvevict::SnapKV::Params p;
    p.window = w;
    REQUIRE_THROWS_MATCHES(kvevict::SnapKV(p), kvevict::invalid_argument,
                           MessageContains("window must be >= 1, got " + std::to_string(w)));
  }
  for (Index k : {4, 0, -1, 2}) {
    kvevict::AdaKV::Params p;
    p.kernel = k;
    REQUIRE_THROWS_MATCHES(kvevict::AdaKV(p), kvevict::invalid_argument,
                           MessageContains("kernel must be an odd number >= 1, got " + std::to_string(k)));
  }
  for (double a : {-0.1, 1.5}) {
    kvevict::AdaKV::Params p;
    p.alpha = a;
    REQUIRE_THROWS_MATCHES(kvevict::AdaKV(p), kvevict::invalid_argument,
                           MessageContains("kvevict::AdaKV::Params: alpha must be in [0, 1], got"));
  }
  kvevict::AdaKV::Params p;
  p.alpha = kNaN;
  REQUIRE_THROWS_MATCHES(kvevict::AdaKV(p), kvevict::invalid_argument, MessageContains("alpha must be in [0, 1]"));
  p.alpha = 1.5;
  REQUIRE_THROWS_MATCHES(kvevict::AdaKV(p), kvevict::invalid_argument, MessageContains("got 1.5"));
  // Valid edges.
  p.alpha = 0.0;
  CHECK_NOTHROW(kvevict::AdaKV(p));
  p.alpha = 1.0;
  p.kernel = 1;
  p.window = 1;
  CHECK_NOTHROW(kvevict::AdaKV(p));
}

TEST_CASE("shape errors of the layer inputs", "[errors]") {
  Rng rng(112);
  const Shape s{4, 2, 4, 40, 16};
  const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
  const auto st = kvevict_test::store<double>(l, Layout::heads_major, true);
  const auto snap = with_window<kvevict::SnapKV>(4);
  const Budget b = Budget::tokens(10);
  REQUIRE_NOTHROW(snap.select(st.in, b));

  SECTION("H not a multiple of Hkv") {
    LayerInputs<double> in = st.in;
    in.queries = HeadsView<const double>::heads_major(st.q.data(), 3, s.w, s.d);
    REQUIRE_THROWS_MATCHES(snap.select(in, b), kvevict::invalid_argument,
                           MessageContains("queries heads (3) must be a multiple of the KV heads (2)"));
    std::vector<double> attn(sz(3 * s.w * s.L), 0.01);
    LayerInputs<double> ia;
    ia.keys = st.in.keys;
    ia.attention = HeadsView<const double>::heads_major(attn.data(), 3, s.w, s.L);
    REQUIRE_THROWS_MATCHES(snap.select(ia, b), kvevict::invalid_argument,
                           MessageContains("attention heads (3) must be a multiple of the KV heads (2)"));
  }
  SECTION("queries rows != window") {
    LayerInputs<double> in = st.in;
    in.queries = HeadsView<const double>::heads_major(st.q.data(), s.H, 3, s.d);
    REQUIRE_THROWS_MATCHES(snap.select(in, b), kvevict::invalid_argument,
                           MessageContains("queries rows (3) must equal the window (4)"));
    REQUIRE_THROWS_MATCHES(with_window<kvevict::AdaKV>(2).select(st.in, b), kvevict::invalid_argument,
                           MessageContains("queries rows (4) must equal the window (2)"));
  }
  SECTION("attention rows != window") {
    std::vector<double> attn(sz(s.H * 5 * s.L), 0.01);
    LayerInputs<double> ia;
    ia.keys = st.in.keys;
    ia.attention = HeadsView<const double>::heads_major(attn.data(), s.H, 5, s.L);
    REQUIRE_THROWS_MATCHES(snap.select(ia, b), kvevict::invalid_argument,
                           MessageContains("attention rows (5) must equal the window (4)"));
  }
  SECTION("queries head_dim != keys head_dim") {
    LayerInputs<double> in = st.in;
    in.queries = HeadsView<const double>::heads_major(st.q.data(), s.H, s.w, 8);
    REQUIRE_THROWS_MATCHES(snap.select(in, b), kvevict::invalid_argument,
                           MessageContains("queries head_dim (8) must equal the keys head_dim (16)"));
  }
  SECTION("attention columns != L") {
    std::vector<double> attn(sz(s.H * s.w * s.L), 0.01);
    LayerInputs<double> ia;
    ia.keys = st.in.keys;
    ia.attention = HeadsView<const double>::heads_major(attn.data(), s.H, s.w, s.L - 1);
    REQUIRE_THROWS_MATCHES(snap.select(ia, b), kvevict::invalid_argument,
                           MessageContains("attention columns (39) must equal the context length (40)"));
  }
  SECTION("both or neither of queries and attention") {
    std::vector<double> attn(sz(s.H * s.w * s.L), 0.01);
    LayerInputs<double> both = st.in;
    both.attention = HeadsView<const double>::heads_major(attn.data(), s.H, s.w, s.L);
    REQUIRE_THROWS_MATCHES(
        snap.select(both, b), kvevict::invalid_argument,
        MessageContains("exactly one of queries [H, w, head_dim] and attention [H, w, L] must be given, got both"));
    LayerInputs<double> neither;
    neither.keys = st.in.keys;
    REQUIRE_THROWS_MATCHES(
        snap.select(neither, b), kvevict::invalid_argument,
        MessageContains("exactly one of queries [H, w, head_dim] and attention [H, w, L] must be given, got neither"));
  }
  SECTION("values shape mismatch") {
    LayerInputs<double> in = st.in;
    in.values = kvevict::kv_heads_major<const double>(st.v.data(), 1, s.L, s.d);
    REQUIRE_THROWS_MATCHES(snap.select(in, b), kvevict::invalid_argument,
                           MessageContains("values [1, 40, 16] must have the keys' KV heads (2) and tokens (40)"));
    in.values = kvevict::kv_heads_major<const double>(st.v.data(), s.Hkv, s.L - 2, s.d);
    REQUIRE_THROWS_MATCHES(snap.select(in, b), kvevict::invalid_argument,
                           MessageContains("values [2, 38, 16] must have the keys' KV heads (2) and tokens (40)"));
  }
  SECTION("empty keys") {
    LayerInputs<double> in = st.in;
    in.keys = kvevict::KVView<const double>();
    REQUIRE_THROWS_MATCHES(
        snap.select(in, b), kvevict::invalid_argument,
        MessageContains("keys must be a non-empty [kv_heads, tokens, head_dim] view, got [0, 0, 0]"));
    in.keys = kvevict::kv_heads_major<const double>(st.k.data(), s.Hkv, 0, s.d);
    REQUIRE_THROWS_MATCHES(snap.select(in, b), kvevict::invalid_argument, MessageContains("got [2, 0, 16]"));
    const LayerInputs<float> nothing;
    REQUIRE_THROWS_MATCHES(with_window<kvevict::AdaKV>(4).select(nothing, b), kvevict::invalid_argument,
                           MessageContains("keys must be a non-empty"));
  }
  SECTION("a queries view with zero head_dim counts as absent, on every code path") {
    // Validation treats a view with a zero extent as not given; the observation must agree and read the attention.
    const std::vector<double> attn = kvevict_test::library_attention<double, double>(st.in.queries, st.in.keys);
    const LayerInputs<double> ia = kvevict_test::attention_inputs(attn, st.k, s);
    LayerInputs<double> odd = ia;
    odd.queries = HeadsView<const double>(st.q.data(), s.H, s.w, 0, s.w * s.d, s.d);
    for (std::int64_t n : {5, 10, 20})
      CHECK(kvevict_test::kept_of(snap.select<double>(odd, Budget::tokens(n))) ==
            kvevict_test::kept_of(snap.select<double>(ia, Budget::tokens(n))));
  }
}

TEST_CASE("budget errors at the select entry point (all three forms)", "[errors]") {
  Rng rng(113);
  const Shape s{2, 1, 4, 40, 16};
  const auto st = kvevict_test::store<float>(kvevict_test::random_layer(s, rng), Layout::tokens_major);
  const auto snap = with_window<kvevict::SnapKV>(4);
  const auto ada = with_window<kvevict::AdaKV>(4);
  const auto orig = original_adakv(4, 5, Pooling::avg);
  const kvevict::StreamingLLM stream;
  auto all = [&](const Budget& b, const std::string& part) {
    REQUIRE_THROWS_MATCHES(snap.select(st.in, b), kvevict::invalid_argument, MessageContains(part));
    REQUIRE_THROWS_MATCHES(ada.select(st.in, b), kvevict::invalid_argument, MessageContains(part));
    REQUIRE_THROWS_MATCHES(orig.select(st.in, b), kvevict::invalid_argument, MessageContains(part));
    REQUIRE_THROWS_MATCHES(stream.select(st.in, b), kvevict::invalid_argument, MessageContains(part));
  };
  all(Budget::tokens(41), "::select: n_kept must be in [1, 40] (the context length), got 41");
  REQUIRE_THROWS_MATCHES(snap.select(st.in, Budget::tokens(41)), kvevict::invalid_argument,
                         MessageContains("kvevict::SnapKV::select: n_kept must be in [1, 40]"));
  REQUIRE_THROWS_MATCHES(Budget::tokens(0), kvevict::invalid_argument, MessageContains("tokens must be >= 1, got 0"));
  REQUIRE_THROWS_MATCHES(Budget::tokens(-7), kvevict::invalid_argument, MessageContains("tokens must be >= 1, got -7"));
  all(Budget::keep_ratio(0.02), "n_kept must be in [1, 40] (the context length), got 0 from keep ratio 0.02");
  all(Budget::compression_ratio(0.99),
      "n_kept must be in [1, 40] (the context length), got 0 from compression ratio 0.99");
  REQUIRE_THROWS_MATCHES(Budget::keep_ratio(0.0), kvevict::invalid_argument,
                         MessageContains("kvevict::Budget::keep_ratio: keep ratio must be in (0, 1], got 0"));
  REQUIRE_THROWS_MATCHES(Budget::keep_ratio(1.01), kvevict::invalid_argument,
                         MessageContains("keep ratio must be in (0, 1], got 1.01"));
  REQUIRE_THROWS_MATCHES(
      Budget::compression_ratio(-0.5), kvevict::invalid_argument,
      MessageContains("kvevict::Budget::compression_ratio: compression ratio must be in [0, 1), got -0.5"));
  REQUIRE_THROWS_MATCHES(Budget::compression_ratio(1.0), kvevict::invalid_argument,
                         MessageContains("compression ratio must be in [0, 1), got 1"));
  REQUIRE_THROWS_MATCHES(Budget::compression_ratio(kNaN), kvevict::invalid_argument,
                         MessageContains("compression ratio must be in [0, 1), got"));
  CHECK(snap.select(st.in, Budget::tokens(40)).total() == 40);
  CHECK(snap.select(st.in, Budget::tokens(1)).total() == 1);
}

TEST_CASE("negative sinks", "[errors]") {
  kvevict::StreamingLLM::Params p;
  p.sinks = -4;
  REQUIRE_THROWS_MATCHES(kvevict::StreamingLLM(p), kvevict::invalid_argument,
                         MessageContains("sinks must be >= 0, got -4"));
}

TEST_CASE("NaN and Inf in queries or keys give a 'not finite' error (float and double, both layouts)", "[errors]") {
  Rng rng(114);
  const Shape s{4, 2, 4, 30, 16};
  const kvevict_test::Layer clean = kvevict_test::random_layer(s, rng);
  struct Poison {
    bool in_keys;
    std::size_t at;  // flat index into the heads-major tensor
    double value;
    const char* what;
  };
  const std::size_t last_key = clean.k.size() - 1, window_key = sz((1 * s.L + s.L - 2) * s.d + 3);
  const Poison poisons[] = {{false, 0, kNaN, "NaN query"},
                            {false, clean.q.size() - 1, kInf, "+Inf query"},
                            {false, 17, -kInf, "-Inf query"},
                            {true, 5, kNaN, "NaN in a prefix key"},
                            {true, window_key, kNaN, "NaN in a window key"},
                            {true, last_key, kInf, "+Inf in the last key"},
                            {true, sz((0 * s.L + 7) * s.d), -kInf, "-Inf in a prefix key"}};
  for (const Poison& p : poisons)
    for (Layout layout : {Layout::heads_major, Layout::tokens_major})
      for (Pooling pooling : {Pooling::avg, Pooling::max}) {
        INFO(p.what << (layout == Layout::heads_major ? " heads-major " : " tokens-major ")
                    << kvevict::to_string(pooling));
        kvevict_test::Layer l = clean;
        (p.in_keys ? l.k : l.q)[p.at] = p.value;
        const auto sd = kvevict_test::store<double>(l, layout);
        const auto sf = kvevict_test::store<float>(l, layout);
        const auto snap = with_window<kvevict::SnapKV>(s.w, 5, pooling);
        const auto ada = with_window<kvevict::AdaKV>(s.w, 5, pooling);
        const auto orig = original_adakv(s.w, 5, pooling);
        for (std::int64_t n : {1, 10}) {
          const Budget b = Budget::tokens(n);
          REQUIRE_THROWS_MATCHES(snap.select(sf.in, b), kvevict::invalid_argument, MessageContains("not finite"));
          REQUIRE_THROWS_MATCHES(snap.select<double>(sd.in, b), kvevict::invalid_argument,
                                 MessageContains("not finite"));
          REQUIRE_THROWS_MATCHES(ada.select(sf.in, b), kvevict::invalid_argument, MessageContains("not finite"));
          REQUIRE_THROWS_MATCHES(ada.select<double>(sd.in, b), kvevict::invalid_argument,
                                 MessageContains("not finite"));
          REQUIRE_THROWS_MATCHES(orig.select(sf.in, b), kvevict::invalid_argument, MessageContains("not finite"));
          REQUIRE_THROWS_MATCHES(orig.select<double>(sd.in, b), kvevict::invalid_argument,
                                 MessageContains("not finite"));
        }
      }
}

TEST_CASE("an infinite key whose logits are all -Inf is still reported (no silent zero weight)", "[errors]") {
  // One query head, one window row, all query components negative: key 2 = (+Inf, 0, ...) gives logit -Inf,
  // which a plain softmax would turn into a weight of exactly 0.
  const Index d = 4, L = 6, w = 1;
  std::vector<double> q(sz(d), -1.0), k(sz(L * d), 0.25);
  k[sz(2 * d)] = kInf;
  LayerInputs<double> in;
  in.queries = HeadsView<const double>::heads_major(q.data(), 1, w, d);
  in.keys = kvevict::kv_heads_major<const double>(k.data(), 1, L, d);
  for (Pooling pooling : {Pooling::avg, Pooling::max}) {
    REQUIRE_THROWS_MATCHES(with_window<kvevict::SnapKV>(w, 1, pooling).select<double>(in, Budget::tokens(3)),
                           kvevict::invalid_argument, MessageContains("not finite"));
    REQUIRE_THROWS_MATCHES(with_window<kvevict::AdaKV>(w, 5, pooling).select(in, Budget::tokens(3)),
                           kvevict::invalid_argument, MessageContains("not finite"));
  }
}

TEST_CASE("a NaN key or value of a layer with positions is named by its row and its token position", "[errors]") {
  // Two KV heads of 6 rows, head 1 holding 4 entries at positions 10, 20, 30, 40 (a compacted, ragged cache).
  const Index d = 4, L = 6, w = 2;
  std::vector<double> q(sz(2 * w * d), 0.5), k(sz(2 * L * d), 0.25), v(sz(2 * L * d), 1.0), wo(sz(3 * 2 * d), 0.1);
  const std::vector<std::int64_t> lengths = {6, 4};
  const std::vector<std::int64_t> positions = {0, 1, 2, 3, 4, 5, 10, 20, 30, 40, 41, 42};
  LayerInputs<double> in;
  in.queries = HeadsView<const double>::heads_major(q.data(), 2, w, d);
  in.keys = kvevict::kv_heads_major<const double>(k.data(), 2, L, d);
  in.values = kvevict::kv_heads_major<const double>(v.data(), 2, L, d);
  in.w_o = kvevict::output_projection<const double>(wo.data(), 3, 2, d);
  in.lengths = lengths.data();
  in.positions = kvevict::positions_heads_major(positions.data(), 2, L);
  SECTION("keys") {
    k[sz((L + 1) * d + 2)] = std::numeric_limits<double>::quiet_NaN();  // head 1, row 1: position 20
    REQUIRE_THROWS_MATCHES(with_window<kvevict::SnapKV>(w).select(in, Budget::tokens(3)), kvevict::invalid_argument,
                           MessageContains("keys[1, 1, 2] (token position 20) is not finite"));
  }
  SECTION("values") {
    v[sz((L + 2) * d)] = kInf;  // head 1, row 2: position 30
    REQUIRE_THROWS_MATCHES(with_window<kvevict::CriticalKV>(w).select(in, Budget::tokens(3)), kvevict::invalid_argument,
                           MessageContains("values[1, 2, 0] (token position 30) is not finite"));
  }
  SECTION("without positions the row alone") {
    in.positions = {};
    k[sz((L + 1) * d + 2)] = std::numeric_limits<double>::quiet_NaN();
    REQUIRE_THROWS_MATCHES(with_window<kvevict::SnapKV>(w).select(in, Budget::tokens(3)), kvevict::invalid_argument,
                           MessageContains("keys[1, 1, 2] is not finite"));
  }
}

TEST_CASE("NaN and Inf in precomputed attention give a 'not finite' error wherever they are", "[errors]") {
  Rng rng(115);
  const Shape s{4, 2, 4, 30, 16};
  const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
  const auto st = kvevict_test::store<double>(l, Layout::heads_major);
  const std::vector<double> clean = kvevict_test::library_attention<double, double>(st.in.queries, st.in.keys);
  const int P = s.P();
  struct Poison {
    int q, i, j;
    double value;
  };
  // Prefix interior, the last prefix column (where max pooling would hide a NaN behind its finite neighbours),
  // the first prefix column, and window columns.
  const Poison poisons[] = {{0, 0, 10, kNaN},     {1, 3, P - 1, kNaN},   {2, 1, P - 2, -kInf}, {3, 2, 0, kInf},
                            {3, 0, P - 1, -kInf}, {0, 3, s.L - 1, kNaN}, {1, 2, P, kInf}};
  for (const Poison& p : poisons)
    for (Pooling pooling : {Pooling::avg, Pooling::max})
      for (Index kernel : {1, 5, 7}) {
        INFO("head " << p.q << " row " << p.i << " column " << p.j << " value " << p.value << " "
                     << kvevict::to_string(pooling) << " kernel " << kernel);
        std::vector<double> attn = clean;
        attn[sz((p.q * s.w + p.i) * s.L + p.j)] = p.value;
        const auto in = kvevict_test::attention_inputs(attn, st.k, s);
        const std::vector<float> attn_f = kvevict_test::cast_to<float>(attn);
        const std::vector<float> keys_f = kvevict_test::cast_to<float>(st.k);
        const auto in_f = kvevict_test::attention_inputs(attn_f, keys_f, s);
        const auto snap = with_window<kvevict::SnapKV>(s.w, kernel, pooling);
        const auto ada = with_window<kvevict::AdaKV>(s.w, kernel, pooling);
        REQUIRE_THROWS_MATCHES(snap.select<double>(in, Budget::tokens(8)), kvevict::invalid_argument,
                               MessageContains("not finite"));
        REQUIRE_THROWS_MATCHES(ada.select<double>(in, Budget::tokens(8)), kvevict::invalid_argument,
                               MessageContains("not finite"));
        REQUIRE_THROWS_MATCHES(snap.select(in_f, Budget::tokens(8)), kvevict::invalid_argument,
                               MessageContains("not finite"));
        REQUIRE_THROWS_MATCHES(original_adakv(s.w, kernel, pooling).select(in_f, Budget::tokens(8)),
                               kvevict::invalid_argument, MessageContains("not finite"));
      }
}

TEST_CASE("errors are std::invalid_argument too", "[errors]") {
  REQUIRE_THROWS_AS(Budget::keep_ratio(2.0), std::invalid_argument);
  REQUIRE_THROWS_AS(Budget::tokens(0).n_kept(5), std::invalid_argument);
}

}  // namespace test_errors
