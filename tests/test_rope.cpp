// rope/rerotate.hpp: renumbered positions of kept entries and key re-rotation (docs/algorithms.md#layouts, "RoPE
// positions"), checked against an independent float64 RoPE written from the Hugging Face formulas.
//
// Tolerances. For a rotary pair of norm r (rotation preserves it), with eps_T the storage epsilon (float 2^-23,
// half 2^-10, bfloat16 2^-7, double 2^-52), eps_A that of the arithmetic (float, double for double storage) and
// eps_d = 2^-52, one re-rotation from position P by D = P' - P differs from the float64 key at P' by at most
//   r * (2 eps_T + 3 eps_A + eps_d (|P| + |P'| + 5 |D| + 10))
// = reading the stored key (u_T (|x| + |y|) <= 0.71 eps_T r) + cos/sin rounded to A and the two products and the
// sum in A (<= 2 eps_A r) + storing the result (0.5 eps_T r) + the float64 angles: p * inv_i is rounded to
// u_d |p| (inv_i <= 1) in the reference at P and P' and in the library at D, and the reference computes inv_i as
// 1 / theta^(2i/rd) (Hugging Face), the library as theta^(-2i/rd): a few ulps apart, times |D|.
// Float storage: ~6e-7 relative (plus ~1e-10 at positions ~1e5); half ~2e-3; bfloat16 ~1.6e-2; double ~1e-15 at
// small positions, ~1e-10 at ~1e5 (the rounding of the angle p * inv_i itself).
// There and back (D then -D): the angles are exact negatives of each other (fl(-D inv) = -fl(D inv), cos even,
// sin odd), so only the arithmetic counts: r * 2 (2 eps_T + 3 eps_A).
#include <catch2/catch.hpp>

#include <kvevict/rope/rerotate.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "support/matchers.hpp"

namespace test_rope {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::HeadsView;
using kvevict::Index;
using kvevict::Rope;
using kvevict::RopeLayout;
using kvevict::Selection;
using kvevict_test::MessageContains;

namespace {

using Rng = std::mt19937_64;

std::size_t sz(Index v) { return static_cast<std::size_t>(v); }

// ---- independent float64 RoPE (Hugging Face) ----------------------------------------------------------------------

// transformers' rotate_half (GPT-NeoX, Llama): cat(-x2, x1) over the rotary dims.
std::vector<double> rotate_half(const std::vector<double>& x) {
  const std::size_t h = x.size() / 2;
  std::vector<double> out(x.size());
  for (std::size_t i = 0; i < h; ++i) {
    out[i] = -x[i + h];
    out[i + h] = x[i];
  }
  return out;
}

// transformers' rotate_every_two (GPT-J): stack((-x[1::2], x[::2]), -1).flatten(-2).
std::vector<double> rotate_every_two(const std::vector<double>& x) {
  std::vector<double> out(x.size());
  for (std::size_t i = 0; i + 1 < x.size(); i += 2) {
    out[i] = -x[i + 1];
    out[i + 1] = x[i];
  }
  return out;
}

// The key at `position` of the raw (pre-RoPE) key `raw` [d]: x_rot * cos + rotate(x_rot) * sin on the first rd dims
// (inv_freq = 1 / theta^(arange(0, rd, 2) / rd), emb = cat(freqs, freqs) or repeat_interleave(freqs, 2)), the rest
// passed through (partial rotary, GPT-NeoX rotary_pct / Phi partial_rotary_factor).
std::vector<double> apply_rope(const std::vector<double>& raw, std::int64_t position, double theta, Index rotary_dim,
                               RopeLayout layout) {
  const std::size_t d = raw.size(), rd = rotary_dim == 0 ? d : sz(rotary_dim), half = rd / 2;
  std::vector<double> inv_freq(half);
  for (std::size_t i = 0; i < half; ++i)
    inv_freq[i] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(rd));
  std::vector<double> cos_emb(rd), sin_emb(rd);
  for (std::size_t j = 0; j < rd; ++j) {
    const std::size_t i = layout == RopeLayout::half ? j % half : j / 2;
    const double freq = static_cast<double>(position) * inv_freq[i];
    cos_emb[j] = std::cos(freq);
    sin_emb[j] = std::sin(freq);
  }
  const std::vector<double> x_rot(raw.begin(), raw.begin() + static_cast<std::ptrdiff_t>(rd));
  const std::vector<double> turned = layout == RopeLayout::half ? rotate_half(x_rot) : rotate_every_two(x_rot);
  std::vector<double> out = raw;
  for (std::size_t j = 0; j < rd; ++j) out[j] = x_rot[j] * cos_emb[j] + turned[j] * sin_emb[j];
  return out;
}

// ---- storage -------------------------------------------------------------------------------------------------------

template <class T>
T store(double v) {
  if constexpr (std::is_same_v<T, double>)
    return v;
  else
    return T(static_cast<float>(v));
}
template <class T>
double load(T v) {
  return static_cast<double>(static_cast<std::conditional_t<std::is_same_v<T, double>, double, float>>(v));
}
// Machine epsilon 2^-(stored mantissa bits) of storage T. Not Eigen::NumTraits<Eigen::half>::epsilon(): Eigen 3.4.0
// returns 2^-13 there (raw 0x0800) instead of 2^-10.
template <class T>
double eps_of() {
  if constexpr (std::is_same_v<T, Eigen::half>)
    return std::ldexp(1.0, -10);
  else if constexpr (std::is_same_v<T, Eigen::bfloat16>)
    return std::ldexp(1.0, -7);
  else
    return static_cast<double>(std::numeric_limits<T>::epsilon());
}
constexpr double eps_d = std::numeric_limits<double>::epsilon();

// Keys [heads, rows, d] in either KV layout, plus a positions-shaped int64 array laid out the same way.
template <class T>
struct Keys {
  Index heads, rows, d;
  bool tokens_major;
  std::vector<T> buf;

  Keys(Index heads_, Index rows_, Index d_, bool tokens_major_)
      : heads(heads_), rows(rows_), d(d_), tokens_major(tokens_major_), buf(sz(heads_ * rows_ * d_), store<T>(0.0)) {}
  HeadsView<T> view() {
    return tokens_major ? kvevict::kv_tokens_major(buf.data(), rows, heads, d)
                        : kvevict::kv_heads_major(buf.data(), heads, rows, d);
  }
  std::size_t at(Index h, Index r) const { return sz((tokens_major ? r * heads + h : h * rows + r) * d); }
  T* row(Index h, Index r) { return buf.data() + at(h, r); }
  const T* row(Index h, Index r) const { return buf.data() + at(h, r); }
  void set(Index h, Index r, const std::vector<double>& v) {
    for (Index c = 0; c < d; ++c) row(h, r)[c] = store<T>(v[sz(c)]);
  }
  std::vector<double> get(Index h, Index r) const {
    std::vector<double> v(sz(d));
    for (Index c = 0; c < d; ++c) v[sz(c)] = load(row(h, r)[c]);
    return v;
  }
  // Whether row (h, r) holds the same bytes as in `other`.
  bool same_row(const Keys& other, Index h, Index r) const {
    return std::memcmp(row(h, r), other.row(h, r), sz(d) * sizeof(T)) == 0;
  }
};

struct Positions {
  Index heads, rows;
  bool tokens_major;
  std::vector<std::int64_t> buf;
  Positions(Index heads_, Index rows_, bool tokens_major_)
      : heads(heads_), rows(rows_), tokens_major(tokens_major_), buf(sz(heads_ * rows_), 0) {}
  std::int64_t& at(Index h, Index r) { return buf[sz(tokens_major ? r * heads + h : h * rows + r)]; }
  kvevict::PositionsView view() const {
    return tokens_major ? kvevict::positions_tokens_major(buf.data(), rows, heads)
                        : kvevict::positions_heads_major(buf.data(), heads, rows);
  }
};

std::vector<double> normal(Rng& rng, Index n) {
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> v(sz(n));
  for (double& x : v) x = dist(rng);
  return v;
}

// The rotary pair partner of dimension c (c itself beyond rotary_dim).
Index partner(Index c, Index rd, RopeLayout layout) {
  if (c >= rd) return c;
  if (layout == RopeLayout::interleaved) return c ^ 1;
  return c < rd / 2 ? c + rd / 2 : c - rd / 2;
}

// Largest |got - want| / (tol * r_pair) over the row (<= 1 passes); r_pair from `want`, the exact key. Dimensions
// >= rd must equal `stored` exactly (nothing touches them).
double worst_ratio(const std::vector<double>& got, const std::vector<double>& want, const std::vector<double>& stored,
                   Index rd, RopeLayout layout, double tol) {
  double worst = 0.0;
  for (Index c = 0; c < static_cast<Index>(got.size()); ++c) {
    if (c >= rd) {
      if (got[sz(c)] != stored[sz(c)]) return std::numeric_limits<double>::infinity();
      continue;
    }
    const Index p = partner(c, rd, layout);
    const double r = std::hypot(want[sz(c)], want[sz(p)]);
    const double err = std::abs(got[sz(c)] - want[sz(c)]);
    if (r == 0.0) {
      if (err != 0.0) return std::numeric_limits<double>::infinity();
    } else {
      if (std::isnan(err)) return std::numeric_limits<double>::infinity();
      worst = std::max(worst, err / (tol * r));
    }
  }
  return worst;
}

template <class T>
double rerotate_tol(std::int64_t from, std::int64_t to) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const double delta = static_cast<double>(to - from);
  return 2 * eps_of<T>() + 3 * eps_of<A>() +
         eps_d * (std::abs(static_cast<double>(from)) + std::abs(static_cast<double>(to)) + 5 * std::abs(delta) + 10);
}

template <class T>
double round_trip_tol() {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  return 2 * (2 * eps_of<T>() + 3 * eps_of<A>());
}

struct Case {
  Index d, rotary_dim;
  RopeLayout layout;
  double theta;
  bool tokens_major;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool tm : {false, true})
    for (RopeLayout layout : {RopeLayout::half, RopeLayout::interleaved})
      for (double theta : {10000.0, 500000.0}) {
        out.push_back({32, 0, layout, theta, tm});   // full rotary (0: the whole head_dim)
        out.push_back({32, 32, layout, theta, tm});  // full, explicitly
        out.push_back({32, 8, layout, theta, tm});   // partial (rotary_pct 0.25)
        out.push_back({10, 6, layout, theta, tm});   // odd pair count, partial
      }
  return out;
}

std::string describe(const Case& c) {
  return "d=" + std::to_string(c.d) + " rotary_dim=" + std::to_string(c.rotary_dim) +
         (c.layout == RopeLayout::half ? " half" : " interleaved") + " theta=" + std::to_string(c.theta) +
         (c.tokens_major ? " tokens-major" : " heads-major");
}

// Random position deltas along a head: runs of equal deltas (the cos/sin reuse), zeros, +-1, large of both signs.
std::int64_t next_delta(Rng& rng, std::int64_t previous) {
  std::uniform_int_distribution<int> kind(0, 9);
  std::uniform_int_distribution<std::int64_t> large(-120000, 120000);
  switch (kind(rng)) {
    case 0:
    case 1:
    case 2:
      return previous;
    case 3:
      return 0;
    case 4:
      return 1;
    case 5:
      return -1;
    default:
      return large(rng);
  }
}

}  // namespace

TEST_CASE("rope: a hand-worked rotation fixes the direction and the pairing of both layouts", "[rope]") {
  // d = 4, theta = 10000: inv = {1, 0.01}. delta = 1 turns pair 0 by 1 radian, pair 1 by 0.01.
  const double c1 = std::cos(1.0), s1 = std::sin(1.0), c2 = std::cos(0.01), s2 = std::sin(0.01);
  std::vector<double> buf = {1, 2, 3, 4};
  const std::int64_t delta = 1;
  const kvevict::PositionsView one = kvevict::positions_heads_major(&delta, 1, 1);
  SECTION("half: pairs (0, 2) and (1, 3)") {
    kvevict::rerotate(kvevict::kv_heads_major(buf.data(), 1, 1, 4), one, Rope{10000.0, 0, RopeLayout::half});
    CHECK(std::abs(buf[0] - (1 * c1 - 3 * s1)) < 1e-15);
    CHECK(std::abs(buf[2] - (1 * s1 + 3 * c1)) < 1e-15);
    CHECK(std::abs(buf[1] - (2 * c2 - 4 * s2)) < 1e-15);
    CHECK(std::abs(buf[3] - (2 * s2 + 4 * c2)) < 1e-15);
  }
  SECTION("interleaved: pairs (0, 1) and (2, 3)") {
    kvevict::rerotate(kvevict::kv_heads_major(buf.data(), 1, 1, 4), one, Rope{10000.0, 0, RopeLayout::interleaved});
    CHECK(std::abs(buf[0] - (1 * c1 - 2 * s1)) < 1e-15);
    CHECK(std::abs(buf[1] - (1 * s1 + 2 * c1)) < 1e-15);
    CHECK(std::abs(buf[2] - (3 * c2 - 4 * s2)) < 1e-15);
    CHECK(std::abs(buf[3] - (3 * s2 + 4 * c2)) < 1e-15);
  }
  SECTION("partial: rotary_dim 2 turns only (0, 1), at inv_0 = 1, in both layouts") {
    for (RopeLayout layout : {RopeLayout::half, RopeLayout::interleaved}) {
      buf = {1, 2, 3, 4};
      kvevict::rerotate(kvevict::kv_heads_major(buf.data(), 1, 1, 4), one, Rope{10000.0, 2, layout});
      CHECK(std::abs(buf[0] - (1 * c1 - 2 * s1)) < 1e-15);
      CHECK(std::abs(buf[1] - (1 * s1 + 2 * c1)) < 1e-15);
      CHECK(buf[2] == 3);
      CHECK(buf[3] == 4);
    }
  }
  SECTION("the test's apply_rope agrees: rotating the key at 0 by 1 gives the key at 1") {
    for (RopeLayout layout : {RopeLayout::half, RopeLayout::interleaved}) {
      const std::vector<double> raw = {1, 2, 3, 4};
      buf = apply_rope(raw, 0, 10000.0, 0, layout);
      CHECK(buf == raw);
      kvevict::rerotate(kvevict::kv_heads_major(buf.data(), 1, 1, 4), one, Rope{10000.0, 0, layout});
      const std::vector<double> want = apply_rope(raw, 1, 10000.0, 0, layout);
      for (std::size_t c = 0; c < 4; ++c) CHECK(std::abs(buf[c] - want[c]) < 1e-15);
    }
  }
}

TEMPLATE_TEST_CASE("rerotate: keys at P turned by P' - P equal keys at P', layouts, partial rotary, storage types",
                   "[rope]", float, double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  Rng rng(20240611);
  std::uniform_int_distribution<std::int64_t> pos(0, 120000);
  const Index heads = 3, rows = 24;
  double worst = 0.0;
  for (const Case& c : cases()) {
    INFO(describe(c));
    const Index rd = c.rotary_dim == 0 ? c.d : c.rotary_dim;
    const Rope rope{c.theta, c.rotary_dim, c.layout};
    Keys<T> keys(heads, rows, c.d, c.tokens_major);
    Positions deltas(heads, rows, c.tokens_major);
    std::vector<std::vector<double>> raw(sz(heads * rows));
    std::vector<std::int64_t> from(sz(heads * rows)), to(sz(heads * rows));
    for (Index h = 0; h < heads; ++h) {
      std::int64_t delta = 0;
      for (Index r = 0; r < rows; ++r) {
        const std::size_t e = sz(h * rows + r);
        raw[e] = normal(rng, c.d);
        from[e] = pos(rng);
        delta = next_delta(rng, delta);
        to[e] = from[e] + delta;
        deltas.at(h, r) = delta;
        keys.set(h, r, apply_rope(raw[e], from[e], c.theta, c.rotary_dim, c.layout));
      }
    }
    const Keys<T> before = keys;
    kvevict::rerotate(keys.view(), deltas.view(), rope);
    for (Index h = 0; h < heads; ++h)
      for (Index r = 0; r < rows; ++r) {
        const std::size_t e = sz(h * rows + r);
        INFO("head " << h << " row " << r << " from " << from[e] << " to " << to[e]);
        const std::vector<double> got = keys.get(h, r);
        if (from[e] == to[e]) {  // delta 0: not touched at all (bit for bit)
          CHECK(keys.same_row(before, h, r));
          continue;
        }
        const double ratio = worst_ratio(got, apply_rope(raw[e], to[e], c.theta, c.rotary_dim, c.layout),
                                         before.get(h, r), rd, c.layout, rerotate_tol<T>(from[e], to[e]));
        CHECK(ratio <= 1.0);
        worst = std::max(worst, ratio);
      }
  }
  UNSCOPED_INFO("worst error / bound: " << worst);
  CHECK(worst <= 1.0);
}

