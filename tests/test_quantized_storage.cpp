// Quantized caches (docs/algorithms.md#quantized): int8 and fp8 (e4m3, e5m2) keys and values with a per-tensor
// scale and optional per-token or per-head-and-token scales. Every code decodes exactly, and every catalogue policy
// selects exactly as on float storage holding the dequantized values float(code) * (tensor * token).
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "support/random_inputs.hpp"

namespace test_quantized_storage {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Rng;

namespace {

/// The OCP formats from their definition, in double (independent of the library's tables).
double e4m3_reference(std::uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 0xF, m = b & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double mag = e == 0 ? std::pow(2.0, -6) * (m / 8.0) : std::pow(2.0, e - 7) * (1.0 + m / 8.0);
  return s ? -mag : mag;
}

/// E5M2 is the upper byte of an IEEE half: decode through Eigen::half.
double e5m2_reference(std::uint8_t b) {
  const std::uint16_t bits = static_cast<std::uint16_t>(b << 8);
  return static_cast<double>(static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits)));
}

template <class T>
T code(int v) {
  if constexpr (std::is_same_v<T, std::int8_t>)
    return static_cast<std::int8_t>(v);
  else
    return T::from_bits(static_cast<std::uint8_t>(v));
}

/// The value of a code as float, by the reference decoders.
template <class T>
float code_value(T c) {
  if constexpr (std::is_same_v<T, std::int8_t>)
    return static_cast<float>(c);
  else if constexpr (std::is_same_v<T, kvevict::float8_e4m3>)
    return static_cast<float>(e4m3_reference(c.bits));
  else
    return static_cast<float>(e5m2_reference(c.bits));
}

/// A random code of moderate magnitude (values within about 2^-3 .. 2^3 of the scale), never NaN or Inf.
template <class T>
T random_code(Rng& rng) {
  std::uniform_int_distribution<int> bit(0, 1), mant(0, 7);
  if constexpr (std::is_same_v<T, std::int8_t>) {
    return static_cast<std::int8_t>(std::uniform_int_distribution<int>(-127, 127)(rng));
  } else if constexpr (std::is_same_v<T, kvevict::float8_e4m3>) {
    const int e = std::uniform_int_distribution<int>(4, 10)(rng);
    return code<T>((bit(rng) << 7) | (e << 3) | mant(rng));
  } else {
    const int e = std::uniform_int_distribution<int>(12, 18)(rng);
    return code<T>((bit(rng) << 7) | (e << 2) | (mant(rng) & 3));
  }
}

enum class TokenScale { none, per_token, per_head, per_head_tokens_major };

/// One layer of a quantized cache (codes heads-major or tokens-major, scales of the given kind) and the same layer
/// on float storage holding the dequantized values; queries and W_o are float in both.
template <class T>
struct QuantizedLayer {
  Index H = 4, Hkv = 2, w = 4, L = 40, d = 8, D = 12;
  bool tokens_major = false;
  TokenScale kind = TokenScale::none;
  float key_tensor = 1, value_tensor = 1;
  std::vector<T> k, v;        // codes, in the cache layout
  std::vector<float> kf, vf;  // dequantized, same layout
  std::vector<float> ks, vs;  // token factors: [L], [Hkv, L] or [L, Hkv]
  std::vector<float> q, w_o;  // [H, w, d], [D, H d]
  kvevict::LayerInputs<T, float, float> quantized;
  kvevict::LayerInputs<float> dequantized;

  Index at(Index h, Index j, Index c) const { return tokens_major ? (j * Hkv + h) * d + c : (h * L + j) * d + c; }
  float token_factor(const std::vector<float>& s, Index h, Index j) const {
    switch (kind) {
      case TokenScale::none:
        return 1.0f;
      case TokenScale::per_token:
        return s[static_cast<std::size_t>(j)];
      case TokenScale::per_head:
        return s[static_cast<std::size_t>(h * L + j)];
      case TokenScale::per_head_tokens_major:
        return s[static_cast<std::size_t>(j * Hkv + h)];
    }
    return 1.0f;
  }
  kvevict::HeadsView<const float> token_view(const std::vector<float>& s) const {
    switch (kind) {
      case TokenScale::none:
        return {};
      case TokenScale::per_token:
        return kvevict::per_token_scales(s.data(), Hkv, L);
      case TokenScale::per_head:
        return kvevict::per_head_token_scales(s.data(), Hkv, L);
      case TokenScale::per_head_tokens_major:
        return kvevict::per_head_token_scales_tokens_major(s.data(), L, Hkv);
    }
    return {};
  }

