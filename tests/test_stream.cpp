// Eviction while the cache grows (docs/algorithms.md#streaming): CacheBook / evict_over_budget over a synthetic
// engine whose "forward pass" appends fixed keys, values and queries per position. One step of the whole prompt is
// the one-shot selection bit for bit; smaller steps keep every layer within the budget plus one step; errors leave
// the cache as it was.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/stream_engine.hpp"

namespace test_stream {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Engine;
using kvevict_test::MessageContains;
using kvevict_test::random_source;
using kvevict_test::Rng;
using kvevict_test::Source;

namespace {

/// The one-shot inputs of the first T tokens of `s`: dense layers, queries of positions T - w .. T - 1.
struct Dense {
  std::vector<std::vector<double>> q, scores;
  std::vector<kvevict::LayerInputs<double>> layers;
};
Dense dense_inputs(const Source& s, Index w) {
  Dense out;
  for (int l = 0; l < s.NL; ++l) {
    std::vector<double> q;
    for (int qh = 0; qh < s.H; ++qh)
      for (Index i = 0; i < w; ++i)
        for (int x = 0; x < s.d; ++x)
          q.push_back(s.q[static_cast<std::size_t>(l)][static_cast<std::size_t>((qh * s.T + s.T - w + i) * s.d + x)]);
    out.q.push_back(q);
  }
  for (int l = 0; l < s.NL; ++l) {
    const auto L = static_cast<std::size_t>(l);
    kvevict::LayerInputs<double> in;
    in.queries = kvevict::HeadsView<const double>::heads_major(out.q[L].data(), s.H, w, s.d);
    in.keys = kvevict::kv_heads_major<const double>(s.k[L].data(), s.Hkv, s.T, s.d);
    in.values = kvevict::kv_heads_major<const double>(s.v[L].data(), s.Hkv, s.T, s.d);
    in.w_o = kvevict::output_projection<const double>(s.w_o[L].data(), s.D, s.H, s.d);
    out.scores.push_back(kvevict_test::engine_scores<double>(s.Hkv, s.T));
    in.scores = kvevict::HeadsView<const double>::heads_major(out.scores.back().data(), s.Hkv, s.T, 1);
    out.layers.push_back(in);
  }
  return out;
}

kvevict::Knobs window_knob(Index w) {
  kvevict::Knobs k;
  k.window = w;
  return k;
}

}  // namespace

TEST_CASE("stream: one step of the whole prompt is the one-shot selection, bit for bit", "[stream]") {
  Rng rng(701);
  for (int trial = 0; trial < 6; ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + trial % 2, w = 2 + trial % 3, T = 40 + 9 * trial;
    const Source s = random_source(rng, 3, Hkv * G, Hkv, 8, T);
    const Dense dense = dense_inputs(s, w);
    for (const Index n : {Index{w}, Index{T / 3}, Index{T - 1}}) {
      kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
        INFO(e.name << " trial " << trial << " n " << n);
        const auto policy = e.make(window_knob(w));
        const std::vector<Selection> once = kvevict::select_layers<double>(policy, dense.layers, Budget::tokens(n));
        Engine eng(s, T + 3, w);
        eng.step(T);
        CHECK(eng.evict(policy, n) == s.NL);
        for (int l = 0; l < s.NL; ++l)
          for (int h = 0; h < Hkv; ++h) {
            const auto kept = once[static_cast<std::size_t>(l)].head(h);
            CHECK(eng.held(l, h) == std::vector<std::int64_t>(kept.begin(), kept.end()));
          }
      });
    }
  }
}

