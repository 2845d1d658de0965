// Self-check of tests/support/reference_ragged.hpp (ragged layers with original positions, docs/algorithms.md#ragged):
//   1. a ragged layer whose heads all hold L entries at positions 0 .. L-1 (or at any positions given by one
//      strictly increasing map shared by all heads) selects exactly what the dense reference selects
//      (tests/support/reference.hpp), on seeded random layers, including tie-heavy ones;
//   2. position invariance: offsets and gaps do not change a single head's kept rows, nor (applied to every head
//      alike) a multi-head layer's; a cross-head tie is decided by position, not by row (hand-worked);
//   3. hand-worked ragged examples of every cross-head rule: the AdaKV flat top-k and the original AdaKV counts
//      over heads of 5 and 8 entries, the DefensiveKV normalisation by position, the uniform allocation with a
//      head shorter than n_kept, StreamingLLM, CriticalKV, the layer-wide window bias and the layer-global step.
// Every expected number below is derived in the comments from docs/algorithms.md.
#include "support/reference_ragged.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/reference.hpp"

namespace test_reference_selfcheck_ragged {  // this file's scope in unity builds (tests/CMakeLists.txt)

namespace {

namespace rg = kvevict_ref::ragged;
using kvevict_ref::Kept;
using kvevict_ref::Pool;
using rg::KeptRows;
using rg::Positions;
using rg::Ragged;
using PosMap = std::function<std::int64_t(std::int64_t)>;

std::size_t sz(int v) { return static_cast<std::size_t>(v); }

auto near(const std::vector<double>& want, double tol = 1e-15) {
  Catch::StringMaker<double>::precision = 17;
  return Catch::Matchers::Approx(want).margin(tol).epsilon(0.0);
}

// Uniform double in [lo, hi) from the raw 32-bit output (portable, unlike std::uniform_real_distribution).
double uniform(std::mt19937& rng, double lo, double hi) {
  return lo + (hi - lo) * (static_cast<double>(rng()) / 4294967296.0);
}

// An integer in [lo, hi].
int integer(std::mt19937& rng, int lo, int hi) {
  return lo + static_cast<int>(rng() % static_cast<std::uint32_t>(hi - lo + 1));
}

// ---------------------------------------------------------------------------------------------
// A dense layer (the inputs of reference.hpp): q [H][w][d], k and v [Hkv][L][d], w_o [D][H*d].
struct Dense {
  int H, Hkv, w, L, d, D;
  std::vector<double> q, k, v, w_o;
};

std::string describe(const Dense& x) {
  std::ostringstream o;
  o << "H=" << x.H << " Hkv=" << x.Hkv << " w=" << x.w << " L=" << x.L << " d=" << x.d << " D=" << x.D;
  return o.str();
}

// Random entries; `ties`: small integers (and zero queries for query head 0), so that attention rows, scores and
// value norms tie exactly, within and across heads, and the tie-breaking is exercised.
Dense random_dense(std::mt19937& rng, int H, int Hkv, int w, int L, int d, int D, bool ties) {
  Dense x{H, Hkv, w, L, d, D, {}, {}, {}, {}};
  auto fill = [&](std::vector<double>& t, std::size_t n, double scale) {
    t.resize(n);
    for (double& e : t) e = ties ? static_cast<double>(integer(rng, -1, 1)) : uniform(rng, -scale, scale);
  };
  fill(x.q, sz(H) * sz(w) * sz(d), 2.0);
  fill(x.k, sz(Hkv) * sz(L) * sz(d), 1.5);
  fill(x.v, sz(Hkv) * sz(L) * sz(d), 1.0);
  fill(x.w_o, sz(D) * sz(H) * sz(d), 1.0);
  if (ties)
    for (std::size_t i = 0; i < sz(w) * sz(d); ++i) x.q[i] = 0.0;  // query head 0: uniform causal rows
  return x;
}

// The same layer as a ragged one: every head holds L entries at positions f(0) .. f(L-1).
rg::Layer to_ragged(const Dense& x, const PosMap& f) {
  rg::Layer l;
  l.H = x.H;
  l.Hkv = x.Hkv;
  l.w = x.w;
  l.d = x.d;
  l.D = x.D;
  l.q = x.q;
  l.w_o = x.w_o;
  const std::size_t block = sz(x.L) * sz(x.d);
  for (int h = 0; h < x.Hkv; ++h) {
    rg::Head head;
    const auto k0 = x.k.begin() + static_cast<std::ptrdiff_t>(sz(h) * block);
    const auto v0 = x.v.begin() + static_cast<std::ptrdiff_t>(sz(h) * block);
    head.keys.assign(k0, k0 + static_cast<std::ptrdiff_t>(block));
    head.values.assign(v0, v0 + static_cast<std::ptrdiff_t>(block));
    for (std::int64_t j = 0; j < x.L; ++j) head.pos.push_back(f(j));
    l.heads.push_back(head);
  }
  return l;
}

// The dense pipelines of reference.hpp, corrected mode.
std::vector<double> dense_attn(const Dense& x) {
  return kvevict_ref::window_attention(x.q, x.k, x.H, x.Hkv, x.w, x.L, x.d);
}
std::vector<double> dense_mean(const Dense& x, int kernel, Pool pool) {
  return kvevict_ref::mean_scores(dense_attn(x), x.H, x.Hkv, x.w, x.L, kernel, pool);
}
std::vector<double> dense_norms(const Dense& x, int p) {
  return kvevict_ref::value_norms(x.v, x.w_o, x.H, x.Hkv, x.L, x.d, x.D, p);
}
std::vector<double> dense_sprime(const Dense& x, const rg::DefensiveParams& p) {
  const std::vector<double> m =
      kvevict_ref::defensive_scores(dense_attn(x), x.H, x.Hkv, x.w, x.L, p.kernel, p.pool, p.floor);
  if (!p.value_term) return m;
  return kvevict_ref::defensive_value_scores(m, dense_norms(x, p.value_norm), x.Hkv, x.w, x.L, true);
}
Kept dense_forced(const Dense& x, std::int64_t n_kept, const rg::DefensiveParams& p) {
  if (!p.mass_forcing) return {};
  return kvevict_ref::mass_forced(dense_attn(x), x.H, x.Hkv, x.w, x.L, p.mass_threshold, n_kept, false, 0.0);
}
Kept dense_defensivekv(const Dense& x, std::int64_t n_kept, const rg::DefensiveParams& p) {
  return kvevict_ref::defensivekv(dense_sprime(x, p), dense_forced(x, n_kept, p), x.Hkv, x.w, x.L, n_kept, p.alpha,
                                  false, 0.0);
}

std::vector<rg::DefensiveParams> defensive_variants() {
  std::vector<rg::DefensiveParams> v;
  rg::DefensiveParams p;  // DefensiveKV defaults
  v.push_back(p);
  p.value_norm = 2;
  p.kernel = 3;
  p.pool = Pool::max;
  p.mass_threshold = 0.5;
  v.push_back(p);
  p = rg::DefensiveParams{};
  p.floor = false;
  p.kernel = 1;
  p.mass_threshold = 0.97;
  v.push_back(p);
  p = rg::DefensiveParams{};
  p.value_term = false;
  p.mass_forcing = false;
  p.alpha = 0.2;  // AdaKVDefensive
  v.push_back(p);
  p = rg::DefensiveParams{};
  p.alpha = 0.5;
  p.mass_threshold = 0.7;
  v.push_back(p);
  return v;
}

// A strictly increasing map applied to every head alike: order and equality of positions are unchanged.
std::int64_t spread(std::int64_t j) { return 5 * j + 3 + (j * j) / 2; }

// Every policy of the ragged reference against the dense reference on one dense layer, positions f.
void check_against_dense(const Dense& x, const PosMap& f) {
  const rg::Layer l = to_ragged(x, f);
  struct Pooling {
    int kernel;
    Pool pool;
  };
  const std::vector<Pooling> poolings = {{5, Pool::avg}, {3, Pool::max}, {1, Pool::avg}};
  for (std::int64_t n_kept = 1; n_kept <= x.L; ++n_kept) {
    INFO(describe(x) << " n_kept=" << n_kept);
    for (const Pooling& pl : poolings) {
      INFO("kernel=" << pl.kernel << (pl.pool == Pool::max ? " max" : " avg"));
      const std::vector<double> s = dense_mean(x, pl.kernel, pl.pool);
      CHECK(rg::snapkv(l, n_kept, pl.kernel, pl.pool) == kvevict_ref::snapkv(s, x.Hkv, x.w, x.L, n_kept));
      for (double alpha : {0.0, 0.2, 0.5, 1.0}) {
        INFO("alpha=" << alpha);
        CHECK(rg::adakv(l, n_kept, alpha, pl.kernel, pl.pool) == kvevict_ref::adakv(s, x.Hkv, x.w, x.L, n_kept, alpha));
        CHECK(rg::adakv_original(l, n_kept, alpha, pl.kernel, pl.pool) ==
              kvevict_ref::adakv_original(s, x.Hkv, x.w, x.L, n_kept, alpha));
      }
    }
    for (int sinks : {0, 2, 4})
      CHECK(rg::streamingllm(rg::lengths(l), n_kept, sinks) == kvevict_ref::streamingllm(x.Hkv, x.L, n_kept, sinks));
    for (bool adaptive : {true, false})
      for (int p : {1, 2})
        for (double ratio : {0.0, 0.5, 1.0}) {
          rg::CriticalParams cp;
          cp.adaptive = adaptive;
          cp.value_norm = p;
          cp.first_stage_ratio = ratio;
          cp.kernel = p == 1 ? 5 : 3;
          cp.pool = p == 1 ? Pool::avg : Pool::max;
          INFO("criticalkv adaptive=" << adaptive << " p=" << p << " ratio=" << ratio);
          CHECK(rg::criticalkv(l, n_kept, cp) == kvevict_ref::criticalkv(dense_mean(x, cp.kernel, cp.pool),
                                                                         dense_norms(x, p), x.Hkv, x.w, x.L, n_kept,
                                                                         adaptive, cp.alpha, cp.eps, ratio, false));
        }
    const auto variants = defensive_variants();
    for (std::size_t i = 0; i < variants.size(); ++i) {
      INFO("defensive variant " << i);
      CHECK(rg::defensivekv(l, n_kept, variants[i]) == dense_defensivekv(x, n_kept, variants[i]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 1. Dense layers: exactly the dense reference.

struct DenseShape {
  int H, Hkv, w, L, d, D;
};
const std::vector<DenseShape> kShapes = {
    {2, 2, 1, 6, 3, 4},   // G = 1
    {4, 2, 2, 9, 2, 3},   // G = 2
    {2, 1, 3, 8, 4, 5},   // one KV head, G = 2
    {6, 3, 4, 12, 2, 4},  // G = 2, w = 4
    {3, 3, 2, 7, 1, 2},   // G = 1, d = 1
    {8, 4, 1, 5, 2, 3},   // G = 2, w = 1
};

TEST_CASE("ragged reference: a dense layer selects what the dense reference selects", "[reference]") {
  std::mt19937 rng(20240611u);
  for (const DenseShape& s : kShapes)
    for (bool ties : {false, true})
      for (int rep = 0; rep < 2; ++rep) {
        const Dense x = random_dense(rng, s.H, s.Hkv, s.w, s.L, s.d, s.D, ties);
        INFO("ties=" << ties << " rep=" << rep);
        check_against_dense(x, [](std::int64_t j) { return j; });
        check_against_dense(x, spread);  // one strictly increasing map for every head: the same selections
      }
}

TEST_CASE("ragged reference: per-head stages on a dense layer are the dense stages", "[reference]") {
  std::mt19937 rng(7u);
  for (const DenseShape& s : kShapes) {
    const Dense x = random_dense(rng, s.H, s.Hkv, s.w, s.L, s.d, s.D, false);
    const rg::Layer l = to_ragged(x, spread);
    INFO(describe(x));
    const rg::Attn a = rg::window_attention(l);
    const std::vector<double> da = dense_attn(x);
    std::vector<double> flat;
    for (const auto& row : a) flat.insert(flat.end(), row.begin(), row.end());
    CHECK(flat == da);  // bit for bit: the same arithmetic
    auto flatten = [](const Ragged& r) {
      std::vector<double> out;
      for (const auto& v : r) out.insert(out.end(), v.begin(), v.end());
      return out;
    };
    CHECK(flatten(rg::mean_scores(a, x.Hkv, x.w, 3, Pool::max)) ==
          kvevict_ref::mean_scores(da, x.H, x.Hkv, x.w, x.L, 3, Pool::max));
    CHECK(flatten(rg::defensive_scores(a, x.Hkv, x.w, 5, Pool::avg, true)) ==
          kvevict_ref::defensive_scores(da, x.H, x.Hkv, x.w, x.L, 5, Pool::avg, true));
    CHECK(flatten(rg::value_norms(l, 1)) == dense_norms(x, 1));
    CHECK(flatten(rg::value_norms(l, 2)) == dense_norms(x, 2));
    for (std::int64_t n_kept : {std::int64_t{1}, std::int64_t{x.w + 1}, std::int64_t{x.L}})
      for (double thr : {0.3, 0.9})
        CHECK(rg::mass_forced(a, x.Hkv, x.w, thr, n_kept) ==
              kvevict_ref::mass_forced(da, x.H, x.Hkv, x.w, x.L, thr, n_kept, false, 0.0));
  }
}

TEST_CASE("ragged reference: Layer-DefensiveKV over dense layers is the dense reference", "[reference]") {
  std::mt19937 rng(99u);
  for (const DenseShape& s : kShapes)
    for (bool ties : {false, true})
      for (int NL : {1, 3}) {
        std::vector<Dense> xs;
        for (int i = 0; i < NL; ++i) xs.push_back(random_dense(rng, s.H, s.Hkv, s.w, s.L, s.d, s.D, ties));
        // One position map shared by every layer (positions are compared across layers): the rows, or spread.
        std::vector<rg::Layer> rows, spread_out;
        for (const Dense& x : xs) {
          rows.push_back(to_ragged(x, [](std::int64_t j) { return j; }));
          spread_out.push_back(to_ragged(x, spread));
        }
        auto variants = defensive_variants();
        for (std::size_t vi = 0; vi < variants.size(); ++vi) {
          rg::DefensiveParams p = variants[vi];
          p.alpha = 0.0;  // no safeguard in the layer-global step
          for (std::int64_t n_kept = 1; n_kept <= s.L; ++n_kept) {
            INFO(describe(xs[0]) << " NL=" << NL << " variant " << vi << " n_kept=" << n_kept);
            std::vector<std::vector<double>> sp;
            std::vector<Kept> forced;
            for (const Dense& x : xs) {
              sp.push_back(dense_sprime(x, p));
              forced.push_back(dense_forced(x, n_kept, p));
            }
            const std::vector<Kept> want = kvevict_ref::layer_defensivekv(
                sp, p.mass_forcing ? forced : std::vector<Kept>{}, s.Hkv, s.w, s.L, n_kept, false, 0.0);
            const std::vector<std::int64_t> n_kepts(sz(NL), n_kept);
            CHECK(rg::layer_defensivekv(rows, n_kepts, p) == want);
            CHECK(rg::layer_defensivekv(spread_out, n_kepts, p) == want);
          }
        }
      }
}

// ---------------------------------------------------------------------------------------------
// Random ragged layers: every head its own length and its own positions.

std::vector<std::int64_t> random_positions(std::mt19937& rng, int L, int span) {
  std::vector<std::int64_t> all;
  for (std::int64_t p = 0; p < span; ++p) all.push_back(p);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(sz(L));
  std::sort(all.begin(), all.end());
  return all;
}

rg::Layer random_ragged(std::mt19937& rng, int H, int Hkv, int w, int Lmax, int d, int D, bool ties) {
  const Dense x = random_dense(rng, H, Hkv, w, Lmax, d, D, ties);
  rg::Layer l = to_ragged(x, [](std::int64_t j) { return j; });
  for (rg::Head& head : l.heads) {
    const int L = integer(rng, w + 1, Lmax);
    head.keys.resize(sz(L) * sz(d));
    head.values.resize(sz(L) * sz(d));
    head.pos = random_positions(rng, L, 2 * Lmax);
  }
  return l;
}

rg::Layer map_positions(rg::Layer l, const PosMap& f) {
  for (rg::Head& head : l.heads)
    for (std::int64_t& p : head.pos) p = f(p);
  return l;
}

std::int64_t max_n_kept(const rg::Layer& l) {
  std::int64_t sum = 0;
  for (std::int64_t n : rg::lengths(l)) sum += n;
  return sum / l.Hkv;  // Hkv * n_kept <= sum of L_h
}

// All selections of one ragged layer at one n_kept, in a fixed order.
std::vector<KeptRows> all_selections(const rg::Layer& l, std::int64_t n_kept) {
  std::vector<KeptRows> out;
  out.push_back(rg::snapkv(l, n_kept, 5, Pool::avg));
  out.push_back(rg::snapkv(l, n_kept, 3, Pool::max));
  for (double alpha : {0.0, 0.2, 1.0}) {
    out.push_back(rg::adakv(l, n_kept, alpha, 5, Pool::avg));
    out.push_back(rg::adakv_original(l, n_kept, alpha, 3, Pool::max));
  }
  out.push_back(rg::streamingllm(rg::lengths(l), n_kept, 2));
  for (bool adaptive : {true, false}) {
    rg::CriticalParams cp;
    cp.adaptive = adaptive;
    out.push_back(rg::criticalkv(l, n_kept, cp));
    cp.value_norm = 2;
    cp.first_stage_ratio = 0.25;
    out.push_back(rg::criticalkv(l, n_kept, cp));
  }
  for (const auto& p : defensive_variants()) out.push_back(rg::defensivekv(l, n_kept, p));
  rg::DefensiveParams p;
  const std::vector<KeptRows> lg = rg::layer_defensivekv({l, l}, {n_kept, n_kept}, p);
  out.insert(out.end(), lg.begin(), lg.end());
  return out;
}

// ---------------------------------------------------------------------------------------------
// 2. Position invariance.

TEST_CASE("ragged reference: offsets and gaps do not change a single head's kept rows", "[reference]") {
  std::mt19937 rng(31337u);
  for (int rep = 0; rep < 12; ++rep) {
    const int G = 1 + rep % 2;
    const int w = 1 + rep % 4;
    const rg::Layer l = random_ragged(rng, G, 1, w, w + 3 + rep % 6, 2, 3, rep % 3 == 0);
    // Random gaps: position j -> sum of j random steps in [1, 6], plus an offset.
    std::vector<std::int64_t> gaps = {1000};
    for (int j = 0; j < 64; ++j) gaps.push_back(gaps.back() + integer(rng, 1, 6));
    const rg::Layer offset = map_positions(l, [](std::int64_t p) { return p + 123456789; });
    const rg::Layer gapped = map_positions(l, [&](std::int64_t p) { return gaps[static_cast<std::size_t>(p)]; });
    for (std::int64_t n_kept = 1; n_kept <= max_n_kept(l); ++n_kept) {
      INFO("rep=" << rep << " w=" << w << " L=" << l.heads[0].pos.size() << " n_kept=" << n_kept);
      const auto want = all_selections(l, n_kept);
      CHECK(all_selections(offset, n_kept) == want);
      CHECK(all_selections(gapped, n_kept) == want);
    }
  }
}

TEST_CASE("ragged reference: one increasing map applied to every head changes nothing", "[reference]") {
  std::mt19937 rng(4242u);
  for (int rep = 0; rep < 12; ++rep) {
    const int Hkv = 2 + rep % 3;
    const int G = 1 + (rep / 3) % 2;
    const int w = 1 + rep % 3;
    const rg::Layer l = random_ragged(rng, G * Hkv, Hkv, w, w + 6, 2, 3, rep % 4 == 0);
    const rg::Layer mapped = map_positions(l, [](std::int64_t p) { return 7 * p * p + 3 * p - 50; });
    for (std::int64_t n_kept = 1; n_kept <= max_n_kept(l); ++n_kept) {
      INFO("rep=" << rep << " Hkv=" << Hkv << " G=" << G << " w=" << w << " n_kept=" << n_kept);
      CHECK(all_selections(mapped, n_kept) == all_selections(l, n_kept));
    }
  }
}

// Two heads, w = 1, AdaKV with alpha 0 (no safeguard), n_kept 2: total 4.
//   head 0: 4 entries at positions [1, 2, 4, 9], prefix scores [.5, .1, .3], window row 3;
//   head 1: 3 entries at positions [8, 10, 12], prefix scores [.3, .2], window row 2.
// The two windows fill 2 places; .5 (head 0 row 0) takes the third; the fourth is a tie at .3 between head 0
// row 2 (position 4) and head 1 row 0 (position 8). Position 8 is higher: head 1 wins, although its row (0) is
// lower and its head index is higher -> {0, 3} and {0, 2}.
// The same scores at positions = rows: row 2 of head 0 is the higher position -> {0, 2, 3} and {2}.
// Head 1 at positions [4, 10, 12]: the tie is at the same position 4 -> the lower head, {0, 2, 3} and {2}.
TEST_CASE("ragged reference: a cross-head tie goes to the higher position, then the lower head", "[reference]") {
  const Ragged s = {{0.5, 0.1, 0.3}, {0.3, 0.2}};
  const Positions pos = {{1, 2, 4, 9}, {8, 10, 12}};
  const Positions rows = {{0, 1, 2, 3}, {0, 1, 2}};
  const Positions same = {{1, 2, 4, 9}, {4, 10, 12}};
  const KeptRows by_position = {{0, 3}, {0, 2}};
  const KeptRows other = {{0, 2, 3}, {2}};
  CHECK(rg::adakv(s, pos, 1, 2, 0.0) == by_position);
  CHECK(rg::adakv(s, rows, 1, 2, 0.0) == other);
  CHECK(rg::adakv(s, same, 1, 2, 0.0) == other);
  // The same flat top-k in every cross-head ranking: DefensiveKV (nothing forced), one-layer Layer-DefensiveKV,
  // CriticalKV with ratio 1 and no safeguard (the base alone), AdaKV original with alpha 0 (B = 1, top-2 of the
  // prefix entries: .5, then the same tie; b - w = counts).
  CHECK(rg::defensivekv(s, {}, pos, 1, 2, 0.0) == by_position);
  CHECK(rg::defensivekv(s, {}, rows, 1, 2, 0.0) == other);
  CHECK(rg::layer_defensivekv({s}, {}, {pos}, {1}, {2}) == std::vector<KeptRows>{by_position});
  CHECK(rg::layer_defensivekv({s}, {}, {same}, {1}, {2}) == std::vector<KeptRows>{other});
  const Ragged n = {{1, 1, 1, 1}, {1, 1, 1}};
  CHECK(rg::criticalkv(s, n, pos, 1, 2, true, 0.0, 1e-4, 1.0) == by_position);
  CHECK(rg::criticalkv(s, n, rows, 1, 2, true, 0.0, 1e-4, 1.0) == other);
  CHECK(rg::adakv_original(s, pos, 1, 2, 0.0) == by_position);
  CHECK(rg::adakv_original(s, rows, 1, 2, 0.0) == other);
  // Inside one head only the order matters: SnapKV keeps the same rows whatever the positions.
  CHECK(rg::snapkv(s, pos, 1, 2) == KeptRows{{0, 3}, {0, 2}});
  CHECK(rg::snapkv(s, rows, 1, 2) == KeptRows{{0, 3}, {0, 2}});
}

// ---------------------------------------------------------------------------------------------
// 3. Hand-worked ragged examples.

// Two heads of 5 and 8 entries, w = 2, windows at positions 20, 21 in both:
//   head 0: positions [2, 5, 6 | 20, 21],                 prefix scores [.30, .05, .20]
//   head 1: positions [0, 10, 11, 12, 13, 14 | 20, 21],   prefix scores [.40, .20, .02, .35, .08, .15]
// Prefix ranking over both heads: .40 (h1 r0), .35 (h1 r3), .30 (h0 r0), then the tie at .20 between h1 r1
// (position 10) and h0 r2 (position 6): h1 r1 first, then h0 r2, .15 (h1 r5), .08, .05, .02.
TEST_CASE("ragged reference: AdaKV flat top-k over heads of 5 and 8 entries", "[reference]") {
  const Ragged s = {{0.30, 0.05, 0.20}, {0.40, 0.20, 0.02, 0.35, 0.08, 0.15}};
  const Positions pos = {{2, 5, 6, 20, 21}, {0, 10, 11, 12, 13, 14, 20, 21}};
  const Positions rows = {{0, 1, 2, 3, 4}, {0, 1, 2, 3, 4, 5, 6, 7}};
  // n_kept 4: total 8. alpha .5 -> n_safe = 2 per head: each head's window (it ranks above every score). The 4
  // windows, then the 4 best prefix entries: h1 r0, h1 r3, h0 r0, h1 r1 (the tie) -> b = (3, 5).
  CHECK(rg::adakv(s, pos, 2, 4, 0.5) == KeptRows{{0, 3, 4}, {0, 1, 3, 6, 7}});
  CHECK(rg::adakv(s, pos, 2, 4, 0.0) == KeptRows{{0, 3, 4}, {0, 1, 3, 6, 7}});
  // At positions = rows the tie goes to h0 r2 (row 2 > row 1): b = (4, 4).
  CHECK(rg::adakv(s, rows, 2, 4, 0.5) == KeptRows{{0, 2, 3, 4}, {0, 3, 6, 7}});
  // alpha 1: n_safe = 4 = n_kept, every head its own top 4 (SnapKV): h0 window + .30 + .20, h1 window + .40 + .35.
  CHECK(rg::adakv(s, pos, 2, 4, 1.0) == KeptRows{{0, 2, 3, 4}, {0, 3, 6, 7}});
  CHECK(rg::adakv(s, pos, 2, 4, 1.0) == rg::snapkv(s, pos, 2, 4));
  // n_kept 3: total 6 = 4 windows + 2 prefix entries. alpha 0: .40 and .35, both head 1 -> b = (2, 4).
  // alpha 1: n_safe 3, each head its window + its best (h0 r0 .30, h1 r0 .40), total 6 -> b = (3, 3).
  CHECK(rg::adakv(s, pos, 2, 3, 0.0) == KeptRows{{3, 4}, {0, 3, 6, 7}});
  CHECK(rg::adakv(s, pos, 2, 3, 1.0) == KeptRows{{0, 3, 4}, {0, 6, 7}});
  // n_kept 1 < w: the window tier alone, most recent first; both windows sit at 20, 21 -> position 21 in each head
  // (the lower head first at the same position, then the other head's 21).
  CHECK(rg::adakv(s, pos, 2, 1, 0.0) == KeptRows{{4}, {7}});

  // Original AdaKV. n_kept 4: B = 2, top-4 of the prefix entries: h1 r0, h1 r3, h0 r0, h1 r1 -> counts (1, 3).
  //   alpha 0: b - w = counts -> h0 keeps r0, h1 keeps r0, r3, r1.
  CHECK(rg::adakv_original(s, pos, 2, 4, 0.0) == KeptRows{{0, 3, 4}, {0, 1, 3, 6, 7}});
  //   at positions = rows the tie goes to h0 r2: counts (2, 2).
  CHECK(rg::adakv_original(s, rows, 2, 4, 0.0) == KeptRows{{0, 2, 3, 4}, {0, 3, 6, 7}});
  //   alpha .5: floor(.5 * 2) = 1; h0 round(.5 + 1) = round(1.5) = 2, h1 round(1.5 + 1) = round(2.5) = 2 (half to
  //   even both ways) -> h0 r0, r2; h1 r0, r3.
  CHECK(rg::adakv_original(s, pos, 2, 4, 0.5) == KeptRows{{0, 2, 3, 4}, {0, 3, 6, 7}});
  // n_kept 6: B = 4, top-8 of the 9 prefix entries (all but .02, h1 r2) -> counts (3, 5); alpha .5: floor(2) = 2;
  // h0 round(1.5 + 2) = 4, cut to P_0 = 3 (the whole head); h1 round(2.5 + 2) = 4: r0, r3, r1, r5.
  CHECK(rg::adakv_original(s, pos, 2, 6, 0.5) == KeptRows{{0, 1, 2, 3, 4}, {0, 1, 3, 5, 6, 7}});
  // n_kept <= w: each head its last n_kept entries.
  CHECK(rg::adakv_original(s, pos, 2, 2, 0.5) == KeptRows{{3, 4}, {6, 7}});
  CHECK(rg::adakv_original(s, pos, 2, 1, 0.5) == KeptRows{{4}, {7}});

  // Budgets against L̄ = (5 + 8) / 2 = 6.5: keep .5 -> int(3.25) = 3, compression .2 -> int(5.2) = 5, keep 1 -> 6.
  CHECK(rg::n_kept_keep_ratio({5, 8}, 0.5) == 3);
  CHECK(rg::n_kept_compression_ratio({5, 8}, 0.2) == 5);
  CHECK(rg::n_kept_keep_ratio({5, 8}, 1.0) == 6);
  // A dense layer: L̄ = L, the dense formulas (1000 * 0.19999999999999996 -> 199).
  CHECK(rg::n_kept_compression_ratio({1000, 1000}, 0.8) == 199);
  CHECK(rg::n_kept_keep_ratio({1000, 1000, 1000}, 0.2) == 200);
}

// Three heads, w = 1:
//   head 0: positions [0, 2, 3 | 5], N [1, 2, 3, 9], M [.2, .4, .6]
//   head 1: positions [0, 1, 2 | 3], N [3, 0, 1, 7], M [.3, .5, .7]
//   head 2: positions [2, 3, 4 | 5], N [1, 1, 4, 0], M [.1, .1, .1]
// Sums of N over the heads whose PREFIX holds the position:
//   position 0: h0 1 + h1 3 = 4;   position 1: h1 0 = 0 (Nn = 0);   position 2: h0 2 + h1 1 + h2 1 = 4;
//   position 3: h0 3 + h2 1 = 4 (head 1 holds position 3 in its window: not counted);   position 4: h2 4.
// s' = M * N / sum:
//   head 0: [.2 * 1/4, .4 * 2/4, .6 * 3/4] = [.05, .2, .45]
//   head 1: [.3 * 3/4, .5 * 0, .7 * 1/4]   = [.225, 0, .175]
//   head 2: [.1 * 1/4, .1 * 1/4, .1 * 4/4] = [.025, .025, .1]
// Normalising by row instead (the dense column sum) would give head 0 row 2 .6 * 3 / (3 + 1 + 4) = .225.
TEST_CASE("ragged reference: DefensiveKV normalises value norms by position", "[reference]") {
  const Ragged m = {{0.2, 0.4, 0.6}, {0.3, 0.5, 0.7}, {0.1, 0.1, 0.1}};
  const Ragged n = {{1, 2, 3, 9}, {3, 0, 1, 7}, {1, 1, 4, 0}};
  const Positions pos = {{0, 2, 3, 5}, {0, 1, 2, 3}, {2, 3, 4, 5}};
  const Ragged sp = rg::defensive_value_scores(m, n, pos, 1, true);
  REQUIRE(sp.size() == 3);
  CHECK_THAT(sp[0], near({0.05, 0.2, 0.45}));
  CHECK_THAT(sp[1], near({0.225, 0.0, 0.175}));
  CHECK_THAT(sp[2], near({0.025, 0.025, 0.1}));
  CHECK(rg::defensive_value_scores(m, n, pos, 1, false) == m);
  // Selection, n_kept 2: total 6 = 3 windows + the 3 best s': .45 (h0 r2), .225 (h1 r0), .2 (h0 r1).
  CHECK(rg::defensivekv(sp, {}, pos, 1, 2, 0.0) == KeptRows{{1, 2, 3}, {0, 3}, {3}});
  // Head 2's row 2 forced (its mass): it ranks above every score; 3 windows + 1 forced + .45 and .225.
  CHECK(rg::defensivekv(sp, {{}, {}, {2}}, pos, 1, 2, 0.0) == KeptRows{{2, 3}, {0, 3}, {2, 3}});
  // Dense positions (rows = positions) turn it back into the column sum of docs/algorithms.md#value-term: every
  // position j < 3 held by all three prefixes; row 2: N 3 + 1 + 4 = 8.
  const Positions dense = {{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}};
  const Ragged spd = rg::defensive_value_scores(m, n, dense, 1, true);
  CHECK_THAT(spd[0], near({0.2 * 1 / 5, 0.4 * 2 / 3, 0.6 * 3 / 8}));
}

// Uniform with a head shorter than n_kept: lengths 3 and 8, w = 1, n_kept 5 (total 10 <= 11).
//   head 0: positions [4, 6, 7], prefix scores [.1, .9]: b_0 = min(5, 3) = 3, everything;
//   head 1: positions 0 .. 7, prefix scores [.5, .1, .4, .3, .2, .6, .05]: b_1 = 5, the window (row 7) and the
//   top 4: .6 (r5), .5 (r0), .4 (r2), .3 (r3).
TEST_CASE("ragged reference: uniform budgets cap at the head's entries", "[reference]") {
  const Ragged s = {{0.1, 0.9}, {0.5, 0.1, 0.4, 0.3, 0.2, 0.6, 0.05}};
  const Positions pos = {{4, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}};
  CHECK(rg::snapkv(s, pos, 1, 5) == KeptRows{{0, 1, 2}, {0, 2, 3, 5, 7}});
  // n_kept 2: head 0 its window + .9; head 1 its window + .6.
  CHECK(rg::snapkv(s, pos, 1, 2) == KeptRows{{1, 2}, {5, 7}});

  // CriticalSnapKV, ratio .5, eps 1e-4. Head 0: b = 3, everything. Head 1: b = 5, stage 1 int(2.5) = 2: the window
  // (r7) and .6 (r5); stage 2 the best 3 of the rest by (s + eps) N with N = [1, 1, 1, 1, 10, .5, 1, 1]:
  // r4 (.2001 * 10 = 2.001), r0 (.5001), r2 (.4001) -> r4 replaces SnapKV's r3.
  const Ragged n = {{1, 1, 1}, {1, 1, 1, 1, 10, 0.5, 1, 1}};
  CHECK(rg::criticalkv(s, n, pos, 1, 5, false, 0.2, 1e-4, 0.5) == KeptRows{{0, 1, 2}, {0, 2, 4, 5, 7}});
  CHECK(rg::criticalkv(s, n, pos, 1, 5, false, 0.2, 1e-4, 1.0) == rg::snapkv(s, pos, 1, 5));
  // ratio 0 (stage 2 alone): the window first, then r4 (2.001), r0 (.5001), r2 (.4001), r3 (.3001); r5 drops to
  // .6001 * .5 = .30005.
  CHECK(rg::criticalkv(s, n, pos, 1, 5, false, 0.2, 1e-4, 0.0) == KeptRows{{0, 1, 2}, {0, 2, 3, 4, 7}});

  // StreamingLLM: b = min(n_kept, L_h); first min(sinks, b) entries, the rest the most recent.
  CHECK(rg::streamingllm({3, 8}, 5, 2) == KeptRows{{0, 1, 2}, {0, 1, 5, 6, 7}});
  CHECK(rg::streamingllm({3, 8}, 5, 4) == KeptRows{{0, 1, 2}, {0, 1, 2, 3, 7}});
  CHECK(rg::streamingllm({3, 8}, 5, 0) == KeptRows{{0, 1, 2}, {3, 4, 5, 6, 7}});
  CHECK(rg::streamingllm({3, 8}, 2, 4) == KeptRows{{0, 1}, {0, 1}});
  CHECK(rg::streamingllm({3, 8}, 3, 1) == KeptRows{{0, 1, 2}, {0, 6, 7}});
}

// Mass forcing on a ragged layer: Hkv = 2, G = 1, w = 1, attention rows given directly.
//   query head 0 (KV 0, 4 entries): [.3, .3, .2 | .2]   -> window mass .2
//   query head 1 (KV 1, 3 entries): [.2, .2 | .6]        -> window mass .6
// window bias = (.2 + .6) / 2 = .4 for the whole layer; threshold 1 -> tau = .6.
//   KV 0: p = [.375, .375, .25], order r1, r0 (tie: the higher row/position), r2; c = .375, .75 -> k = 1: {1}.
//   KV 1: p = [.5, .5], order r1, r0; c = .5, 1 -> k = 1: {1}.
// A per-head bias would give tau .8 for KV 0 (k = 2: {0, 1}) and .4 for KV 1 (k = 0).
// The cap max(0, n_kept - w): n_kept 3 -> 2 (no effect); n_kept 1 -> 0 (nothing forced).
TEST_CASE("ragged reference: the mass-forcing window bias is one mean over all query heads", "[reference]") {
  const rg::Attn attn = {{0.3, 0.3, 0.2, 0.2}, {0.2, 0.2, 0.6}};
  CHECK(rg::window_bias(attn, 1) == Approx(0.4).margin(1e-15));
  CHECK(rg::mass_forced(attn, 2, 1, 1.0, 3) == KeptRows{{1}, {1}});
  CHECK(rg::mass_forced(attn, 2, 1, 1.0, 2) == KeptRows{{1}, {1}});
  CHECK(rg::mass_forced(attn, 2, 1, 1.0, 1) == KeptRows{{}, {}});
  // Threshold .5 -> tau .1: reached at the first entry of either ranking, k = 0.
  CHECK(rg::mass_forced(attn, 2, 1, 0.5, 3) == KeptRows{{}, {}});
}

// Layer-global over two layers of different shapes, w = 1 in both.
//   layer 0 (Hkv 1, n_kept 1): positions [0, 4, 7 | 9], scores [.5, .2, .3]
//   layer 1 (Hkv 2, n_kept 2): head 0 positions [0, 1, 2 | 9], scores [.3, .1, .25];
//                              head 1 positions [3, 7 | 9],    scores [.3, .3]
// Total 1 * 1 + 2 * 2 = 5: the 3 windows, then .5 (l0 r0), then the tie at .3 among l0 r2 (position 7),
// l1 h1 r1 (position 7), l1 h1 r0 (3), l1 h0 r0 (0): l0 r2 (position 7, the lower layer).
TEST_CASE("ragged reference: the layer-global step ranks by position, then layer, then head", "[reference]") {
  const Ragged s0 = {{0.5, 0.2, 0.3}};
  const Ragged s1 = {{0.3, 0.1, 0.25}, {0.3, 0.3}};
  const Positions p0 = {{0, 4, 7, 9}};
  const Positions p1 = {{0, 1, 2, 9}, {3, 7, 9}};
  CHECK(rg::layer_defensivekv({s0, s1}, {}, {p0, p1}, {1, 1}, {1, 2}) ==
        std::vector<KeptRows>{{{0, 2, 3}}, {{3}, {2}}});
  // Head 1 of layer 1 at positions [3, 8 | 9]: its .3 at position 8 now outranks layer 0's at 7.
  const Positions p1b = {{0, 1, 2, 9}, {3, 8, 9}};
  CHECK(rg::layer_defensivekv({s0, s1}, {}, {p0, p1b}, {1, 1}, {1, 2}) ==
        std::vector<KeptRows>{{{0, 3}}, {{3}, {1, 2}}});
  // Forced layer 1 head 0 row 1 (score .1): above every score with the windows; one scored place left: .5.
  const std::vector<KeptRows> forced = {{{}}, {{1}, {}}};
  CHECK(rg::layer_defensivekv({s0, s1}, forced, {p0, p1}, {1, 1}, {1, 2}) ==
        std::vector<KeptRows>{{{0, 3}}, {{1, 3}, {2}}});
}

// ---------------------------------------------------------------------------------------------
// Identities of docs/algorithms.md#stages that must hold on ragged layers too.
TEST_CASE("ragged reference: budgets, windows and compositions on random ragged layers", "[reference]") {
  std::mt19937 rng(555u);
  for (int rep = 0; rep < 16; ++rep) {
    const int Hkv = 1 + rep % 4;
    const int G = 1 + (rep / 4) % 2;
    const int w = 1 + rep % 3;
    const rg::Layer l = random_ragged(rng, G * Hkv, Hkv, w, w + 7, 3, 4, rep % 5 == 0);
    const Positions pos = rg::positions(l);
    const std::vector<std::int64_t> len = rg::lengths(l);
    const rg::Attn attn = rg::window_attention(l);
    for (int q = 0; q < l.H; ++q) CHECK(attn[sz(q)].size() == sz(w) * static_cast<std::size_t>(len[sz(q / G)]));
    const Ragged s = rg::mean_scores(attn, Hkv, w, 5, Pool::avg);
    const Ragged n = rg::value_norms(l, 1);
    for (std::int64_t n_kept = 1; n_kept <= max_n_kept(l); ++n_kept) {
      INFO("rep=" << rep << " Hkv=" << Hkv << " G=" << G << " w=" << w << " n_kept=" << n_kept);
      auto sizes = [](const KeptRows& k) {
        std::vector<std::int64_t> out;
        for (const auto& v : k) out.push_back(static_cast<std::int64_t>(v.size()));
        return out;
      };
      auto total = [&](const KeptRows& k) {
        std::int64_t t = 0;
        for (std::int64_t x : sizes(k)) t += x;
        return t;
      };
      auto holds_window = [&](const KeptRows& k) {
        for (std::size_t h = 0; h < k.size(); ++h)
          for (std::int64_t j = len[h] - w; j < len[h]; ++j)
            if (!std::binary_search(k[h].begin(), k[h].end(), j)) return false;
        return true;
      };
      std::vector<std::int64_t> uniform;
      for (std::int64_t L : len) uniform.push_back(std::min(n_kept, L));
      const KeptRows snap = rg::snapkv(s, pos, w, n_kept);
      CHECK(sizes(snap) == uniform);
      CHECK(sizes(rg::streamingllm(len, n_kept, 3)) == uniform);
      CHECK(total(rg::adakv(s, pos, w, n_kept, 0.2)) == Hkv * n_kept);
      // alpha 1 is SnapKV wherever every head holds n_kept.
      bool all_hold = true;
      for (std::int64_t L : len) all_hold = all_hold && L >= n_kept;
      if (all_hold) CHECK(rg::adakv(s, pos, w, n_kept, 1.0) == snap);
      // CriticalKV with ratio 1 is its base; its budgets are the base's.
      CHECK(rg::criticalkv(s, n, pos, w, n_kept, false, 0.2, 1e-4, 1.0) == snap);
      CHECK(rg::criticalkv(s, n, pos, w, n_kept, true, 0.2, 1e-4, 1.0) == rg::adakv(s, pos, w, n_kept, 0.2));
      CHECK(sizes(rg::criticalkv(s, n, pos, w, n_kept, true, 0.2, 1e-4, 0.3)) ==
            sizes(rg::adakv(s, pos, w, n_kept, 0.2)));
      // DefensiveKV's selection with nothing forced is the AdaKV flat top-k on the same scores.
      for (double alpha : {0.0, 0.2})
        CHECK(rg::defensivekv(s, {}, pos, w, n_kept, alpha) == rg::adakv(s, pos, w, n_kept, alpha));
      // DefensiveKV: the total, the window and the forced rows are kept; one layer of Layer-DefensiveKV is it.
      rg::DefensiveParams p;
      const KeptRows d = rg::defensivekv(l, n_kept, p);
      CHECK(total(d) == Hkv * n_kept);
      const KeptRows forced = rg::mass_forced(attn, Hkv, w, p.mass_threshold, n_kept);
      for (std::size_t h = 0; h < forced.size(); ++h) {
        CHECK(static_cast<std::int64_t>(forced[h].size()) <= std::max<std::int64_t>(0, n_kept - w));
        for (std::int64_t j : forced[h]) CHECK(std::binary_search(d[h].begin(), d[h].end(), j));
      }
      if (n_kept >= w) {
        CHECK(holds_window(snap));
        CHECK(holds_window(d));
        CHECK(holds_window(rg::adakv(s, pos, w, n_kept, 0.0)));
        CHECK(holds_window(rg::adakv_original(s, pos, w, n_kept, 0.2)));
        CHECK(holds_window(rg::criticalkv(s, n, pos, w, n_kept, true, 0.2, 1e-4, 0.0)));
      }
      CHECK(rg::layer_defensivekv({l}, {n_kept}, p) == std::vector<KeptRows>{d});
    }
  }
}

}  // namespace

}  // namespace test_reference_selfcheck_ragged
