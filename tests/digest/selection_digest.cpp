// kvevict-selection-digest: what every catalogue policy and composition keeps on seeded random models, one line
// per (policy, case): a hash of every kept row of every layer, or the error message. Run it before and after a
// change that must not change any selection (a refactor) and diff the two outputs:
//   cmake --preset dev -DKVEVICT_BUILD_DIGEST=ON && cmake --build --preset dev --target kvevict-selection-digest
//   build/dev/tests/kvevict-selection-digest > before.txt   # change, rebuild, run again: diff before.txt after.txt
// Cases: dense models of 3 layers (random shapes) at several budgets, in float and double arithmetic, through
// select_layers, per-layer select and plan/apply, under every layout (per head, per layer, per model, blocks, both
// reductions) and the reference quirks; ragged layers with positions; eviction while the cache grows.
#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using Rng = std::mt19937_64;

std::vector<float> normal(std::size_t n, Rng& rng, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<float> x(n);
  for (float& v : x) v = static_cast<float>(scale * dist(rng));
  return x;
}

/// FNV-1a over the kept rows of every head of every layer.
struct Hash {
  std::uint64_t h = 1469598103934665603ull;
  void add(std::int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<std::uint64_t>(v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  void add(const Selection& s) {
    add(s.heads());
    for (Index k = 0; k < s.heads(); ++k) {
      add(s.head(k).size());
      for (auto j : s.head(k)) add(static_cast<std::int64_t>(j));
    }
  }
  void add(const std::vector<Selection>& v) {
    for (const Selection& s : v) add(s);
  }
};

/// The score an engine gives the entry of layer l, KV head h at position `pos` (LayerInputs::scores): a fixed
/// pseudo-random value in [0, 1) that draws nothing from the random stream (the other policies' cases stay as they
/// were).
float engine_score(int l, Index h, std::int64_t pos) {
  const double x = std::sin(12.9898 * static_cast<double>(pos + 1) + 78.233 * static_cast<double>(h + 1) +
                            3.7 * static_cast<double>(l)) *
                   43758.5453;
  return static_cast<float>(x - std::floor(x));
}

/// A model: per layer keys, values [Hkv, cap, d], queries [H, w, d], W_o [D, H d], the engine's scores [Hkv, cap];
/// lengths and positions when ragged.
struct Model {
  int NL = 3, H = 4, Hkv = 2, w = 4, L = 64, d = 16, D = 32;
  bool ragged = false;
  std::vector<std::vector<float>> k, v, q, w_o, scores;
  std::vector<std::vector<std::int64_t>> lengths, positions;
  std::vector<kvevict::LayerInputs<float>> in;
};

Model random_model(Rng& rng, bool ragged) {
  static const int heads[] = {1, 2, 4};
  static const int windows[] = {1, 4, 8};
  Model m;
  m.ragged = ragged;
  m.Hkv = heads[rng() % 3];
  m.H = m.Hkv * static_cast<int>(1 + rng() % 3);
  m.w = windows[rng() % 3];
  m.L = m.w + 8 + static_cast<int>(rng() % 160);
  for (int l = 0; l < m.NL; ++l) {
    const auto n = static_cast<std::size_t>(m.Hkv * m.L * m.d);
    m.k.push_back(normal(n, rng));
    m.v.push_back(normal(n, rng));
    m.q.push_back(normal(static_cast<std::size_t>(m.H * m.w * m.d), rng, 1.5));
    m.w_o.push_back(normal(static_cast<std::size_t>(m.D * m.H * m.d), rng, 0.5));
    std::vector<std::int64_t> len, pos(static_cast<std::size_t>(m.Hkv * m.L), 0);
    for (int h = 0; h < m.Hkv; ++h) {
      const int n_h = ragged ? m.w + 4 + static_cast<int>(rng() % static_cast<unsigned>(m.L - m.w - 3)) : m.L;
      len.push_back(n_h);
      std::int64_t p = 0;
      for (int j = 0; j < n_h; ++j) {
        p += ragged ? 1 + static_cast<std::int64_t>(rng() % 3) : 1;
        pos[static_cast<std::size_t>(h * m.L + j)] = p;
      }
    }
    m.lengths.push_back(len);
    m.positions.push_back(pos);
    std::vector<float> scores(pos.size());
    for (std::size_t i = 0; i < pos.size(); ++i) scores[i] = engine_score(l, static_cast<Index>(i) / m.L, pos[i]);
    m.scores.push_back(scores);
  }
  for (int l = 0; l < m.NL; ++l) {
    const auto L = static_cast<std::size_t>(l);
    kvevict::LayerInputs<float> in;
    in.queries = kvevict::HeadsView<const float>::heads_major(m.q[L].data(), m.H, m.w, m.d);
    in.keys = kvevict::kv_heads_major<const float>(m.k[L].data(), m.Hkv, m.L, m.d);
    in.values = kvevict::kv_heads_major<const float>(m.v[L].data(), m.Hkv, m.L, m.d);
    in.w_o = kvevict::output_projection<const float>(m.w_o[L].data(), m.D, m.H, m.d);
    in.scores = kvevict::HeadsView<const float>::heads_major(m.scores[L].data(), m.Hkv, m.L, 1);
    if (ragged) {
      in.lengths = m.lengths[L].data();
      in.positions = kvevict::positions_heads_major(m.positions[L].data(), m.Hkv, m.L);
    }
    m.in.push_back(in);
  }
  return m;
}

struct Layout {
  const char* name;
  kvevict::Sharing share;
  Index block;
  kvevict::Reduce reduce;
  bool quirks;
};
const Layout kLayouts[] = {
    {"head", kvevict::Sharing::per_head, 1, kvevict::Reduce::max, false},
    {"head-quirks", kvevict::Sharing::per_head, 1, kvevict::Reduce::max, true},
    {"head-b4", kvevict::Sharing::per_head, 4, kvevict::Reduce::max, false},
    {"layer-max", kvevict::Sharing::per_layer, 1, kvevict::Reduce::max, false},
    {"layer-mean-b8", kvevict::Sharing::per_layer, 8, kvevict::Reduce::mean, false},
    {"model", kvevict::Sharing::per_model, 1, kvevict::Reduce::max, false},
    {"model-mean-b4", kvevict::Sharing::per_model, 4, kvevict::Reduce::mean, false},
};

template <class F>
std::string outcome(F&& f) {
  try {
    Hash h;
    f(h);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h.h));
    return buf;
  } catch (const kvevict::invalid_argument& e) {
    return std::string("error: ") + e.what();
  }
}

