#pragma once
/// The L1 value term only where it can change the selection (docs/algorithms.md#pruned-l1): a rigorous upper
/// bound of N[h][j] as value_norms computes it, for every entry at the cost of the L2 term, and the exact N on chosen
/// rows, bit for bit what value_norms gives them.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/core/inputs.hpp"
#include "kvevict/core/parallel.hpp"
#include "kvevict/core/views.hpp"
#include "kvevict/value/value_norm.hpp"

namespace kvevict::extend {
inline namespace KVEVICT_ABI_NAMESPACE {

/// What the pruned L1 term computed, for benchmarks and tuning: the entries whose exact term was computed, of the
/// entries it scored. While a ValueTermCounter::Scope lives, every pruned L1 term of the process counts into it
/// (atomic), so that no public parameter carries it:
///   extend::ValueTermCounter counter;
///   { extend::ValueTermCounter::Scope counting(counter); policy.select(in, budget); }   // counter.fraction()
struct ValueTermCounter {
  std::atomic<std::int64_t> computed{0};
  std::atomic<std::int64_t> scored{0};
  double fraction() const {
    const auto n = scored.load();
    return n > 0 ? static_cast<double>(computed.load()) / static_cast<double>(n) : 0.0;
  }
  /// Makes `counter` the active one until the scope ends (then the one before it again).
  class Scope {
   public:
    explicit Scope(ValueTermCounter& counter) : previous_(active().exchange(&counter)) {}
    ~Scope() { active().store(previous_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ValueTermCounter* previous_;
  };
  /// The counter of the innermost live Scope, or null.
  static std::atomic<ValueTermCounter*>& active() {
    static std::atomic<ValueTermCounter*> counter{nullptr};
    return counter;
  }
};

/// The hidden sizes D at which the pruned L1 term is used: below, every product of value_norms' blocks is not
/// Eigen's matrix-product kernel (small products take a coefficient-wise path), and the term costs little anyway.
constexpr Index kMinPrunedHidden = 16;

/// Ubar [Hkv, L]: Ubar[h][j] >= N[h][j] = value_norms(..., ValueNorm::l1)(h, j) as computed in S, for the entries
/// j < length_of(h) (0 beyond). Per query head q, with x = v (W^q)^T over D outputs, ||x||_1 <= sqrt(D) ||x||_2 and
/// ||x||_2^2 = v G_q v^T (G_q the Gram matrix); the rounding of both sides is bounded with T = sum_k |v_k| c_k
/// (c_k: the L1 norm of column k of W^q) and g = (D + 2 d + 16) u (u: S's unit roundoff):
///   U_q = (1 + g)^2 (sqrt(D) sqrt(max(fl(v G_q v^T), 0) + g T^2) + g T),
/// summed over the group's query heads in order and divided by G as value_norms does (rounding is monotone), so the
/// bound holds for the computed values, not only for exact arithmetic. Non-finite bounds are +infinity.
template <class S, class KV, class W, class Lengths>
RowMatrix<S> l1_value_bounds(const KVView<const KV>& values, const HeadsView<const W>& w_o, Index group,
                             const OutputGram<S>& gram, Lengths length_of, const KVScale& values_scale = {}) {
  const Index Hkv = values.heads(), d = values.cols(), D = w_o.rows();
  Index longest = 0;
  for (Index h = 0; h < Hkv; ++h) longest = std::max(longest, length_of(h));
  RowMatrix<S> bound = RowMatrix<S>::Zero(Hkv, longest);
  RowMatrix<S> column_l1(w_o.heads(), d);  // c [H, d]
  for (Index q = 0; q < w_o.heads(); ++q) column_l1.row(q) = w_o.head(q).template cast<S>().cwiseAbs().colwise().sum();
  const S g = static_cast<S>(static_cast<double>(D + 2 * d + 16) * std::numeric_limits<S>::epsilon() / 2);
  const S outer = (S(1) + g) * (S(1) + g), sqrt_hidden = std::sqrt(static_cast<S>(D));
  struct Scratch {
    RowMatrix<S> v, grams, projected, t;  // [block, d] in S; [d, G d]; [block, G d]; [block, G]
  };
  detail::parallel_for_with<Scratch>(Hkv, [&](Index h, Scratch& scratch) {
    const Index L = length_of(h);
    const detail::HeadRows<KV> v = detail::head_rows(values, h, L, values_scale);
    scratch.grams.resize(d, group * d);
    for (Index k = 0; k < group; ++k)
      scratch.grams.middleCols(k * d, d) = gram.per_head[static_cast<std::size_t>(h * group + k)];
    const auto c = column_l1.middleRows(h * group, group);  // [G, d]
    constexpr Index block = 256;
    for (Index j0 = 0; j0 < L; j0 += block) {
      const Index rows = std::min(block, L - j0);
      const detail::RowsRef<S> vb = detail::block_in<S>(v, j0, rows, scratch.v);
      scratch.projected.noalias() = vb * scratch.grams;
      scratch.t.noalias() = vb.cwiseAbs() * c.transpose();
      for (Index r = 0; r < rows; ++r) {
        S sum = 0;
        for (Index k = 0; k < group; ++k) {
          const S quad = scratch.projected.row(r).segment(k * d, d).dot(vb.row(r));
          const S t = scratch.t(r, k);
          sum += outer * (sqrt_hidden * std::sqrt(std::max(quad, S(0)) + g * t * t) + g * t);
        }
        bound(h, j0 + r) = sum;
      }
    }
  });
  bound /= static_cast<S>(group);
  for (Index i = 0; i < bound.size(); ++i)
    if (!(bound.data()[i] <= std::numeric_limits<S>::max())) bound.data()[i] = std::numeric_limits<S>::infinity();
  return bound;
}

/// N[h][rows[i]] of value_norms(..., ValueNorm::l1) for the listed rows of KV head h only (rows ascending, each
/// < length, the head's L_h), bit for bit: value_norms projects blocks of 128 rows (the last one shorter) through
/// each W^q with one Eigen product, whose rounding of a row depends on the block's height and the row's slot in it.
/// Here a block whose rows are all listed is computed as there (from the view, no copy); any other row sits at the
/// slot it has there (j mod 128, or its place in the last block), rows of different blocks sharing a block buffer
/// when their slots differ (free slots hold zeros); the same products run per query head.
template <class S, class KV, class W>
std::vector<S> l1_value_norms_of_rows(const KVView<const KV>& values, const HeadsView<const W>& w_o, Index group,
                                      Index h, Index length, const std::vector<Index>& rows,
                                      const KVScale& values_scale = {}) {
  constexpr Index block = detail::kL1Block;
  const Index d = values.cols();
  const Index last_start = (length - 1) / block * block, last_height = length - last_start;
  // Buffers: full-height ones (slot j mod 128) for rows before the last block, one of the last block's height.
  struct Buffer {
    RowMatrix<S> rows;
    std::vector<std::pair<Index, std::size_t>> placed;  // (slot, index into `rows` of the caller)
  };
  std::vector<Buffer> buffers;
  std::vector<Index> used(static_cast<std::size_t>(block), 0);  // full-height buffers holding each slot so far
  std::vector<std::pair<Index, std::size_t>> whole;             // blocks requested whole: (first row, index of it)
  Buffer last;
  const detail::HeadRows<KV> v = detail::head_rows(values, h, length, values_scale);
  RowMatrix<S> row_in;
  for (std::size_t i = 0; i < rows.size();) {
    const Index j = rows[i], j0 = j / block * block, height = std::min(block, length - j0);
    if (j == j0 && i + static_cast<std::size_t>(height) <= rows.size() &&
        rows[i + static_cast<std::size_t>(height) - 1] == j0 + height - 1) {  // ascending and distinct: all of it
      whole.emplace_back(j0, i);
      i += static_cast<std::size_t>(height);
      continue;
    }
    Buffer* target = &last;
    Index slot = j - last_start;
    if (j < last_start) {
      slot = j % block;
      const auto b = static_cast<std::size_t>(used[static_cast<std::size_t>(slot)]++);
      if (b == buffers.size()) buffers.push_back({RowMatrix<S>::Zero(block, d), {}});
      target = &buffers[b];
    } else if (last.rows.rows() == 0) {
      last.rows = RowMatrix<S>::Zero(last_height, d);
    }
    target->rows.row(slot) = detail::block_in<S>(v, j, 1, row_in);
    target->placed.emplace_back(slot, i);
    ++i;
  }
  if (last.rows.rows() > 0) buffers.push_back(std::move(last));

  std::vector<S> out(rows.size(), S(0));
  RowMatrix<S> w, proj, pad, converted;
  for (Index k = 0; k < group; ++k) {
    const auto project = [&](const auto& wq) {
      for (const auto& [j0, i0] : whole) {  // as accumulate_l1_norms computes the block
        const Index n = std::min(block, length - j0);
        detail::project_block<S>(detail::block_in<S>(v, j0, n, converted), wq, proj, pad);
        for (Index r = 0; r < n; ++r) out[i0 + static_cast<std::size_t>(r)] += proj.row(r).cwiseAbs().sum();
      }
      for (const Buffer& b : buffers) {
        detail::project_block<S>(b.rows, wq, proj, pad);
        for (const auto& [slot, i] : b.placed) out[i] += proj.row(slot).cwiseAbs().sum();
      }
    };
    if constexpr (std::is_same_v<std::remove_const_t<W>, S>) {
      project(w_o.head(h * group + k));
    } else {
      w = w_o.head(h * group + k).template cast<S>();
      project(w);
    }
  }
  for (S& x : out) x /= static_cast<S>(group);
  return out;
}

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict::extend
