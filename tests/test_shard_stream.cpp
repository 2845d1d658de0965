// evict_over_budget(policy, book, n, shard::ModelShard, ...): a model whose layers are split across pipeline stages
// and whose KV heads are split across tensor-parallel ranks (threads here), each rank an engine holding its part and
// evicting while the cache grows, holds after every step exactly what the one-rank engine of the whole model holds
// for those layers and heads (docs/algorithms.md#sharded-streams): chunked prefill and capped decoding, every
// catalogue policy per head, in shared and block layouts, with a layer kept whole.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/cases.hpp"
#include "support/shard_models.hpp"
#include "support/stream_engine.hpp"
#include "support/thread_communicator.hpp"

namespace test_shard_stream {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::shard::Communicator;
using kvevict_test::Engine;
using kvevict_test::History;
using kvevict_test::Source;
using kvevict_test::Stream;

namespace {

// The splits compared: TP 1, 2, 4, PP 2, TP 2 x PP 2 (the sanitizers' tier: the last, whose both kinds of
// exchanges take every path).
std::vector<std::pair<int, int>> splits() {
  if (kvevict_test::sanitized) return {{2, 2}};
  return {{1, 1}, {2, 1}, {4, 1}, {1, 2}, {2, 2}};
}

// Each rank's history over tp x pp (contiguous layers per stage, contiguous KV heads per rank) against the one-rank
// history `whole`. Returns the (step, layer, head) triples compared.
template <class P>
int compare(const P& policy, const Source& src, const Stream& stream, Index w, Index n, Index kept_whole,
            const History& whole, int tp, int pp, const std::string& what) {
  std::vector<std::string> first_mismatch(static_cast<std::size_t>(tp * pp));
  std::vector<int> compared(static_cast<std::size_t>(tp * pp), 0);
  kvevict_test::run_split_ranks(tp, pp, [&](Communicator& model, Communicator& stage) {
    const int r = model.rank(), s = r / tp;
    const Index heads = src.Hkv / tp, h0 = (r % tp) * heads;
    kvevict::shard::ModelShard shard{&model, &stage, {}, {}};
    for (Index l = src.NL * s / pp; l < src.NL * (s + 1) / pp; ++l) shard.layers.push_back(l);
    for (Index h = h0; h < h0 + heads; ++h) shard.kv_heads.push_back(h);
    Engine mine(src, src.T, w, h0, heads, shard.layers, true, kept_whole);
    std::string& bad = first_mismatch[static_cast<std::size_t>(r)];
    for (std::size_t t = 0; t < stream.steps.size(); ++t) {
      mine.step(stream.steps[t]);
      mine.evict(policy, n, shard);
      for (std::size_t i = 0; i < shard.layers.size(); ++i)
        for (Index j = 0; j < heads; ++j, ++compared[static_cast<std::size_t>(r)])
          if (bad.empty() && mine.held(static_cast<Index>(i), j) !=
                                 whole[t][static_cast<std::size_t>(shard.layers[i])][static_cast<std::size_t>(h0 + j)])
            bad = "step " + std::to_string(t) + ", layer " + std::to_string(shard.layers[i]) + ", KV head " +
                  std::to_string(h0 + j);
    }
  });
  int total = 0;
  for (std::size_t r = 0; r < first_mismatch.size(); ++r) {
    INFO(what << ", " << stream.name << ", TP " << tp << " x PP " << pp << ", rank " << r);
    CHECK(first_mismatch[r] == "");
    total += compared[r];
  }
  return total;
}

// Every split of `policy` on `stream`.
template <class P>
int compare_splits(const P& policy, const Source& src, const Stream& stream, Index w, Index n, Index kept_whole,
                   const std::string& what) {
  const History whole = kvevict_test::one_rank(policy, src, stream, w, n, kept_whole);
  int compared = 0;
  for (const auto& [tp, pp] : splits()) compared += compare(policy, src, stream, w, n, kept_whole, whole, tp, pp, what);
  return compared;
}

// The streams compared: chunked prefill and capped decoding (the sanitizers' tier: chunked).
std::vector<Stream> streams(kvevict_test::Rng& rng, Index w, Index T) {
  std::vector<Stream> out{kvevict_test::chunked(rng, w, T)};
  if (!kvevict_test::sanitized) out.push_back(kvevict_test::capped(w, T));
  return out;
}

}  // namespace

TEST_CASE("a sharded model evicting while its cache grows holds what one rank holds, step after step",
          "[shard][stream]") {
  kvevict_test::Rng rng(20261208);
  const Index w = 4, T = 64;
  int compared = 0;
  for (int c = 0; c < kvevict_test::cases(2); ++c) {
    const int G = 1 + c % 2, Hkv = 4;
    const Source src = kvevict_test::random_source(rng, 2, Hkv * G, Hkv, 8, T);
    const Index n = 10 + 2 * c, kept_whole = c == 1 ? 1 : -1;
    for (const Stream& stream : streams(rng, w, T))
      kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
        kvevict::Knobs knobs;
        knobs.window = w;
        compared += compare_splits(e.make(knobs), src, stream, w, n, kept_whole,
                                   std::string(e.name) + ", case " + std::to_string(c));
      });
  }
  CHECK(compared > (kvevict_test::sanitized ? 500 : 10000));
}