/// Every entry point on one model and budget, in arithmetic type S.
template <class S, class P>
void run_entry_points(const P& policy, const Model& m, const Budget& budget, const std::string& tag) {
  std::printf("%s select_layers %s\n", tag.c_str(),
              outcome([&](Hash& h) { h.add(kvevict::select_layers<S>(policy, m.in, budget)); }).c_str());
  std::printf("%s select-each %s\n", tag.c_str(),
              outcome([&](Hash& h) {
                for (int l = 0; l < m.NL; ++l)
                  h.add(policy.template select<S>(m.in[static_cast<std::size_t>(l)], budget, l, m.NL));
              }).c_str());
  std::printf("%s select-one %s\n", tag.c_str(),
              outcome([&](Hash& h) { h.add(policy.template select<S>(m.in.front(), budget)); }).c_str());
  // StreamingLLM has plan() too since it became Policy<UniformAllocation, RecencySelector> (cf196d3); it stays out
  // so that this file still compiles against, and compares with, include/ trees from before that.
  if constexpr (!std::is_same_v<P, kvevict::StreamingLLM>)
    std::printf("%s plan %s\n", tag.c_str(), outcome([&](Hash& h) {
                                               auto plan = policy.template plan<S>(budget, m.NL);
                                               for (const auto& in : m.in) plan.add(in);
                                               h.add(plan.apply());
                                             }).c_str());
}

/// Eviction while the cache grows: steps of `step` tokens under a cap of n per head on average.
template <class P>
void run_stream(const P& policy, const Model& m, Index n, Index step, const std::string& tag) {
  std::printf("%s stream %s\n", tag.c_str(),
              outcome([&](Hash& hash) {
                const Index cap = m.L;
                kvevict::CacheBook book(m.NL, m.Hkv, cap);
                std::vector<std::vector<float>> k(static_cast<std::size_t>(m.NL)), v = k, scores = k;
                for (auto& x : k) x.assign(static_cast<std::size_t>(m.Hkv * cap * m.d), 0.f);
                for (auto& x : v) x.assign(static_cast<std::size_t>(m.Hkv * cap * m.d), 0.f);
                for (auto& x : scores) x.assign(static_cast<std::size_t>(m.Hkv * cap), 0.f);
                Index t = 0;
                while (t + step <= m.L) {
                  book.append(step);
                  for (int l = 0; l < m.NL; ++l)
                    for (int h = 0; h < m.Hkv; ++h) {
                      const Index len = book.layer(l).length(h);
                      for (Index i = 0; i < step; ++i)
                        for (int x = 0; x < m.d; ++x) {
                          const auto from = static_cast<std::size_t>((h * m.L + t + i) * m.d + x);
                          const auto to = static_cast<std::size_t>((h * cap + len - step + i) * m.d + x);
                          k[static_cast<std::size_t>(l)][to] = m.k[static_cast<std::size_t>(l)][from];
                          v[static_cast<std::size_t>(l)][to] = m.v[static_cast<std::size_t>(l)][from];
                        }
                    }
                  t += step;
                  kvevict::evict_over_budget<float>(
                      policy, book, n,
                      [&](Index l) {
                        const auto L = static_cast<std::size_t>(l);
                        kvevict::LayerInputs<float> in = m.in[L];
                        in.lengths = nullptr;
                        in.positions = kvevict::PositionsView();
                        in.keys = kvevict::kv_heads_major<const float>(k[L].data(), m.Hkv, cap, m.d);
                        in.values = kvevict::kv_heads_major<const float>(v[L].data(), m.Hkv, cap, m.d);
                        for (Index h = 0; h < m.Hkv; ++h)  // the scores of what each head holds now
                          for (Index j = 0; j < book.layer(l).length(h); ++j)
                            scores[L][static_cast<std::size_t>(h * cap + j)] =
                                engine_score(static_cast<int>(l), h, book.layer(l).position(h, j));
                        in.scores = kvevict::HeadsView<const float>::heads_major(scores[L].data(), m.Hkv, cap, 1);
                        return in;
                      },
                      [&](Index l, const Selection& s) {
                        const auto L = static_cast<std::size_t>(l);
                        book.layer(l).apply(s, kvevict::kv_heads_major<float>(k[L].data(), m.Hkv, cap, m.d),
                                            kvevict::kv_heads_major<float>(v[L].data(), m.Hkv, cap, m.d));
                      });
                }
                for (int l = 0; l < m.NL; ++l)
                  for (int h = 0; h < m.Hkv; ++h)
                    for (Index j = 0; j < book.layer(l).length(h); ++j) hash.add(book.layer(l).position(h, j));
              }).c_str());
}

template <class Entry>
void run_policy(const Entry& entry, bool both_precisions) {
  using P = typename Entry::policy_type;
  Rng rng(20261204);
  for (int c = 0; c < 6; ++c) {
    const bool ragged = c >= 4;
    const Model m = random_model(rng, ragged);
    const Index n_small = m.w / 2 + 1, n_mid = m.L / 4, n_big = m.L / 2;
    const std::vector<Budget> budgets = {Budget::tokens(n_small), Budget::tokens(n_mid), Budget::tokens(n_big),
                                         Budget::keep_ratio(0.3)};
    for (const Layout& layout : kLayouts) {
      kvevict::Knobs knobs;
      knobs.window = m.w;
      knobs.share = layout.share;
      knobs.block = layout.block;
      knobs.reduce = layout.reduce;
      if (layout.quirks) knobs.reference_quirks = true;
      std::string made;
      P policy;
      try {
        policy = entry.make(knobs);
      } catch (const kvevict::invalid_argument& e) {
        std::printf("%s case%d %s make error: %s\n", std::string(entry.name).c_str(), c, layout.name, e.what());
        continue;
      }
      for (std::size_t b = 0; b < budgets.size(); ++b) {
        const std::string tag =
            std::string(entry.name) + " case" + std::to_string(c) + " " + layout.name + " b" + std::to_string(b);
        run_entry_points<double>(policy, m, budgets[b], tag + " f64");
        if (both_precisions) run_entry_points<float>(policy, m, budgets[b], tag + " f32");
      }
      if (!ragged && !layout.quirks) {
        const std::string tag = std::string(entry.name) + " case" + std::to_string(c) + " " + layout.name;
        run_stream(policy, m, n_mid, std::max<Index>(m.w, m.L / 5), tag + " step/5");
        run_stream(policy, m, n_big, std::max<Index>(m.w, m.L / 2), tag + " step/2");
      }
    }
  }
}

}  // namespace

int main() {
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [](const auto& e) { run_policy(e, true); });
  kvevict::catalogue::for_each(kvevict::catalogue::bases(), [](const auto& b) {
    kvevict::catalogue::for_each(kvevict::catalogue::selectors(), [&](const auto& s) {
      kvevict::catalogue::compose(b.name, s.name, [](const auto& e) { run_policy(e, false); });
    });
  });
}
