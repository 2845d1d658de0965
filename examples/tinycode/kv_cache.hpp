#pragma once
/// A per-(layer, KV head) variable-length KV cache: what an engine needs to run on a cache compressed by kvevict.
///
/// Storage of one layer, one of two:
///   slabs (default)  heads-major, the Hugging Face layout, one fixed-capacity slab per KV head:
///                    keys, values [kv_heads, capacity, head_dim]; head h's live rows are [0, length(h))
///   pages            vLLM's paged cache (page_rows > 0): a pool per layer [pool_pages, page_rows, kv_heads,
///                    head_dim] and one block table for every layer and KV head (a KV cache group), token i in
///                    page table[i / page_rows] at row i % page_rows. Pages come from a free list (shuffled once, so
///                    a request's pages lie anywhere in the pool); evict_pages() applies kvevict::adapters::vllm_plan
///                    (slot copies, the new table, the freed pages back to the list), so every (layer, KV head)
///                    keeps the same tokens (select with share = per_model). Positions are kept.
/// Keys are post-RoPE. The bookkeeping (each head's length and the original positions of its rows) is a
/// kvevict::CacheBook: after eviction the heads of a layer hold different numbers of rows (AdaKV, DefensiveKV;
/// slabs only), rows stay in ascending position order, and new tokens are appended after each head's last live row.

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <kvevict/adapters/vllm.hpp>
#include <kvevict/kvevict.hpp>

namespace tinycode {

class KVCache {
 public:
  using Index = Eigen::Index;
  using Position = std::int64_t;
  /// The rows [0, length) of one head: [length, head_dim], sharing the cache storage.
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using HeadRows = Eigen::Map<const Matrix>;

  KVCache() = default;
  /// page_rows 0: slabs; > 0: a page pool of ceil(capacity / page_rows) pages per layer (see the file comment).
  KVCache(Index layers, Index kv_heads, Index head_dim, Index capacity, Index page_rows = 0)
      : layers_(layers), kv_heads_(kv_heads), head_dim_(head_dim), capacity_(capacity), page_rows_(page_rows) {
    if (layers < 1 || kv_heads < 1 || head_dim < 1 || capacity < 1 || page_rows < 0)
      throw std::invalid_argument("KVCache: every extent must be >= 1 (page_rows >= 0)");
    book_ = kvevict::CacheBook(layers, kv_heads, capacity);
    if (paged()) {
      pool_pages_ = (capacity + page_rows - 1) / page_rows;
      free_pages_.resize(static_cast<std::size_t>(pool_pages_));
      for (Index p = 0; p < pool_pages_; ++p) free_pages_[static_cast<std::size_t>(p)] = static_cast<std::int32_t>(p);
      std::shuffle(free_pages_.begin(), free_pages_.end(), std::mt19937(2026));  // taken from the back
    }
    const auto n = static_cast<std::size_t>(layers * layer_elements());
    keys_.assign(n, 0.0f);
    values_.assign(n, 0.0f);
  }

  Index layers() const { return layers_; }
  Index kv_heads() const { return kv_heads_; }
  Index head_dim() const { return head_dim_; }
  Index capacity() const { return capacity_; }
  /// Whether the cache lives in a page pool, and its pages' rows (0: slabs).
  bool paged() const { return page_rows_ > 0; }
  Index page_rows() const { return page_rows_; }
  /// The request's block table (paged): its pages in token order.
  const std::vector<std::int32_t>& block_table() const { return table_; }
  /// Lengths and positions of every (layer, KV head).
  const kvevict::CacheBook& book() const { return book_; }
  kvevict::CacheBook& book() { return book_; }

  /// Live rows of (layer, head).
  Index length(Index layer, Index head) const { return book_.layer(layer).length(head); }
  /// Live rows of every (layer, head) pair, summed.
  Index total_length() const { return book_.entries(); }
  /// Empties every head (capacity is kept; a paged cache's pages go back to the free list).
  void clear() {
    book_.clear();
    free_pages_.insert(free_pages_.end(), table_.rbegin(), table_.rend());
    table_.clear();
  }