TEST_CASE("a sharded stream in a layout (a page table per layer, one set per model, blocks) holds what one rank holds",
          "[shard][stream][layout]") {
  kvevict_test::Rng rng(20261209);
  const Index w = 4, T = 72;
  const Source src = kvevict_test::random_source(rng, 2, 8, 4, 8, T);
  int compared = 0;
  std::vector<std::pair<kvevict::Sharing, Index>> layouts{{kvevict::Sharing::per_layer, 4}};
  if (!kvevict_test::sanitized)
    layouts.insert(layouts.end(), {{kvevict::Sharing::per_model, 1}, {kvevict::Sharing::per_head, 4}});
  for (const Stream& stream : streams(rng, w, T))
    for (const auto& layout : layouts)
      kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
        const auto [share, block] = layout;  // (C++17 lambdas cannot capture structured bindings)
        kvevict::Knobs knobs;
        knobs.window = w;
        knobs.share = share;
        knobs.block = block;
        compared +=
            compare_splits(e.make(knobs), src, stream, w, 16, -1,
                           std::string(e.name) + ", " + kvevict::to_string(share) + "/" + std::to_string(block));
      });
  CHECK(compared > (kvevict_test::sanitized ? 200 : 5000));
}

TEST_CASE("a sharded stream evicts a layer once it holds one entry over its budget, on every rank alike",
          "[shard][stream]") {
  kvevict_test::Rng rng(6);
  const Source src = kvevict_test::random_source(rng, 2, 4, 4, 8, 40);
  const kvevict::SnapKV policy = kvevict_test::with_window<kvevict::SnapKV>(4);
  const kvevict::LayerDefensiveKV global = kvevict_test::with_window<kvevict::LayerDefensiveKV>(4);
  std::vector<std::vector<Index>> evicted(4);
  std::vector<Index> held(4);
  kvevict_test::run_split_ranks(2, 2, [&](Communicator& model, Communicator& stage) {
    const int r = model.rank();
    kvevict::shard::ModelShard shard{&model, &stage, {r / 2}, {2 * (r % 2), 2 * (r % 2) + 1}};
    Engine mine(src, 40, 4, 2 * (r % 2), 2, shard.layers);
    std::vector<Index>& got = evicted[static_cast<std::size_t>(r)];
    mine.step(12);
    got.push_back(mine.evict(policy, 12, shard));  // 12 per head, the budget: not due, the step ends
    got.push_back(mine.book.step());
    mine.step(4);
    got.push_back(mine.evict(policy, 15, shard));  // 16 per head, one over 15 (its step of 4 holds the window): due
    got.push_back(mine.book.layer(0).entries());
    mine.step(4);
    got.push_back(mine.evict(global, 10, shard));  // the model: 4 heads x 2 layers x (15 + 4) > 80, every layer
    held[static_cast<std::size_t>(r)] = mine.book.layer(0).entries();
  });
  for (const std::vector<Index>& got : evicted) CHECK(got == std::vector<Index>{0, 0, 1, 2 * 15, 1});
  CHECK(held[0] + held[1] + held[2] + held[3] == 2 * 4 * 10);  // the model's budget, split as one budget across layers
}

