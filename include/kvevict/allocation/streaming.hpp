#pragma once
/// Stage 2.5, StreamingLLM (arXiv 2309.17453) baseline: positional, no scores.

#include <algorithm>
#include <cstdint>
#include <string>

#include "kvevict/core/budget.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/ranking/topk.hpp"

namespace kvevict {

/// Every KV head keeps its first min(sinks, n_kept) tokens (attention sinks) and its most recent
/// max(0, n_kept - sinks) tokens. Reads only the keys' shape.
class StreamingLLM {
 public:
  static constexpr const char* type_name = "StreamingLLM";
  struct Params {
    Index sinks = 4;
    void validate(const char* where) const { detail::require(sinks >= 0, where, "sinks must be >= 0, got ", sinks); }
  };

  StreamingLLM() = default;
  explicit StreamingLLM(const Params& params) : params_((params.validate("StreamingLLM::Params"), params)) {}
  const Params& params() const { return params_; }
  const std::string& name() const {
    static const std::string n = type_name;
    return n;
  }
  /// StreamingLLM reads only the keys' shape.
  static constexpr bool reads_observation() { return false; }
  bool reads_values() const { return false; }

  /// Selection over a layer of kv_heads x tokens.
  Selection select(Index kv_heads, Index tokens, const Budget& budget,
                   const char* where = "StreamingLLM::select") const {
    detail::require(kv_heads >= 1 && tokens >= 1, where, "needs kv_heads >= 1 and tokens >= 1, got ", kv_heads, " and ",
                    tokens);
    extend::LayerShape shape;
    shape.kv_heads = kv_heads;
    shape.tokens = tokens;
    return select(shape, budget, where);
  }

  /// Same as the scored policies' entry point; reads only the keys' shape, lengths and positions (a ragged layer
  /// keeps b_h = min(n_kept, L_h) per head, sinks first: docs/algorithms.md section 6).
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget) const {
    const char* where = "StreamingLLM::select";
    return select(detail::read_entries(in, where), budget, where);
  }
  /// The same for layer `layer` of a model (named in error messages).
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, Index layer) const {
    const std::string where = "StreamingLLM::select (layer " + std::to_string(layer) + ")";
    return select(detail::read_entries(in, where.c_str()), budget, where.c_str());
  }

 private:
  Selection select(const extend::LayerShape& shape, const Budget& budget, const char* where) const {
    const auto n_kept = static_cast<Index>(shape.ragged() ? budget.n_kept(shape.entries(), shape.kv_heads, where)
                                                          : budget.n_kept(shape.tokens, where));
    extend::KeepFlags keep(static_cast<std::size_t>(shape.kv_heads * shape.tokens), 0);
    for (Index h = 0; h < shape.kv_heads; ++h) {
      const Index L = shape.length(h), kept = std::min(n_kept, L);
      const Index sinks = std::min(params_.sinks, kept), recent = kept - sinks;
      for (Index j = 0; j < L; ++j)
        keep[static_cast<std::size_t>(h * shape.tokens + j)] = (j < sinks || j >= L - recent) ? 1 : 0;
    }
    return Selection::from_flags(keep, shape);
  }

  Params params_;
};

}  // namespace kvevict
