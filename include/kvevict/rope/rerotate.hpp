#pragma once
/// RoPE positions of kept keys (docs/algorithms.md#layouts, "RoPE positions"): the new positions of a layer's kept
/// entries when an engine renumbers them contiguously, and the re-rotation of post-RoPE keys from their original
/// positions to the new ones (StreamingLLM's position shift, llama.cpp's K-shift, kvpress's key re-rotation).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kvevict/core/error.hpp"
#include "kvevict/core/quantized.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict {

/// Which dimensions of a head form the rotary pairs i < rotary_dim / 2.
enum class RopeLayout {
  half,        ///< (i, i + rotary_dim / 2): GPT-NeoX, Hugging Face Llama (rotate_half)
  interleaved  ///< (2i, 2i + 1): GPT-J, llama.cpp's default
};

/// The model's rotary embedding: pair i turns by position * theta^(-2i / rotary_dim).
struct Rope {
  double theta = 10000.0;                ///< base, finite and > 0 (Llama 2: 10000, Llama 3: 500000)
  Index rotary_dim = 0;                  ///< rotated dimensions, even, <= head_dim (partial rotary); 0: all head_dim
  RopeLayout layout = RopeLayout::half;  ///< pairing of the rotated dimensions
};

/// New position of every kept entry of `sel` [sum of lengths], parallel to sel.indices(): entry k of head h (its k-th
/// kept entry, ascending) moves to first + k. O(sum of lengths).
inline std::vector<std::int64_t> renumbered_positions(const Selection& sel, std::int64_t first = 0) {
  std::vector<std::int64_t> out(sel.indices().size());
  const auto& offsets = sel.offsets();
  for (std::size_t h = 0; h + 1 < offsets.size(); ++h)
    for (std::int64_t e = offsets[h]; e < offsets[h + 1]; ++e)
      out[static_cast<std::size_t>(e)] = first + (e - offsets[h]);
  return out;
}

/// renumbered_positions(sel, first) minus the original positions sel.positions() [sum of lengths], parallel to
/// sel.indices(): what rerotate() turns each kept key by. Non-increasing along each head (0 where the kept entries
/// are already contiguous from `first`).
inline std::vector<std::int64_t> position_deltas(const Selection& sel, std::int64_t first = 0) {
  std::vector<std::int64_t> out = renumbered_positions(sel, first);
  const auto& positions = sel.positions();
  for (std::size_t e = 0; e < out.size(); ++e) out[e] -= positions[e];
  return out;
}

