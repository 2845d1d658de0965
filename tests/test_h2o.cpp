// H2O (docs/algorithms.md#h2o): the attention entries received, one-shot and carried across steps by the
// CacheBook, against the float64 reference of tests/support/reference_h2o.hpp; worked numbers; errors.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "support/matchers.hpp"
#include "support/ragged_inputs.hpp"
#include "support/random_inputs.hpp"
#include "support/reference_h2o.hpp"

namespace test_h2o {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::HeadsView;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::MessageContains;
using kvevict_test::Ragged;
using kvevict_test::Rng;
using kvevict_test::rows_of;
namespace ref = kvevict_ref::h2o;

namespace {

kvevict::H2O h2o(Index window, double recent_share) {
  kvevict::H2O::Params p;
  p.window = window;
  p.recent_share = recent_share;
  return kvevict::H2O(p);
}

/// [Hkv, capacity] heads-major float scores from per-head vectors (the rest `junk`).
std::vector<float> flat_scores(const kvevict_ref::ragged::Ragged& s, Index capacity, float junk) {
  std::vector<float> out(s.size() * static_cast<std::size_t>(capacity), junk);
  for (std::size_t h = 0; h < s.size(); ++h)
    for (std::size_t j = 0; j < s[h].size(); ++j)
      out[h * static_cast<std::size_t>(capacity) + j] = static_cast<float>(s[h][j]);
  return out;
}

/// The queries of each head's last c entries of `r`: [H, c, d].
std::vector<double> step_queries(Rng& rng, const Ragged& r, int c) {
  return kvevict_test::normal_vector(static_cast<std::size_t>(r.H * c * r.d), rng, 1.5);
}

}  // namespace

TEST_CASE("H2O: worked numbers, one KV head", "[h2o]") {
  // 8 entries, n_kept 4, recent_share 0.5: the last 2 kept, then the 2 highest received attentions of the rest.
  const std::vector<double> keys(8 * 2, 0.0);  // any keys: the scores are given
  kvevict::LayerInputs<double> in;
  in.keys = kvevict::kv_heads_major<const double>(keys.data(), 1, 8, 2);
  const std::vector<double> q(2, 0.0);
  in.queries = HeadsView<const double>::heads_major(q.data(), 1, 1, 2);
  const std::vector<float> received = {0.5f, 3.0f, 0.25f, 3.0f, 2.0f, 1.0f, 9.0f, 0.0f};
  in.accumulated = HeadsView<const float>::heads_major(received.data(), 1, 8, 1);
  CHECK(rows_of(h2o(1, 0.5).select(in, Budget::tokens(4))) == kvevict_ref::ragged::KeptRows{{1, 3, 6, 7}});
  // recent_share 0: only the window (1) is recent; 3.0 ties go to the later entry (3) over 1.
  CHECK(rows_of(h2o(1, 0.0).select(in, Budget::tokens(3))) == kvevict_ref::ragged::KeptRows{{3, 6, 7}});
  // recent_share 1: the last n_kept entries, StreamingLLM without sinks.
  CHECK(rows_of(h2o(1, 1.0).select(in, Budget::tokens(3))) == kvevict_ref::ragged::KeptRows{{5, 6, 7}});
  // Without accumulated scores: the attention received from the window. One query [1, 0] over keys e_0 * 2 and
  // zeros: entry 0 gets e^(2/sqrt 2) / (e^(2/sqrt 2) + 7) and is kept over the other (equal) entries.
  std::vector<double> k2(8 * 2, 0.0);
  k2[0] = 2.0;
  const std::vector<double> q2 = {1.0, 0.0};
  kvevict::LayerInputs<double> in2;
  in2.keys = kvevict::kv_heads_major<const double>(k2.data(), 1, 8, 2);
  in2.queries = HeadsView<const double>::heads_major(q2.data(), 1, 1, 2);
  CHECK(rows_of(h2o(1, 0.5).select(in2, Budget::tokens(3))) == kvevict_ref::ragged::KeptRows{{0, 6, 7}});
  std::vector<float> sums(8, 0.0f);
  kvevict::accumulate_attention<double>(in2, HeadsView<float>::heads_major(sums.data(), 1, 8, 1));
  const double e = std::exp(2.0 / std::sqrt(2.0));
  CHECK(sums[0] == Approx(e / (e + 7.0)));
  CHECK(sums[7] == Approx(1.0 / (e + 7.0)));
}

TEST_CASE("H2O matches the float64 reference: window attention or accumulated scores, ragged layers", "[h2o]") {
  Rng rng(1601);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int trial = 0; trial < 24; ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + (trial / 3) % 2, w = 1 + trial % 4, d = 4 + 4 * (trial % 2);
    const Ragged r = kvevict_test::random_ragged(rng, Hkv * G, Hkv, w, d, 30 + 2 * trial, 0.3 + 0.02 * trial);
    const Index capacity = kvevict_test::longest(r) + 3;
    const auto stored =
        kvevict_test::store<double>(r, capacity, trial % 2 == 1, std::numeric_limits<double>::quiet_NaN(), trial);
    const auto pos = kvevict_ref::ragged::positions(r);
    // From the window: the reference's received attention of the window queries.
    const auto from_window = ref::received(r, r.q, w);
    // Accumulated: random scores with ties (a few distinct values).
    kvevict_ref::ragged::Ragged given;
    for (int h = 0; h < Hkv; ++h) {
      std::vector<double> s;
      for (Index j = 0; j < kvevict_test::length(r, h); ++j) s.push_back(static_cast<double>((j * 7 + h * 3) % 5) / 4);
      given.push_back(s);
    }
    const std::vector<float> given_flat = flat_scores(given, capacity, nan);
    Index entries = 0;
    for (int h = 0; h < Hkv; ++h) entries += kvevict_test::length(r, h);
    for (const double share : {0.0, 0.5, 0.8, 1.0})
      for (const std::int64_t n :
           {std::int64_t{1}, std::int64_t{w + 1}, std::int64_t{entries / Hkv / 3}, std::int64_t{entries / Hkv}}) {
        if (n < 1) continue;
        INFO("trial " << trial << " Hkv " << Hkv << " G " << G << " w " << w << " n " << n << " share " << share);
        const kvevict::H2O p = h2o(w, share);
        CHECK(rows_of(p.select<double>(stored.in, Budget::tokens(n))) == ref::select(from_window, pos, w, n, share));
        kvevict::LayerInputs<double> with = stored.in;
        with.accumulated = HeadsView<const float>(given_flat.data(), Hkv, capacity, 1, capacity, 1);
        CHECK(rows_of(p.select<double>(with, Budget::tokens(n))) == ref::select(given, pos, w, n, share));
        CHECK(rows_of(p.select<float>(with, Budget::tokens(n))) == ref::select(given, pos, w, n, share));
      }
    // reference_quirks (dense layers only): the recent entries carry the layer's maximum instead of the window
    // tier, the same ranking inside a head, so the same uniform selection.
    const Ragged dense = kvevict_test::random_ragged(rng, Hkv * G, Hkv, w, d, 30, 1.0);
    const auto dense_stored = kvevict_test::store<double>(dense, 30, false, 0.0);
    kvevict::H2O::Params quirks;
    quirks.window = w;
    quirks.reference_quirks = true;
    const Budget cr = Budget::compression_ratio(0.6);
    CHECK(rows_of(kvevict::H2O(quirks).select<double>(dense_stored.in, cr)) ==
          rows_of(h2o(w, 0.5).select<double>(dense_stored.in, cr)));
  }
}

