#pragma once
/// A per-(layer, KV head) variable-length KV cache: what an engine needs to run on a cache compressed by kvevict.
///
/// Storage of one layer (heads-major, the Hugging Face layout, one fixed-capacity slab per KV head):
///   keys, values [kv_heads, capacity, head_dim]   head h's live rows are [0, length(h)), post-RoPE keys
///   positions    [kv_heads, capacity]             the original token position of each live row
/// After eviction the heads of a layer may hold different numbers of rows (AdaKV, DefensiveKV); rows stay in
/// ascending position order, and new tokens are appended after each head's last live row.

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <kvevict/kvevict.hpp>

namespace tinycode {

class KVCache {
 public:
  using Index = Eigen::Index;
  using Position = std::int64_t;
  /// The rows [0, length) of one head: [length, head_dim], sharing the cache storage.
  using HeadRows = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

  KVCache() = default;
  KVCache(Index layers, Index kv_heads, Index head_dim, Index capacity)
      : layers_(layers), kv_heads_(kv_heads), head_dim_(head_dim), capacity_(capacity) {
    if (layers < 1 || kv_heads < 1 || head_dim < 1 || capacity < 1)
      throw std::invalid_argument("KVCache: every extent must be >= 1");
    const auto n = static_cast<std::size_t>(layers * kv_heads * capacity);
    keys_.assign(n * static_cast<std::size_t>(head_dim), 0.0f);
    values_.assign(n * static_cast<std::size_t>(head_dim), 0.0f);
    positions_.assign(n, -1);
    lengths_.assign(static_cast<std::size_t>(layers * kv_heads), 0);
  }

  Index layers() const { return layers_; }
  Index kv_heads() const { return kv_heads_; }
  Index head_dim() const { return head_dim_; }
  Index capacity() const { return capacity_; }

  /// Live rows of (layer, head).
  Index length(Index layer, Index head) const { return lengths_[slot(layer, head)]; }
  /// Live rows of every (layer, head) pair, summed.
  Index total_length() const {
    Index n = 0;
    for (Index v : lengths_) n += v;
    return n;
  }
  /// Empties every head (capacity is kept).
  void clear() { std::fill(lengths_.begin(), lengths_.end(), Index{0}); }

  /// Keys / values of (layer, head) as [length, head_dim] maps (no copy).
  HeadRows keys(Index layer, Index head) const { return {key_row(layer, head, 0), length(layer, head), head_dim_}; }
  HeadRows values(Index layer, Index head) const { return {value_row(layer, head, 0), length(layer, head), head_dim_}; }
  /// Original token position of row `row` of (layer, head).
  Position position(Index layer, Index head, Index row) const {
    return positions_[slot(layer, head) * static_cast<std::size_t>(capacity_) + static_cast<std::size_t>(row)];
  }

  /// Appends n rows to (layer, head): keys and values [n, head_dim] (any Eigen expression), at positions
  /// first_position .. first_position + n - 1.
  template <class K, class V>
  void append(Index layer, Index head, const Eigen::MatrixBase<K>& k, const Eigen::MatrixBase<V>& v,
              Position first_position) {
    const Index n = k.rows(), len = length(layer, head);
    if (k.cols() != head_dim_ || v.cols() != head_dim_ || v.rows() != n)
      throw std::invalid_argument("KVCache::append: keys and values must both be [n, head_dim]");
    if (len + n > capacity_)
      throw std::length_error("KVCache::append: layer " + std::to_string(layer) + " head " + std::to_string(head) +
                              " would hold " + std::to_string(len + n) + " rows, capacity " +
                              std::to_string(capacity_));
    using RowMap = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
    RowMap(key_row(layer, head, len), n, head_dim_) = k;
    RowMap(value_row(layer, head, len), n, head_dim_) = v;
    Position* pos = &positions_[slot(layer, head) * static_cast<std::size_t>(capacity_)];
    for (Index i = 0; i < n; ++i) pos[len + i] = first_position + i;
    lengths_[slot(layer, head)] = len + n;
  }

