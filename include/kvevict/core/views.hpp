#pragma once
/// Zero-copy strided views over the engine's tensors: keys, values, window queries, attention rows, W_o; keys and
/// values also through a page table (a paged cache: vLLM, SGLang, FlashInfer, OpenVINO GenAI).

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kvevict/core/error.hpp"

namespace kvevict {

using Index = Eigen::Index;

/// The page table of a paged view (docs/algorithms.md#paged): logical row r lives in page table[r / page_rows] of a
/// pool of `pool_pages` pages, `page_stride` elements apart; int32 ids, as vLLM's block tables, SGLang's
/// req_to_token (page_rows 1) and FlashInfer's page indices hold them.
struct PageTable {
  const std::int32_t* table = nullptr;  ///< [ceil(rows / page_rows)] page ids, each in [0, pool_pages)
  Index page_rows = 0;                  ///< rows (tokens) per page: the engine's block or page size
  Index page_stride = 0;                ///< elements from one pool page to the next
  Index pool_pages = 0;                 ///< pages in the pool (bounds the ids)
};

/// Row-major dense matrix used for per-head work buffers.
template <class S>
using RowMatrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// A 3-D view [heads, rows, cols] with contiguous cols and arbitrary head and row strides (in elements).
/// Covers both engine layouts of a KV cache without copying:
///   heads-major (Hugging Face)   [kv_heads, tokens, head_dim]: head_stride = tokens * head_dim, row_stride = head_dim
///   tokens-major (llama.cpp, vLLM) [tokens, kv_heads, head_dim]: head_stride = head_dim, row_stride = kv_heads *
///   head_dim
/// A paged view (PageTable) holds its rows in pages anywhere in a pool: row r of head h is at
///   data + table[r / page_rows] * page_stride + h * head_stride + (r % page_rows) * row_stride,
/// read in place (kv_paged_tokens_major, kv_paged_heads_major); it has no single matrix per head (head() refuses
/// it): the library reads it by runs of rows within a page (run_rows, run), as every stage does.
/// T is the storage type, usually const-qualified: float, double, Eigen::half or Eigen::bfloat16 (engines' KV
/// caches; keys and values also std::int8_t, float8_e4m3 or float8_e5m2 with their scales, core/quantized.hpp);
/// the library converts what it reads to its arithmetic type S (float unless select<double>()).
template <class T>
class HeadsView {
 public:
  using value_type = std::remove_const_t<T>;
  /// One head as an Eigen matrix [rows, cols] sharing the view's storage.
  using HeadMap = Eigen::Map<std::conditional_t<std::is_const_v<T>, const RowMatrix<value_type>, RowMatrix<value_type>>,
                             Eigen::Unaligned, Eigen::OuterStride<>>;

  HeadsView() = default;
  HeadsView(T* data, Index heads, Index rows, Index cols, Index head_stride, Index row_stride)
      : data_(data), heads_(heads), rows_(rows), cols_(cols), head_stride_(head_stride), row_stride_(row_stride) {
    detail::require(heads >= 0 && rows >= 0 && cols >= 0, "HeadsView", "extents must be non-negative, got [", heads,
                    ", ", rows, ", ", cols, "]");
    detail::require(data != nullptr || heads * rows * cols == 0, "HeadsView",
                    "data must not be null for a non-empty view");
    detail::require(row_stride >= cols && head_stride >= 0, "HeadsView", "row_stride (", row_stride,
                    ") must be >= cols (", cols, ") and head_stride (", head_stride, ") >= 0");
  }