TEST_CASE("accumulate_attention matches the float64 reference: queries or attention rows, c up to every entry",
          "[h2o]") {
  Rng rng(1602);
  for (int trial = 0; trial < 16; ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + (trial / 3) % 3, w = 2 + trial % 3, d = 8;
    const Ragged r = kvevict_test::random_ragged(rng, Hkv * G, Hkv, w, d, 24 + trial, 0.5);
    const Index capacity = kvevict_test::longest(r) + 2;
    const auto stored = kvevict_test::store<double>(r, capacity, trial % 2 == 0, 0.0, 0);
    Index shortest = capacity;
    for (int h = 0; h < Hkv; ++h) shortest = std::min(shortest, kvevict_test::length(r, h));
    for (const int c : {1, w, static_cast<int>(shortest)}) {
      INFO("trial " << trial << " c " << c);
      const std::vector<double> q = step_queries(rng, r, c);
      const auto want = ref::received(r, q, c);
      kvevict::LayerInputs<double> step = stored.in;
      step.queries = HeadsView<const double>::heads_major(q.data(), r.H, c, d);
      std::vector<float> got(static_cast<std::size_t>(Hkv * capacity), 0.25f);  // added to what is there
      const HeadsView<float> scores(got.data(), Hkv, capacity, 1, capacity, 1);
      kvevict::accumulate_attention<double>(step, scores);
      std::vector<float> got_f(got.size(), 0.0f);
      kvevict::accumulate_attention<float>(step, HeadsView<float>(got_f.data(), Hkv, capacity, 1, capacity, 1));
      // The same from softmax rows [H, c, capacity] (the reference's rows, zero beyond each head's entries).
      std::vector<double> rows(static_cast<std::size_t>(r.H * c * capacity), 0.0);
      for (int qh = 0; qh < r.H; ++qh) {
        const int h = qh / G;
        const Index L = kvevict_test::length(r, h);
        kvevict_ref::ragged::Layer one = r;
        one.H = 1;
        one.Hkv = 1;
        one.heads = {r.heads[static_cast<std::size_t>(h)]};
        const std::vector<double> qh_q(q.begin() + qh * c * d, q.begin() + (qh + 1) * c * d);
        for (int i = 0; i < c; ++i) {  // row i alone: received() of one query is its softmax row
          kvevict_ref::ragged::Layer upto = one;
          upto.heads[0].keys.resize(static_cast<std::size_t>((L - c + i + 1) * d));
          upto.heads[0].pos.resize(static_cast<std::size_t>(L - c + i + 1));
          const std::vector<double> qi(qh_q.begin() + i * d, qh_q.begin() + (i + 1) * d);
          const auto row = ref::received(upto, qi, 1)[0];
          for (std::size_t j = 0; j < row.size(); ++j)
            rows[static_cast<std::size_t>((qh * c + i) * capacity) + j] = row[j];
        }
      }
      kvevict::LayerInputs<double> from_rows = stored.in;
      from_rows.queries = HeadsView<const double>();
      from_rows.attention = HeadsView<const double>::heads_major(rows.data(), r.H, c, capacity);
      std::vector<float> got_rows(got.size(), 0.0f);
      kvevict::accumulate_attention<double>(from_rows,
                                            HeadsView<float>(got_rows.data(), Hkv, capacity, 1, capacity, 1));
      for (int h = 0; h < Hkv; ++h)
        for (Index j = 0; j < capacity; ++j) {
          const auto f = static_cast<std::size_t>(h * capacity + j);
          if (j >= kvevict_test::length(r, h)) {  // beyond the entries: untouched
            CHECK(got[f] == 0.25f);
            CHECK(got_rows[f] == 0.0f);
            continue;
          }
          const double x = want[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)];
          CHECK(got[f] == Approx(x + 0.25).epsilon(1e-6));
          CHECK(got_f[f] == Approx(x).epsilon(1e-4).margin(1e-6));
          CHECK(got_rows[f] == Approx(x).epsilon(1e-6).margin(1e-7));
        }
    }
  }
}

