#pragma once
/// Selection: what one layer keeps, in the engine-friendly form of flash-attention's varlen API.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "kvevict/core/error.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict {

/// Kept entries of one layer, per KV head, sorted ascending, in one flat array:
///   indices()    [sum of lengths]  head h's kept rows are indices()[offsets()[h] .. offsets()[h+1])
///   positions()  [sum of lengths]  their original token positions (the rows themselves when the layer had none)
///   offsets()    [kv_heads + 1]    cu_seqlens-style prefix sums, offsets()[0] == 0
/// On a ragged layer (docs/algorithms.md#ragged) rows index each head's own entries. A selection made of blocks
/// (docs/algorithms.md#layouts) also lists each head's kept block ids (block b = rows [bB, bB + B); the partial tail is
/// the last).
class Selection {
 public:
  using index_type = std::int64_t;

  /// One copy of a compaction plan: `count` rows (or blocks) of KV head `head` from [from, from + count) to
  /// [to, to + count), to < from.
  struct Move {
    index_type head, from, to, count;
    bool operator==(const Move& o) const { return head == o.head && from == o.from && to == o.to && count == o.count; }
  };

  /// Contiguous read-only range of one head's kept indices.
  struct HeadIndices {
    const index_type* first;
    const index_type* last;
    const index_type* begin() const { return first; }
    const index_type* end() const { return last; }
    Index size() const { return static_cast<Index>(last - first); }
    index_type operator[](Index i) const { return first[i]; }
  };

  Selection() : offsets_(1, 0) {}
  /// From per-head keep flags `keep` [kv_heads, tokens] (row-major, non-zero = kept).
  /// O(kv_heads * tokens): a linear scan, so indices come out sorted without sorting.
  template <class Flag>
  static Selection from_flags(const std::vector<Flag>& keep, Index kv_heads, Index tokens) {
    extend::LayerShape shape;
    shape.kv_heads = kv_heads;
    shape.tokens = tokens;
    return from_flags(keep, shape);
  }
  /// The same on the layer of `shape` [Hkv, L] (a ragged head's flags beyond its L_h must be 0); kept positions
  /// are read from shape.positions. With block > 1 the kept rows must be whole blocks of `block` rows (or a head's
  /// tail block), and blocks() lists them.
  template <class Flag>
  static Selection from_flags(const std::vector<Flag>& keep, const extend::LayerShape& shape, Index block = 1) {
    const Index kv_heads = shape.kv_heads, tokens = shape.tokens;
    KVEVICT_ASSERT(static_cast<Index>(keep.size()) == kv_heads * tokens);
    Selection s;
    s.tokens_ = tokens;
    s.offsets_.assign(static_cast<std::size_t>(kv_heads) + 1, 0);
    for (Index h = 0; h < kv_heads; ++h) {
      const Flag* row = keep.data() + h * tokens;
      for (Index j = 0; j < tokens; ++j)
        if (row[j]) {
          KVEVICT_ASSERT(j < shape.length(h));
          s.indices_.push_back(j);
          s.positions_.push_back(shape.position(h, j));
        }
      s.offsets_[static_cast<std::size_t>(h) + 1] = static_cast<index_type>(s.indices_.size());
    }
    s.block_ = block;
    if (block > 1) {
      s.block_offsets_.assign(s.offsets_.size(), 0);
      for (Index h = 0; h < kv_heads; ++h) {
        for (index_type j : s.head(h))
          if (s.blocks_.size() == static_cast<std::size_t>(s.block_offsets_[idx(h)]) || s.blocks_.back() != j / block)
            s.blocks_.push_back(j / block);
        s.block_offsets_[idx(h) + 1] = static_cast<index_type>(s.blocks_.size());
      }
    }
    return s;
  }

  Index heads() const { return static_cast<Index>(offsets_.size()) - 1; }
  /// The context length L the selection was made over (on a ragged layer, the longest head's entries).
  Index context_length() const { return tokens_; }
  const std::vector<index_type>& indices() const { return indices_; }
  /// Original positions of the kept entries, parallel to indices().
  const std::vector<index_type>& positions() const { return positions_; }
  const std::vector<index_type>& offsets() const { return offsets_; }
  /// Total kept entries over all heads (sum of lengths).
  Index total() const { return static_cast<Index>(indices_.size()); }

  Index length(Index h) const {
    check_head(h);
    return static_cast<Index>(offsets_[idx(h) + 1] - offsets_[idx(h)]);
  }
  /// Per-head lengths [kv_heads].
  std::vector<index_type> lengths() const {
    std::vector<index_type> out(static_cast<std::size_t>(heads()));
    for (Index h = 0; h < heads(); ++h) out[idx(h)] = offsets_[idx(h) + 1] - offsets_[idx(h)];
    return out;
  }
  /// The longest head (the row capacity compact() needs in its destination).
  Index max_length() const {
    Index m = 0;
    for (Index h = 0; h < heads(); ++h) m = std::max(m, length(h));
    return m;
  }
  HeadIndices head(Index h) const {
    check_head(h);
    return {indices_.data() + offsets_[idx(h)], indices_.data() + offsets_[idx(h) + 1]};
  }
  /// Original positions of head h's kept entries, ascending.
  HeadIndices head_positions(Index h) const {
    check_head(h);
    return {positions_.data() + offsets_[idx(h)], positions_.data() + offsets_[idx(h) + 1]};
  }
  /// B, the rows per block (1: a token selection).
  Index block_size() const { return block_; }
  /// Kept block ids of every head, ascending, flat like indices() (block_offsets() [kv_heads + 1] separates the
  /// heads); a token selection's blocks are its rows.
  const std::vector<index_type>& blocks() const { return block_ > 1 ? blocks_ : indices_; }
  const std::vector<index_type>& block_offsets() const { return block_ > 1 ? block_offsets_ : offsets_; }
  HeadIndices head_blocks(Index h) const {
    check_head(h);
    const std::vector<index_type>& b = blocks();
    const std::vector<index_type>& o = block_offsets();
    return {b.data() + o[idx(h)], b.data() + o[idx(h) + 1]};
  }