  /// The same rows through a page table: `data` is the pool, head_stride and row_stride the strides inside a page.
  HeadsView(T* pool, Index heads, Index rows, Index cols, Index head_stride, Index row_stride, const PageTable& pages)
      : HeadsView(pool, heads, rows, cols, head_stride, row_stride) {
    const char* where = "HeadsView (paged)";
    detail::require(pages.page_rows >= 1, where, "page_rows must be >= 1, got ", pages.page_rows);
    detail::require(pages.pool_pages >= 0 && pages.page_stride >= 0, where, "pool_pages (", pages.pool_pages,
                    ") and page_stride (", pages.page_stride, ") must be >= 0");
    detail::require(pages.table != nullptr || rows == 0, where, "the page table must not be null for ", rows, " rows");
    const Index used = (rows + pages.page_rows - 1) / pages.page_rows;
    for (Index p = 0; p < used; ++p)
      detail::require(pages.table[p] >= 0 && pages.table[p] < pages.pool_pages, where, "page table entry ", p,
                      " (rows ", p * pages.page_rows, "..", std::min(rows, (p + 1) * pages.page_rows) - 1,
                      ") must be a page of the pool, in [0, ", pages.pool_pages, "), got ", pages.table[p]);
    // Distinct pages: two entries on one page would make in-place compaction overwrite rows it still reads.
    std::vector<std::int32_t> ids(pages.table, pages.table + used);
    std::sort(ids.begin(), ids.end());
    const auto repeat = std::adjacent_find(ids.begin(), ids.end());
    detail::require(repeat == ids.end(), where, "the page table lists page ", repeat == ids.end() ? 0 : *repeat,
                    " twice; each page holds rows of one place in the view");
    pages_ = pages;
  }

  /// [heads, rows, cols] stored contiguously (Hugging Face KV layout, or [H, w, d] queries, [H, w, L] attention).
  static HeadsView heads_major(T* data, Index heads, Index rows, Index cols) {
    return HeadsView(data, heads, rows, cols, rows * cols, cols);
  }
  /// [rows, heads, cols] stored contiguously (token-major KV layout of llama.cpp and vLLM).
  static HeadsView rows_major(T* data, Index rows, Index heads, Index cols) {
    return HeadsView(data, heads, rows, cols, cols, heads * cols);
  }

  T* data() const { return data_; }
  Index heads() const { return heads_; }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  Index head_stride() const { return head_stride_; }
  Index row_stride() const { return row_stride_; }

  /// Whether the rows lie in pages through a page table.
  bool paged() const { return pages_.table != nullptr; }
  const PageTable& pages() const { return pages_; }

  T* row(Index h, Index r) const {
    KVEVICT_ASSERT(h >= 0 && h < heads_ && r >= 0 && r < rows_);
    if (!paged()) return data_ + h * head_stride_ + r * row_stride_;
    return data_ + pages_.table[r / pages_.page_rows] * pages_.page_stride + h * head_stride_ +
           (r % pages_.page_rows) * row_stride_;
  }
  /// The rows from r on stored row_stride apart: to the end of r's page (of the view when not paged).
  Index run_rows(Index r) const {
    KVEVICT_ASSERT(r >= 0 && r < rows_);
    return paged() ? std::min(pages_.page_rows - r % pages_.page_rows, rows_ - r) : rows_ - r;
  }
  /// Rows [r, r + n) of head h as an Eigen map [n, cols] (no copy); n <= run_rows(r).
  HeadMap run(Index h, Index r, Index n) const {
    KVEVICT_ASSERT(n >= 0 && (n == 0 || n <= run_rows(r)));
    return HeadMap(n == 0 ? data_ : row(h, r), n, cols_, Eigen::OuterStride<>(row_stride_));
  }
  /// Head h as an Eigen map [rows, cols] (no copy). A paged view has none (read it with run()).
  HeadMap head(Index h) const {
    KVEVICT_ASSERT(h >= 0 && h < heads_);
    detail::require(!paged(), "HeadsView::head", "a paged view has no single matrix per head; read its rows by ",
                    "page runs (run_rows, run) or row()");
    return HeadMap(data_ + h * head_stride_, rows_, cols_, Eigen::OuterStride<>(row_stride_));
  }
  /// Read-only view of the same storage.
  operator HeadsView<const value_type>() const {
    HeadsView<const value_type> v(data_, heads_, rows_, cols_, head_stride_, row_stride_);
    v.pages_ = pages_;
    return v;
  }

 private:
  template <class>
  friend class HeadsView;

