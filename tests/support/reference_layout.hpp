// kvevict reference implementation of sharing and blocks (tests only).
//
// A plain, obviously-correct float64 statement of docs/algorithms.md#layouts "Sharing, blocks and RoPE positions"
// (the `share`, `reduce` and `block` layout parameters), on top of the ragged reference
// tests/support/reference_ragged.hpp. No Eigen, no kvevict headers. Slow on purpose: every top-k is a full std::sort
// with one total order.
//
// What is reused from the ragged reference: the per-(layer, KV head, entry) scoring only, which
// docs/algorithms.md#layouts leaves unchanged (window attention, mean and defensive aggregation, pooling, floor, value
// norms, the DefensiveKV value term and the mass forcing with the per-head token n_kept as its cap). Everything
// docs/algorithms.md#layouts adds is written here: the groups, the reduction over a group, the blocks and the tail, the
// budgets in blocks, the allocations on blocks and the expansion back to rows.
//
// Pipeline (docs/algorithms.md#layouts, for each of the selector's maps):
//   token map   per (layer, KV head, row): a Cell {tier, score}; tiers safeguard > window > forced > scored (a forced
//               row keeps its own score, a window row scores 0; the safeguard is the head-adaptive allocation's);
//   groups      per_head: each (layer, KV head); per_layer: the Hkv heads of a layer; per_model: every head of every
//               layer. Members hold the same positions (asserted). Members are listed in (layer, head) order.
//   reduce      row by row over the members: tier = max member tier; score = max, or the sum in (layer, head) order
//               divided by the member count (mean);
//   blocks      a group of L rows: U = floor(L / B) whole blocks, block u = rows [uB, uB + B); the tail
//               r = L - U B rows is always kept and never ranked; a block's tier = max of its rows' tiers, its score
//               = max, or the sum in row order divided by B (mean), of its rows' reduced scores (compared in the
//               scored and forced tiers), its position = that of its last row;
//   cap         (sharing or blocks, a count budget) each group keeps at most max(0, n_blocks - w_b) forced blocks
//               (n_blocks of its scope's budget below, w_b = max over the scope's groups of ceil(max(0, w - r_v) / B),
//               w = 0 for StreamingLLM), the first in the ranking order; the others go to the scored tier;
//   retrieval   every block of a group holding a named retrieval head is forced (after the cap);
//   ranking     tier desc (safeguard, window, forced, scored), then score desc (scored and forced tiers: a forced block
//   ranks
//               among the forced by its rows' own scores, never by recency alone), then higher position, then
//               lower layer, then lower group (the KV head for per_head, 0 otherwise). A per_model group is layer 0,
//               group 0. The layer-global step uses the same order (the window is never cut for forced blocks);
//   budget      a scope of V groups with the token n_kept per head: T = V n_kept, total = floor((T - sum r_v) / B),
//               n_blocks = floor(total / V); B <= n_kept (asserted);
//   allocate    uniform: b_v = min(n_blocks, U_v), the group's top b_v blocks;
//               head-adaptive (kvpress): each group's top min(int(n_blocks alpha), U_v) blocks promoted to the
//               safeguard tier,
//               then one flat top-k of `total` over every block of the scope;
//               original AdaKV: see adakv_original() below (w_b blocks of window);
//               layer-global: one top-k over every block of every group of every layer (see select_maps());
//               CriticalKV: with b_v from the base allocation, stage 1 the group's top int(b_v ratio) blocks by the
//               allocation map (after the safeguard promotion), stage 2 the best b_v - stage 1 of the others by the
//               stage-2 map, in which the allocation map's safeguard blocks are safeguard blocks;
//   expand      every member head of a group keeps the rows of the group's kept blocks and the tail rows.
//
// Scopes: for a per-layer allocation one layer (V = Hkv groups for per_head, 1 for per_layer), for per_model the
// single group (V = 1, T = n_kept); for the layer-global allocation every group of every layer, T = sum over layers
// of V_l n_kept_l (per_model: T = n_kept).
//
// Output: per layer a ragged::KeptRows (per KV head, kept ROWS ascending), as the ragged reference returns.
//
// Readings of docs/algorithms.md#layouts where its text leaves a choice (each one a decision of this reference):
//   - per_model needs one n_kept and one window w for every layer (asserted): the members hold the same entries,
//     so one budget resolves to one n_kept, and the policy has one window.
//   - A block's mean is taken over the group's reduced row scores (reduce the group first, then the block), both
//     sums in order (members in (layer, head) order, rows ascending), each divided once.
//   - A window cell scores 0, a forced cell its raw score (the row's score before forcing); both enter the
//     group/block max or mean. A window block's score is never compared; a forced block's is, against the other
//     forced blocks: the members' own scores decide which forced blocks a budget too small for all of them keeps.
//   - The safeguard tier ranks above the window, as the reference's dtype maximum does above its layer maximum: with
//     n_kept < w it guarantees each head its n_safe most recent entries (the ragged reference's forced tier).
//   - The head-adaptive safeguard counts whole blocks, window blocks included (they rank first), as the token
//     safeguard counts the window.
//   - Original AdaKV: a group's window is its LAST w_b blocks (not its window-tier blocks: with unequal tails a
//     group may have fewer window-tier blocks than w_b), its prefix the blocks before them (all scored). With
//     n_blocks <= w_b a group keeps its last min(n_blocks, U_v) blocks. Like the token rule, the rounded shares can
//     exceed T (three groups, counts (1, 1, 4), alpha .5): the "never over the budget" of docs/algorithms.md#layouts
//     does not hold for this variant.
//   - StreamingLLM's forced rows are min(sinks, min(n_kept, L)) ROWS scored by their positions; a forced block cut
//     by the budget loses to a more recent forced block (a higher position scores higher), so with B > 1 and a
//     budget of fewer blocks than the sinks span, the most recent sink-holding block is kept, not block 0.
//   - CriticalKV: the stage-2 map's window rows are in the window tier (corrected mode); the (promoted) allocation
//     map's safeguard blocks are safeguard blocks in stage 2. CriticalKV on the original or layer-global allocation is
//     not modelled (asserted).
//   - Ranking identity of a group: per_head (layer, KV head), per_layer (layer, 0), per_model (0, 0).
#ifndef KVEVICT_TESTS_SUPPORT_REFERENCE_LAYOUT_HPP
#define KVEVICT_TESTS_SUPPORT_REFERENCE_LAYOUT_HPP

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "support/reference.hpp"
#include "support/reference_ragged.hpp"