namespace detail {

/// The rotated dimensions of `rope` on heads of `head_dim` (rotary_dim 0: head_dim), checked along with theta.
inline Index rope_rotary_dim(const Rope& rope, Index head_dim, const char* where) {
  const Index rd = rope.rotary_dim == 0 ? head_dim : rope.rotary_dim;
  require(rd >= 2 && rd <= head_dim && rd % 2 == 0, where, "rotary_dim (", rope.rotary_dim,
          rope.rotary_dim == 0 ? ": the whole head_dim" : "", ") must be even and in [2, head_dim = ", head_dim, "]");
  require(std::isfinite(rope.theta) && rope.theta > 0.0, where, "theta must be finite and > 0, got ", rope.theta);
  return rd;
}

/// Inverse frequencies inv_i = theta^(-2i / rotary_dim) [rotary_dim / 2], in double.
inline std::vector<double> rope_inv_frequencies(double theta, Index rotary_dim) {
  std::vector<double> inv(static_cast<std::size_t>(rotary_dim / 2));
  for (std::size_t i = 0; i < inv.size(); ++i)
    inv[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
  return inv;
}

/// cos and sin [inv.size()] of the angles a_i = delta * inv[i] (computed in double, stored as A).
template <class A>
void rope_cos_sin(std::int64_t delta, const std::vector<double>& inv, A* cos_out, A* sin_out) {
  const double d = static_cast<double>(delta);
  for (std::size_t i = 0; i < inv.size(); ++i) {
    const double a = d * inv[i];
    cos_out[i] = static_cast<A>(std::cos(a));
    sin_out[i] = static_cast<A>(std::sin(a));
  }
}

/// Rotates one row of a head in place: each rotary pair (x, y) of `row` [>= rotary_dim] -> (x c - y s, x s + y c)
/// with c = cos_tab[i], s = sin_tab[i] [rotary_dim / 2]; dimensions >= rotary_dim are untouched. Arithmetic in A
/// (float, or double for double storage), storage T converted on read and write.
template <class A, class T>
void rope_rotate_row(T* row, Index rotary_dim, RopeLayout layout, const A* cos_tab, const A* sin_tab) {
  const Index half = rotary_dim / 2;
  const Index step = layout == RopeLayout::half ? 1 : 2;        // stride between consecutive pairs' x
  const Index partner = layout == RopeLayout::half ? half : 1;  // offset from x to its pair's y
  for (Index i = 0; i < half; ++i) {
    T& xs = row[i * step];
    T& ys = row[i * step + partner];
    const A x = static_cast<A>(xs), y = static_cast<A>(ys);
    const A c = cos_tab[i], s = sin_tab[i];
    xs = T(x * c - y * s);
    ys = T(x * s + y * c);
  }
}

/// Rotates rows [0, length(h)) of every head h of `keys` by delta(h, r), computing the cos/sin table once per run of
/// equal deltas (rows of a head kept contiguously share one) and skipping rows whose delta is 0.
template <class T, class Length, class Delta>
void rope_rotate_rows(const HeadsView<T>& keys, Index rotary_dim, const Rope& rope, Length&& length, Delta&& delta) {
  static_assert(!std::is_const_v<T>, "rerotate: the keys view must be writable");
  static_assert(!is_quantized_v<T>, "rerotate: int8 and fp8 keys cannot be rotated in place (re-quantize them)");
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const std::vector<double> inv = rope_inv_frequencies(rope.theta, rotary_dim);
  std::vector<A> cos_tab(inv.size()), sin_tab(inv.size());
  bool have = false;
  std::int64_t tab_delta = 0;
  for (Index h = 0; h < keys.heads(); ++h) {
    const Index rows = length(h);
    for (Index r = 0; r < rows; ++r) {
      const std::int64_t d = delta(h, r);
      if (d == 0) continue;
      if (!have || d != tab_delta) {
        rope_cos_sin(d, inv, cos_tab.data(), sin_tab.data());
        tab_delta = d;
        have = true;
      }
      rope_rotate_row<A>(keys.row(h, r), rotary_dim, rope.layout, cos_tab.data(), sin_tab.data());
    }
  }
}

}  // namespace detail

/// Rotates post-RoPE keys [Hkv, rows, head_dim] (either KV layout) in place: row r < lengths[h] of head h (every row
/// when lengths is null) turns by the position delta *deltas.row(h, r), deltas [Hkv, >= rows used, 1] (a
/// PositionsView; e.g. position_deltas() laid out per head). A key computed at position p becomes the key at
/// p + delta (within rounding). Rows beyond lengths[h] and dimensions >= rotary_dim are untouched. Storage float,
/// double, Eigen::half or Eigen::bfloat16; angles in double, arithmetic in float (double for double storage).
/// O(rows * head_dim) plus rotary_dim / 2 cos/sin per change of delta along a head.
template <class T>
void rerotate(const HeadsView<T>& keys, const PositionsView& deltas, const Rope& rope,
              const std::int64_t* lengths = nullptr) {
  static_assert(!std::is_const_v<T>, "rerotate: the keys view must be writable");
  const char* where = "rerotate";
  const Index rd = detail::rope_rotary_dim(rope, keys.cols(), where);
  Index used = lengths ? 0 : keys.rows();
  if (lengths) {
    for (Index h = 0; h < keys.heads(); ++h) {
      detail::require(lengths[h] >= 0 && lengths[h] <= keys.rows(), where, "lengths[", h, "] must be in [0, ",
                      keys.rows(), "] (the keys' rows), got ", lengths[h]);
      used = std::max(used, static_cast<Index>(lengths[h]));
    }
  }
  detail::require(deltas.heads() == keys.heads() && deltas.cols() == 1 && deltas.rows() >= used, where, "deltas [",
                  deltas.heads(), ", ", deltas.rows(), ", ", deltas.cols(), "] must be [kv_heads = ", keys.heads(),
                  ", >= ", used, " rows] (one column)");
  detail::rope_rotate_rows(
      keys, rd, rope, [&](Index h) { return lengths ? static_cast<Index>(lengths[h]) : keys.rows(); },
      [&](Index h, Index r) { return *deltas.row(h, r); });
}

/// After sel.compact(keys, keys) (row k of head h holds the head's k-th kept entry, at its original position
/// sel.head_positions(h)[k]), rotates each such row to position first + k: the keys an engine that renumbers its
/// kept entries contiguously from `first` needs (renumbered_positions(sel, first)). keys [Hkv, >= sel.max_length(),
/// head_dim]; rows beyond sel.length(h) are untouched. Same arithmetic as rerotate().
template <class T>
void rerotate_kept(const HeadsView<T>& keys, const Selection& sel, const Rope& rope, std::int64_t first = 0) {
  static_assert(!std::is_const_v<T>, "rerotate_kept: the keys view must be writable");
  const char* where = "rerotate_kept";
  detail::require(keys.heads() == sel.heads(), where, "keys heads (", keys.heads(),
                  ") must equal the selection's KV heads (", sel.heads(), ")");
  detail::require(keys.rows() >= sel.max_length(), where, "keys rows (", keys.rows(),
                  ") must hold the selection's longest head (", sel.max_length(), " rows)");
  const Index rd = detail::rope_rotary_dim(rope, keys.cols(), where);
  const auto& offsets = sel.offsets();
  const auto& positions = sel.positions();
  detail::rope_rotate_rows(
      keys, rd, rope,
      [&](Index h) {
        return static_cast<Index>(offsets[static_cast<std::size_t>(h) + 1] - offsets[static_cast<std::size_t>(h)]);
      },
      [&](Index h, Index k) {
        const std::int64_t original = positions[static_cast<std::size_t>(offsets[static_cast<std::size_t>(h)] + k)];
        return first + static_cast<std::int64_t>(k) - original;
      });
}

}  // namespace kvevict