  /// kvevict views of one layer's keys / values: [kv_heads, tokens, head_dim] over this cache's storage (no copy;
  /// head stride = capacity * head_dim). Eviction runs on an uncompressed layer, so every head must hold the same
  /// number of rows (the context length).
  kvevict::KVView<const float> key_view(Index layer) const { return view(keys_, layer); }
  kvevict::KVView<const float> value_view(Index layer) const { return view(values_, layer); }

  /// Keeps only the rows `selection` chose for each KV head of `layer` (in place, order preserved): keys, values
  /// and positions are gathered with Selection::compact, and each head's length becomes selection.length(h).
  void compact(Index layer, const kvevict::Selection& selection) {
    const Index tokens = uniform_length(layer, "KVCache::compact");
    if (selection.heads() != kv_heads_ || selection.context_length() != tokens)
      throw std::invalid_argument("KVCache::compact: the selection was made for " + std::to_string(selection.heads()) +
                                  " heads x " + std::to_string(selection.context_length()) + " tokens; layer " +
                                  std::to_string(layer) + " holds " + std::to_string(kv_heads_) + " x " +
                                  std::to_string(tokens));
    const auto compact_rows = [&](auto* base, Index cols) {
      using T = std::remove_pointer_t<decltype(base)>;
      const Index head_stride = capacity_ * cols;
      const kvevict::HeadsView<T> live(base, kv_heads_, tokens, cols, head_stride, cols);
      const kvevict::HeadsView<T> all(base, kv_heads_, capacity_, cols, head_stride, cols);
      selection.compact(live, all);  // in place: kept row k moves to row <= k
    };
    const std::size_t first = slot(layer, 0) * static_cast<std::size_t>(capacity_);
    compact_rows(keys_.data() + first * static_cast<std::size_t>(head_dim_), head_dim_);
    compact_rows(values_.data() + first * static_cast<std::size_t>(head_dim_), head_dim_);
    compact_rows(positions_.data() + first, Index{1});
    for (Index h = 0; h < kv_heads_; ++h) lengths_[slot(layer, h)] = selection.length(h);
  }

 private:
  std::size_t slot(Index layer, Index head) const {
    KVEVICT_ASSERT(layer >= 0 && layer < layers_ && head >= 0 && head < kv_heads_);
    return static_cast<std::size_t>(layer * kv_heads_ + head);
  }
  const float* key_row(Index layer, Index head, Index row) const { return &keys_[offset(layer, head, row)]; }
  const float* value_row(Index layer, Index head, Index row) const { return &values_[offset(layer, head, row)]; }
  float* key_row(Index layer, Index head, Index row) { return &keys_[offset(layer, head, row)]; }
  float* value_row(Index layer, Index head, Index row) { return &values_[offset(layer, head, row)]; }
  std::size_t offset(Index layer, Index head, Index row) const {
    return (slot(layer, head) * static_cast<std::size_t>(capacity_) + static_cast<std::size_t>(row)) *
           static_cast<std::size_t>(head_dim_);
  }
  Index uniform_length(Index layer, const char* where) const {
    const Index tokens = length(layer, 0);
    for (Index h = 1; h < kv_heads_; ++h)
      if (length(layer, h) != tokens)
        throw std::logic_error(std::string(where) + ": the heads of layer " + std::to_string(layer) +
                               " hold different numbers of rows (already compressed)");
    return tokens;
  }
  kvevict::KVView<const float> view(const std::vector<float>& storage, Index layer) const {
    const Index tokens = uniform_length(layer, "KVCache::key_view/value_view");
    return kvevict::KVView<const float>(storage.data() + offset(layer, 0, 0), kv_heads_, tokens, head_dim_,
                                        capacity_ * head_dim_, head_dim_);
  }

  Index layers_ = 0, kv_heads_ = 0, head_dim_ = 0, capacity_ = 0;
  std::vector<float> keys_, values_;  // [layers, kv_heads, capacity, head_dim]
  std::vector<Position> positions_;   // [layers, kv_heads, capacity]
  std::vector<Index> lengths_;        // [layers, kv_heads]
};

}  // namespace tinycode
