// Ragged layers and original positions (docs/algorithms.md#ragged): the same entries give the same selection
// whatever the storage (layout, capacity, what lies beyond each head's length), a ragged layer holding a dense
// layer's entries selects as the dense layer, per-head stages see only the head's own entries, positions order ties
// and come back in the Selection, and bad ragged inputs are refused.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "support/matchers.hpp"
#include "support/ragged_inputs.hpp"
#include "support/random_inputs.hpp"

namespace test_ragged {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::MessageContains;
using kvevict_test::Ragged;
using kvevict_test::Rng;
template <class T>
using Stored = kvevict_test::RaggedStored<T>;
using kvevict_test::length;
using kvevict_test::longest;
using kvevict_test::random_ragged;
using kvevict_test::store;

namespace {

bool same(const Selection& a, const Selection& b) {
  return a.indices() == b.indices() && a.offsets() == b.offsets() && a.positions() == b.positions();
}

/// Window w, per-head selections: TOVA shares one set per layer by default, which needs every KV head at the same
/// positions (docs/algorithms.md#layouts); these layers hold each head's own.
kvevict::Knobs window_knob(int w) {
  kvevict::Knobs k;
  k.window = w;
  k.share = kvevict::Sharing::per_head;
  return k;
}

/// Calls f(name, policy) for every catalogue entry with window w.
template <class F>
void for_each_policy(int w, F&& f) {
  kvevict::catalogue::for_each(kvevict::catalogue::entries(),
                               [&](const auto& e) { f(e.name, e.make(window_knob(w))); });
}

template <class P, class In>
Selection select_one(const P& policy, const In& in, const Budget& budget) {
  return kvevict::select_layers<double>(policy, std::vector<In>{in}, budget).front();
}

}  // namespace

TEST_CASE("ragged: the same entries select alike in every layout, capacity and padding", "[ragged]") {
  Rng rng(601);
  for (int trial = 0; trial < 12; ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + trial % 2, w = 1 + trial % 4, d = 8 + 8 * (trial % 2);
    const Ragged r = random_ragged(rng, Hkv * G, Hkv, w, d, 40 + 7 * trial, 0.3 + 0.05 * trial);
    const Index L = longest(r);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const Stored<double> tight = store<double>(r, L, false, 0.0);
    const Stored<double> roomy = store<double>(r, L + 9, false, nan);  // NaN beyond every head's length
    const Stored<double> tokens = store<double>(r, L + 3, true, nan);
    const Stored<double> shifted = store<double>(r, L, false, 0.0, 1000);
    Index min_length = L;
    for (int h = 0; h < Hkv; ++h) min_length = std::min(min_length, length(r, h));
    for (const std::int64_t n :
         {std::int64_t{1}, static_cast<std::int64_t>(w), static_cast<std::int64_t>(min_length)}) {
      for_each_policy(w, [&](std::string_view name, const auto& policy) {
        INFO(name << " trial " << trial << " n " << n);
        const Selection a = select_one(policy, tight.in, Budget::tokens(n));
        CHECK(same(a, select_one(policy, roomy.in, Budget::tokens(n))));
        CHECK(same(a, select_one(policy, tokens.in, Budget::tokens(n))));
        const Selection s = select_one(policy, shifted.in, Budget::tokens(n));  // only the order of positions counts
        CHECK(a.indices() == s.indices());
        // Kept positions are the entries' positions; each head keeps at most its length.
        for (int h = 0; h < Hkv; ++h) {
          CHECK(a.length(h) <= length(r, h));
          for (Index i = 0; i < a.length(h); ++i)
            CHECK(a.head_positions(h)[i] ==
                  r.heads[static_cast<std::size_t>(h)].pos[static_cast<std::size_t>(a.head(h)[i])]);
        }
        CHECK(a.total() <= Hkv * n);
      });
    }
  }
}

TEST_CASE("ragged: a ragged layer holding a dense layer's entries selects as the dense layer", "[ragged]") {
  Rng rng(602);
  for (int trial = 0; trial < 10; ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + (trial / 3) % 2, w = 1 + trial % 3, d = 16;
    const Ragged r = random_ragged(rng, Hkv * G, Hkv, w, d, 30 + 5 * trial, 2.0);  // every position kept
    const Index L = longest(r);
    const Stored<double> dense = store<double>(r, L, false, 0.0, 0, false);
    kvevict::LayerInputs<double> plain = dense.in;  // no lengths, no positions: a dense layer of L tokens
    plain.lengths = nullptr;
    const Stored<double> ragged = store<double>(r, L + 5, trial % 2 == 1, std::numeric_limits<double>::quiet_NaN());
    for (const double keep : {0.1, 0.5, 0.9}) {
      for_each_policy(w, [&](std::string_view name, const auto& policy) {
        INFO(name << " trial " << trial << " keep " << keep);
        CHECK(same(select_one(policy, plain, Budget::keep_ratio(keep)),
                   select_one(policy, ragged.in, Budget::keep_ratio(keep))));
      });
    }
  }
}

TEST_CASE("ragged: per-head policies see each head's own entries only", "[ragged]") {
  // SnapKV, CriticalSnapKV and StreamingLLM choose per head: head h of a ragged layer keeps what a one-head layer of
  // its own entries (its G query heads) keeps with min(n, L_h).
  Rng rng(603);
  for (int trial = 0; trial < 10; ++trial) {
    const int Hkv = 2 + trial % 3, G = 1 + trial % 2, w = 1 + trial % 4, d = 8;
    const Ragged r = random_ragged(rng, Hkv * G, Hkv, w, d, 50, 0.2 + 0.07 * trial);
    const Stored<double> all = store<double>(r, longest(r) + 2, false, std::numeric_limits<double>::quiet_NaN());
    const std::int64_t n = std::min<Index>(longest(r) - 1, 2 * w + 3);
    if (static_cast<Index>(Hkv) * n > std::accumulate(all.lengths.begin(), all.lengths.end(), Index{0})) continue;
    for (int h = 0; h < Hkv; ++h) {
      Ragged one;
      one.H = G;
      one.Hkv = 1;
      one.w = w;
      one.d = d;
      one.D = r.D;
      one.heads = {r.heads[static_cast<std::size_t>(h)]};
      one.q.assign(r.q.begin() + h * G * w * d, r.q.begin() + (h + 1) * G * w * d);
      for (int row = 0; row < r.D; ++row)  // W_o's columns of query heads h*G .. h*G + G - 1
        for (int c = 0; c < G * d; ++c)
          one.w_o.push_back(r.w_o[static_cast<std::size_t>(row * r.H * d + h * G * d + c)]);
      const Stored<double> single = store<double>(one, longest(one), false, 0.0);
      const Budget own = Budget::tokens(std::min<Index>(n, length(r, h)));
      INFO("trial " << trial << " head " << h);
      const kvevict::SnapKV::Params sp = [&] {
        kvevict::SnapKV::Params p;
        p.window = w;
        return p;
      }();
      CHECK(kvevict::SnapKV(sp).select<double>(all.in, Budget::tokens(n)).head_positions(h).size() ==
            std::min<Index>(n, length(r, h)));
      const Selection a = kvevict::SnapKV(sp).select<double>(all.in, Budget::tokens(n));
      const Selection b = kvevict::SnapKV(sp).select<double>(single.in, own);
      CHECK(std::vector<std::int64_t>(a.head(h).begin(), a.head(h).end()) ==
            std::vector<std::int64_t>(b.head(0).begin(), b.head(0).end()));
      kvevict::CriticalSnapKV::Params cp;
      cp.window = w;
      const Selection c = kvevict::CriticalSnapKV(cp).select<double>(all.in, Budget::tokens(n));
      const Selection e = kvevict::CriticalSnapKV(cp).select<double>(single.in, own);
      CHECK(std::vector<std::int64_t>(c.head(h).begin(), c.head(h).end()) ==
            std::vector<std::int64_t>(e.head(0).begin(), e.head(0).end()));
      const Selection s = kvevict::StreamingLLM().select(all.in, Budget::tokens(n));
      const Selection t = kvevict::StreamingLLM().select(single.in, own);
      CHECK(std::vector<std::int64_t>(s.head_positions(h).begin(), s.head_positions(h).end()) ==
            std::vector<std::int64_t>(t.head_positions(0).begin(), t.head_positions(0).end()));
    }
  }
}

TEST_CASE("ragged: ties across heads go to the higher position, not the higher row", "[ragged]") {
  // Two KV heads, w = 1, attention given, no pooling: every prefix entry scores .25. AdaKV (alpha 0) keeping 4 of 6
  // keeps both windows and the two highest positions of the four tied prefix entries. Head 0 at {0, 5, 9}, head 1
  // at {3, 4, 9}: positions 5 and 4. Head 1 at {6, 7, 9}: positions 7 and 6, both in head 1 (by rows, row 1 of each
  // head would win).
  const std::vector<double> attn = {0.25, 0.25, 0.5, 0.25, 0.25, 0.5};  // [H = 2, w = 1, 3]
  const std::vector<double> keys(2 * 3 * 1, 0.0);
  const std::vector<std::int64_t> lengths = {3, 3};
  kvevict::AdaKV::Params p;
  p.window = 1;
  p.alpha = 0.0;
  p.kernel = 1;
  for (const auto& [positions, want] : std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>>{
           {{0, 5, 9, 3, 4, 9}, {5, 9, 4, 9}}, {{0, 5, 9, 6, 7, 9}, {9, 6, 7, 9}}}) {
    kvevict::LayerInputs<double> in;
    in.attention = kvevict::HeadsView<const double>::heads_major(attn.data(), 2, 1, 3);
    in.keys = kvevict::kv_heads_major<const double>(keys.data(), 2, 3, 1);
    in.lengths = lengths.data();
    in.positions = kvevict::positions_heads_major(positions.data(), 2, 3);
    const Selection s = kvevict::AdaKV(p).select<double>(in, Budget::tokens(2));
    CHECK(s.positions() == want);
  }
}

TEST_CASE("ragged: compaction of keys, values and positions with one Selection", "[ragged]") {
  Rng rng(604);
  const Ragged r = random_ragged(rng, 4, 2, 2, 4, 30, 0.5);
  Stored<float> s = store<float>(r, longest(r) + 4, false, 0.0f);
  kvevict::AdaKV::Params p;
  p.window = 2;
  const Selection sel = kvevict::AdaKV(p).select(s.in, Budget::tokens(6));
  const Index C = longest(r) + 4;
  const kvevict::HeadsView<std::int64_t> pos(s.positions.data(), 2, C, 1, C, 1);
  const kvevict::KVView<float> keys(s.k.data(), 2, C, 4, C * 4, 4);
  sel.compact(pos, pos);  // the positions array: one call
  sel.compact(keys, keys);
  for (int h = 0; h < 2; ++h)
    for (Index i = 0; i < sel.length(h); ++i) {
      CHECK(*pos.row(h, i) == sel.head_positions(h)[i]);
      const auto j = static_cast<std::size_t>(sel.head(h)[i]);
      CHECK(keys.row(h, i)[0] == static_cast<float>(r.heads[static_cast<std::size_t>(h)].keys[j * 4]));
    }
}

TEST_CASE("ragged: bad lengths, positions and windows are refused", "[ragged][errors]") {
  Rng rng(605);
  const Ragged r = random_ragged(rng, 2, 2, 3, 4, 20, 0.5);
  Stored<float> s = store<float>(r, longest(r) + 1, false, 0.0f);
  kvevict::SnapKV::Params p;
  p.window = 3;
  const kvevict::SnapKV snap(p);
  const auto refuses = [&](const kvevict::LayerInputs<float>& in, const std::string& what) {
    REQUIRE_THROWS_MATCHES(snap.select(in, Budget::tokens(3)), kvevict::invalid_argument, MessageContains(what));
  };
  {
    std::vector<std::int64_t> bad = s.lengths;
    bad[1] = longest(r) + 2;
    kvevict::LayerInputs<float> in = s.in;
    in.lengths = bad.data();
    refuses(in, "kvevict::SnapKV::select: lengths[1] must be in [1, " + std::to_string(longest(r) + 1) +
                    "] (the keys' rows, the capacity), got " + std::to_string(longest(r) + 2));
    bad[1] = 0;
    refuses(in, "lengths[1] must be in [1, ");
    bad[1] = 3;  // == window
    refuses(in, "window (3) must be smaller than the entries of KV head 1 (3)");
  }
  {
    std::vector<std::int64_t> pos = s.positions;
    pos[1] = pos[0];
    kvevict::LayerInputs<float> in = s.in;
    in.positions = kvevict::positions_heads_major(pos.data(), 2, longest(r) + 1);
    refuses(in, "positions of KV head 0 must be strictly increasing, got " + std::to_string(pos[0]) + " then " +
                    std::to_string(pos[0]) + " at entry 1");
    in.positions = kvevict::positions_heads_major(pos.data(), 1, longest(r) + 1);
    refuses(in, "positions [1, ");
  }
  {
    kvevict::SnapKV::Params q = p;
    q.reference_quirks = true;
    if (s.lengths[0] != s.lengths[1])
      REQUIRE_THROWS_MATCHES(
          kvevict::SnapKV(q).select(s.in, Budget::tokens(3)), kvevict::invalid_argument,
          MessageContains("reference_quirks needs every KV head to hold the same number of entries"));
  }
  {
    const std::int64_t total = s.lengths[0] + s.lengths[1];
    REQUIRE_THROWS_MATCHES(
        snap.select(s.in, Budget::tokens(total / 2 + 1)), kvevict::invalid_argument,
        MessageContains("n_kept must be in [1, " + std::to_string(total / 2) + "] (the mean entries per KV head"));
  }
}

}  // namespace test_ragged