namespace kvevict_ref {
namespace layout {

using ragged::KeptRows;
using ragged::Positions;
using ragged::Ragged;

// Tiers: a higher tier ranks above every entry of a lower tier. The safeguard, the window, then the forced rows (the
// ragged reference has one forced tier above the window for both the safeguard and a selector's forcing: per head a
// selector's forced entries fit next to the window, so the orders keep the same rows there; under sharing and blocks
// they do not).
constexpr int kScored = 0;
constexpr int kForced = 1;
constexpr int kWindow = 2;
constexpr int kSafeguard = 3;
constexpr int kProtected = 4;  // docs/algorithms.md#protected-prefix: original positions < p, above everything

enum class Share { per_head, per_layer, per_model };
enum class Reduce { max, mean };

struct Layout {
  Share share = Share::per_head;
  Reduce reduce = Reduce::max;
  std::int64_t block = 1;  // B >= 1
};

enum class Method {
  snapkv,             // mean scores, uniform
  adakv,              // mean scores, head-adaptive (kvpress) with alpha
  adakv_original,     // mean scores, head-adaptive (original AdaKV repository) with alpha
  criticalkv,         // mean scores + value norms, head-adaptive (kvpress) with alpha, two stages
  critical_snapkv,    // as criticalkv on the uniform allocation (alpha ignored)
  defensivekv,        // defensive scores (+ value term, + mass forcing), head-adaptive (kvpress) with alpha
  adakv_defensive,    // the same code as defensivekv: only the parameters differ (see preset())
  layer_defensivekv,  // defensive scores, layer-global (alpha ignored: no safeguard)
  streamingllm,       // positional map, uniform
  tova,               // mean scores (kernel 1 by its preset), uniform; the library preset shares per layer by mean
  knorm,              // key-only: -||k||, uniform
  keydiff,            // key-only: -cos(k, the head's mean unit key), uniform
};

// Every method's parameters in one struct. The defaults are AdaKV's / CriticalKV's. The caller passes the
// parameters of the policy it compares with: preset(m) gives the library presets' defaults (DefensiveKV and
// Layer-DefensiveKV: alpha 0; AdaKVDefensive: alpha 0.2, value_term = mass_forcing = false).
struct MethodParams {
  double alpha = 0.2;  // head-adaptive safeguard (and the original AdaKV's alpha)
  double eps = 1e-4;   // CriticalKV
  double first_stage_ratio = 0.5;
  int value_norm = 1;  // 1 or 2 (CriticalKV, DefensiveKV value term)
  int kernel = 5;
  kvevict_ref::Pool pool = kvevict_ref::Pool::avg;
  double mass_threshold = 0.9;  // DefensiveKV family
  bool value_term = true;
  bool mass_forcing = true;
  bool floor = true;
  int sinks = 4;            // StreamingLLM
  double redundancy = 0.0;  // rho of docs/algorithms.md#redundancy (not StreamingLLM)
};

// The library presets' defaults (docs/algorithms.md#presets) for each method.
inline MethodParams preset(Method m) {
  MethodParams p;
  switch (m) {
    case Method::defensivekv:
    case Method::layer_defensivekv:
      p.alpha = 0.0;
      break;
    case Method::adakv_defensive:
      p.alpha = 0.2;
      p.value_term = false;
      p.mass_forcing = false;
      break;
    case Method::tova:
      p.kernel = 1;
      break;
    default:
      break;
  }
  return p;
}

namespace detail {

using kvevict_ref::detail::py_int;

inline std::size_t sz(std::int64_t v) {
  assert(v >= 0);
  return static_cast<std::size_t>(v);
}
inline std::size_t sz(int v) {
  assert(v >= 0);
  return static_cast<std::size_t>(v);
}
inline std::size_t sz(std::size_t v) { return v; }
inline std::int64_t i64(std::size_t v) { return static_cast<std::int64_t>(v); }

}  // namespace detail

// =============================================================================================
// Token maps: one Cell per (layer, KV head, row).

struct Cell {
  int tier = kScored;
  double score = 0.0;  // compared in the scored and forced tiers
};
using HeadMap = std::vector<Cell>;       // [L_h]
using LayerMap = std::vector<HeadMap>;   // [Hkv]
using ModelMap = std::vector<LayerMap>;  // [NL]

// A scored layer: prefix rows j < L_h - w scored with scores[h][j], the last w rows in the window tier (score 0,
// never compared), the rows of forced[h] (prefix rows; forced empty: none) in the forced tier with their scores.
inline LayerMap token_map(const Ragged& scores, const Positions& pos, int w, const KeptRows& forced = {}) {
  using detail::sz;
  ragged::detail::check_scores(scores, pos, w);
  assert(forced.empty() || forced.size() == pos.size());
  LayerMap map(pos.size());
  for (std::size_t h = 0; h < pos.size(); ++h) {
    const std::int64_t L = detail::i64(pos[h].size());
    const std::int64_t P = L - w;
    for (std::int64_t j = 0; j < L; ++j) {
      Cell c;
      if (j < P) {
        c.tier = kScored;
        c.score = scores[h][sz(j)];
      } else {
        c.tier = kWindow;
        c.score = 0.0;
      }
      map[h].push_back(c);
    }
    if (!forced.empty())
      for (std::int64_t j : forced[h]) {
        assert(j >= 0 && j < P);
        map[h][sz(j)].tier = kForced;
      }
  }
  return map;
}

// StreamingLLM (docs/algorithms.md#layouts, step 4): rows j < min(sinks, min(n_kept, L_h)) forced, every other row
// scored by its position (recency). No window tier. Built per head; the members of a group hold the same positions, so
// the group's reduced map is this map whatever the reduction.
inline LayerMap streaming_map(const Positions& pos, std::int64_t n_kept, int sinks) {
  using detail::sz;
  assert(n_kept >= 1 && sinks >= 0);
  LayerMap map(pos.size());
  for (std::size_t h = 0; h < pos.size(); ++h) {
    const std::int64_t L = detail::i64(pos[h].size());
    assert(L >= 1);
    const std::int64_t n_sinks = std::min<std::int64_t>(sinks, std::min(n_kept, L));
    for (std::int64_t j = 0; j < L; ++j) {
      Cell c;
      c.tier = j < n_sinks ? kForced : kScored;
      c.score = static_cast<double>(pos[h][sz(j)]);
      map[h].push_back(c);
    }
  }
  return map;
}

// =============================================================================================
// Groups.

struct Member {
  std::size_t layer;
  std::size_t head;
};

struct Group {
  std::int64_t layer = 0;         // for the ranking: the layer (per_model: 0)
  std::int64_t index = 0;         // for the ranking: the KV head (per_head), 0 otherwise
  std::vector<Member> members;    // (layer, head) ascending
  std::vector<std::int64_t> pos;  // the members' common positions [L]
  std::int64_t rows() const { return detail::i64(pos.size()); }
};

// The groups of a model whose layer l holds positions pos[l] [Hkv_l][L_h], in (layer, head) order of their first
// member. Asserts that the members of every group hold identical positions.
inline std::vector<Group> make_groups(Share share, const std::vector<Positions>& pos) {
  assert(!pos.empty());
  std::vector<Group> groups;
  for (std::size_t l = 0; l < pos.size(); ++l) {
    assert(!pos[l].empty());
    for (std::size_t h = 0; h < pos[l].size(); ++h) {
      assert(!pos[l][h].empty());
      const Member m{l, h};
      const bool opens = share == Share::per_head || (share == Share::per_layer && h == 0) ||
                         (share == Share::per_model && l == 0 && h == 0);
      if (opens) {
        Group g;
        g.layer = share == Share::per_model ? 0 : detail::i64(l);
        g.index = share == Share::per_head ? detail::i64(h) : 0;
        g.pos = pos[l][h];
        groups.push_back(g);
      }
      Group& g = groups.back();
      assert(pos[l][h] == g.pos);  // members must hold identical entries
      g.members.push_back(m);
    }
  }
  return groups;
}

// docs/algorithms.md#layouts step 1: the group's map row by row.
inline std::vector<Cell> reduce_group(const Group& g, const ModelMap& map, Reduce reduce) {
  using detail::sz;
  assert(!g.members.empty());
  std::vector<Cell> rows;
  for (std::int64_t j = 0; j < g.rows(); ++j) {
    int tier = kScored;
    double best = 0.0;
    double sum = 0.0;
    bool first = true;
    for (const Member& m : g.members) {
      const HeadMap& hm = map[m.layer][m.head];
      assert(detail::i64(hm.size()) == g.rows());
      const Cell& c = hm[sz(j)];
      tier = std::max(tier, c.tier);
      if (first || c.score > best) best = c.score;
      sum += c.score;  // (layer, head) order
      first = false;
    }
    Cell out;
    out.tier = tier;
    out.score = reduce == Reduce::max ? best : sum / static_cast<double>(g.members.size());
    rows.push_back(out);
  }
  return rows;
}

// =============================================================================================
// Blocks.

// One whole block of a group: the candidate of every top-k below.
struct Block {
  int tier = kScored;
  double score = 0.0;      // compared in the scored and forced tiers
  std::int64_t pos = 0;    // the position of its last row
  std::int64_t layer = 0;  // the group's layer (per_model: 0)
  std::int64_t group = 0;  // the group's index in its layer (per_head: the KV head; otherwise 0)
  std::int64_t id = 0;     // u: rows [uB, uB + B)
};

// Tier desc, then (scored and forced tiers) score desc, then higher position, then lower layer, then lower group.
inline bool ranks_before(const Block& a, const Block& b) {
  if (a.tier != b.tier) return a.tier > b.tier;
  if (a.tier != kWindow && a.score != b.score) return a.score > b.score;
  if (a.pos != b.pos) return a.pos > b.pos;
  if (a.layer != b.layer) return a.layer < b.layer;
  if (a.group != b.group) return a.group < b.group;
  assert(a.id == b.id);  // the order is total over distinct blocks
  return false;
}

// The first k blocks in that order.
inline std::vector<Block> top_k(std::vector<Block> blocks, std::int64_t k) {
  assert(k >= 0 && detail::sz(k) <= blocks.size());
  std::sort(blocks.begin(), blocks.end(), ranks_before);
  blocks.resize(detail::sz(k));
  return blocks;
}

// A group cut into blocks.
struct Blocks {
  std::int64_t L = 0;         // rows of the group
  std::int64_t B = 1;         // block size
  std::int64_t U = 0;         // whole blocks, floor(L / B)
  std::int64_t r = 0;         // tail rows, L - U B (always kept)
  std::vector<Block> blocks;  // [U], blocks[u].id == u
};

// docs/algorithms.md#layouts step 2 on a group's reduced rows.
inline Blocks cut_blocks(const Group& g, const std::vector<Cell>& rows, std::int64_t B, Reduce reduce) {
  using detail::sz;
  assert(B >= 1);
  assert(detail::i64(rows.size()) == g.rows());
  Blocks out;
  out.L = g.rows();
  out.B = B;
  out.U = out.L / B;
  out.r = out.L - out.U * B;
  for (std::int64_t u = 0; u < out.U; ++u) {
    Block b;
    b.tier = kScored;
    double best = 0.0;
    double sum = 0.0;
    for (std::int64_t j = u * B; j < u * B + B; ++j) {
      const Cell& c = rows[sz(j)];
      b.tier = std::max(b.tier, c.tier);
      if (j == u * B || c.score > best) best = c.score;
      sum += c.score;  // row order
    }
    b.score = reduce == Reduce::max ? best : sum / static_cast<double>(B);
    b.pos = g.pos[sz(u * B + B - 1)];
    b.layer = g.layer;
    b.group = g.index;
    b.id = u;
    out.blocks.push_back(b);
  }
  return out;
}

// =============================================================================================
// Budgets in blocks (docs/algorithms.md#layouts step 3).

struct ScopeBudget {
  std::int64_t tokens = 0;    // T = V n_kept
  std::int64_t tails = 0;     // sum of r_v
  std::int64_t total = 0;     // floor((T - tails) / B) whole blocks
  std::int64_t n_blocks = 0;  // floor(total / V) per group
};

// floor((tokens - tails) / B): the whole blocks of a scope that keeps `tokens` tokens, its tails included.
inline std::int64_t blocks_total(std::int64_t tokens, std::int64_t tails, std::int64_t B) {
  assert(B >= 1 && tails >= 0 && tokens >= tails);
  return (tokens - tails) / B;  // non-negative: truncation is floor
}

// A per-layer (or per_model) scope of V = tails.size() groups, n_kept tokens per head.
inline ScopeBudget scope_budget(std::int64_t n_kept, const std::vector<std::int64_t>& tails, std::int64_t B) {
  assert(!tails.empty());
  assert(B >= 1 && B <= n_kept);  // "a budget smaller than one block keeps no whole block"
  ScopeBudget s;
  const std::int64_t V = detail::i64(tails.size());
  s.tokens = V * n_kept;
  for (std::int64_t r : tails) {
    assert(r >= 0 && r < B);
    s.tails += r;
  }
  s.total = blocks_total(s.tokens, s.tails, B);
  s.n_blocks = s.total / V;
  return s;
}

// Original AdaKV: the window spans w_b = max over the groups of ceil(max(0, w - r_v) / B) blocks.
inline std::int64_t window_blocks(int w, const std::vector<std::int64_t>& tails, std::int64_t B) {
  assert(w >= 1 && B >= 1 && !tails.empty());
  std::int64_t w_b = 0;
  for (std::int64_t r : tails) {
    const std::int64_t rest = std::max<std::int64_t>(0, w - r);
    w_b = std::max(w_b, (rest + B - 1) / B);  // ceil for rest >= 0
  }
  return w_b;
}

// =============================================================================================
// Allocations on blocks (docs/algorithms.md#layouts step 4). A scope is a list of groups' Blocks; the result lists, per
// group of the scope, its kept block ids ascending.

using KeptBlocks = std::vector<std::vector<std::int64_t>>;

namespace detail {

inline void sort_ids(KeptBlocks& kept) {
  for (auto& v : kept) std::sort(v.begin(), v.end());
}

// The index in the scope of the group that holds block b.
inline std::size_t slot_of(const std::vector<Blocks>& scope, const Block& b) {
  for (std::size_t v = 0; v < scope.size(); ++v)
    for (const Block& x : scope[v].blocks)
      if (x.layer == b.layer && x.group == b.group) return v;
  assert(false);
  return 0;
}

}  // namespace detail

// Uniform: b_v = min(n_blocks, U_v); group v keeps its top b_v blocks.
inline KeptBlocks uniform(const std::vector<Blocks>& scope, std::int64_t n_blocks) {
  assert(n_blocks >= 0);
  KeptBlocks kept(scope.size());
  for (std::size_t v = 0; v < scope.size(); ++v)
    for (const Block& b : top_k(scope[v].blocks, std::min(n_blocks, scope[v].U))) kept[v].push_back(b.id);
  detail::sort_ids(kept);
  return kept;
}

// The head-adaptive safeguard: each group's top min(int(n_blocks alpha), U_v) blocks go to the safeguard tier.
inline std::vector<Blocks> promote_safeguard(std::vector<Blocks> scope, std::int64_t n_blocks, double alpha) {
  assert(alpha >= 0.0 && alpha <= 1.0);
  const std::int64_t n_safe = detail::py_int(static_cast<double>(n_blocks) * alpha);
  for (Blocks& g : scope)
    for (const Block& t : top_k(g.blocks, std::min(n_safe, g.U))) {
      int& tier = g.blocks[detail::sz(t.id)].tier;
      tier = std::max(tier, kSafeguard);  // a protected block stays protected
    }
  return scope;
}

// One flat top-k of `total` over every block of every group of the scope.
inline KeptBlocks flat_top_k(const std::vector<Blocks>& scope, std::int64_t total) {
  std::vector<Block> all;
  for (const Blocks& g : scope) all.insert(all.end(), g.blocks.begin(), g.blocks.end());
  KeptBlocks kept(scope.size());
  for (const Block& b : top_k(all, total)) kept[detail::slot_of(scope, b)].push_back(b.id);
  detail::sort_ids(kept);
  return kept;
}

// Head-adaptive (kvpress): the safeguard, then the flat top-k of `total`.
inline KeptBlocks head_adaptive(const std::vector<Blocks>& scope, std::int64_t n_blocks, std::int64_t total,
                                double alpha) {
  return flat_top_k(promote_safeguard(scope, n_blocks, alpha), total);
}

// Original AdaKV on blocks, the token rule of docs/algorithms.md#allocation / docs/algorithms.md#ragged with w_b blocks
// of window and n_blocks per group: the window of group v is its last min(w_b, U_v) blocks, its prefix the blocks [0,
// max(0, U_v - w_b)).
//   n_blocks <= w_b: group v keeps its last min(n_blocks, U_v) blocks;
//   otherwise Bb = n_blocks - w_b; count_v = v's share of one top-k of V Bb over every prefix block of every group;
//   group v keeps its top min(prefix_v, round_half_even(count_v (1 - alpha) + floor(alpha Bb))) prefix blocks and
//   its whole window.
inline KeptBlocks adakv_original(const std::vector<Blocks>& scope, std::int64_t n_blocks, std::int64_t w_b,
                                 double alpha) {
  using detail::sz;
  assert(alpha >= 0.0 && alpha <= 1.0);
  assert(n_blocks >= 0 && w_b >= 0);
  KeptBlocks kept(scope.size());
  if (n_blocks <= w_b) {
    for (std::size_t v = 0; v < scope.size(); ++v)
      for (std::int64_t u = scope[v].U - std::min(n_blocks, scope[v].U); u < scope[v].U; ++u) kept[v].push_back(u);
    return kept;
  }
  const std::int64_t Bb = n_blocks - w_b;
  std::vector<std::vector<Block>> prefix(scope.size());
  std::vector<Block> all_prefix;
  for (std::size_t v = 0; v < scope.size(); ++v) {
    const std::int64_t n_prefix = std::max<std::int64_t>(0, scope[v].U - w_b);
    for (std::int64_t u = 0; u < n_prefix; ++u) {
      assert(scope[v].blocks[sz(u)].tier == kScored);  // no window row below the last w_b blocks, nothing forced
      prefix[v].push_back(scope[v].blocks[sz(u)]);
    }
    all_prefix.insert(all_prefix.end(), prefix[v].begin(), prefix[v].end());
  }
  std::vector<std::int64_t> count(scope.size(), 0);
  for (const Block& b : top_k(all_prefix, detail::i64(scope.size()) * Bb)) ++count[detail::slot_of(scope, b)];
  const double floor_part = std::floor(alpha * static_cast<double>(Bb));
  for (std::size_t v = 0; v < scope.size(); ++v) {
    const double b = kvevict_ref::detail::round_half_even(static_cast<double>(count[v]) * (1.0 - alpha) + floor_part);
    const std::int64_t n_take = std::min(detail::i64(prefix[v].size()), static_cast<std::int64_t>(b));
    assert(n_take >= 0);
    for (const Block& x : top_k(prefix[v], n_take)) kept[v].push_back(x.id);
    for (std::int64_t u = scope[v].U - std::min(w_b, scope[v].U); u < scope[v].U; ++u) kept[v].push_back(u);
  }
  detail::sort_ids(kept);
  return kept;
}

// CriticalKV's two stages inside each group's budget b_v. `alloc`: the allocation map's blocks AFTER the safeguard
// promotion (the map the base allocated on); `stage2`: the stage-2 map's blocks (same groups, same cut). Stage 1:
// the top int(b_v ratio) blocks by `alloc`; stage 2: the best b_v - stage 1 of the others by `stage2`, in which every
// safeguard block of `alloc` is a safeguard block.
inline KeptBlocks critical(const std::vector<Blocks>& alloc, const std::vector<Blocks>& stage2,
                           const std::vector<std::int64_t>& budgets, double ratio) {
  using detail::sz;
  assert(alloc.size() == stage2.size() && budgets.size() == alloc.size());
  assert(ratio >= 0.0 && ratio <= 1.0);
  KeptBlocks kept(alloc.size());
  for (std::size_t v = 0; v < alloc.size(); ++v) {
    assert(alloc[v].U == stage2[v].U);
    const std::int64_t b = budgets[v];
    assert(b >= 0 && b <= alloc[v].U);
    const std::int64_t k1 = detail::py_int(static_cast<double>(b) * ratio);
    assert(k1 >= 0 && k1 <= b);
    std::vector<bool> taken(sz(alloc[v].U), false);
    for (const Block& x : top_k(alloc[v].blocks, k1)) {
      taken[sz(x.id)] = true;
      kept[v].push_back(x.id);
    }
    std::vector<Block> rest;
    for (Block x : stage2[v].blocks) {
      if (taken[sz(x.id)]) continue;
      if (alloc[v].blocks[sz(x.id)].tier == kSafeguard) x.tier = kSafeguard;
      rest.push_back(x);
    }
    for (const Block& x : top_k(rest, b - k1)) kept[v].push_back(x.id);
  }
  detail::sort_ids(kept);
  return kept;
}

// Layer-global: one top-k of `total` over every block of every group given (every group of every layer), in the
// same order as every other top-k (the window, then forced blocks by score, then scored blocks).
inline KeptBlocks layer_global(const std::vector<Blocks>& all, std::int64_t total) { return flat_top_k(all, total); }

// =============================================================================================
// Expansion (docs/algorithms.md#layouts step 5).

// The rows of one group: those of its kept blocks and its tail, ascending.
inline std::vector<std::int64_t> group_rows(const Blocks& g, const std::vector<std::int64_t>& kept_blocks) {
  std::vector<std::int64_t> rows;
  for (std::int64_t u : kept_blocks) {
    assert(u >= 0 && u < g.U);
    for (std::int64_t j = u * g.B; j < u * g.B + g.B; ++j) rows.push_back(j);
  }
  for (std::int64_t j = g.U * g.B; j < g.L; ++j) rows.push_back(j);
  std::sort(rows.begin(), rows.end());
  assert(std::adjacent_find(rows.begin(), rows.end()) == rows.end());
  return rows;
}

// Every member head of group v keeps group_rows(blocks[v], kept[v]). heads[l] = Hkv of layer l. Returns per layer
// the kept rows per KV head.
inline std::vector<KeptRows> expand(const std::vector<Group>& groups, const std::vector<Blocks>& blocks,
                                    const KeptBlocks& kept, const std::vector<std::size_t>& heads) {
  assert(groups.size() == blocks.size() && kept.size() == groups.size());
  std::vector<KeptRows> out;
  for (std::size_t n : heads) out.emplace_back(n);
  std::vector<std::vector<bool>> seen;
  for (std::size_t n : heads) seen.emplace_back(n, false);
  for (std::size_t v = 0; v < groups.size(); ++v) {
    const std::vector<std::int64_t> rows = group_rows(blocks[v], kept[v]);
    for (const Member& m : groups[v].members) {
      assert(!seen[m.layer][m.head]);
      seen[m.layer][m.head] = true;
      out[m.layer][m.head] = rows;
    }
  }
  for (const auto& s : seen)
    for (bool b : s) {
      assert(b);
      (void)b;
    }
  return out;
}

// =============================================================================================
// Selection from token maps (hand-made maps in the self-check; select() below builds them from layers).

enum class Allocation { uniform, head_adaptive, adakv_original, layer_global };

struct Maps {
  std::vector<Positions> pos;  // [NL][Hkv_l][L_h]
  std::vector<int> w;          // [NL] window (original AdaKV's w_b; per_model: all equal)
  ModelMap alloc;              // [NL][Hkv_l][L_h] the allocation map
  ModelMap stage2;             // CriticalKV's stage-2 map (same shape), or empty
  std::vector<int> cap_w;      // [NL] the window the forcing cap leaves room for (StreamingLLM: 0); empty: w
  std::vector<std::vector<int>> retrieval;  // [NL] KV heads named as retrieval heads (empty: none)
};

// docs/algorithms.md#forcing-cap: in a group whose forced blocks outnumber
// cap = max(0, n_blocks - w_b) (n_blocks of its scope's budget, w_b its window blocks), the cap that rank first stay
// forced and the others return to the scored tier with their scores.
inline void cap_forced(Blocks& g, std::int64_t cap) {
  std::vector<Block> forced;
  for (const Block& b : g.blocks)
    if (b.tier == kForced) forced.push_back(b);
  if (detail::i64(forced.size()) <= cap) return;
  std::sort(forced.begin(), forced.end(), ranks_before);
  for (std::size_t i = detail::sz(cap); i < forced.size(); ++i) g.blocks[detail::sz(forced[i].id)].tier = kScored;
}

// docs/algorithms.md#threshold-budgets, written from the text: a block passes when its tier is above kScored or its
// score >= tau; the count of each scope (a group, a layer's groups (per_model: the one group), every group) is the
// blocks that pass, clamped to [ceil(lo / B), floor(hi / B)] and to the blocks it holds; the scope keeps its best that
// many (the order of every top-k). The allocation does not run; CriticalKV's two stages take those counts.
enum class ThresholdScope { head, layer, model };
struct Threshold {
  bool on = false;
  double tau = 0.0;
  std::int64_t lo = 0;
  std::int64_t hi = std::numeric_limits<std::int64_t>::max();
  ThresholdScope scope = ThresholdScope::head;
};

struct AllocParams {
  Threshold threshold;
  Allocation allocation = Allocation::uniform;
  double alpha = 0.0;     // head-adaptive safeguard, original AdaKV's alpha
  bool critical = false;  // CriticalKV's two stages (uniform or head_adaptive only)
  double first_stage_ratio = 0.5;
};

// n_kept[l]: layer l's token n_kept per head (per_model: the same in every layer).
inline std::vector<KeptRows> select_maps(const Maps& maps, const std::vector<std::int64_t>& n_kept,
                                         const AllocParams& ap, const Layout& layout) {
  using detail::sz;
  const std::size_t NL = maps.pos.size();
  const std::int64_t B = layout.block;
  assert(NL >= 1);
  assert(maps.w.size() == NL && maps.alloc.size() == NL && n_kept.size() == NL);
  assert(maps.stage2.empty() == !ap.critical);
  assert(!ap.critical || ap.allocation == Allocation::uniform || ap.allocation == Allocation::head_adaptive);
  assert(B >= 1);
  std::vector<std::size_t> heads;
  for (std::size_t l = 0; l < NL; ++l) {
    assert(maps.alloc[l].size() == maps.pos[l].size());
    assert(ap.critical == false || maps.stage2[l].size() == maps.pos[l].size());
    assert(n_kept[l] >= 1 && B <= n_kept[l]);
    // docs/algorithms.md#ragged: Hkv n_kept <= sum of L_h.
    assert(detail::i64(maps.pos[l].size()) * n_kept[l] <= ragged::detail::total_entries(maps.pos[l]));
    if (layout.share == Share::per_model) {
      assert(n_kept[l] == n_kept[0]);  // one budget resolved against the same entries
      assert(maps.w[l] == maps.w[0]);  // one policy, one window
    }
    heads.push_back(maps.pos[l].size());
  }

  const std::vector<Group> groups = make_groups(layout.share, maps.pos);
  std::vector<Blocks> alloc, stage2;
  for (const Group& g : groups) {
    alloc.push_back(cut_blocks(g, reduce_group(g, maps.alloc, layout.reduce), B, layout.reduce));
    if (ap.critical) stage2.push_back(cut_blocks(g, reduce_group(g, maps.stage2, layout.reduce), B, layout.reduce));
  }
  // The forcing cap (sharing or blocks, a count budget): per scope (a layer; per_model the one group) of V groups,
  // cap = max(0, floor(floor((V n_kept - sum r_v) / B) / V) - w_b), w_b = max over them of ceil(max(0, w - r_v) / B).
  if (!(layout.share == Share::per_head && B == 1) && !ap.threshold.on) {
    for (std::size_t l = 0; l < (layout.share == Share::per_model ? 1 : NL); ++l) {
      std::vector<std::size_t> scope;
      std::vector<std::int64_t> tails;
      for (std::size_t v = 0; v < groups.size(); ++v)
        if (layout.share == Share::per_model || groups[v].layer == detail::i64(l)) {
          scope.push_back(v);
          tails.push_back(alloc[v].r);
        }
      const int w = maps.cap_w.empty() ? maps.w[l] : maps.cap_w[l];
      std::int64_t w_b = 0;
      for (std::int64_t r : tails) w_b = std::max(w_b, (std::max<std::int64_t>(0, w - r) + B - 1) / B);
      const std::int64_t cap = std::max<std::int64_t>(0, scope_budget(n_kept[l], tails, B).n_blocks - w_b);
      for (std::size_t v : scope) {
        cap_forced(alloc[v], cap);
        if (ap.critical) cap_forced(stage2[v], cap);
      }
    }
  }
  // Retrieval heads (docs/algorithms.md#retrieval-heads): every block of a group that holds one is forced.
  for (std::size_t v = 0; v < groups.size(); ++v) {
    bool named = false;
    for (const Member& m : groups[v].members)
      if (m.layer < maps.retrieval.size())
        for (int h : maps.retrieval[m.layer]) named = named || sz(h) == m.head;
    if (!named) continue;
    for (std::vector<Blocks>* list : {&alloc, &stage2})
      if (v < list->size())
        for (Block& b : (*list)[v].blocks) b.tier = std::max(b.tier, kForced);
  }

  KeptBlocks kept(groups.size());
  if (ap.threshold.on) {
    const Threshold& t = ap.threshold;
    const std::int64_t lo = (t.lo + B - 1) / B, hi = t.hi == std::numeric_limits<std::int64_t>::max() ? t.hi : t.hi / B;
    const auto passing = [&](const std::vector<std::size_t>& scope, std::int64_t& held) {
      std::int64_t c = 0;
      for (std::size_t v : scope) {
        held += alloc[v].U;
        for (const Block& b : alloc[v].blocks) c += b.tier > kScored || b.score >= t.tau ? 1 : 0;
      }
      return c;
    };
    // The scopes of the counts: each group, each layer's groups (per_model: the one group), every group.
    std::vector<std::vector<std::size_t>> scopes;
    if (t.scope == ThresholdScope::head) {
      for (std::size_t v = 0; v < groups.size(); ++v) scopes.push_back({v});
    } else if (t.scope == ThresholdScope::model || layout.share == Share::per_model) {
      scopes.emplace_back();
      for (std::size_t v = 0; v < groups.size(); ++v) scopes.back().push_back(v);
    } else {
      for (std::size_t l = 0; l < NL; ++l) {
        scopes.emplace_back();
        for (std::size_t v = 0; v < groups.size(); ++v)
          if (groups[v].layer == detail::i64(l)) scopes.back().push_back(v);
      }
    }
    for (const auto& scope : scopes) {
      std::int64_t held = 0;
      const std::int64_t c = passing(scope, held);
      std::vector<Blocks> a;
      for (std::size_t v : scope) a.push_back(alloc[v]);
      const KeptBlocks k = flat_top_k(a, std::min(held, std::max(lo, std::min(hi, c))));
      for (std::size_t i = 0; i < scope.size(); ++i) kept[scope[i]] = k[i];
    }
    if (ap.critical) {
      std::vector<std::int64_t> b;
      for (const auto& x : kept) b.push_back(detail::i64(x.size()));
      kept = critical(alloc, stage2, b, ap.first_stage_ratio);
    }
    return expand(groups, alloc, kept, heads);
  }
  if (ap.allocation == Allocation::layer_global) {
    // One scope: T = sum over layers of V_l n_kept_l (V_l = Hkv_l for per_head, 1 for per_layer); per_model n_kept.
    std::int64_t tokens = 0;
    std::int64_t tails = 0;
    if (layout.share == Share::per_model) {
      tokens = n_kept[0];
    } else {
      for (std::size_t l = 0; l < NL; ++l) {
        const std::int64_t V = layout.share == Share::per_head ? detail::i64(maps.pos[l].size()) : 1;
        tokens += V * n_kept[l];
      }
    }
    for (const Blocks& b : alloc) tails += b.r;
    kept = layer_global(alloc, blocks_total(tokens, tails, B));
    return expand(groups, alloc, kept, heads);
  }

  // Per-layer scopes (per_model: one scope of the single group).
  std::vector<std::vector<std::size_t>> scopes;
  std::vector<std::size_t> scope_layer;
  if (layout.share == Share::per_model) {
    scopes.push_back({0});
    scope_layer.push_back(0);
  } else {
    for (std::size_t l = 0; l < NL; ++l) {
      scopes.emplace_back();
      scope_layer.push_back(l);
      for (std::size_t v = 0; v < groups.size(); ++v)
        if (groups[v].layer == detail::i64(l)) scopes.back().push_back(v);
    }
  }
  for (std::size_t s = 0; s < scopes.size(); ++s) {
    const std::size_t l = scope_layer[s];
    std::vector<Blocks> a, c;
    std::vector<std::int64_t> tails;
    for (std::size_t v : scopes[s]) {
      a.push_back(alloc[v]);
      if (ap.critical) c.push_back(stage2[v]);
      tails.push_back(alloc[v].r);
    }
    const ScopeBudget budget = scope_budget(n_kept[l], tails, B);
    KeptBlocks k;
    switch (ap.allocation) {
      case Allocation::uniform:
        if (ap.critical) {
          std::vector<std::int64_t> b;
          for (const Blocks& x : a) b.push_back(std::min(budget.n_blocks, x.U));
          k = critical(a, c, b, ap.first_stage_ratio);
        } else {
          k = uniform(a, budget.n_blocks);
        }
        break;
      case Allocation::head_adaptive: {
        const std::vector<Blocks> promoted = promote_safeguard(a, budget.n_blocks, ap.alpha);
        k = flat_top_k(promoted, budget.total);
        if (ap.critical) {
          std::vector<std::int64_t> b;
          for (const auto& x : k) b.push_back(detail::i64(x.size()));
          k = critical(promoted, c, b, ap.first_stage_ratio);
        }
        break;
      }
      case Allocation::adakv_original:
        k = adakv_original(a, budget.n_blocks, window_blocks(maps.w[l], tails, B), ap.alpha);
        break;
      case Allocation::layer_global:
        assert(false);
        break;
    }
    for (std::size_t i = 0; i < scopes[s].size(); ++i) kept[scopes[s][i]] = k[i];
  }
  return expand(groups, alloc, kept, heads);
}

// =============================================================================================
// Whole methods on ragged layers: scoring per (layer, KV head, entry) with the ragged reference, then select_maps.

inline Allocation allocation_of(Method m) {
  switch (m) {
    case Method::snapkv:
    case Method::critical_snapkv:
    case Method::streamingllm:
    case Method::tova:
    case Method::knorm:
    case Method::keydiff:
      return Allocation::uniform;
    case Method::adakv:
    case Method::criticalkv:
    case Method::defensivekv:
    case Method::adakv_defensive:
      return Allocation::head_adaptive;
    case Method::adakv_original:
      return Allocation::adakv_original;
    case Method::layer_defensivekv:
      return Allocation::layer_global;
  }
  assert(false);
  return Allocation::uniform;
}

// The ragged reference's DefensiveKV parameters of `p` (alpha included: the safeguard of a per-layer allocation).
inline ragged::DefensiveParams defensive_params(const MethodParams& p) {
  ragged::DefensiveParams dp;
  dp.mass_threshold = p.mass_threshold;
  dp.value_norm = p.value_norm;
  dp.kernel = p.kernel;
  dp.pool = p.pool;
  dp.value_term = p.value_term;
  dp.mass_forcing = p.mass_forcing;
  dp.floor = p.floor;
  dp.alpha = p.alpha;
  return dp;
}

// The maps of every layer for method m (n_kept[l] sets layer l's mass-forcing cap and StreamingLLM's sinks).
inline Maps method_maps(Method m, const std::vector<ragged::Layer>& layers, const std::vector<std::int64_t>& n_kept,
                        const MethodParams& p) {
  using detail::sz;
  assert(layers.size() == n_kept.size());
  Maps maps;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const ragged::Layer& layer = layers[l];
    const Positions pos = ragged::positions(layer);
    maps.pos.push_back(pos);
    maps.w.push_back(layer.w);
    switch (m) {
      case Method::knorm:
        maps.alloc.push_back(token_map(ragged::key_norm_scores(layer), pos, layer.w));
        break;
      case Method::keydiff:
        maps.alloc.push_back(token_map(ragged::key_diff_scores(layer), pos, layer.w));
        break;
      case Method::snapkv:
      case Method::adakv:
      case Method::adakv_original:
      case Method::tova:
        maps.alloc.push_back(token_map(
            ragged::mean_scores(ragged::window_attention(layer), layer.Hkv, layer.w, p.kernel, p.pool), pos, layer.w));
        break;
      case Method::criticalkv:
      case Method::critical_snapkv: {
        const Ragged s = ragged::mean_scores(ragged::window_attention(layer), layer.Hkv, layer.w, p.kernel, p.pool);
        const Ragged n = ragged::value_norms(layer, p.value_norm);
        assert(std::isfinite(p.eps) && p.eps >= 0.0);
        Ragged s2(s.size());
        for (std::size_t h = 0; h < s.size(); ++h)
          for (std::size_t j = 0; j < s[h].size(); ++j) s2[h].push_back((s[h][j] + p.eps) * n[h][j]);
        maps.alloc.push_back(token_map(s, pos, layer.w));
        maps.stage2.push_back(token_map(s2, pos, layer.w));
        break;
      }
      case Method::defensivekv:
      case Method::adakv_defensive:
      case Method::layer_defensivekv: {
        const ragged::DefensiveParams dp = defensive_params(p);  // alpha is not read by the scoring
        KeptRows forced;
        const Ragged sprime = ragged::defensive_layer_scores(layer, n_kept[l], dp, forced);
        maps.alloc.push_back(token_map(sprime, pos, layer.w, forced));
        break;
      }
      case Method::streamingllm:
        maps.alloc.push_back(streaming_map(pos, n_kept[l], p.sinks));
        break;
    }
    maps.cap_w.push_back(m == Method::streamingllm ? 0 : layer.w);
    if (p.redundancy > 0.0) {  // every ranked cell of this layer's maps: (1 - rho) s - rho R
      assert(m != Method::streamingllm);
      const Ragged r = ragged::key_redundancy(layer);
      for (std::vector<LayerMap>* list : {&maps.alloc, &maps.stage2})
        if (list->size() == l + 1)
          for (std::size_t h = 0; h < list->back().size(); ++h)
            for (std::size_t j = 0; j < list->back()[h].size(); ++j) {
              Cell& c = list->back()[h][j];
              if (c.tier == kScored || c.tier == kForced)
                c.score = (1.0 - p.redundancy) * c.score - p.redundancy * r[h][j];
            }
    }
  }
  return maps;
}

// All layers of a model at once; n_kept[l] is layer l's token n_kept (resolved by the caller; per_model: the same
// in every layer). Returns the kept rows per layer (per KV head, ascending). The caller passes the method's
// parameters (preset(m) for the library presets' defaults): alpha is read by adakv, adakv_original, criticalkv,
// defensivekv and adakv_defensive; layer_defensivekv, snapkv, critical_snapkv and streamingllm ignore it.
// With `protect` = p > 0 (docs/algorithms.md#protected-prefix), every cell at an original position < p of every map
// is in the protected tier; n_kept then counts it (an extra prefix: the caller adds p to n_kept). The caller checks
// that the budget holds the prefix (the library refuses one that does not).
// With `threshold.on` (docs/algorithms.md#threshold-budgets) the counts come from the threshold; n_kept is then what
// the selectors read while scoring (the library's: the mean entries per head, or a per-head upper bound).
// `retrieval[l]` (docs/algorithms.md#retrieval-heads; empty: none) lists KV heads of layer l whose every cell below the
// forced tier is forced (the window and the protected prefix stay in theirs), in every map.
inline std::vector<KeptRows> select(Method m, const std::vector<ragged::Layer>& layers,
                                    const std::vector<std::int64_t>& n_kept, const MethodParams& p,
                                    const Layout& layout, std::int64_t protect = 0, const Threshold& threshold = {},
                                    const std::vector<std::vector<int>>& retrieval = {}) {
  assert(!layers.empty() && layers.size() == n_kept.size());
  AllocParams ap;
  ap.allocation = allocation_of(m);
  ap.alpha = p.alpha;
  ap.critical = m == Method::criticalkv || m == Method::critical_snapkv;
  ap.first_stage_ratio = p.first_stage_ratio;
  ap.threshold = threshold;
  assert(protect == 0 || ap.allocation != Allocation::adakv_original);
  Maps maps = method_maps(m, layers, n_kept, p);
  maps.retrieval = retrieval;
  for (ModelMap* model : {&maps.alloc, &maps.stage2})
    for (std::size_t l = 0; l < model->size(); ++l)
      for (std::size_t h = 0; h < (*model)[l].size(); ++h)
        for (std::size_t j = 0; j < (*model)[l][h].size(); ++j)
          if (maps.pos[l][h][j] < protect) (*model)[l][h][j].tier = kProtected;
  return select_maps(maps, n_kept, ap, layout);
}

// PyramidKV's per-layer n_kept before the cap by what a layer holds (docs/algorithms.md#allocation, "Pyramid"), written
// from the text: the line from hi down to lo, each layer's floor, then one more token to the R layers of largest
// fractional part (a stable sort keeps the shallower first on ties); the window on top.
inline std::vector<std::int64_t> pyramid_shares(double beta, std::int64_t n, std::int64_t w, std::int64_t N) {
  const std::int64_t p = n - w;
  if (N == 1 || p <= 0) return std::vector<std::int64_t>(detail::sz(N), n);
  const double lo = static_cast<double>(p) / beta, hi = 2.0 * static_cast<double>(p) - lo;
  std::vector<double> t;
  for (std::int64_t l = 0; l < N; ++l)
    t.push_back(hi - static_cast<double>(l) * ((hi - lo) / static_cast<double>(N - 1)));
  std::vector<std::int64_t> out;
  std::int64_t given = 0;
  for (double x : t) {
    out.push_back(w + static_cast<std::int64_t>(std::floor(x)));
    given += static_cast<std::int64_t>(std::floor(x));
  }
  std::vector<std::size_t> order(t.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return t[a] - std::floor(t[a]) > t[b] - std::floor(t[b]); });
  for (std::int64_t r = 0; r < N * p - given; ++r) ++out[order[detail::sz(r)]];
  return out;
}

}  // namespace layout
}  // namespace kvevict_ref

#endif  // KVEVICT_TESTS_SUPPORT_REFERENCE_LAYOUT_HPP