TEST_CASE("rerotate: double storage at small positions is exact to 1e-12", "[rope]") {
  Rng rng(7);
  std::uniform_int_distribution<std::int64_t> pos(0, 199);
  for (RopeLayout layout : {RopeLayout::half, RopeLayout::interleaved})
    for (Index rd : {Index{0}, Index{16}}) {
      Keys<double> keys(2, 16, 64, false);
      Positions deltas(2, 16, false);
      std::vector<std::vector<double>> want(32);
      for (Index h = 0; h < 2; ++h)
        for (Index r = 0; r < 16; ++r) {
          const std::vector<double> raw = normal(rng, 64);
          const std::int64_t p = pos(rng), q = pos(rng);
          keys.set(h, r, apply_rope(raw, p, 500000.0, rd, layout));
          want[sz(h * 16 + r)] = apply_rope(raw, q, 500000.0, rd, layout);
          deltas.at(h, r) = q - p;
        }
      const Keys<double> before = keys;
      kvevict::rerotate(keys.view(), deltas.view(), Rope{500000.0, rd, layout});
      for (Index h = 0; h < 2; ++h)
        for (Index r = 0; r < 16; ++r)
          CHECK(worst_ratio(keys.get(h, r), want[sz(h * 16 + r)], before.get(h, r), rd == 0 ? 64 : rd, layout, 1e-12) <=
                1.0);
    }
}

TEMPLATE_TEST_CASE("rerotate: by delta then by -delta returns the keys", "[rope]", float, double, Eigen::half,
                   Eigen::bfloat16) {
  using T = TestType;
  Rng rng(99);
  const Index heads = 2, rows = 16;
  double worst = 0.0;
  for (const Case& c : cases()) {
    INFO(describe(c));
    const Index rd = c.rotary_dim == 0 ? c.d : c.rotary_dim;
    const Rope rope{c.theta, c.rotary_dim, c.layout};
    Keys<T> keys(heads, rows, c.d, c.tokens_major);
    Positions there(heads, rows, c.tokens_major), back(heads, rows, c.tokens_major);
    for (Index h = 0; h < heads; ++h) {
      std::int64_t delta = 0;
      for (Index r = 0; r < rows; ++r) {
        keys.set(h, r, normal(rng, c.d));
        delta = next_delta(rng, delta);
        there.at(h, r) = delta;
        back.at(h, r) = -delta;
      }
    }
    Keys<T> original = keys;
    kvevict::rerotate(keys.view(), there.view(), rope);
    kvevict::rerotate(keys.view(), back.view(), rope);
    for (Index h = 0; h < heads; ++h)
      for (Index r = 0; r < rows; ++r) {
        INFO("head " << h << " row " << r << " delta " << there.at(h, r));
        const std::vector<double> want = original.get(h, r);
        const double ratio = worst_ratio(keys.get(h, r), want, want, rd, c.layout, round_trip_tol<T>());
        CHECK(ratio <= 1.0);
        worst = std::max(worst, ratio);
      }
  }
  UNSCOPED_INFO("worst error / bound: " << worst);
  CHECK(worst <= 1.0);
}

TEMPLATE_TEST_CASE("rerotate: lengths rotate each head's first lengths(h) rows and leave the rest untouched", "[rope]",
                   float, Eigen::half) {
  using T = TestType;
  Rng rng(5);
  const Index heads = 3, rows = 9, d = 16;
  const std::vector<std::int64_t> lengths = {9, 0, 4};
  for (bool tokens_major : {false, true})
    for (RopeLayout layout : {RopeLayout::half, RopeLayout::interleaved}) {
      INFO((tokens_major ? "tokens-major" : "heads-major") << (layout == RopeLayout::half ? " half" : " interleaved"));
      Keys<T> keys(heads, rows, d, tokens_major);
      // deltas hold rows for the longest head only (9 here; fewer than the keys' rows is fine, see below), and
      // garbage beyond each head's length, which must not be read.
      Positions deltas(heads, rows, tokens_major);
      std::vector<std::vector<double>> raw(sz(heads * rows));
      for (Index h = 0; h < heads; ++h)
        for (Index r = 0; r < rows; ++r) {
          raw[sz(h * rows + r)] = normal(rng, d);
          keys.set(h, r, apply_rope(raw[sz(h * rows + r)], 1000 + r, 10000.0, 0, layout));
          deltas.at(h, r) = r < lengths[sz(h)] ? -1000 : std::numeric_limits<std::int64_t>::max();
        }
      Keys<T> before = keys;
      kvevict::rerotate(keys.view(), deltas.view(), Rope{10000.0, 0, layout}, lengths.data());
      for (Index h = 0; h < heads; ++h)
        for (Index r = 0; r < rows; ++r) {
          INFO("head " << h << " row " << r);
          if (r >= lengths[sz(h)]) {
            CHECK(keys.same_row(before, h, r));
          } else {
            CHECK(worst_ratio(keys.get(h, r), apply_rope(raw[sz(h * rows + r)], r, 10000.0, 0, layout),
                              before.get(h, r), d, layout, rerotate_tol<T>(1000 + r, r)) <= 1.0);
          }
        }
    }
  SECTION("deltas need only the rows used: max lengths[h]") {
    Keys<T> keys(2, 8, 4, false);
    const std::vector<std::int64_t> short_lengths = {3, 5};
    const std::vector<std::int64_t> five(10, 2);
    CHECK_NOTHROW(kvevict::rerotate(keys.view(), kvevict::positions_heads_major(five.data(), 2, 5), Rope{},
                                    short_lengths.data()));
  }
}

