#pragma once
/// A per-(layer, KV head) variable-length KV cache: what an engine needs to run on a cache compressed by kvevict.
///
/// Storage of one layer (heads-major, the Hugging Face layout, one fixed-capacity slab per KV head):
///   keys, values [kv_heads, capacity, head_dim]   head h's live rows are [0, length(h)), post-RoPE keys
/// The bookkeeping (each head's length and the original positions of its rows) is a kvevict::CacheBook: after
/// eviction the heads of a layer hold different numbers of rows (AdaKV, DefensiveKV), rows stay in ascending
/// position order, and new tokens are appended after each head's last live row.

#include <Eigen/Core>

#include <cstdint>
#include <stdexcept>
#include <string>
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
    book_ = kvevict::CacheBook(layers, kv_heads, capacity);
    const auto n = static_cast<std::size_t>(layers * kv_heads * capacity * head_dim);
    keys_.assign(n, 0.0f);
    values_.assign(n, 0.0f);
  }

  Index layers() const { return layers_; }
  Index kv_heads() const { return kv_heads_; }
  Index head_dim() const { return head_dim_; }
  Index capacity() const { return capacity_; }
  /// Lengths and positions of every (layer, KV head).
  const kvevict::CacheBook& book() const { return book_; }
  kvevict::CacheBook& book() { return book_; }

  /// Live rows of (layer, head).
  Index length(Index layer, Index head) const { return book_.layer(layer).length(head); }
  /// Live rows of every (layer, head) pair, summed.
  Index total_length() const { return book_.entries(); }
  /// Empties every head (capacity is kept).
  void clear() { book_.clear(); }

  /// Keys / values of (layer, head) as [length, head_dim] maps (no copy).
  HeadRows keys(Index layer, Index head) const { return {key_row(layer, head, 0), length(layer, head), head_dim_}; }
  HeadRows values(Index layer, Index head) const { return {value_row(layer, head, 0), length(layer, head), head_dim_}; }
  /// Original token position of row `row` of (layer, head).
  Position position(Index layer, Index head, Index row) const { return book_.layer(layer).position(head, row); }

  /// Records n new tokens at the next positions in every (layer, head): rows [length - n, length) of each head,
  /// written by write_new() as each layer runs.
  void append(Index n) { book_.append(n); }
  /// Writes the n newest rows of (layer, head): keys and values [n, head_dim] (any Eigen expression).
  template <class K, class V>
  void write_new(Index layer, Index head, const Eigen::MatrixBase<K>& k, const Eigen::MatrixBase<V>& v) {
    const Index n = k.rows(), len = length(layer, head);
    if (k.cols() != head_dim_ || v.cols() != head_dim_ || v.rows() != n || n > len)
      throw std::invalid_argument("KVCache::write_new: keys and values must both be [n <= length, head_dim]");
    using RowMap = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
    RowMap(key_row(layer, head, len - n), n, head_dim_) = k;
    RowMap(value_row(layer, head, len - n), n, head_dim_) = v;
  }

  /// kvevict views of one layer's keys / values over the whole capacity, [kv_heads, capacity, head_dim] (no copy;
  /// head stride = capacity * head_dim). LayerBook::describe() adds each head's length and positions.
  kvevict::KVView<const float> key_view(Index layer) const { return view(keys_.data(), layer); }
  kvevict::KVView<const float> value_view(Index layer) const { return view(values_.data(), layer); }

  /// Turns rows [0, length(h)) of each KV head h of `layer`'s keys by deltas(h, row) RoPE positions.
  void rerotate(Index layer, const kvevict::PositionsView& deltas, const kvevict::Rope& rope) {
    std::vector<std::int64_t> lengths;
    for (Index h = 0; h < kv_heads_; ++h) lengths.push_back(length(layer, h));
    kvevict::rerotate(view(keys_.data(), layer), deltas, rope, lengths.data());
  }

  /// Keeps only the rows `selection` chose for each KV head of `layer` (in place, order preserved): keys, values
  /// and positions are gathered with Selection::compact, and each head's length becomes selection.length(h).
  void compact(Index layer, const kvevict::Selection& selection) {
    book_.layer(layer).apply(selection, view(keys_.data(), layer), view(values_.data(), layer));
  }

 private:
  const float* key_row(Index layer, Index head, Index row) const { return &keys_[offset(layer, head, row)]; }
  const float* value_row(Index layer, Index head, Index row) const { return &values_[offset(layer, head, row)]; }
  float* key_row(Index layer, Index head, Index row) { return &keys_[offset(layer, head, row)]; }
  float* value_row(Index layer, Index head, Index row) { return &values_[offset(layer, head, row)]; }
  std::size_t offset(Index layer, Index head, Index row) const {
    KVEVICT_ASSERT(layer >= 0 && layer < layers_ && head >= 0 && head < kv_heads_ && row >= 0 && row <= capacity_);
    return static_cast<std::size_t>(((layer * kv_heads_ + head) * capacity_ + row) * head_dim_);
  }
  template <class T>
  kvevict::KVView<T> view(T* storage, Index layer) const {
    return kvevict::KVView<T>(storage + offset(layer, 0, 0), kv_heads_, capacity_, head_dim_, capacity_ * head_dim_,
                              head_dim_);
  }

  Index layers_ = 0, kv_heads_ = 0, head_dim_ = 0, capacity_ = 0;
  kvevict::CacheBook book_;
  std::vector<float> keys_, values_;  // [layers, kv_heads, capacity, head_dim]
};

}  // namespace tinycode