  T* data_ = nullptr;
  Index heads_ = 0, rows_ = 0, cols_ = 0, head_stride_ = 0, row_stride_ = 0;
  PageTable pages_;
};

/// The last n rows of every head of `v` (no copy): e.g. the last w of an engine's longer buffer of recent queries,
/// for a policy whose window is w (TOVA's is 1).
template <class T>
HeadsView<T> last_rows(const HeadsView<T>& v, Index n) {
  detail::require(n >= 0 && n <= v.rows(), "last_rows", "n must be in [0, ", v.rows(), "] (the view's rows), got ", n);
  detail::require(!v.paged(), "last_rows", "the view must not be paged (window queries are contiguous)");
  return HeadsView<T>(v.data() == nullptr ? nullptr : v.data() + (v.rows() - n) * v.row_stride(), v.heads(), n,
                      v.cols(), v.head_stride(), v.row_stride());
}

/// Keys or values of one layer: [kv_heads, tokens, head_dim] seen per head as [tokens, head_dim].
template <class T>
using KVView = HeadsView<T>;

/// Builds a KV view over [kv_heads, tokens, head_dim] storage (Hugging Face layout).
template <class T>
KVView<T> kv_heads_major(T* data, Index kv_heads, Index tokens, Index head_dim) {
  return KVView<T>::heads_major(data, kv_heads, tokens, head_dim);
}
/// Builds a KV view over [tokens, kv_heads, head_dim] storage (llama.cpp / vLLM layout).
template <class T>
KVView<T> kv_tokens_major(T* data, Index tokens, Index kv_heads, Index head_dim) {
  return KVView<T>::rows_major(data, tokens, kv_heads, head_dim);
}

/// A paged KV cache whose pages are [page_rows, kv_heads, head_dim] (token-major inside a page): vLLM's
/// [num_blocks, block_size, num_kv_heads, head_size] cache of one layer, FlashInfer's NHD layout, SGLang's token pool
/// [slots, head_num, head_dim] with page_rows 1 and req_to_token as the table. `page_table` [ceil(tokens /
/// page_rows)]: the request's pages in logical order (its block table row); `pool_pages` pages in the pool.
template <class T>
KVView<T> kv_paged_tokens_major(T* pool, Index pool_pages, const std::int32_t* page_table, Index tokens,
                                Index page_rows, Index kv_heads, Index head_dim) {
  return KVView<T>(pool, kv_heads, tokens, head_dim, head_dim, kv_heads * head_dim,
                   PageTable{page_table, page_rows, page_rows * kv_heads * head_dim, pool_pages});
}
/// A paged KV cache whose pages are [kv_heads, page_rows, head_dim] (heads-major inside a page): FlashInfer's HND
/// layout, OpenVINO GenAI's [num_blocks, num_kv_heads, block_size, head_size].
template <class T>
KVView<T> kv_paged_heads_major(T* pool, Index pool_pages, const std::int32_t* page_table, Index tokens, Index page_rows,
                               Index kv_heads, Index head_dim) {
  return KVView<T>(pool, kv_heads, tokens, head_dim, page_rows * head_dim, head_dim,
                   PageTable{page_table, page_rows, kv_heads * page_rows * head_dim, pool_pages});
}

/// Original token positions of a cache's entries [kv_heads, rows] (a HeadsView with one column): entry r of head h
/// holds the token at position *row(h, r). Strictly increasing along each head.
using PositionsView = HeadsView<const std::int64_t>;

/// Positions stored [kv_heads, capacity] (one array per head, as the keys of kv_heads_major).
inline PositionsView positions_heads_major(const std::int64_t* data, Index kv_heads, Index capacity) {
  return PositionsView(data, kv_heads, capacity, 1, capacity, 1);
}
/// Positions stored [capacity, kv_heads] (token-major, as the keys of kv_tokens_major).
inline PositionsView positions_tokens_major(const std::int64_t* data, Index capacity, Index kv_heads) {
  return PositionsView(data, kv_heads, capacity, 1, 1, kv_heads);
}

}  // namespace kvevict