TEMPLATE_TEST_CASE("rerotate_kept: compacted kept keys equal the keys at first + k, both KV layouts, ragged heads",
                   "[rope]", float, double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  Rng rng(31);
  const Index heads = 4, tokens = 20;
  const std::vector<Index> head_lengths = {20, 13, 20, 7};  // ragged layer: head h holds rows [0, L_h)
  std::bernoulli_distribution keep_one(0.45);
  std::uniform_int_distribution<std::int64_t> gap(1, 3000);
  for (const Case& c : cases())
    for (std::int64_t first : {std::int64_t{0}, std::int64_t{4}, std::int64_t{-50}, std::int64_t{90000}}) {
      INFO(describe(c) << " first=" << first);
      const Rope rope{c.theta, c.rotary_dim, c.layout};
      const Index rd = c.rotary_dim == 0 ? c.d : c.rotary_dim;
      // Original positions [Hkv, tokens] heads-major, strictly increasing with gaps (earlier evictions).
      std::vector<std::int64_t> positions(sz(heads * tokens));
      for (Index h = 0; h < heads; ++h) {
        std::int64_t p = gap(rng) - 1;
        for (Index j = 0; j < tokens; ++j) {
          positions[sz(h * tokens + j)] = p;
          p += (j % 5 == 4) ? gap(rng) : 1;  // runs of contiguous positions: equal deltas after renumbering
        }
      }
      kvevict::extend::LayerShape shape;
      shape.kv_heads = heads;
      shape.tokens = tokens;
      shape.lengths = head_lengths;
      shape.positions = kvevict::positions_heads_major(positions.data(), heads, tokens);
      std::vector<std::uint8_t> flags(sz(heads * tokens), 0);
      for (Index h = 0; h < heads; ++h)
        for (Index j = 0; j < head_lengths[sz(h)]; ++j) flags[sz(h * tokens + j)] = (h == 2 || keep_one(rng)) ? 1 : 0;
      for (Index j = 0; j < tokens; ++j) flags[sz(1 * tokens + j)] = 0;  // head 1 keeps nothing
      const Selection sel = Selection::from_flags(flags, shape);

      Keys<T> keys(heads, tokens, c.d, c.tokens_major);
      std::vector<std::vector<double>> raw(sz(heads * tokens));
      for (Index h = 0; h < heads; ++h)
        for (Index j = 0; j < tokens; ++j) {
          raw[sz(h * tokens + j)] = normal(rng, c.d);
          keys.set(h, j,
                   apply_rope(raw[sz(h * tokens + j)], positions[sz(h * tokens + j)], c.theta, c.rotary_dim, c.layout));
        }
      sel.compact(keys.view(), keys.view());
      Keys<T> compacted = keys;

      // The same through rerotate() with position_deltas() laid out per head: bit for bit.
      Keys<T> via_deltas = keys;
      const std::vector<std::int64_t> flat = kvevict::position_deltas(sel, first);
      Positions deltas(heads, std::max<Index>(sel.max_length(), 1), c.tokens_major);
      for (Index h = 0; h < heads; ++h)
        for (Index k = 0; k < sel.length(h); ++k) deltas.at(h, k) = flat[sz(sel.offsets()[sz(h)] + k)];
      const std::vector<std::int64_t> lengths = sel.lengths();
      kvevict::rerotate(via_deltas.view(), deltas.view(), rope, lengths.data());

      kvevict::rerotate_kept(keys.view(), sel, rope, first);
      CHECK(keys.buf == via_deltas.buf);
      for (Index h = 0; h < heads; ++h) {
        const auto kept = sel.head(h);
        for (Index k = 0; k < tokens; ++k) {
          INFO("head " << h << " row " << k);
          if (k >= kept.size()) {  // beyond the kept rows: untouched by rerotate_kept
            CHECK(keys.same_row(compacted, h, k));
            continue;
          }
          const std::size_t e = sz(h * tokens + kept[k]);
          CHECK(sel.head_positions(h)[k] == positions[e]);
          const std::int64_t target = first + k;
          CHECK(worst_ratio(keys.get(h, k), apply_rope(raw[e], target, c.theta, c.rotary_dim, c.layout),
                            compacted.get(h, k), rd, c.layout, rerotate_tol<T>(positions[e], target)) <= 1.0);
        }
      }
    }
}