  void build(Rng& rng) {
    std::uniform_real_distribution<float> factor(0.5f, 1.5f);
    const float base = std::is_same_v<T, std::int8_t> ? 1.0f / 64 : 0.25f;
    key_tensor = base * factor(rng), value_tensor = base * factor(rng);
    const std::size_t n = static_cast<std::size_t>(Hkv * L * d);
    k.resize(n), v.resize(n), kf.resize(n), vf.resize(n);
    const std::size_t n_scales = static_cast<std::size_t>(kind == TokenScale::per_token ? L : Hkv * L);
    ks.resize(n_scales), vs.resize(n_scales);
    for (std::size_t i = 0; i < n_scales; ++i) ks[i] = factor(rng), vs[i] = factor(rng);
    for (Index h = 0; h < Hkv; ++h)
      for (Index j = 0; j < L; ++j) {
        // The documented order: the factor tensor * token is rounded first, then multiplies the code's value.
        const float fk = kind == TokenScale::none ? key_tensor : key_tensor * token_factor(ks, h, j);
        const float fv = kind == TokenScale::none ? value_tensor : value_tensor * token_factor(vs, h, j);
        for (Index c = 0; c < d; ++c) {
          const auto i = static_cast<std::size_t>(at(h, j, c));
          k[i] = random_code<T>(rng), v[i] = random_code<T>(rng);
          kf[i] = code_value(k[i]) * fk, vf[i] = code_value(v[i]) * fv;
        }
      }
    q = kvevict_test::cast_to<float>(kvevict_test::normal_vector(static_cast<std::size_t>(H * w * d), rng, 1.5));
    w_o = kvevict_test::cast_to<float>(kvevict_test::normal_vector(static_cast<std::size_t>(D * H * d), rng, 0.2));
    quantized.queries = kvevict::HeadsView<const float>::heads_major(q.data(), H, w, d);
    dequantized.queries = quantized.queries;
    quantized.w_o = kvevict::output_projection<const float>(w_o.data(), D, H, d);
    dequantized.w_o = quantized.w_o;
    if (tokens_major) {
      quantized.keys = kvevict::kv_tokens_major<const T>(k.data(), L, Hkv, d);
      quantized.values = kvevict::kv_tokens_major<const T>(v.data(), L, Hkv, d);
      dequantized.keys = kvevict::kv_tokens_major<const float>(kf.data(), L, Hkv, d);
      dequantized.values = kvevict::kv_tokens_major<const float>(vf.data(), L, Hkv, d);
    } else {
      quantized.keys = kvevict::kv_heads_major<const T>(k.data(), Hkv, L, d);
      quantized.values = kvevict::kv_heads_major<const T>(v.data(), Hkv, L, d);
      dequantized.keys = kvevict::kv_heads_major<const float>(kf.data(), Hkv, L, d);
      dequantized.values = kvevict::kv_heads_major<const float>(vf.data(), Hkv, L, d);
    }
    quantized.keys_scale = kvevict::KVScale{key_tensor, token_view(ks)};
    quantized.values_scale = kvevict::KVScale{value_tensor, token_view(vs)};
  }
};

template <class Policy>
Policy make_policy(Index window, kvevict::ValueNorm norm = kvevict::ValueNorm::l1) {
  typename Policy::Params p;
  p.window = window;
  if constexpr (std::is_base_of_v<kvevict::CriticalSelector::Params, typename Policy::Params> ||
                std::is_base_of_v<kvevict::DefensiveSelector::Params, typename Policy::Params>)
    p.value_norm = norm;
  return Policy(p);
}

template <class S, class Policy, class T>
void check_policy(const char* name, const Policy& policy, const QuantizedLayer<T>& l, std::int64_t n_kept,
                  const std::string& what) {
  const Budget budget = Budget::tokens(n_kept);
  Selection a, b;
  if constexpr (kvevict::catalogue::Entry<Policy>::layer_global) {
    a = policy.template select<S>(std::vector{l.quantized}, budget)[0];
    b = policy.template select<S>(std::vector{l.dequantized}, budget)[0];
  } else {
    a = policy.template select<S>(l.quantized, budget);
    b = policy.template select<S>(l.dequantized, budget);
  }
  INFO(name << " " << what << " n_kept=" << n_kept);
  CHECK(a.indices() == b.indices());
  CHECK(a.offsets() == b.offsets());
}

/// The readers of the cache are the window attention (every scored policy), the key-only scores and the value term
/// (L1 and L2, weighted as CriticalKV does or normalised across heads as DefensiveKV does); these policies cover each
/// of them, and allocations and layer-global ranking read only scores.
template <class S, class T>
void same_as_dequantized(const QuantizedLayer<T>& l, std::int64_t n_kept, const std::string& what) {
  using kvevict::ValueNorm;
  check_policy<S>("snapkv", make_policy<kvevict::SnapKV>(l.w), l, n_kept, what);
  check_policy<S>("defensivekv-l1", make_policy<kvevict::DefensiveKV>(l.w, ValueNorm::l1), l, n_kept, what);
  // The key-only reader (docs/algorithms.md#key-only).
  check_policy<S>("knorm", make_policy<kvevict::KNorm>(l.w), l, n_kept, what);
  check_policy<S>("keydiff", make_policy<kvevict::KeyDiff>(l.w), l, n_kept, what);
  if constexpr (std::is_same_v<S, float>) {
    check_policy<S>("adakv", make_policy<kvevict::AdaKV>(l.w), l, n_kept, what);
    check_policy<S>("criticalkv-l1", make_policy<kvevict::CriticalKV>(l.w, ValueNorm::l1), l, n_kept, what);
    check_policy<S>("criticalkv-l2", make_policy<kvevict::CriticalKV>(l.w, ValueNorm::l2), l, n_kept, what);
    check_policy<S>("layer-defensivekv-l2", make_policy<kvevict::LayerDefensiveKV>(l.w, ValueNorm::l2), l, n_kept,
                    what);
  }
}

}  // namespace

TEST_CASE("quantized storage: every fp8 code decodes exactly (e4m3 by its definition, e5m2 as a half's top byte)",
          "[views][quantized]") {
  int nan4 = 0, nan5 = 0, inf5 = 0;
  for (int b = 0; b < 256; ++b) {
    const auto u = static_cast<std::uint8_t>(b);
    const float a = static_cast<float>(kvevict::float8_e4m3::from_bits(u));
    const double ra = e4m3_reference(u);
    INFO("code 0x" << std::hex << b);
    if (std::isnan(ra)) {
      ++nan4;
      CHECK(std::isnan(a));
    } else {
      CHECK(static_cast<double>(a) == ra);
      CHECK(std::signbit(a) == ((b & 0x80) != 0));  // -0 included
    }
    const float e = static_cast<float>(kvevict::float8_e5m2::from_bits(u));
    const double re = e5m2_reference(u);
    if (std::isnan(re)) {
      ++nan5;
      CHECK(std::isnan(e));
    } else {
      inf5 += std::isinf(re) ? 1 : 0;
      CHECK(static_cast<double>(e) == re);
      CHECK(std::signbit(e) == ((b & 0x80) != 0));
    }
  }
  CHECK(nan4 == 2);  // S.1111.111 only: e4m3 has no infinities
  CHECK(nan5 == 6);
  CHECK(inf5 == 2);
  // Worked values (OCP FP8 table): e4m3 max 448, min normal 2^-6, min subnormal 2^-9; e5m2 max 57344, 2^-16.
  CHECK(static_cast<float>(kvevict::float8_e4m3::from_bits(0x7E)) == 448.0f);
  CHECK(static_cast<float>(kvevict::float8_e4m3::from_bits(0x38)) == 1.0f);
  CHECK(static_cast<float>(kvevict::float8_e4m3::from_bits(0x08)) == std::ldexp(1.0f, -6));
  CHECK(static_cast<float>(kvevict::float8_e4m3::from_bits(0x01)) == std::ldexp(1.0f, -9));
  CHECK(static_cast<float>(kvevict::float8_e4m3::from_bits(0xC4)) == -3.0f);
  CHECK(static_cast<float>(kvevict::float8_e5m2::from_bits(0x7B)) == 57344.0f);
  CHECK(static_cast<float>(kvevict::float8_e5m2::from_bits(0x3C)) == 1.0f);
  CHECK(static_cast<float>(kvevict::float8_e5m2::from_bits(0x01)) == std::ldexp(1.0f, -16));
}

TEMPLATE_TEST_CASE(
    "quantized storage: int8 and fp8 caches with tensor, per-token and per-head-token scales select exactly as float "
    "storage of the dequantized values, through every reader of the cache, f32 and f64",
    "[views][quantized]", std::int8_t, kvevict::float8_e4m3, kvevict::float8_e5m2) {
  using T = TestType;
  Rng rng(71);
  int c = 0;
  for (TokenScale kind :
       {TokenScale::none, TokenScale::per_token, TokenScale::per_head, TokenScale::per_head_tokens_major}) {
    for (int rep = 0; rep < 3; ++rep, ++c) {
      QuantizedLayer<T> l;
      l.kind = kind;
      l.tokens_major = c % 2 == 1;
      l.H = rep == 2 ? 2 : 4;
      l.L = std::uniform_int_distribution<Index>(12, 60)(rng);
      l.build(rng);
      const std::int64_t n_kept = std::uniform_int_distribution<std::int64_t>(1, l.L)(rng);
      const std::string what = "kind " + std::to_string(static_cast<int>(kind)) + " L=" + std::to_string(l.L) +
                               (l.tokens_major ? " tokens-major" : " heads-major");
      same_as_dequantized<float>(l, n_kept, what);
      same_as_dequantized<double>(l, n_kept, what);
    }
  }
}

