#pragma once
/// A minimal float32 inference engine for tinycode (models/tinycode/MODEL.md) with KV-cache eviction by kvevict.
///
/// Life of a request:
///   Engine e(model);
///   Matrix logits = e.extend(context);             // prefill: all positions at once, full causal attention
///   e.compress(kvevict::SnapKV{}, kvevict::Budget::keep_ratio(0.1));   // one kvevict call per layer
///   RowVector next = e.decode(token);              // decoding against the compressed cache
///
/// extend() is the only forward pass: it runs a chunk of n new tokens at positions next_position() .. + n - 1,
/// appends their keys and values to every (layer, KV head) cache and lets each new token attend to that head's
/// cached rows and to the new tokens up to itself. On an empty cache it is the prefill; with n = 1 it is one
/// decoding step (decode()); with a compressed cache and n > 1 it is the teacher-forced equivalent of n decoding
/// steps (chunked decoding). Positions are original token positions unless renumber_positions(true): then after
/// every eviction each head's kept keys are re-rotated to the contiguous RoPE positions 0 .. length - 1
/// (kvevict::rerotate, docs/algorithms.md#layouts) and new tokens of a KV head (keys and its group's queries) are
/// rotated at that head's length, as StreamingLLM's position shift and llama.cpp's K-shift do.
///
/// Eviction: extend() remembers, per layer, the post-RoPE queries of the last `window` positions [H, w, d].
/// eviction_inputs(layer) hands them to kvevict together with the layer's keys and values as views over the cache
/// storage (no copy) and each head's length and positions (a ragged cache after an eviction); evict(layer,
/// selection) compacts the cache in place. Eviction while the cache grows (chunked prefill, decoding under a cap):
/// call evict_over_budget(policy, n) after each extend() (a step shorter than the window is evicted once it holds the
/// window, docs/algorithms.md#streaming).
/// The forward pass also adds each softmax row to the attention its entries received (LayerBook::add_attention),
/// which H2O reads: the prefill's whole causal attention, then every later token's.
/// hand_attention_rows(true): extend() also keeps the softmax rows it computed for the last `window` positions
/// [H, w, capacity], and eviction_inputs() hands kvevict those rows (LayerInputs::attention, as an engine with eager
/// attention can) instead of the queries, so the policy does not compute the window's attention again. The rows are
/// those of the cache they were computed over: an eviction invalidates a layer's rows until `window` more
/// positions have run (eviction_inputs() then hands the queries).
/// Paged (page_rows > 0): the cache is vLLM's page pool with one block table (KVCache); kvevict reads it in place
/// through the table (kvevict::kv_paged_tokens_major) and every eviction applies kvevict::adapters::vllm_plan to all
/// layers at once, so the policy must keep one set for the model (share = per_model); positions are kept.

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvevict/kvevict.hpp>

#include "kv_cache.hpp"
#include "model.hpp"

namespace tinycode {

using Token = std::int32_t;

/// What one compress() did.
struct EvictionStats {
  double select_ms = 0;     ///< time in the policy's select(), summed over layers
  double compact_ms = 0;    ///< time spent compacting the cache, summed over layers
  std::vector<Index> kept;  ///< rows kept per (layer, KV head), [n_layer * n_kv_head]
};

class Engine {
 public:
  /// `window`: how many trailing query positions to remember for eviction (the policy's window, default 32).
  /// `capacity`: rows per (layer, KV head) cache; the default is the model context (config.ctx).
  /// `page_rows`: 0, slabs; > 0, a page pool of pages of page_rows tokens (see the file comment).
  explicit Engine(const Model& model, Index window = 32, Index capacity = 0, Index page_rows = 0)
      : model_(&model), window_(window) {
    const Config& c = model.config;
    if (window < 1) throw std::invalid_argument("Engine: window must be >= 1");
    cache_ = KVCache(c.n_layer, c.n_kv_head, c.head_dim, capacity > 0 ? capacity : c.ctx, page_rows);
    window_queries_.assign(static_cast<std::size_t>(c.n_layer),
                           std::vector<float>(static_cast<std::size_t>(c.n_head * window * c.head_dim), 0.0f));
    // RoPE table [ctx, head_dim / 2], rotate-half convention: angle(t, m) = t * theta^(-2m / d).
    const Index half = c.head_dim / 2;
    rope_cos_.resize(c.ctx, half);
    rope_sin_.resize(c.ctx, half);
    for (Index t = 0; t < c.ctx; ++t)
      for (Index m = 0; m < half; ++m) {
        const double inv = std::pow(c.rope_theta, -2.0 * static_cast<double>(m) / static_cast<double>(c.head_dim));
        const double angle = static_cast<double>(t) * inv;
        rope_cos_(t, m) = static_cast<float>(std::cos(angle));
        rope_sin_(t, m) = static_cast<float>(std::sin(angle));
      }
  }