TEST_CASE("renumbered_positions and position_deltas: a hand-worked example", "[rope]") {
  // 3 KV heads, 5 entries each; head 0 keeps entries {0, 3, 4}, head 1 nothing, head 2 {1, 2, 3}.
  const std::vector<std::uint8_t> flags = {1, 0, 0, 1, 1,  //
                                           0, 0, 0, 0, 0,  //
                                           0, 1, 1, 1, 0};
  const std::vector<std::int64_t> positions = {0,   2,   5,   6,   9,  //
                                               1,   2,   3,   4,   5,  //
                                               100, 101, 102, 107, 108};
  kvevict::extend::LayerShape shape;
  shape.kv_heads = 3;
  shape.tokens = 5;
  shape.positions = kvevict::positions_heads_major(positions.data(), 3, 5);
  const Selection sel = Selection::from_flags(flags, shape);
  REQUIRE(sel.positions() == std::vector<std::int64_t>{0, 6, 9, 101, 102, 107});

  CHECK(kvevict::renumbered_positions(sel) == std::vector<std::int64_t>{0, 1, 2, 0, 1, 2});
  CHECK(kvevict::position_deltas(sel) == std::vector<std::int64_t>{0, -5, -7, -101, -101, -105});
  CHECK(kvevict::renumbered_positions(sel, 4) == std::vector<std::int64_t>{4, 5, 6, 4, 5, 6});
  CHECK(kvevict::position_deltas(sel, 4) == std::vector<std::int64_t>{4, -1, -3, -97, -97, -101});

  SECTION("without positions, entry j is at position j") {
    const Selection plain = Selection::from_flags(flags, 3, 5);
    CHECK(kvevict::renumbered_positions(plain, 10) == std::vector<std::int64_t>{10, 11, 12, 10, 11, 12});
    CHECK(kvevict::position_deltas(plain, 10) == std::vector<std::int64_t>{10, 8, 8, 9, 9, 9});
  }
  SECTION("an empty selection") {
    CHECK(kvevict::renumbered_positions(Selection()).empty());
    CHECK(kvevict::position_deltas(Selection(), 3).empty());
  }
}