TEST_CASE("H2O while decoding under a cap matches a float64 run entry by entry", "[h2o][stream]") {
  Rng rng(1603);
  for (int trial = 0; trial < 8; ++trial) {
    const int Hkv = 1 + trial % 2, G = 1 + (trial / 2) % 2, H = Hkv * G, d = 8, T = 90;
    const Index n = 12 + 4 * (trial % 3);
    const double share = trial % 4 == 3 ? 0.25 : 0.5;
    const std::vector<double> k = kvevict_test::normal_vector(static_cast<std::size_t>(Hkv * T * d), rng);
    const std::vector<double> q = kvevict_test::normal_vector(static_cast<std::size_t>(H * T * d), rng, 1.5);
    // A prompt of 30 tokens in one step, then decoding: single tokens, and steps of 3 in odd trials.
    std::vector<int> steps = {30};
    for (int t = 30; t < T;) {
      const int c = trial % 2 == 1 && T - t >= 3 ? 3 : 1;
      steps.push_back(c);
      t += c;
    }
    const Index capacity = n + 30;
    kvevict::CacheBook book(1, Hkv, capacity);
    std::vector<float> kc(static_cast<std::size_t>(Hkv * capacity * d), 0.0f);
    const kvevict::H2O policy = h2o(1, share);
    Index evictions = 0;
    for (const int c : steps) {
      const std::int64_t first = book.next_position();
      book.append(c);
      for (int h = 0; h < Hkv; ++h)
        for (int i = 0; i < c; ++i)
          for (int x = 0; x < d; ++x)
            kc[static_cast<std::size_t>((h * capacity + book.layer(0).length(h) - c + i) * d + x)] =
                static_cast<float>(k[static_cast<std::size_t>((h * T + first + i) * d + x)]);
      std::vector<float> qs;  // the step's queries [H, c, d]
      for (int qh = 0; qh < H; ++qh)
        for (int i = 0; i < c; ++i)
          for (int x = 0; x < d; ++x)
            qs.push_back(static_cast<float>(q[static_cast<std::size_t>((qh * T + first + i) * d + x)]));
      kvevict::LayerInputs<float> step;
      step.keys = kvevict::kv_heads_major<const float>(kc.data(), Hkv, capacity, d);
      step.queries = HeadsView<const float>::heads_major(qs.data(), H, c, d);
      book.layer(0).accumulate(step);
      kvevict::LayerInputs<float> window = step;  // the last query
      window.queries = kvevict::last_rows(step.queries, 1);
      evictions += kvevict::evict_over_budget(
          policy, book, n, [&](Index) { return window; },
          [&](Index, const Selection& s) {
            book.layer(0).apply(s, kvevict::kv_heads_major<float>(kc.data(), Hkv, capacity, d));
          });
    }
    std::vector<float> kf(k.size()), qf(q.size());  // the reference reads the float inputs the library got
    for (std::size_t i = 0; i < k.size(); ++i) kf[i] = static_cast<float>(k[i]);
    for (std::size_t i = 0; i < q.size(); ++i) qf[i] = static_cast<float>(q[i]);
    const auto want = ref::decode(std::vector<double>(kf.begin(), kf.end()), std::vector<double>(qf.begin(), qf.end()),
                                  H, Hkv, d, T, steps, 1, n, share);
    INFO("trial " << trial << " Hkv " << Hkv << " G " << G << " n " << n);
    CHECK(evictions == static_cast<Index>(steps.size()));  // the prompt, then every step
    for (int h = 0; h < Hkv; ++h) {
      std::vector<std::int64_t> held;
      for (Index j = 0; j < book.layer(0).length(h); ++j) held.push_back(book.layer(0).position(h, j));
      CHECK(held == want[static_cast<std::size_t>(h)]);
      // The carried scores moved with their entries: the newest entry received its own query's attention alone
      // plus the later ones (a single-token step: at least its self-attention, here > 0).
      CHECK(*book.layer(0).accumulated().row(h, book.layer(0).length(h) - 1) > 0.0f);
    }
  }
}