TEST_CASE("stream: chunked prefill and capped decoding stay within the budget plus one step", "[stream]") {
  Rng rng(702);
  for (int trial = 0; trial < 4; ++trial) {
    const int Hkv = 2 + trial % 2, G = 1 + trial % 2, w = 2 + trial, T = 150;
    const Source s = random_source(rng, 2, Hkv * G, Hkv, 8, T);
    const Index n = 3 * w + trial;
    kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
      INFO(e.name << " trial " << trial);
      const auto policy = e.make(window_knob(w));
      using P = typename std::decay_t<decltype(e)>::policy_type;
      const bool model_budget = kvevict::budget_scope<P>() == kvevict::BudgetScope::model;
      Index kept_window = w;  // an open window (docs/algorithms.md#open-window) keeps only the newest entry
      if constexpr (std::is_base_of_v<kvevict::DefensiveSelector::Params, typename P::Params>)
        if (policy.params().open_window) kept_window = 1;
      Engine eng(s, T, w);
      std::uniform_int_distribution<Index> step_size(w, 4 * w);
      Index evictions = 0;
      while (eng.book.next_position() < T) {
        const Index c = std::min<Index>(step_size(rng), T - eng.book.next_position());
        if (c < w) break;
        eng.step(c);
        for (int l = 0; l < s.NL; ++l) CHECK(eng.book.layer(l).entries() <= (model_budget ? s.NL : 1) * Hkv * (n + c));
        evictions += eng.evict(policy, n);
        if (model_budget) CHECK(eng.book.entries() <= s.NL * Hkv * n);
        for (int l = 0; l < s.NL; ++l) {
          if (!model_budget) CHECK(eng.book.layer(l).entries() <= Hkv * n);
          for (int h = 0; h < Hkv; ++h) {
            const std::vector<std::int64_t> p = eng.held(l, h);
            CHECK(std::is_sorted(p.begin(), p.end()));
            CHECK(std::adjacent_find(p.begin(), p.end()) == p.end());
            // The window (the step's last w positions; an open window's newest) is always kept (n >= w).
            for (Index i = 1; i <= kept_window; ++i)
              CHECK(std::find(p.begin(), p.end(), eng.book.next_position() - i) != p.end());
          }
        }
      }
      CHECK(evictions > 0);
    });
  }
}

TEST_CASE("stream: a step shorter than the window is not evicted yet, one over the capacity changes nothing",
          "[stream][errors]") {
  Rng rng(703);
  const Source s = random_source(rng, 2, 2, 2, 4, 60);
  kvevict::SnapKV::Params p;
  p.window = 4;
  const kvevict::SnapKV snap(p);
  Engine eng(s, 40, 4);
  eng.step(20);
  CHECK(eng.evict(snap, 8) == 2);
  CHECK_FALSE(eng.book.layer(0).over_budget(8));
  CHECK_FALSE(eng.book.over_budget(8));
  eng.step(3);
  CHECK(eng.book.layer(0).over_budget(8));  // 11 per head > 8
  CHECK(eng.book.over_budget(8));
  CHECK_FALSE(eng.book.layer(0).over_budget(11));
  const std::vector<std::int64_t> before = eng.held(1, 1);
  CHECK(eng.evict(snap, 8) == 0);  // not yet: 3 tokens since the last eviction, the window is 4
  CHECK(eng.book.step() == 3);     // the step goes on
  CHECK(eng.held(1, 1) == before);
  CHECK(eng.book.layer(1).entries() == 2 * 11);
  REQUIRE_THROWS_MATCHES(eng.book.append(30), kvevict::invalid_argument,
                         MessageContains("CacheBook::append: layer 0 KV head 0 would hold 41 entries, over the "
                                         "capacity of 40"));
  CHECK(eng.book.next_position() == 23);
  CHECK(eng.held(1, 1) == before);
  eng.step(1);  // 4 tokens since the last eviction: now it may evict
  CHECK(eng.evict(snap, 8) == 2);
  CHECK(eng.book.layer(1).entries() == 16);
  REQUIRE_THROWS_MATCHES(kvevict::LayerBook(0, 4), kvevict::invalid_argument, MessageContains("kv_heads >= 1"));
}

