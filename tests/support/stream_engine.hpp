#pragma once
// A synthetic engine whose "forward pass" appends fixed keys, values and queries per position, bookkept by a
// CacheBook (tests/test_stream.cpp; tests/test_shard_stream.cpp and tests/mpi/ run one per rank, holding a part of
// the model's layers and KV heads, against the one-rank engine of the whole model).

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/random_inputs.hpp"

namespace kvevict_test {
namespace stream_engine {

using kvevict::Index;

inline std::size_t at(Index i) { return static_cast<std::size_t>(i); }

/// What a model computes per (layer, position), fixed in advance: keys and values [Hkv, T, d], queries [H, T, d],
/// W_o [D, H * d].
struct Source {
  int NL = 0, H = 0, Hkv = 0, d = 0, D = 8, T = 0;
  std::vector<std::vector<double>> k, v, q, w_o;  // per layer
};

inline Source random_source(Rng& rng, int NL, int H, int Hkv, int d, int T) {
  Source s{NL, H, Hkv, d, 8, T, {}, {}, {}, {}};
  for (int l = 0; l < NL; ++l) {
    s.k.push_back(normal_vector(static_cast<std::size_t>(Hkv * T * d), rng));
    s.v.push_back(normal_vector(static_cast<std::size_t>(Hkv * T * d), rng));
    s.q.push_back(normal_vector(static_cast<std::size_t>(H * T * d), rng, 1.5));
    s.w_o.push_back(normal_vector(static_cast<std::size_t>(s.D * H * d), rng, 0.5));
  }
  return s;
}

/// An engine over a Source holding global layers `layers` (book layer i = layers[i]) and KV heads [h0, h0 + nh) of
/// each (their G = H / Hkv query heads and W_o columns): keys and values [nh, capacity, d] per layer. Defaults: the
/// whole model. With `accumulate`, each step's queries add the attention they give to the book (H2O's scores); global
/// layer `kept_whole` (>= 0) is kept whole (CacheBook's kept_whole).
struct Engine {
  const Source* src;
  Index capacity, w, h0, nh;
  std::vector<Index> layers;
  bool accumulate;
  kvevict::CacheBook book;
  std::vector<std::vector<double>> k, v, q_window, q_step;  // per book layer; q_window [nh G, w, d]
  mutable std::vector<std::vector<double>> scores;          // per book layer [nh, capacity]: engine_score()