  /// The copies that compact every head's kept rows to its first rows in ascending order (what compact() does),
  /// as runs of consecutive rows, head by head, in an order safe in place; runs already in place are omitted.
  std::vector<Move> compaction_plan() const { return runs(indices_, offsets_); }
  /// The same in whole blocks (block mode): block runs, the tail block included.
  std::vector<Move> block_compaction_plan() const { return runs(blocks(), block_offsets()); }

  /// Whether token j of head h is kept (binary search, O(log length)).
  bool kept(Index h, Index j) const {
    const HeadIndices r = head(h);
    return std::binary_search(r.begin(), r.end(), static_cast<index_type>(j));
  }
  /// Dense keep mask [kv_heads, tokens].
  Eigen::Array<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> mask() const {
    Eigen::Array<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> m =
        Eigen::Array<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>::Constant(heads(), tokens_, false);
    for (Index h = 0; h < heads(); ++h)
      for (index_type j : head(h)) m(h, static_cast<Index>(j)) = true;
    return m;
  }

  /// Gathers the kept rows of `src` [kv_heads, >= tokens, dim] into `dst` [kv_heads, capacity, dim]:
  /// head h's kept rows land in dst rows [0, length(h)), in ascending token order; rows beyond are untouched.
  /// In-place compaction (dst over the same storage and strides as src) is safe: kept index k >= output row k.
  /// Any element type: keys, values, or positions [kv_heads, capacity] as a one-column view (PositionsView's
  /// writable form, HeadsView<std::int64_t>), so the same call compacts the positions array.
  template <class TSrc, class TDst>
  void compact(const HeadsView<TSrc>& src, const HeadsView<TDst>& dst) const {
    static_assert(!std::is_const_v<TDst>, "compact: the destination view must be writable");
    detail::require(src.heads() == heads(), "Selection::compact", "source heads (", src.heads(),
                    ") must equal the selection's KV heads (", heads(), ")");
    detail::require(src.rows() >= tokens_, "Selection::compact", "source rows (", src.rows(),
                    ") must hold the selection's context length (", tokens_, ")");
    detail::require(dst.heads() == heads(), "Selection::compact", "destination heads (", dst.heads(),
                    ") must equal the selection's KV heads (", heads(), ")");
    detail::require(dst.cols() == src.cols(), "Selection::compact", "destination head_dim (", dst.cols(),
                    ") must equal the source head_dim (", src.cols(), ")");
    detail::require(dst.rows() >= max_length(), "Selection::compact", "destination capacity (", dst.rows(),
                    " rows) must hold the longest head (", max_length(), " rows)");
    for (Index h = 0; h < heads(); ++h) {
      Index out = 0;
      for (index_type j : head(h)) {
        const auto* from = src.row(h, static_cast<Index>(j));
        auto* to = dst.row(h, out++);
        if (static_cast<const void*>(from) != static_cast<const void*>(to)) std::copy(from, from + src.cols(), to);
      }
    }
  }

 private:
  static std::size_t idx(Index h) { return static_cast<std::size_t>(h); }
  static std::vector<Move> runs(const std::vector<index_type>& kept, const std::vector<index_type>& offsets) {
    std::vector<Move> moves;
    for (std::size_t h = 0; h + 1 < offsets.size(); ++h) {
      const auto first = static_cast<std::size_t>(offsets[h]), last = static_cast<std::size_t>(offsets[h + 1]);
      for (std::size_t i = first; i < last;) {
        std::size_t end = i + 1;
        while (end < last && kept[end] == kept[end - 1] + 1) ++end;
        const auto to = static_cast<index_type>(i - first);
        if (kept[i] != to) moves.push_back({static_cast<index_type>(h), kept[i], to, static_cast<index_type>(end - i)});
        i = end;
      }
    }
    return moves;
  }
  void check_head(Index h) const {
    detail::require(h >= 0 && h < heads(), "Selection", "head must be in [0, ", heads(), "), got ", h);
  }

  std::vector<index_type> indices_;
  std::vector<index_type> positions_;
  std::vector<index_type> offsets_;
  std::vector<index_type> blocks_;         // block mode: kept block ids, flat
  std::vector<index_type> block_offsets_;  // block mode: [kv_heads + 1]
  Index tokens_ = 0;
  Index block_ = 1;
};

}  // namespace kvevict