  /// Keys / values of (layer, head) as [length, head_dim] maps: of the slab (no copy), or of `scratch` holding the
  /// rows read through the block table (what a paged attention kernel reads).
  HeadRows keys(Index layer, Index head, Matrix& scratch) const { return rows(keys_, layer, head, scratch); }
  HeadRows values(Index layer, Index head, Matrix& scratch) const { return rows(values_, layer, head, scratch); }
  /// The same of a slab cache (no scratch needed).
  HeadRows keys(Index layer, Index head) const { return rows(keys_, layer, head, slab_only()); }
  HeadRows values(Index layer, Index head) const { return rows(values_, layer, head, slab_only()); }
  /// Original token position of row `row` of (layer, head).
  Position position(Index layer, Index head, Index row) const { return book_.layer(layer).position(head, row); }

  /// Records n new tokens at the next positions in every (layer, head): rows [length - n, length) of each head,
  /// written by write_new() as each layer runs.
  void append(Index n) {
    book_.append(n);
    if (!paged()) return;
    const Index rows = book_.layer(0).length(0);  // one table: every (layer, KV head) holds the same tokens
    while (static_cast<Index>(table_.size()) * page_rows_ < rows) {
      if (free_pages_.empty()) throw std::length_error("KVCache::append: the page pool is exhausted");
      table_.push_back(free_pages_.back());
      free_pages_.pop_back();
    }
  }
  /// Writes the n newest rows of (layer, head): keys and values [n, head_dim] (any Eigen expression).
  template <class K, class V>
  void write_new(Index layer, Index head, const Eigen::MatrixBase<K>& k, const Eigen::MatrixBase<V>& v) {
    const Index n = k.rows(), len = length(layer, head);
    if (k.cols() != head_dim_ || v.cols() != head_dim_ || v.rows() != n || n > len)
      throw std::invalid_argument("KVCache::write_new: keys and values must both be [n <= length, head_dim]");
    const auto keys = view(keys_.data(), layer), values = view(values_.data(), layer);
    for (Index r = len - n; r < len;) {  // a run of rows within one page (the whole slab when not paged)
      const Index m = std::min(keys.run_rows(r), len - r);
      keys.run(head, r, m) = k.middleRows(r - (len - n), m);
      values.run(head, r, m) = v.middleRows(r - (len - n), m);
      r += m;
    }
  }

  /// kvevict views of one layer's keys / values (no copy): over the whole capacity, [kv_heads, capacity, head_dim]
  /// (head stride = capacity * head_dim), or through the block table over the pages it lists
  /// (kvevict::kv_paged_tokens_major). LayerBook::describe() adds each head's length and positions.
  kvevict::KVView<const float> key_view(Index layer) const { return view(keys_.data(), layer); }
  kvevict::KVView<const float> value_view(Index layer) const { return view(values_.data(), layer); }

  /// Turns rows [0, length(h)) of each KV head h of `layer`'s keys by deltas(h, row) RoPE positions.
  void rerotate(Index layer, const kvevict::PositionsView& deltas, const kvevict::Rope& rope) {
    if (paged()) throw std::logic_error("KVCache::rerotate: a paged cache keeps positions");
    std::vector<std::int64_t> lengths;
    for (Index h = 0; h < kv_heads_; ++h) lengths.push_back(length(layer, h));
    kvevict::rerotate(view(keys_.data(), layer), deltas, rope, lengths.data());
  }

  /// Keeps only the rows `selection` chose for each KV head of `layer` (in place, order preserved): keys, values
  /// and positions are gathered with Selection::compact, and each head's length becomes selection.length(h).
  void compact(Index layer, const kvevict::Selection& selection) {
    if (paged()) throw std::logic_error("KVCache::compact: a paged cache evicts every layer at once (evict_pages)");
    book_.layer(layer).apply(selection, view(keys_.data(), layer), view(values_.data(), layer));
  }