TEST_CASE("quantized storage: dequantized across the 256-row blocks keys and values are read in",
          "[views][quantized]") {
  Rng rng(5);
  for (Index L : {255, 256, 257, 513, 700}) {
    QuantizedLayer<kvevict::float8_e4m3> l;
    l.L = L;
    l.kind = TokenScale::per_head;
    l.tokens_major = L % 2 == 1;
    l.build(rng);
    same_as_dequantized<float>(l, L / 10, "L=" + std::to_string(L));
  }
}

TEST_CASE("quantized storage: bad scales and non-finite values are refused by name", "[views][quantized][errors]") {
  Rng rng(9);
  QuantizedLayer<kvevict::float8_e5m2> l;
  l.kind = TokenScale::per_head;
  l.build(rng);
  const kvevict::SnapKV snap([&] {
    kvevict::SnapKV::Params p;
    p.window = l.w;
    return p;
  }());
  kvevict::DefensiveKV defensive([&] {
    kvevict::DefensiveKV::Params p;
    p.window = l.w;
    return p;
  }());
  const Budget budget = Budget::tokens(10);

  SECTION("a scale on float storage") {
    auto in = l.dequantized;
    in.keys_scale.tensor = 0.5f;
    CHECK_THROWS_WITH(snap.select(in, budget), Catch::Contains("keys_scale is for int8 and fp8 caches"));
    in = l.dequantized;
    in.values_scale.token = kvevict::per_token_scales(l.vs.data(), l.Hkv, l.L);
    CHECK_THROWS_WITH(snap.select(in, budget), Catch::Contains("values_scale is for int8 and fp8 caches"));
  }
  SECTION("token scales of the wrong shape") {
    auto in = l.quantized;
    in.keys_scale.token = kvevict::per_head_token_scales(l.ks.data(), l.Hkv, l.L - 1);
    CHECK_THROWS_WITH(snap.select(in, budget), Catch::Contains("keys_scale.token [2, 39, 1] must be [kv_heads, >= "
                                                               "tokens, 1] = [2, >= 40, 1]"));
  }
  SECTION("a tensor scale that is not finite") {
    auto in = l.quantized;
    in.values_scale.tensor = std::nanf("");
    CHECK_THROWS_WITH(snap.select(in, budget), Catch::Contains("values_scale.tensor must be finite"));
  }
  SECTION("a NaN code, and a scale that overflows a value to Inf") {
    auto k = l.k;
    k[static_cast<std::size_t>(l.at(1, 7, 3))] = kvevict::float8_e5m2::from_bits(0x7E);  // NaN
    auto in = l.quantized;
    in.keys = kvevict::kv_heads_major<const kvevict::float8_e5m2>(k.data(), l.Hkv, l.L, l.d);
    CHECK_THROWS_WITH(snap.select(in, budget), Catch::Contains("keys[1, 7, 3] is not finite"));
    auto v = l.v;
    v[static_cast<std::size_t>(l.at(0, 2, 5))] = kvevict::float8_e5m2::from_bits(0x7B);  // 57344
    in = l.quantized;
    in.values = kvevict::kv_heads_major<const kvevict::float8_e5m2>(v.data(), l.Hkv, l.L, l.d);
    in.values_scale.tensor = 1e36f;
    CHECK_THROWS_WITH(defensive.select(in, budget), Catch::Contains("values[0, 2, 5] is not finite"));
  }
  SECTION("the defaults read int8 codes as they are") {
    QuantizedLayer<std::int8_t> i8;
    i8.build(rng);
    auto in = i8.quantized;
    in.keys_scale = {}, in.values_scale = {};
    std::vector<float> kf(i8.k.size()), vf(i8.v.size());
    for (std::size_t i = 0; i < kf.size(); ++i) kf[i] = i8.k[i], vf[i] = i8.v[i];
    auto ref = i8.dequantized;
    ref.keys = kvevict::kv_heads_major<const float>(kf.data(), i8.Hkv, i8.L, i8.d);
    ref.values = kvevict::kv_heads_major<const float>(vf.data(), i8.Hkv, i8.L, i8.d);
    kvevict::CriticalKV critical([&] {
      kvevict::CriticalKV::Params p;
      p.window = i8.w;
      return p;
    }());
    CHECK(critical.select(in, budget).indices() == critical.select(ref, budget).indices());
  }
}

}  // namespace test_quantized_storage