TEST_CASE("rerotate and rerotate_kept: errors name the entry point, the field and the value", "[rope]") {
  std::vector<float> buf(3 * 7 * 32, 1.0f);
  const auto keys = kvevict::kv_heads_major(buf.data(), 3, 7, 32);
  const std::vector<std::int64_t> ones(3 * 7, 1);  // every row would turn: a refused call must write nothing
  const auto deltas = kvevict::positions_heads_major(ones.data(), 3, 7);
  const std::vector<float> untouched = buf;
  using kvevict::invalid_argument;

  SECTION("rotary_dim") {
    REQUIRE_THROWS_MATCHES(kvevict::rerotate(keys, deltas, Rope{10000.0, 7}), invalid_argument,
                           MessageContains("kvevict::rerotate: rotary_dim (7) must be even and in [2, head_dim = 32]"));
    REQUIRE_THROWS_MATCHES(kvevict::rerotate(keys, deltas, Rope{10000.0, 34}), invalid_argument,
                           MessageContains("rotary_dim (34) must be even and in [2, head_dim = 32]"));
    REQUIRE_THROWS_MATCHES(kvevict::rerotate(keys, deltas, Rope{10000.0, -2}), invalid_argument,
                           MessageContains("rotary_dim (-2) must be even"));
    std::vector<float> odd(33, 0.0f);
    const std::int64_t d1 = 1;
    REQUIRE_THROWS_MATCHES(
        kvevict::rerotate(kvevict::kv_heads_major(odd.data(), 1, 1, 33), kvevict::positions_heads_major(&d1, 1, 1),
                          Rope{}),
        invalid_argument, MessageContains("rotary_dim (0: the whole head_dim) must be even and in [2, head_dim = 33]"));
  }
  SECTION("theta") {
    for (double theta :
         {0.0, -10000.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
      INFO("theta " << theta);
      REQUIRE_THROWS_MATCHES(kvevict::rerotate(keys, deltas, Rope{theta}), invalid_argument,
                             MessageContains("kvevict::rerotate: theta must be finite and > 0, got "));
    }
    REQUIRE_THROWS_MATCHES(kvevict::rerotate(keys, deltas, Rope{-1.5}), invalid_argument,
                           MessageContains("theta must be finite and > 0, got -1.5"));
  }
  SECTION("deltas shape") {
    REQUIRE_THROWS_MATCHES(kvevict::rerotate(keys, kvevict::positions_heads_major(ones.data(), 2, 7), Rope{}),
                           invalid_argument,
                           MessageContains("kvevict::rerotate: deltas [2, 7, 1] must be [kv_heads = 3, >= 7 rows] "
                                           "(one column)"));
    REQUIRE_THROWS_MATCHES(kvevict::rerotate(keys, kvevict::positions_heads_major(ones.data(), 3, 6), Rope{}),
                           invalid_argument, MessageContains("deltas [3, 6, 1] must be [kv_heads = 3, >= 7 rows]"));
    REQUIRE_THROWS_MATCHES(kvevict::rerotate(keys, kvevict::PositionsView(ones.data(), 3, 7, 2, 7, 2), Rope{}),
                           invalid_argument, MessageContains("deltas [3, 7, 2] must be [kv_heads = 3, >= 7 rows]"));
    const std::vector<std::int64_t> lengths = {2, 5, 1};
    REQUIRE_THROWS_MATCHES(
        kvevict::rerotate(keys, kvevict::positions_heads_major(ones.data(), 3, 4), Rope{}, lengths.data()),
        invalid_argument, MessageContains("deltas [3, 4, 1] must be [kv_heads = 3, >= 5 rows]"));
  }
  SECTION("lengths") {
    std::vector<std::int64_t> lengths = {7, 8, 0};
    REQUIRE_THROWS_MATCHES(kvevict::rerotate(keys, deltas, Rope{}, lengths.data()), invalid_argument,
                           MessageContains("kvevict::rerotate: lengths[1] must be in [0, 7] (the keys' rows), got 8"));
    lengths = {7, 3, -1};
    REQUIRE_THROWS_MATCHES(kvevict::rerotate(keys, deltas, Rope{}, lengths.data()), invalid_argument,
                           MessageContains("lengths[2] must be in [0, 7] (the keys' rows), got -1"));
  }
  SECTION("rerotate_kept: keys against the selection") {
    std::vector<std::uint8_t> flags(3 * 7, 0);
    flags[0] = flags[3] = flags[5] = 1;  // head 0 keeps 3 entries
    flags[7 + 1] = 1;
    const Selection sel = Selection::from_flags(flags, 3, 7);
    REQUIRE_THROWS_MATCHES(
        kvevict::rerotate_kept(kvevict::kv_heads_major(buf.data(), 2, 7, 32), sel, Rope{}), invalid_argument,
        MessageContains("kvevict::rerotate_kept: keys heads (2) must equal the selection's KV heads (3)"));
    REQUIRE_THROWS_MATCHES(
        kvevict::rerotate_kept(kvevict::kv_heads_major(buf.data(), 3, 2, 32), sel, Rope{}), invalid_argument,
        MessageContains("kvevict::rerotate_kept: keys rows (2) must hold the selection's longest head (3 rows)"));
    REQUIRE_THROWS_MATCHES(kvevict::rerotate_kept(keys, sel, Rope{10000.0, 33}), invalid_argument,
                           MessageContains("kvevict::rerotate_kept: rotary_dim (33) must be even and in [2, "
                                           "head_dim = 32]"));
    REQUIRE_THROWS_MATCHES(kvevict::rerotate_kept(keys, sel, Rope{0.0}), invalid_argument,
                           MessageContains("kvevict::rerotate_kept: theta must be finite and > 0, got 0"));
    CHECK(buf == untouched);
    CHECK_NOTHROW(kvevict::rerotate_kept(kvevict::kv_heads_major(buf.data(), 3, 3, 32), sel, Rope{}));
    CHECK(buf != untouched);
    return;
  }
  // Every check runs before the first write: a refused call leaves the keys as they were.
  CHECK(buf == untouched);
}

}  // namespace test_rope