TEST_CASE("stream: decoding one token at a time evicts every w tokens, within stream_capacity", "[stream]") {
  Rng rng(704);
  const int Hkv = 2, w = 3, T = 64;
  const Source s = random_source(rng, 2, 4, Hkv, 8, T);
  const Index n = 12;
  CHECK(kvevict::stream_capacity(n, 1, w) == n + w);
  CHECK(kvevict::stream_capacity(n, 2, w) == n + 4);  // evicts once the step reaches 4 >= w
  CHECK(kvevict::stream_capacity(n, 5, w) == n + 5);
  CHECK(kvevict::stream_capacity(n, 1, 0) == n + 1);
  REQUIRE_THROWS_MATCHES(kvevict::stream_capacity(n, 0, w), kvevict::invalid_argument,
                         MessageContains("stream_capacity: needs n >= 1, step >= 1 and window >= 0, got n 12, step 0"));
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
    INFO(e.name);
    const auto policy = e.make(window_knob(w));
    using P = typename std::decay_t<decltype(e)>::policy_type;
    const Index layers = kvevict::budget_scope<P>() == kvevict::BudgetScope::model ? s.NL : 1;
    const Index wp = policy.params().window;  // 0: StreamingLLM evicts after every token
    Engine eng(s, T, w);
    eng.step(2 * w);  // the prompt
    Index evictions = 0;
    while (eng.book.next_position() < T) {
      eng.step(1);
      const Index step = eng.book.step();
      const Index evicted = eng.evict(policy, n);
      evictions += evicted;
      CHECK(eng.book.step() < std::max<Index>(wp, 1));  // evicted as soon as the step holds the window
      if (evicted > 0) CHECK(step >= wp);
      for (int l = 0; l < s.NL; ++l)
        CHECK(eng.book.layer(l).entries() <= layers * Hkv * kvevict::stream_capacity(n, 1, wp));
    }
    CHECK(evictions >= (T - n - 2 * w) / std::max<Index>(wp, 1));
  });
}

TEST_CASE("stream: worked examples, per-token scales and a K-shift carried through eviction", "[stream]") {
  // docs/algorithms.md#streaming. One layer, Hkv 1, d 4, capacity 16, StreamingLLM (2 sinks, window 0), n 4; the
  // engine stores a per-token key scale beside its keys and re-rotates the kept keys to 0, 1, ... (a K-shift).
  kvevict::StreamingLLM::Params p;
  p.sinks = 2;
  const kvevict::StreamingLLM policy(p);
  const Index cap = 16, d = 4;
  std::vector<float> k(cap * d), v(cap * d), k_scale(cap);
  const auto keys = kvevict::kv_heads_major<float>(k.data(), 1, cap, d);
  const auto values = kvevict::kv_heads_major<float>(v.data(), 1, cap, d);
  const auto scales = kvevict::HeadsView<float>::heads_major(k_scale.data(), 1, cap, 1);
  const kvevict::Rope rope;  // half pairs over all 4 dimensions: pair 0 is (0, 2), frequency 1
  kvevict::CacheBook book(1, 1, cap);
  // Token t's key before RoPE is (t + 1, 0, 1, 0), its scale t + 1: at position a it is stored as
  // ((t + 1) cos a - sin a, 0, (t + 1) sin a + cos a, 0).
  const auto rotated = [](double x, double a) {
    return std::make_pair(x * std::cos(a) - std::sin(a), x * std::sin(a) + std::cos(a));
  };
  std::int64_t tokens = 0;
  const auto write = [&](Index c) {  // the forward pass of c tokens at the book's next positions
    book.append(c);
    const Index L = book.layer(0).length(0);
    for (Index j = L - c; j < L; ++j, ++tokens) {
      const double x = static_cast<double>(tokens + 1);
      const auto [k0, k2] = rotated(x, static_cast<double>(book.layer(0).position(0, j)));
      float* row = k.data() + j * d;
      row[0] = static_cast<float>(k0), row[1] = 0.f, row[2] = static_cast<float>(k2), row[3] = 0.f;
      k_scale[static_cast<std::size_t>(j)] = static_cast<float>(x);
      v[static_cast<std::size_t>(j * d)] = static_cast<float>(x);
    }
  };
  const auto holds = [&](const std::vector<float>& want_scales) {
    CHECK(std::vector<float>(k_scale.begin(), k_scale.begin() + 4) == want_scales);
    for (Index j = 0; j < 4; ++j) {
      CHECK(book.layer(0).position(0, j) == j);
      const auto [k0, k2] = rotated(k_scale[static_cast<std::size_t>(j)], static_cast<double>(j));
      CHECK(k[static_cast<std::size_t>(j * d)] == Approx(k0).margin(1e-5));
      CHECK(k[static_cast<std::size_t>(j * d) + 2] == Approx(k2).margin(1e-5));
      CHECK(v[static_cast<std::size_t>(j * d)] == k_scale[static_cast<std::size_t>(j)]);
    }
  };
  const auto evict = [&] {
    return kvevict::evict_over_budget(
        policy, book, 4,
        [&](Index) {
          kvevict::LayerInputs<float> in;
          in.keys = keys;
          in.values = values;
          return in;
        },
        [&](Index, const Selection& kept) {
          book.layer(0).apply(kept, keys, values, scales);  // the scales move with their rows
          kvevict::rerotate_kept(keys, kept, rope);         // the K-shift: kept row j to position j
        });
  };
  write(7);  // tokens 0..6 at positions 0..6
  REQUIRE(evict() == 1);
  book.renumber();  // kept: the sinks (tokens 0, 1) and the newest (5, 6), now at positions 0..3; next at 4
  CHECK(book.next_position() == 4);
  holds({1, 2, 6, 7});
  write(3);  // tokens 7, 8, 9 at positions 4, 5, 6: the book's positions are the keys' own
  REQUIRE(evict() == 1);
  book.renumber();
  CHECK(book.next_position() == 4);
  holds({1, 2, 9, 10});
  REQUIRE_THROWS_MATCHES(kvevict::CacheBook(1, 1, 4).renumber(), kvevict::invalid_argument,
                         MessageContains("renumbers right after a step that evicted every layer"));
}

TEST_CASE("stream: shared and block layouts stay shared, whole and within budget while the cache grows",
          "[stream][layout]") {
  Rng rng(703);
  const int Hkv = 2, G = 2, w = 4, T = 160;
  const Source s = random_source(rng, 3, Hkv * G, Hkv, 8, T);
  const Index n = 24;
  for (kvevict::Sharing share : {kvevict::Sharing::per_layer, kvevict::Sharing::per_model})
    for (Index block : {Index(1), Index(8)}) {
      kvevict::Knobs k = window_knob(w);
      k.share = share;
      k.block = block;
      kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
        INFO(e.name << " share " << kvevict::to_string(share) << " block " << block);
        const auto policy = e.make(k);
        Engine eng(s, T, w);
        Index evictions = 0;
        while (eng.book.next_position() < T) {
          eng.step(std::min<Index>(20, T - eng.book.next_position()));
          evictions += eng.evict(policy, n);
          for (int l = 0; l < s.NL; ++l) {
            // Every head of the layer (per_model: of the model) holds the same positions.
            const std::vector<std::int64_t> first = eng.held(share == kvevict::Sharing::per_model ? 0 : l, 0);
            for (int h = 0; h < Hkv; ++h) CHECK(eng.held(l, h) == first);
          }
          // Shared: n tokens per layer (per_model: n for the model), whole blocks rounding down; a model budget
          // (layer-global, PyramidKV) per layer: n per layer on average.
          if (evictions > 0 && eng.book.step() == 0) {
            Index total = 0;
            for (int l = 0; l < s.NL; ++l) {
              total += eng.book.layer(l).length(0);
              if (e.scope != kvevict::BudgetScope::model || share == kvevict::Sharing::per_model)
                CHECK(eng.book.layer(l).length(0) <= n);
            }
            CHECK(total <= s.NL * n);
          }
        }
        CHECK(evictions > 0);
      });
    }
}

}  // namespace test_stream