TEST_CASE("LayerBook carries received attention: zero for new entries, compacted, attached once accumulating",
          "[h2o][stream]") {
  kvevict::LayerBook layer(2, 6);
  layer.append(0, 4);
  kvevict::LayerInputs<float> in;
  CHECK_FALSE(layer.accumulates());
  CHECK(layer.describe(in).accumulated.heads() == 0);  // nothing accumulated: H2O reads the window
  const std::vector<float> a = {1, 2, 3, 4}, b = {5, 6};
  layer.add_attention(0, a.data(), 4);
  layer.add_attention(1, b.data(), 2);
  CHECK(layer.accumulates());
  CHECK(layer.describe(in).accumulated.rows() == 6);
  layer.append(4, 2);  // new entries start at 0
  CHECK(*layer.accumulated().row(0, 4) == 0.0f);
  CHECK(*layer.accumulated().row(1, 5) == 0.0f);
  std::vector<unsigned char> keep(2 * 6, 0);  // rows {1, 3, 5} of head 0, {0, 4} of head 1
  for (const int f : {1, 3, 5, 6 + 0, 6 + 4}) keep[static_cast<std::size_t>(f)] = 1;
  const Selection s = Selection::from_flags(keep, 2, 6);
  layer.apply(s);
  CHECK(*layer.accumulated().row(0, 0) == 2.0f);
  CHECK(*layer.accumulated().row(0, 1) == 4.0f);
  CHECK(*layer.accumulated().row(0, 2) == 0.0f);
  CHECK(*layer.accumulated().row(1, 0) == 5.0f);
  CHECK(layer.position(1, 1) == 4);
  REQUIRE_THROWS_MATCHES(layer.add_attention(1, a.data(), 3), kvevict::invalid_argument,
                         MessageContains("LayerBook::add_attention: n must be in [0, 2] (the entries of KV head 1)"));
  layer.clear();
  CHECK_FALSE(layer.accumulates());
}