  Engine(const Source& s, Index cap, Index window, Index first_head = 0, Index heads = 0,
         std::vector<Index> held_layers = {}, bool accumulates = false, Index kept_whole = -1)
      : src(&s),
        capacity(cap),
        w(window),
        h0(first_head),
        nh(heads > 0 ? heads : s.Hkv),
        layers(std::move(held_layers)),
        accumulate(accumulates) {
    if (layers.empty())
      for (Index l = 0; l < s.NL; ++l) layers.push_back(l);
    std::vector<bool> whole;
    for (Index l : layers) whole.push_back(l == kept_whole);
    book = kvevict::CacheBook(std::vector<Index>(layers.size(), nh), cap, whole);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      k.emplace_back(at(nh * cap * s.d), 0.0);
      v.emplace_back(at(nh * cap * s.d), 0.0);
      q_window.emplace_back(at(nh * group() * window * s.d), 0.0);
      q_step.emplace_back();
      scores.emplace_back(at(nh * cap), 0.0);
    }
  }
  Index group() const { return src->H / src->Hkv; }
  /// The forward pass of c tokens: append their rows after each head's entries, remember the last w queries.
  void step(Index c) {
    const std::int64_t first = book.next_position();
    book.append(c);
    const Index d = src->d, G = group();
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const std::size_t l = at(layers[i]);
      for (Index h = 0; h < nh; ++h) {
        const Index len = book.layer(static_cast<Index>(i)).length(h);
        for (Index t = 0; t < c; ++t)
          for (Index x = 0; x < d; ++x) {
            const std::size_t from = at(((h0 + h) * src->T + first + t) * d + x),
                              to = at((h * capacity + len - c + t) * d + x);
            k[i][to] = src->k[l][from];
            v[i][to] = src->v[l][from];
          }
      }
      const auto query = [&](Index qh, std::int64_t p, Index x) {  // this engine's query head qh
        return src->q[l][at(((h0 * G + qh) * src->T + p) * d + x)];
      };
      const std::int64_t last = first + c;  // window queries: positions last - w .. last - 1
      for (Index qh = 0; qh < nh * G; ++qh)
        for (Index t = 0; t < w; ++t)
          for (Index x = 0; x < d; ++x) q_window[i][at((qh * w + t) * d + x)] = query(qh, last - w + t, x);
      if (!accumulate) continue;
      q_step[i].assign(at(nh * G * c * d), 0.0);
      for (Index qh = 0; qh < nh * G; ++qh)
        for (Index t = 0; t < c; ++t)
          for (Index x = 0; x < d; ++x) q_step[i][at((qh * c + t) * d + x)] = query(qh, first + t, x);
      kvevict::LayerInputs<double> in = inputs(static_cast<Index>(i));
      in.queries = kvevict::HeadsView<const double>::heads_major(q_step[i].data(), nh * G, c, d);
      book.layer(static_cast<Index>(i)).accumulate<double>(in);
    }
  }
  /// Book layer i's inputs: keys and values viewing the capacity rows, the window queries, W_o's columns, scores.
  kvevict::LayerInputs<double> inputs(Index i) const {
    const std::size_t L = at(layers[at(i)]), I = at(i);
    const Index G = group(), d = src->d;
    kvevict::LayerInputs<double> in;
    in.queries = kvevict::HeadsView<const double>::heads_major(q_window[I].data(), nh * G, w, d);
    in.keys = kvevict::kv_heads_major<const double>(k[I].data(), nh, capacity, d);
    in.values = kvevict::kv_heads_major<const double>(v[I].data(), nh, capacity, d);
    const auto w_o = kvevict::output_projection<const double>(src->w_o[L].data(), src->D, src->H, d);
    in.w_o = kvevict::HeadsView<const double>(w_o.data() + h0 * G * w_o.head_stride(), nh * G, w_o.rows(), w_o.cols(),
                                              w_o.head_stride(), w_o.row_stride());
    for (Index h = 0; h < nh; ++h)
      for (Index j = 0; j < book.layer(i).length(h); ++j)
        scores[I][at(h * capacity + j)] = engine_score(static_cast<int>(h0 + h), book.layer(i).position(h, j));
    in.scores = kvevict::HeadsView<const double>::heads_major(scores[I].data(), nh, capacity, 1);
    return in;
  }
  void apply(Index i, const kvevict::Selection& s) {
    book.layer(i).apply(s, kvevict::kv_heads_major<double>(k[at(i)].data(), nh, capacity, src->d),
                        kvevict::kv_heads_major<double>(v[at(i)].data(), nh, capacity, src->d));
  }
  /// evict_over_budget under a budget of n tokens per KV head (a shard: this engine's part of the model).
  template <class P>
  Index evict(const P& policy, Index n) {
    return kvevict::evict_over_budget<double>(
        policy, book, n, [&](Index i) { return inputs(i); },
        [&](Index i, const kvevict::Selection& s) { apply(i, s); });
  }
  template <class P>
  Index evict(const P& policy, Index n, const kvevict::shard::ModelShard& shard) {
    return kvevict::evict_over_budget<double>(
        policy, book, n, shard, [&](Index i) { return inputs(i); },
        [&](Index i, const kvevict::Selection& s) { apply(i, s); });
  }
  /// Positions held by (book layer i, this engine's KV head h).
  std::vector<std::int64_t> held(Index i, Index h) const {
    std::vector<std::int64_t> p;
    for (Index j = 0; j < book.layer(i).length(h); ++j) p.push_back(book.layer(i).position(h, j));
    return p;
  }
};

// A stream: the prompt's steps and then the decoded ones, in tokens.
struct Stream {
  std::vector<Index> steps;
  std::string name;
};

// Chunked prefill (chunks of w .. 4w tokens) or capped decoding (a prompt of 3w, then one token at a time) of T
// tokens.
inline Stream chunked(kvevict_test::Rng& rng, Index w, Index T) {
  Stream s{{}, "chunked"};
  std::uniform_int_distribution<Index> size(w, 4 * w);
  for (Index done = 0; done + w <= T;) done += s.steps.emplace_back(std::min(size(rng), T - done));
  return s;
}
inline Stream capped(Index w, Index T) {
  Stream s{{3 * w}, "capped"};
  for (Index done = 3 * w; done < T; ++done) s.steps.push_back(1);
  return s;
}

// Held positions of every (layer, KV head) of `eng` after each step: [steps][layer][head].
using History = std::vector<std::vector<std::vector<std::vector<std::int64_t>>>>;
inline void record(const Engine& eng, History& h) {
  h.emplace_back();
  for (Index i = 0; i < static_cast<Index>(eng.layers.size()); ++i) {
    h.back().emplace_back();
    for (Index j = 0; j < eng.nh; ++j) h.back().back().push_back(eng.held(i, j));
  }
}

// The one-rank engine's history of `stream`.
template <class P>
History one_rank(const P& policy, const Source& src, const Stream& stream, Index w, Index n, Index kept_whole) {
  Engine one(src, src.T, w, 0, 0, {}, true, kept_whole);
  History whole;
  for (Index c : stream.steps) {
    one.step(c);
    one.evict(policy, n);
    record(one, whole);
  }
  return whole;
}

}  // namespace stream_engine

using stream_engine::capped;
using stream_engine::chunked;
using stream_engine::Engine;
using stream_engine::History;
using stream_engine::one_rank;
using stream_engine::random_source;
using stream_engine::Source;
using stream_engine::Stream;

}  // namespace kvevict_test