  const Model& model() const { return *model_; }
  const KVCache& cache() const { return cache_; }
  /// Position of the next token = tokens run so far (the cache may hold fewer rows after eviction).
  Index next_position() const { return next_position_; }
  Index window() const { return window_; }
  /// Whether evictions renumber the kept entries' RoPE positions contiguously (see the file comment).
  bool renumbers_positions() const { return renumber_; }
  void renumber_positions(bool on) {
    if (on && cache_.paged()) throw std::invalid_argument("Engine: a paged cache keeps positions (no renumbering)");
    renumber_ = on;
  }
  /// The model's rotary embedding as kvevict describes it (rotate-half pairs over the whole head).
  kvevict::Rope rope() const {
    kvevict::Rope r;
    r.theta = model_->config.rope_theta;
    r.layout = kvevict::RopeLayout::half;
    return r;
  }
  /// Whether eviction_inputs() hands the forward pass's softmax rows of the window (see the file comment).
  bool hands_attention_rows() const { return !window_attention_.empty(); }
  void hand_attention_rows(bool on) {
    const Config& c = model_->config;
    window_attention_.assign(on ? static_cast<std::size_t>(c.n_layer) : 0,
                             std::vector<float>(static_cast<std::size_t>(c.n_head * window_ * cache_.capacity())));
    attention_filled_.assign(static_cast<std::size_t>(c.n_layer), 0);
  }
  /// Forgets every token (keeps the allocations).
  void reset() {
    cache_.clear();
    tokens_.clear();
    engine_scores_.clear();
    next_position_ = 0;
    window_filled_ = 0;
    std::fill(attention_filled_.begin(), attention_filled_.end(), 0);
  }

  /// Runs `n` tokens (see the file comment); returns their logits [n, vocab]: row i predicts the token after
  /// tokens[i].
  Matrix extend(const Token* tokens, Index n) {
    const Config& c = model_->config;
    if (n < 1) throw std::invalid_argument("Engine::extend: needs at least one token");
    if (next_position_ + n > c.ctx)
      throw std::length_error("Engine::extend: positions up to " + std::to_string(next_position_ + n - 1) +
                              " exceed the model context of " + std::to_string(c.ctx));
    Matrix x(n, c.d_model);
    for (Index i = 0; i < n; ++i) {
      if (tokens[i] < 0 || tokens[i] >= c.vocab)
        throw std::invalid_argument("Engine::extend: token " + std::to_string(tokens[i]) + " is outside [0, " +
                                    std::to_string(c.vocab) + ")");
      x.row(i) = model_->embed.row(tokens[i]);
    }
    cache_.append(n);        // every (layer, KV head) gets rows for positions next_position_ .. + n - 1
    engine_scores_.clear();  // they scored the entries before these
    tokens_.insert(tokens_.end(), tokens, tokens + n);
    for (Index l = 0; l < c.n_layer; ++l) layer_forward(l, x);
    next_position_ += n;
    window_filled_ = std::min(window_, window_filled_ + n);
    return rms_norm(x, model_->final_norm) * model_->embed.transpose();  // tied head
  }
  Matrix extend(const std::vector<Token>& tokens) { return extend(tokens.data(), static_cast<Index>(tokens.size())); }