TEST_CASE("H2O composes: AdaKV allocation, one budget across layers, shared sets", "[h2o]") {
  Rng rng(1604);
  const Ragged r = kvevict_test::random_ragged(rng, 4, 2, 2, 8, 40, 1.0);  // dense: shared sets need it
  const auto stored = kvevict_test::store<float>(r, kvevict_test::longest(r), false, 0.0f);
  std::vector<float> acc(static_cast<std::size_t>(2 * kvevict_test::longest(r)));
  for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = static_cast<float>((i * 37) % 11);
  kvevict::LayerInputs<float> in = stored.in;
  in.accumulated = HeadsView<const float>::heads_major(acc.data(), 2, kvevict_test::longest(r), 1);
  kvevict::Policy<kvevict::AdaKV, kvevict::H2OSelector>::Params ap;
  ap.window = 2;
  const Selection a = kvevict::Policy<kvevict::AdaKV, kvevict::H2OSelector>(ap).select(in, Budget::tokens(10));
  CHECK(a.total() == 20);
  kvevict::LayerGlobalPolicy<kvevict::H2OSelector>::Params lp;
  lp.window = 2;
  const std::vector<Selection> both = kvevict::LayerGlobalPolicy<kvevict::H2OSelector>(lp).select(
      std::vector<kvevict::LayerInputs<float>>{in, in}, Budget::tokens(10));
  CHECK(both[0].total() + both[1].total() == 40);
  kvevict::H2O::Params sp;
  sp.window = 2;
  sp.share = kvevict::Sharing::per_layer;
  const Selection shared = kvevict::H2O(sp).select(in, Budget::tokens(10));
  CHECK(rows_of(shared)[0].size() == 10);
  CHECK(rows_of(shared)[0] == rows_of(shared)[1]);
}

TEST_CASE("H2O errors", "[h2o][errors]") {
  const std::vector<float> keys(2 * 8 * 2, 1.0f), q(2 * 1 * 2, 1.0f);
  kvevict::LayerInputs<float> in;
  in.keys = kvevict::kv_heads_major<const float>(keys.data(), 2, 8, 2);
  in.queries = HeadsView<const float>::heads_major(q.data(), 2, 1, 2);
  std::vector<float> acc(2 * 7, 1.0f);
  in.accumulated = HeadsView<const float>::heads_major(acc.data(), 2, 7, 1);
  REQUIRE_THROWS_MATCHES(kvevict::H2O().select(in, Budget::tokens(4)), kvevict::invalid_argument,
                         MessageContains("kvevict::H2O::select: accumulated [2, 7, 1] must be [kv_heads = 2, >= 8"));
  acc.resize(2 * 8, 1.0f);
  acc[9] = std::numeric_limits<float>::quiet_NaN();
  in.accumulated = HeadsView<const float>::heads_major(acc.data(), 2, 8, 1);
  REQUIRE_THROWS_MATCHES(kvevict::H2O().select(in, Budget::tokens(4)), kvevict::invalid_argument,
                         MessageContains("accumulated[1, 1] is not finite"));
  kvevict::H2O::Params p;
  p.recent_share = 1.5;
  REQUIRE_THROWS_MATCHES(kvevict::H2O{p}, kvevict::invalid_argument,
                         MessageContains("recent_share must be in [0, 1], got 1.5"));
  p.recent_share = std::numeric_limits<double>::quiet_NaN();
  REQUIRE_THROWS_AS(kvevict::H2O{p}, kvevict::invalid_argument);
  // accumulate_attention: more step queries than a head holds, scores of the wrong shape, NaN queries.
  std::vector<float> scores(2 * 8, 0.0f);
  kvevict::LayerInputs<float> step;
  step.keys = in.keys;
  const std::vector<float> q9(2 * 9 * 2, 0.5f);
  step.queries = HeadsView<const float>::heads_major(q9.data(), 2, 9, 2);
  REQUIRE_THROWS_MATCHES(kvevict::accumulate_attention(step, HeadsView<float>::heads_major(scores.data(), 2, 8, 1)),
                         kvevict::invalid_argument,
                         MessageContains("the step's 9 queries must be the last entries of every KV head, but KV "
                                         "head 0 holds 8"));
  step.queries = HeadsView<const float>::heads_major(q9.data(), 2, 2, 2);
  REQUIRE_THROWS_MATCHES(kvevict::accumulate_attention(step, HeadsView<float>::heads_major(scores.data(), 2, 7, 1)),
                         kvevict::invalid_argument, MessageContains("scores [2, 7, 1] must be [kv_heads = 2, >= 8"));
  std::vector<float> qnan(q9.begin(), q9.begin() + 8);
  qnan[3] = std::numeric_limits<float>::infinity();
  step.queries = HeadsView<const float>::heads_major(qnan.data(), 2, 2, 2);
  REQUIRE_THROWS_MATCHES(kvevict::accumulate_attention(step, HeadsView<float>::heads_major(scores.data(), 2, 8, 1)),
                         kvevict::invalid_argument, MessageContains("queries[0, 1, 1] is not finite"));
  for (float s : scores) CHECK(s == 0.0f);  // nothing was added on any error
  kvevict::CacheBook book(1, 2, 8);
  book.append(4);
  REQUIRE_THROWS_MATCHES(book.layer(0).accumulate(step), kvevict::invalid_argument,
                         MessageContains("LayerBook::accumulate"));
  CHECK_FALSE(book.layer(0).accumulates());
}

}  // namespace test_h2o