  /// A paged cache keeps what `selections` [layers] chose, as vLLM would apply it: kvevict::adapters::vllm_plan
  /// (positions kept) gives the slot copies, done in order on every layer's keys and values, the new block table
  /// and the freed pages (back to the free list), after the book compacts positions and lengths. A selection the
  /// table cannot hold (other rows per head or layer) is refused by the plan before anything changes.
  kvevict::adapters::VllmPlan evict_pages(const std::vector<kvevict::Selection>& selections) {
    if (!paged()) throw std::logic_error("KVCache::evict_pages: the cache is not paged");
    if (static_cast<Index>(selections.size()) != layers_)
      throw std::invalid_argument("KVCache::evict_pages: needs one selection per layer");
    const std::vector<std::int64_t> table(table_.begin(), table_.end());
    const kvevict::adapters::VllmPlan plan =  // refuses what one table cannot hold, before anything changes
        kvevict::adapters::vllm_plan(selections, table, page_rows_, kvevict::adapters::Positions::kept);
    // The book first: its checks throw before it changes, and every layer keeps the same set (the plan checked).
    for (Index l = 0; l < layers_; ++l) book_.layer(l).apply(selections[static_cast<std::size_t>(l)]);
    const Index token = kv_heads_ * head_dim_;  // a slot: one token's rows of every KV head
    for (Index l = 0; l < layers_; ++l)
      for (std::vector<float>* pool : {&keys_, &values_}) {
        float* base = pool->data() + l * layer_elements();
        for (const auto& c : plan.copies)  // ascending, as the plan prescribes (no copy reads a written slot)
          for (std::int64_t i = 0; i < c.count; ++i)
            std::copy_n(base + (c.src_slot + i) * token, token, base + (c.dst_slot + i) * token);
      }
    table_.assign(plan.block_table.begin(), plan.block_table.end());
    free_pages_.insert(free_pages_.end(), plan.freed_blocks.rbegin(), plan.freed_blocks.rend());
    return plan;
  }

 private:
  Matrix& slab_only() const {
    if (paged()) throw std::logic_error("KVCache: a paged cache's rows are read into a scratch matrix");
    static thread_local Matrix unused;
    return unused;
  }
  Index layer_elements() const {
    return paged() ? pool_pages_ * page_rows_ * kv_heads_ * head_dim_ : kv_heads_ * capacity_ * head_dim_;
  }
  HeadRows rows(const std::vector<float>& storage, Index layer, Index head, Matrix& scratch) const {
    const Index len = length(layer, head);
    const auto v = view(storage.data(), layer);
    if (!paged()) return {v.row(head, 0), len, head_dim_};
    scratch.resize(len, head_dim_);
    for (Index r = 0; r < len; r += v.run_rows(r)) {
      const Index m = std::min(v.run_rows(r), len - r);
      scratch.middleRows(r, m) = v.run(head, r, m);
    }
    return {scratch.data(), len, head_dim_};
  }
  template <class T>
  kvevict::KVView<T> view(T* storage, Index layer) const {
    T* base = storage + layer * layer_elements();
    if (paged())
      return kvevict::kv_paged_tokens_major<T>(base, pool_pages_, table_.data(),
                                               static_cast<Index>(table_.size()) * page_rows_, page_rows_, kv_heads_,
                                               head_dim_);
    return kvevict::KVView<T>(base, kv_heads_, capacity_, head_dim_, capacity_ * head_dim_, head_dim_);
  }

  Index layers_ = 0, kv_heads_ = 0, head_dim_ = 0, capacity_ = 0, page_rows_ = 0, pool_pages_ = 0;
  kvevict::CacheBook book_;
  std::vector<float> keys_, values_;      // [layers, kv_heads, capacity, head_dim] or [layers, pool, page, Hkv, d]
  std::vector<std::int32_t> table_;       // paged: the block table, pages in token order
  std::vector<std::int32_t> free_pages_;  // paged: the free list, taken from the back
};

}  // namespace tinycode