  /// One decoding step: logits [vocab] of the token after `token`.
  RowVector decode(Token token) { return extend(&token, 1); }

  /// What a kvevict policy reads for `layer`: queries [H, w, d] (post-RoPE queries of the last w <= window()
  /// positions; w = window() by default) or, with hand_attention_rows(true) and w rows run since the layer's last
  /// eviction, their softmax rows [H, w, capacity], keys / values [Hkv, capacity, d] viewing this engine's cache (no
  /// copy) with each head's length and positions, and W_o (model().layers[layer].wo, [d_model, H * d] in PyTorch Linear
  /// layout, for value-aware selectors). Valid until the next extend() or evict(). Needs window() positions run.
  kvevict::LayerInputs<float> eviction_inputs(Index layer, Index w = 0) const {
    const Config& c = model_->config;
    if (w == 0) w = window_;
    if (layer < 0 || layer >= c.n_layer)
      throw std::out_of_range("Engine::eviction_inputs: layer " + std::to_string(layer) + " out of range");
    if (w < 1 || w > window_)
      throw std::invalid_argument("Engine::eviction_inputs: the policy's window " + std::to_string(w) +
                                  " must be in [1, " + std::to_string(window_) + "] (the engine's window)");
    if (window_filled_ < window_)
      throw std::logic_error("Engine::eviction_inputs: fewer than window = " + std::to_string(window_) +
                             " positions have been run");
    kvevict::LayerInputs<float> in;
    const auto l = static_cast<std::size_t>(layer);
    if (hands_attention_rows() && attention_filled_[l] >= w)
      in.attention = kvevict::last_rows(kvevict::HeadsView<const float>::heads_major(
                                            window_attention_[l].data(), c.n_head, window_, cache_.capacity()),
                                        w);
    else
      in.queries = kvevict::last_rows(
          kvevict::HeadsView<const float>::heads_major(window_queries_[l].data(), c.n_head, window_, c.head_dim), w);
    in.keys = cache_.key_view(layer);
    in.values = cache_.value_view(layer);
    const Matrix& wo = model_->layers[static_cast<std::size_t>(layer)].wo;  // W_o [d_model, n_head * head_dim]
    in.w_o = kvevict::output_projection<const float>(wo.data(), c.d_model, c.n_head, c.head_dim);
    if (!engine_scores_.empty())  // [Hkv, capacity, 1]
      in.scores = kvevict::HeadsView<const float>::heads_major(engine_scores_[static_cast<std::size_t>(layer)].data(),
                                                               c.n_kv_head, cache_.capacity(), 1);
    return cache_.book().layer(layer).describe(in);
  }
  /// eviction_inputs(l) of every layer l, for policies that plan over the whole model before evicting.
  std::vector<kvevict::LayerInputs<float>> eviction_inputs() const { return model_inputs(window_); }
  /// The same with the window `policy` observes (window_of(policy) query rows).
  template <class Policy>
  std::vector<kvevict::LayerInputs<float>> eviction_inputs_for(const Policy& policy) const {
    return model_inputs(window_of(policy));
  }
  /// The window `policy` observes: its params().window (TOVA's is 1; StreamingLLM's 0, which eviction_inputs()
  /// reads as the engine's window: a positional policy reads no queries), or the engine's for a policy without one.
  template <class Policy>
  Index window_of(const Policy& policy) const {
    if constexpr (has_window<Policy>::value)
      return policy.params().window;
    else
      return window_;
  }

  /// Keeps only the entries `selection` chose in `layer`'s cache (per KV head). With renumber_positions(true) the
  /// kept keys are then re-rotated from their current RoPE position (their row: positions are contiguous after an
  /// earlier renumbering; before any eviction the row is the position) to their new row.
  void evict(Index layer, const kvevict::Selection& selection) {
    if (cache_.paged()) throw std::logic_error("Engine::evict: a paged cache evicts every layer at once");
    cache_.compact(layer, selection);
    engine_scores_.clear();
    if (hands_attention_rows()) attention_filled_[static_cast<std::size_t>(layer)] = 0;  // its columns moved
    if (!renumber_) return;
    const Index heads = selection.heads(), rows = std::max<Index>(1, selection.max_length());
    std::vector<std::int64_t> deltas(static_cast<std::size_t>(heads * rows), 0);  // [Hkv, rows]
    for (Index h = 0; h < heads; ++h) {
      Index k = 0;
      for (const std::int64_t row : selection.head(h)) deltas[static_cast<std::size_t>(h * rows + k)] = k - row, ++k;
    }
    cache_.rerotate(layer, kvevict::positions_heads_major(deltas.data(), heads, rows), rope());
  }
  /// evict() for every layer; selections [n_layer].
  void evict(const std::vector<kvevict::Selection>& selections) {
    if (static_cast<Index>(selections.size()) != model_->config.n_layer)
      throw std::invalid_argument("Engine::evict: needs one selection per layer");
    if (cache_.paged()) {
      cache_.evict_pages(selections);
      engine_scores_.clear();
      std::fill(attention_filled_.begin(), attention_filled_.end(), 0);
      return;
    }
    for (Index l = 0; l < model_->config.n_layer; ++l) evict(l, selections[static_cast<std::size_t>(l)]);
  }

  /// Compresses every layer with `policy` (anything with `Selection select(const LayerInputs<float>&, const
  /// Budget&, Index layer, Index layers) const`, e.g. kvevict::SnapKV, kvevict::AdaKV, kvevict::StreamingLLM): one
  /// select() and one compaction per layer, right after the prefill.
  template <class Policy>
  EvictionStats compress(const Policy& policy, const kvevict::Budget& budget) {
    using clock = std::chrono::steady_clock;
    EvictionStats stats;
    if (cache_.paged()) {  // every layer's selection, then one plan
      const auto t0 = clock::now();
      const std::vector<kvevict::Selection> selections =
          kvevict::select_layers(policy, model_inputs(window_of(policy)), budget);
      const auto t1 = clock::now();
      evict(selections);
      stats.select_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
      stats.compact_ms = std::chrono::duration<double, std::milli>(clock::now() - t1).count();
      stats.kept = kept_lengths();
      return stats;
    }
    for (Index l = 0; l < model_->config.n_layer; ++l) {
      const auto t0 = clock::now();
      const kvevict::Selection selection =
          policy.select(eviction_inputs(l, window_of(policy)), budget, l, model_->config.n_layer);
      const auto t1 = clock::now();
      evict(l, selection);
      const auto t2 = clock::now();
      stats.select_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
      stats.compact_ms += std::chrono::duration<double, std::milli>(t2 - t1).count();
    }
    stats.kept = kept_lengths();
    return stats;
  }

  /// KVzip's context reconstruction (arXiv 2505.23416; docs/algorithms.md#engine-scores), as kvpress KVzipPress
  /// scores it: the tokens run so far are replayed in chunks of `chunk`, each on a copy of this engine (this cache is
  /// unchanged) after a repeat prompt ("\n\nRepeat the previous context exactly." for the first chunk; "\n\nRepeat
  /// the part of the previous context exactly, starting with" and the previous chunk's last 8 tokens for the others;
  /// then "\n"). Entry j of chunk [s, e) scores the largest attention any replayed query of the G query heads of its KV
  /// head pays it, the softmax taken over the first min(4, s) entries (sinks), the chunk's entries and the replay up
  /// to the query; the first 4 entries score 1. The scores, [Hkv, capacity] per layer, go to eviction_inputs() as
  /// LayerInputs::scores until the next extend() or evict(). Costs about one more prefill plus a copy of the cache per
  /// chunk. Needs the cache as the prefill left it (the replay is what was run).
  void score_by_reconstruction(Index chunk = 128) {
    const Config& c = model_->config;
    const auto run = static_cast<Index>(tokens_.size());
    for (Index l = 0; l < c.n_layer; ++l)
      for (Index h = 0; h < c.n_kv_head; ++h)
        if (cache_.length(l, h) != run)
          throw std::logic_error("Engine::score_by_reconstruction: needs the uncompressed cache of the tokens run");
    static const std::string first = "\n\nRepeat the previous context exactly.",
                             later = "\n\nRepeat the part of the previous context exactly, starting with",
                             suffix = "\n";
    constexpr Index tail = 8, sinks = 4;
    if (chunk < 1 || run + static_cast<Index>(later.size() + suffix.size()) + tail + chunk > c.ctx)
      throw std::length_error("Engine::score_by_reconstruction: a replay of chunk " + std::to_string(chunk) +
                              " after " + std::to_string(run) + " positions exceeds the model context " +
                              std::to_string(c.ctx));
    std::vector<std::vector<float>> peak(static_cast<std::size_t>(c.n_layer),
                                         std::vector<float>(static_cast<std::size_t>(c.n_kv_head * cache_.capacity())));
    for (Index at = 0; at < run; at += chunk) {
      const Index end = std::min(run, at + chunk);
      std::vector<Token> t(at == 0 ? first.begin() : later.begin(), at == 0 ? first.end() : later.end());
      if (at > 0) t.insert(t.end(), tokens_.begin() + at - std::min(tail, at), tokens_.begin() + at);
      t.insert(t.end(), suffix.begin(), suffix.end());
      t.insert(t.end(), tokens_.begin() + at, tokens_.begin() + end);
      Engine replay = *this;
      replay.peak_ = &peak;
      replay.peak_chunk_ = {at, end};
      replay.peak_sinks_ = std::min(sinks, at);
      replay.extend(t);
    }
    for (auto& layer : peak)
      for (Index h = 0; h < c.n_kv_head; ++h)
        std::fill_n(layer.begin() + h * cache_.capacity(), std::min(sinks, run), 1.0f);
    engine_scores_ = std::move(peak);
  }

  /// Ends a step of the stream (the tokens run since the last call; not yet while fewer than the window): evicts
  /// every layer holding more than n rows per KV head on average with `policy` (all layers together for a
  /// layer-global one, when the model is over), with kvevict::evict_over_budget. Returns how many layers were evicted;
  /// adds the policy's time to stats->select_ms when given.
  /// `retrieval` [n_layer] (null: none): each layer's LayerInputs::retrieval_heads.
  template <class Policy>
  Index evict_over_budget(const Policy& policy, Index n, EvictionStats* stats = nullptr,
                          const std::vector<std::vector<Index>>* retrieval = nullptr) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    std::vector<kvevict::Selection> due;  // paged: every layer's selection (one set for the model), then one plan
    const Index evicted = kvevict::evict_over_budget(
        policy, cache_.book(), n,
        [&](Index l) {
          auto in = eviction_inputs(l, window_of(policy));
          if (retrieval) in.retrieval_heads = (*retrieval)[static_cast<std::size_t>(l)];
          return in;
        },
        [&](Index l, const kvevict::Selection& s) {
          if (!cache_.paged()) return evict(l, s);
          due.push_back(s);  // the plan takes every layer at once, inside the step (a refusal ends nothing)
          if (static_cast<Index>(due.size()) == model_->config.n_layer) evict(due);
        });
    if (cache_.paged() && evicted > 0 && evicted != model_->config.n_layer)
      throw std::logic_error(
          "Engine::evict_over_budget: a paged cache evicts every layer at once (share = "
          "per_model); " +
          std::to_string(evicted) + " layers were due");
    if (stats) stats->select_ms += std::chrono::duration<double, std::milli>(clock::now() - t0).count();
    return evicted;
  }

  /// Rows held per (layer, KV head), [n_layer * n_kv_head].
  std::vector<Index> kept_lengths() const {
    std::vector<Index> out;
    for (Index l = 0; l < cache_.layers(); ++l)
      for (Index h = 0; h < cache_.kv_heads(); ++h) out.push_back(cache_.length(l, h));
    return out;
  }

 private:
  std::vector<kvevict::LayerInputs<float>> model_inputs(Index w) const {
    std::vector<kvevict::LayerInputs<float>> all;
    for (Index l = 0; l < model_->config.n_layer; ++l) all.push_back(eviction_inputs(l, w));
    return all;
  }
  template <class P, class = void>
  struct has_window : std::false_type {};
  template <class P>
  struct has_window<P, std::void_t<decltype(std::declval<const P&>().params().window)>> : std::true_type {};

  /// Query rows per attention block: bounds the score buffer to [block, L] and skips most of the causal triangle.
  static constexpr Index attention_block = 128;

  Matrix rms_norm(const Matrix& x, const RowVector& gain) const {
    Matrix out(x.rows(), x.cols());
    const auto eps = static_cast<float>(model_->config.norm_eps);
    for (Index i = 0; i < x.rows(); ++i) {
      const float inv = 1.0f / std::sqrt(x.row(i).squaredNorm() / static_cast<float>(x.cols()) + eps);
      out.row(i) = x.row(i).cwiseProduct(gain) * inv;
    }
    return out;
  }

  /// Rotates heads [head, head + heads) of `m` [n, * d] in place for positions first .. first + n - 1
  /// (rotate-half).
  void apply_rope(Matrix& m, Index head, Index heads, Index first) const {
    const Index d = model_->config.head_dim, half = d / 2;
    for (Index i = 0; i < m.rows(); ++i) {
      const auto c = rope_cos_.row(first + i), s = rope_sin_.row(first + i);
      for (Index h = head; h < head + heads; ++h) {
        auto x1 = m.row(i).segment(h * d, half);
        auto x2 = m.row(i).segment(h * d + half, half);
        const Eigen::Array<float, 1, Eigen::Dynamic> a = x1.array(), b = x2.array();
        x1.array() = a * c.array() - b * s.array();
        x2.array() = b * c.array() + a * s.array();
      }
    }
  }

  /// The sliding window of rows both remembered tensors keep: `heads` blocks of [window, width] rows in `buf`, the
  /// first `filled` valid. Before n new rows arrive, moves the newest min(filled, window - min(n, window)) rows of
  /// each head to its front and returns how many (the new rows then go right after them).
  static Index slide_window(float* buf, Index heads, Index window, Index width, Index filled, Index n) {
    const Index old = std::min(filled, window - std::min(n, window));
    for (Index h = 0; h < heads; ++h) {
      float* head = buf + h * window * width;
      if (filled > old) std::copy(head + (filled - old) * width, head + filled * width, head);  // destination first
    }
    return old;
  }

  /// Keeps the post-RoPE queries of the last `window_` positions of layer l ([H, w, d], oldest first).
  void remember_window_queries(Index l, const Matrix& q) {
    const Config& c = model_->config;
    const Index n = q.rows(), d = c.head_dim, take = std::min(n, window_);
    float* buf = window_queries_[static_cast<std::size_t>(l)].data();
    const Index old = slide_window(buf, c.n_head, window_, d, window_filled_, n);  // rows kept from earlier calls
    for (Index h = 0; h < c.n_head; ++h)
      for (Index i = 0; i < take; ++i) {
        const auto src = q.row(n - take + i).segment(h * d, d);
        std::copy(src.data(), src.data() + d, buf + (h * window_ + old + i) * d);
      }
  }

  /// Before layer l's forward over n new tokens: slides its window attention rows ([H, window, capacity]);
  /// returns how many rows of earlier calls stay, at the front.
  Index shift_window_attention(Index l, Index n) {
    if (!hands_attention_rows()) return 0;
    const auto i = static_cast<std::size_t>(l);
    return slide_window(window_attention_[i].data(), model_->config.n_head, window_, cache_.capacity(),
                        attention_filled_[i], n);
  }
  /// Keeps the softmax rows of the new tokens among the last `window` positions: `scores` [bn, visible] are rows
  /// b0 .. b0 + bn - 1 of the n new tokens of query head qh over a cache of `length` rows, zero beyond each row's
  /// causal end. A kept row is read while fewer than `window` positions follow it, so its columns up to
  /// length + window (or the capacity) are written, zeros beyond `visible`.
  void remember_window_attention(Index l, Index qh, const Matrix& scores, Index n, Index b0, Index kept_rows,
                                 Index length) {
    if (!hands_attention_rows()) return;
    const Index cap = cache_.capacity(), take = std::min(n, window_), first = n - take;
    const Index cols = std::min(cap, length + window_);
    float* head = window_attention_[static_cast<std::size_t>(l)].data() + qh * window_ * cap;
    for (Index i = std::max<Index>(0, first - b0); i < scores.rows(); ++i) {
      float* row = head + (kept_rows + b0 + i - first) * cap;
      for (Index j = 0; j < scores.cols(); ++j) row[j] = scores(i, j);
      std::fill(row + scores.cols(), row + cols, 0.0f);
    }
  }

  /// score_by_reconstruction's scoring of one block of replayed queries: `logits` [bn, >= cached + b0 + bn] are
  /// the raw q k^T of replay rows b0 .. b0 + bn - 1 over the cache. For each row, the softmax over the sinks, the
  /// chunk's entries and the replay up to that row; each chunk entry keeps the largest weight it gets.
  void add_replay_peaks(Index l, Index kh, const Matrix& logits, Index cached, Index b0, float scale) {
    const auto [first, end] = peak_chunk_;
    float* peak = (*peak_)[static_cast<std::size_t>(l)].data() + kh * cache_.capacity();
    for (Index i = 0; i < logits.rows(); ++i) {
      const auto row = logits.row(i);
      const Index replayed = b0 + i + 1;  // replay rows visible to this query
      float mx = -std::numeric_limits<float>::infinity();
      for (Index j = 0; j < peak_sinks_; ++j) mx = std::max(mx, row(j) * scale);
      for (Index j = first; j < end; ++j) mx = std::max(mx, row(j) * scale);
      for (Index j = cached; j < cached + replayed; ++j) mx = std::max(mx, row(j) * scale);
      double z = 0;
      for (Index j = 0; j < peak_sinks_; ++j) z += std::exp(row(j) * scale - mx);
      for (Index j = first; j < end; ++j) z += std::exp(row(j) * scale - mx);
      for (Index j = cached; j < cached + replayed; ++j) z += std::exp(row(j) * scale - mx);
      for (Index j = first; j < end; ++j)
        peak[j] = std::max(peak[j], static_cast<float>(std::exp(row(j) * scale - mx) / z));
    }
  }

  /// One transformer block on x [n, d_model] (in place) for the new tokens at next_position_ ...
  void layer_forward(Index l, Matrix& x) {
    const Config& c = model_->config;
    const LayerWeights& w = model_->layers[static_cast<std::size_t>(l)];
    const Index n = x.rows(), d = c.head_dim, group = c.group();

    // Attention: projections, RoPE at the original positions, append K/V, causal GQA attention.
    Matrix h = rms_norm(x, w.attn_norm);
    Matrix q = h * w.wq.transpose();  // [n, H * d]
    Matrix k = h * w.wk.transpose();  // [n, Hkv * d]
    const Matrix v = h * w.wv.transpose();
    for (Index kh = 0; kh < c.n_kv_head; ++kh) {  // RoPE position of the new tokens: original, or the head's rows
      const Index first = renumber_ ? cache_.length(l, kh) - n : next_position_;
      apply_rope(q, kh * group, group, first);
      apply_rope(k, kh, 1, first);
    }
    remember_window_queries(l, q);
    for (Index kh = 0; kh < c.n_kv_head; ++kh)
      cache_.write_new(l, kh, k.middleCols(kh * d, d), v.middleCols(kh * d, d));

    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const Index kept_rows = shift_window_attention(l, n);  // rows of earlier calls that stay, at the front
    Matrix attn(n, c.n_head * d);
    Matrix scores, key_rows, value_rows;  // the head's rows read through the block table (paged)
    RowVector received;  // attention each row of the KV head received from the new tokens' queries (H2O)
    for (Index kh = 0; kh < c.n_kv_head; ++kh) {
      const auto keys = cache_.keys(l, kh, key_rows);  // [len, d]: kept context rows, then the new tokens
      const auto values = cache_.values(l, kh, value_rows);
      const Index cached = keys.rows() - n;  // rows before the new tokens, all visible to every new token
      received.setZero(keys.rows());
      for (Index qh = kh * group; qh < (kh + 1) * group; ++qh) {
        for (Index b0 = 0; b0 < n; b0 += attention_block) {
          const Index bn = std::min(attention_block, n - b0), visible_end = cached + b0 + bn;
          scores.noalias() = q.block(b0, qh * d, bn, d) * keys.topRows(visible_end).transpose();
          if (peak_) add_replay_peaks(l, kh, scores, cached, b0, scale);
          for (Index i = 0; i < bn; ++i) {  // softmax over keys [0, cached + b0 + i], zero beyond (causal)
            const Index visible = cached + b0 + i + 1;
            auto row = scores.row(i);
            row.head(visible) *= scale;
            const float mx = row.head(visible).maxCoeff();
            row.head(visible) = (row.head(visible).array() - mx).exp();
            row.head(visible) /= row.head(visible).sum();
            row.tail(visible_end - visible).setZero();
          }
          remember_window_attention(l, qh, scores, n, b0, kept_rows, keys.rows());
          attn.block(b0, qh * d, bn, d).noalias() = scores * values.topRows(visible_end);
          for (Index i = 0; i < bn; ++i) received.head(visible_end) += scores.row(i);  // rows are contiguous
        }
      }
      received /= static_cast<float>(group);  // the mean over the group's query heads
      cache_.book().layer(l).add_attention(kh, received.data(), keys.rows());
    }
    if (hands_attention_rows()) {
      auto& filled = attention_filled_[static_cast<std::size_t>(l)];
      filled = std::min(window_, kept_rows + n);
    }
    x.noalias() += attn * w.wo.transpose();

    // SwiGLU MLP.
    h = rms_norm(x, w.mlp_norm);
    Matrix gate = h * w.w_gate.transpose();
    const Matrix up = h * w.w_up.transpose();
    gate = (gate.array() / (1.0f + (-gate.array()).exp()) * up.array()).matrix();
    x.noalias() += gate * w.w_down.transpose();
  }

  const Model* model_;
  Index window_;
  KVCache cache_;
  Index next_position_ = 0;
  bool renumber_ = false;
  Index window_filled_ = 0;                           // valid rows of window_queries_ (min(window_, positions run))
  std::vector<std::vector<float>> window_queries_;    // per layer [H, window_, d]
  std::vector<std::vector<float>> window_attention_;  // hand_attention_rows(true): per layer [H, window_, capacity]
  std::vector<Index> attention_filled_;               // per layer: valid rows of window_attention_ since its eviction
  std::vector<Token> tokens_;                         // every token run since the last reset()
  std::vector<std::vector<float>> engine_scores_;     // per layer [Hkv, capacity]: score_by_reconstruction()'s
  std::vector<std::vector<float>>* peak_ = nullptr;   // during a replay: where the peaks go
  std::pair<Index, Index> peak_chunk_{0, 0};          // during a replay: the entries scored [first, end)
  Index peak_sinks_ = 0;                              // during a replay: the sink entries in each softmax
  Matrix rope_cos_, rope_sin_;                        // [ctx, d / 2]
};

}  // namespace tinycode