TEST_CASE("a sharded stream refuses, on every rank, books that do not match the shard or each other",
          "[shard][stream]") {
  kvevict_test::Rng rng(5);
  const Source src = kvevict_test::random_source(rng, 2, 4, 4, 8, 32);
  const kvevict::SnapKV policy = kvevict_test::with_window<kvevict::SnapKV>(4);
  std::vector<std::string> messages(2);
  // Rank 1 appended one token more than rank 0.
  kvevict_test::run_split_ranks(2, 1, [&](Communicator& model, Communicator& stage) {
    const int r = model.rank();
    kvevict::shard::ModelShard shard{&model, &stage, {0, 1}, {2 * r, 2 * r + 1}};
    Engine mine(src, 32, 4, 2 * r, 2, {0, 1});
    mine.step(r == 0 ? 20 : 21);
    try {
      mine.evict(policy, 8, shard);
    } catch (const kvevict::invalid_argument& e) {
      messages[static_cast<std::size_t>(r)] = e.what();
    }
    CHECK(mine.book.layer(0).length(0) == (r == 0 ? 20 : 21));  // nothing evicted
  });
  for (const std::string& m : messages)
    CHECK_THAT(m, Catch::Contains("the ranks' books are at different steps (rank 0: 20, rank 1: 21"));
  // Rank 1's book holds one layer, its shard names two; and both ranks claim KV head 0.
  for (int bad = 0; bad < 2; ++bad) {
    kvevict_test::run_split_ranks(2, 1, [&](Communicator& model, Communicator& stage) {
      const int r = model.rank();
      kvevict::shard::ModelShard shard{&model, &stage, {0, 1}, {2 * r, 2 * r + 1}};
      if (bad == 1) shard.kv_heads = {0, 1};
      Engine mine(src, 32, 4, 2 * r, 2, r == 1 && bad == 0 ? std::vector<Index>{0} : std::vector<Index>{0, 1});
      mine.step(20);
      try {
        mine.evict(policy, 8, shard);
      } catch (const kvevict::invalid_argument& e) {
        messages[static_cast<std::size_t>(r)] = e.what();
      }
    });
    for (const std::string& m : messages)
      CHECK_THAT(
          m, Catch::Contains(bad == 0 ? "rank 1 of 2: the book holds 1 layers, the shard names 2 (ModelShard::layers)"
                                      : "layer 0, KV head 0 is held by rank 0 and rank 1"));
  }
  // Layer 1 kept whole on rank 0 only; then rank 1's inputs_of throws (an engine's error): every rank refuses, and
  // nothing is evicted.
  for (int bad = 0; bad < 2; ++bad) {
    messages.assign(2, "");
    kvevict_test::run_split_ranks(2, 1, [&](Communicator& model, Communicator& stage) {
      const int r = model.rank();
      kvevict::shard::ModelShard shard{&model, &stage, {0, 1}, {2 * r, 2 * r + 1}};
      Engine mine(src, 32, 4, 2 * r, 2, {0, 1}, false, bad == 0 && r == 0 ? 1 : -1);
      mine.step(20);
      try {
        kvevict::evict_over_budget<double>(
            policy, mine.book, 8, shard,
            [&](Index i) {
              if (r == 1) throw std::runtime_error("the engine's view of layer " + std::to_string(i) + " failed");
              return mine.inputs(i);
            },
            [&](Index i, const kvevict::Selection& sel) { mine.apply(i, sel); });
      } catch (const kvevict::invalid_argument& e) {
        messages[static_cast<std::size_t>(r)] = e.what();
      }
      CHECK(mine.book.layer(0).length(0) == 20);
    });
    for (const std::string& m : messages)
      CHECK_THAT(m, Catch::Contains(bad == 0 ? "layer 1 is evicted on one rank and kept whole on another"
                                             : "rank 1 of 2: the engine's view of layer 0 failed"));
  }
}

}  // namespace test_shard_stream
