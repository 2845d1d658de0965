#pragma once
/// Eviction while the cache grows (docs/algorithms.md#streaming): the bookkeeping of a ragged cache, per-head lengths
/// and original positions, and nothing else. The engine owns keys and values and runs the forward pass.
///
///   kvevict::CacheBook book(n_layers, kv_heads, capacity);
///   for each step of c >= w tokens:
///     book.append(c);                                  // positions next_position() .. + c - 1, every layer
///     ... forward pass: write each layer's new K/V rows at [length(h) - c, length(h)) of head h ...
///     kvevict::evict_over_budget(policy, book, n, [&](Index l) { return inputs_of(l); },   // views + queries
///                                [&](Index l, const kvevict::Selection& s) { book.layer(l).apply(s, k(l), v(l)); });
///
/// For H2O the book also carries the attention each entry has received: after each forward pass, before evicting,
/// book.layer(l).accumulate(step_inputs) (the step's c queries) or, from an engine's own softmax rows,
/// book.layer(l).add_attention(h, sums, n).

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "kvevict/core/budget.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/views.hpp"
#include "kvevict/observation/accumulated_attention.hpp"

namespace kvevict {
inline namespace KVEVICT_ABI_NAMESPACE {  // core/config.hpp: LayerBook::accumulate depends on KVEVICT_OPENMP

/// One layer's bookkeeping: lengths [Hkv] and original positions [Hkv, capacity] of the entries each KV head holds
/// in the engine's storage (keys and values [Hkv, capacity, d], either layout). Rows stay in ascending position
/// order: appends go after each head's last entry, eviction compacts in place. Once something was accumulated
/// (accumulate(), add_attention()), it also carries each entry's received attention [Hkv, capacity] (H2O,
/// docs/algorithms.md#h2o): 0 for new entries, compacted with them, attached by describe().
class LayerBook {
 public:
  LayerBook() = default;
  LayerBook(Index kv_heads, Index capacity)
      : kv_heads_(kv_heads),
        capacity_(capacity),
        lengths_(static_cast<std::size_t>(kv_heads), 0),
        positions_(static_cast<std::size_t>(kv_heads * capacity), 0),
        accumulated_(static_cast<std::size_t>(kv_heads * capacity), 0.0f) {
    detail::require(kv_heads >= 1 && capacity >= 1, "LayerBook", "needs kv_heads >= 1 and capacity >= 1, got ",
                    kv_heads, " and ", capacity);
  }

  Index kv_heads() const { return kv_heads_; }
  Index capacity() const { return capacity_; }
  /// L_h [Hkv], what LayerInputs::lengths points to.
  const std::vector<std::int64_t>& lengths() const { return lengths_; }
  Index length(Index h) const { return static_cast<Index>(lengths_[head(h)]); }
  /// Sum of L_h.
  Index entries() const { return static_cast<Index>(std::accumulate(lengths_.begin(), lengths_.end(), 0LL)); }
  /// Whether the layer holds more than its budget of n tokens per KV head on average (Hkv * n entries).
  bool over_budget(Index n) const { return entries() > kv_heads_ * n; }
  /// Original positions [Hkv, capacity] (entries beyond L_h are stale), what LayerInputs::positions views.
  PositionsView positions() const { return positions_heads_major(positions_.data(), kv_heads_, capacity_); }
  std::int64_t position(Index h, Index j) const {
    return positions_[head(h) * static_cast<std::size_t>(capacity_) + static_cast<std::size_t>(j)];
  }

  /// Whether entries carry received attention (something was accumulated since construction or clear()).
  bool accumulates() const { return accumulates_; }
  /// The attention each entry has received, [Hkv, capacity, 1] (entries beyond L_h are stale); 0 everywhere before
  /// the first accumulate() or add_attention().
  HeadsView<const float> accumulated() const {
    return HeadsView<const float>::heads_major(accumulated_.data(), kv_heads_, capacity_, 1);
  }
  /// Adds the attention received from the step's queries (kvevict::accumulate_attention over this layer's entries):
  /// `step` as any select() input (keys viewing the capacity rows) with the queries [H, c, d] of each head's last c
  /// entries, or their softmax rows [H, c, >= L_h]. Throws kvevict::invalid_argument, changing nothing, on bad input.
  template <class S = float, class KV, class Q, class W>
  void accumulate(LayerInputs<KV, Q, W> step) {
    step.lengths = lengths_.data();
    step.positions = positions();
    accumulate_attention<S>(step, HeadsView<float>::heads_major(accumulated_.data(), kv_heads_, capacity_, 1),
                            "LayerBook::accumulate");
    accumulates_ = true;
  }
  /// Adds sums[j] to the received attention of entry j of KV head h, j in [0, n): for an engine that computes the
  /// softmax rows itself (sums = the step's rows summed over its queries, averaged over the G query heads of h).
  void add_attention(Index h, const float* sums, Index n) {
    detail::require(n >= 0 && n <= length(h), "LayerBook::add_attention", "n must be in [0, ", length(h),
                    "] (the entries of KV head ", h, "), got ", n);
    float* row = accumulated_.data() + head(h) * static_cast<std::size_t>(capacity_);
    for (Index j = 0; j < n; ++j) row[j] += sums[j];
    accumulates_ = true;
  }

  /// Records n tokens at positions first .. first + n - 1 appended to every head (rows [L_h, L_h + n)). Throws
  /// kvevict::invalid_argument, changing nothing, if a head would exceed the capacity or the positions would not
  /// increase.
  void append(std::int64_t first_position, Index n) {
    detail::require(n >= 1, "LayerBook::append", "needs n >= 1 tokens, got ", n);
    for (Index h = 0; h < kv_heads_; ++h) {
      detail::require(length(h) + n <= capacity_, "LayerBook::append", "KV head ", h, " would hold ", length(h) + n,
                      " entries, over the capacity of ", capacity_);
      if (length(h) == 0) continue;
      const std::int64_t last = position(h, length(h) - 1);  // (require evaluates its message parts eagerly)
      detail::require(last < first_position, "LayerBook::append", "positions must increase: KV head ", h,
                      " ends at position ", last, ", appending at ", first_position);
    }
    for (Index h = 0; h < kv_heads_; ++h) {
      std::int64_t* row = positions_.data() + head(h) * static_cast<std::size_t>(capacity_);
      float* received = accumulated_.data() + head(h) * static_cast<std::size_t>(capacity_);
      for (Index i = 0; i < n; ++i) row[length(h) + i] = first_position + i, received[length(h) + i] = 0.0f;
      lengths_[head(h)] += n;
    }
  }

  /// `in` with this layer's lengths and positions attached (keys and values must view the capacity rows), and the
  /// received attention once the book accumulates.
  template <class KV, class Q, class W>
  LayerInputs<KV, Q, W> describe(LayerInputs<KV, Q, W> in) const {
    in.lengths = lengths_.data();
    in.positions = positions();
    if (accumulates_) in.accumulated = accumulated();
    return in;
  }

  /// Keeps what `selection` chose (made over this layer's entries): compacts every view in `rows` in place (the
  /// engine's keys, values, or any per-entry array [Hkv, capacity, .]) and the positions, and sets L_h to the kept
  /// lengths. Throws kvevict::invalid_argument, changing nothing, if the selection does not fit this layer.
  template <class... T>
  void apply(const Selection& selection, const HeadsView<T>&... rows) {
    detail::require(selection.heads() == kv_heads_, "LayerBook::apply", "the selection has ", selection.heads(),
                    " KV heads, the layer ", kv_heads_);
    for (Index h = 0; h < kv_heads_; ++h) {
      const auto kept = selection.head(h);
      detail::require(kept.size() == 0 || kept[kept.size() - 1] < length(h), "LayerBook::apply",
                      "the selection keeps row ", kept.size() ? kept[kept.size() - 1] : 0, " of KV head ", h,
                      ", which holds ", length(h), " entries");
    }
    (detail::require(rows.heads() == kv_heads_ && rows.rows() >= capacity_, "LayerBook::apply", "each view must be [",
                     kv_heads_, ", >= ", capacity_, ", .], got [", rows.heads(), ", ", rows.rows(), ", ", rows.cols(),
                     "]"),
     ...);
    (selection.compact(rows, rows), ...);
    const HeadsView<std::int64_t> pos(positions_.data(), kv_heads_, capacity_, 1, capacity_, 1);
    selection.compact(pos, pos);
    const HeadsView<float> received(accumulated_.data(), kv_heads_, capacity_, 1, capacity_, 1);
    selection.compact(received, received);
    for (Index h = 0; h < kv_heads_; ++h) lengths_[head(h)] = selection.length(h);
  }

  /// Renumbers every head's entries first, first + 1, ... (an engine that re-rotates its kept keys, as a K-shift
  /// does: rerotate_kept(keys, selection, rope, first) after apply()), so that the positions stay the keys' own.
  void renumber(std::int64_t first = 0) {
    detail::require(first >= 0, "LayerBook::renumber", "first must be >= 0, got ", first);
    for (Index h = 0; h < kv_heads_; ++h) {
      std::int64_t* row = positions_.data() + head(h) * static_cast<std::size_t>(capacity_);
      for (Index j = 0; j < length(h); ++j) row[j] = first + j;
    }
  }

  /// Empties every head (the capacity is kept) and stops carrying received attention until the next accumulation.
  void clear() {
    std::fill(lengths_.begin(), lengths_.end(), 0);
    accumulates_ = false;
  }

 private:
  std::size_t head(Index h) const {
    detail::require(h >= 0 && h < kv_heads_, "LayerBook", "KV head must be in [0, ", kv_heads_, "), got ", h);
    return static_cast<std::size_t>(h);
  }

  Index kv_heads_ = 0, capacity_ = 0;
  std::vector<std::int64_t> lengths_;    // [Hkv]
  std::vector<std::int64_t> positions_;  // [Hkv, capacity]
  std::vector<float> accumulated_;       // [Hkv, capacity], received attention (H2O)
  bool accumulates_ = false;
};

/// A model's bookkeeping: one LayerBook per layer, the next token position, and the tokens appended since the last
/// eviction (the step).
class CacheBook {
 public:
  CacheBook() = default;
  CacheBook(Index layers, Index kv_heads, Index capacity) {
    detail::require(layers >= 1, "CacheBook", "needs layers >= 1, got ", layers);
    layers_.assign(static_cast<std::size_t>(layers), LayerBook(kv_heads, capacity));
    evict_.assign(layers_.size(), true);
  }
  /// A hybrid model (docs/algorithms.md#hybrid-models): layer l has kv_heads[l] KV heads, and the layers with
  /// kept_whole[l] (empty: none) are never evicted (sliding-window or full-attention layers the engine keeps): the
  /// model's budget counts the other layers only.
  CacheBook(const std::vector<Index>& kv_heads, Index capacity, const std::vector<bool>& kept_whole = {}) {
    detail::require(!kv_heads.empty(), "CacheBook", "needs layers >= 1, got 0");
    detail::require(kept_whole.empty() || kept_whole.size() == kv_heads.size(), "CacheBook", "kept_whole has ",
                    kept_whole.size(), " entries, expected one per layer (", kv_heads.size(), ") or none");
    for (Index h : kv_heads) layers_.emplace_back(h, capacity);
    evict_.assign(layers_.size(), true);
    for (std::size_t l = 0; l < kept_whole.size(); ++l) evict_[l] = !kept_whole[l];
  }

  Index layers() const { return static_cast<Index>(layers_.size()); }
  /// Whether layer l is evicted (false: the engine keeps it whole).
  bool evicts(Index l) const { return evict_[checked(l)]; }
  /// The evicted layers.
  Index evicted_layers() const { return static_cast<Index>(std::count(evict_.begin(), evict_.end(), true)); }
  LayerBook& layer(Index l) { return layers_[checked(l)]; }
  const LayerBook& layer(Index l) const { return layers_[checked(l)]; }
  /// Position of the next token (tokens appended so far, evicted or not; after renumber(), first + the longest head).
  std::int64_t next_position() const { return next_position_; }
  /// Tokens appended since the last evict_over_budget() (the current step).
  Index step() const { return step_; }
  /// Entries held by the whole model.
  Index entries() const {
    Index n = 0;
    for (const LayerBook& l : layers_) n += l.entries();
    return n;
  }

  /// Whether the model holds more than its budget of n tokens per KV head on average (the sum over the evicted layers
  /// of Hkv * n entries, against their entries: what a layer-global policy evicts to).
  bool over_budget(Index n) const {
    Index total = 0, held = 0;
    for (std::size_t l = 0; l < layers_.size(); ++l)
      if (evict_[l]) total += layers_[l].kv_heads() * n, held += layers_[l].entries();
    return held > total;
  }

  /// Records n tokens appended to every layer and head at next_position() .. + n - 1.
  void append(Index n) {
    detail::require(n >= 1, "CacheBook::append", "needs n >= 1 tokens, got ", n);
    for (const LayerBook& l : layers_)  // check every layer first: nothing changes on error
      for (Index h = 0; h < l.kv_heads(); ++h)
        detail::require(l.length(h) + n <= l.capacity(), "CacheBook::append", "layer ", &l - layers_.data(),
                        " KV head ", h, " would hold ", l.length(h) + n, " entries, over the capacity of ",
                        l.capacity());
    for (LayerBook& l : layers_) l.append(next_position_, n);
    next_position_ += n;
    step_ += n;
  }
  /// Renumbers every layer's entries first, first + 1, ... per KV head (LayerBook::renumber) and moves the next
  /// position to first + the longest head's entries, where the next token's keys are then computed: a K-shift
  /// engine, right after an evict_over_budget() that evicted every layer, in whose apply each layer's kept keys were
  /// re-rotated to those positions (rerotate_kept(keys, selection, rope, first); docs/algorithms.md#streaming).
  /// Refused after a step that evicted fewer layers (their keys were not re-rotated), and with layers kept whole
  /// (theirs would run past the next position).
  void renumber(std::int64_t first = 0) {
    detail::require(evicted_layers() == layers(), "CacheBook::renumber",
                    "a model with layers kept whole cannot renumber its positions: theirs would run past the next "
                    "position (",
                    layers() - evicted_layers(), " of ", layers(), " layers are kept whole)");
    detail::require(step_ == 0 && last_evicted_ == layers(), "CacheBook::renumber",
                    "renumbers right after a step that evicted every layer (their kept keys re-rotated), but the "
                    "last step evicted ",
                    last_evicted_, " of ", layers(), " layers", step_ > 0 ? " and tokens were appended since" : "",
                    " (select with share = per_model or a layer-global policy, which evict all layers at once)");
    detail::require(first >= 0, "CacheBook::renumber", "first must be >= 0, got ", first);
    Index longest = 0;
    for (LayerBook& l : layers_) {
      l.renumber(first);
      for (Index h = 0; h < l.kv_heads(); ++h) longest = std::max(longest, l.length(h));
    }
    next_position_ = first + longest;
  }
  /// Forgets every token.
  void clear() {
    for (LayerBook& l : layers_) l.clear();
    next_position_ = 0;
    step_ = 0;
  }
  /// Marks the end of a step in which `evicted` layers were evicted (evict_over_budget() calls it).
  void end_step(Index evicted = 0) {
    step_ = 0;
    last_evicted_ = evicted;
  }
  /// Layers evicted by the last step that ended (0 before any).
  Index last_evicted() const { return last_evicted_; }

 private:
  std::size_t checked(Index l) const {
    detail::require(l >= 0 && l < layers(), "CacheBook", "layer must be in [0, ", layers(), "), got ", l);
    return static_cast<std::size_t>(l);
  }

  std::vector<LayerBook> layers_;
  std::vector<bool> evict_;  // [layers] false: kept whole
  std::int64_t next_position_ = 0;
  Index step_ = 0, last_evicted_ = 0;
};

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict
