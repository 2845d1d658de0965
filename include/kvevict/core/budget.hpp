#pragma once
/// Budgets (docs/algorithms.md#budgets): how many tokens each KV head keeps on average, window included.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvevict/core/error.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict {

/// A budget in one of three forms, resolved against the context length L by n_kept(L).
///   Budget::tokens(n)            n_kept = n
///   Budget::keep_ratio(r)        n_kept = int(L * r), in double, truncated toward zero
///   Budget::compression_ratio(c) n_kept = int(L * (1 - c)), in double, truncated (the reference's rounding:
///                                L = 1000, c = 0.8 gives 199, not 200)
/// Each form is checked when it is made (tokens >= 1, ratios in range); n_kept(L) must then lie in [1, L].
///
/// A shared prompt prefix (docs/algorithms.md#protected-prefix): budget.protect_prefix(p) marks the entries at original
/// positions < p protected, never evicted. Counted (the default), they are part of n_kept; PrefixBudget::extra keeps
/// them on top: the form is resolved against the entries past the prefix, and each head keeps p more.
///
/// A fourth form keeps a count that the scores decide (docs/algorithms.md#threshold-budgets, DMS and KVzap):
///   Budget::threshold(tau)       every entry whose score reaches tau (window, forced and protected entries always),
///     .count_bounds(lo, hi, scope)  with at least lo and at most hi entries per KV head, per layer or per model.
class Budget {
 public:
  enum class Kind { tokens, keep_ratio, compression_ratio, threshold };
  /// Whether a protected prefix is part of the budget or kept on top of it.
  enum class PrefixBudget { counted, extra };
  /// Where a threshold budget's count bounds apply: each KV head, each layer (its KV heads together), the model.
  enum class Scope { head, layer, model };

  static Budget tokens(std::int64_t n) {
    detail::require(n >= 1, "Budget::tokens", "tokens must be >= 1, got ", n);
    return Budget(Kind::tokens, static_cast<double>(n), n);
  }
  static Budget keep_ratio(double r) {
    detail::require(std::isfinite(r) && r > 0.0 && r <= 1.0, "Budget::keep_ratio", "keep ratio must be in (0, 1], got ",
                    r);
    return Budget(Kind::keep_ratio, r, 0);
  }
  static Budget compression_ratio(double c) {
    detail::require(std::isfinite(c) && c >= 0.0 && c < 1.0, "Budget::compression_ratio",
                    "compression ratio must be in [0, 1), got ", c);
    return Budget(Kind::compression_ratio, c, 0);
  }

  /// Keeps every entry whose score reaches tau: score >= tau, or a tier above the scored one (the window, forced
  /// entries, the safeguard, a protected prefix). Without bounds a KV head may keep only its window, or nothing.
  static Budget threshold(double tau) {
    detail::require(std::isfinite(tau), "Budget::threshold", "the threshold must be finite, got ", tau);
    return Budget(Kind::threshold, tau, 0);
  }
  /// A threshold budget whose count is clamped to [lo, hi] entries in each `scope` (hi < 0: no upper bound). Where
  /// fewer entries pass, the next best are kept; where more, the best hi (the ranking order of
  /// docs/algorithms.md#ties).
  Budget count_bounds(std::int64_t lo, std::int64_t hi, Scope scope) const {
    const char* where = "Budget::count_bounds";
    detail::require(kind_ == Kind::threshold, where, "count bounds apply to a threshold budget (Budget::threshold)");
    detail::require(lo >= 0, where, "the lower bound must be >= 0, got ", lo);
    detail::require(hi < 0 || hi >= lo, where, "the upper bound must be >= the lower bound (", lo,
                    ") or < 0 for none, got ", hi);
    Budget b = *this;
    b.lo_ = lo;
    b.hi_ = hi < 0 ? std::numeric_limits<std::int64_t>::max() : hi;
    b.scope_ = scope;
    return b;
  }
  bool is_threshold() const { return kind_ == Kind::threshold; }
  /// A threshold budget's bounds: at least lower(), at most upper() entries in each bounds_scope().
  std::int64_t lower() const { return lo_; }
  std::int64_t upper() const { return hi_; }
  Scope bounds_scope() const { return scope_; }

  /// This budget with the entries at original positions < `positions` protected (docs/algorithms.md#protected-prefix).
  Budget protect_prefix(std::int64_t positions, PrefixBudget counting = PrefixBudget::counted) const {
    detail::require(positions >= 0, "Budget::protect_prefix", "the protected prefix must be >= 0 positions, got ",
                    positions);
    Budget b = *this;
    b.prefix_ = positions;
    b.prefix_budget_ = counting;
    return b;
  }
  /// p: entries at original positions < p are never evicted (0: none).
  std::int64_t protected_prefix() const { return prefix_; }
  PrefixBudget prefix_budget() const { return prefix_budget_; }
  /// The entries each head keeps on top of the resolved form: p under PrefixBudget::extra, else 0.
  std::int64_t extra() const { return prefix_budget_ == PrefixBudget::extra ? prefix_ : 0; }

  Kind kind() const { return kind_; }
  /// The ratio (keep or compression) or the token count, as given.
  double value() const { return value_; }

  /// Tokens kept per KV head on average for a context of L tokens; throws unless 1 <= n_kept <= L. With an extra
  /// prefix p: the form resolved against L - p, plus p (p at most L). A threshold budget, whose count the scores
  /// decide, gives what the selectors that read n_kept see: L, or the upper bound of a per-head scope when lower.
  std::int64_t n_kept(Index L, const char* where = "Budget") const {
    const std::int64_t p = std::min<std::int64_t>(extra(), L);
    const std::int64_t n = resolve(static_cast<double>(L - p)) + p;
    detail::require(n >= 1 && n <= L, where, "n_kept must be in [1, ", L, "] (the context length), got ", n,
                    describe());
    return n;
  }
  /// The same for a ragged layer of `heads` KV heads holding `entries` in all (docs/algorithms.md#ragged):
  /// resolved against the mean entries per head; throws unless 1 <= n_kept and heads * n_kept <= entries.
  std::int64_t n_kept(Index entries, Index heads, const char* where) const {
    const double mean = static_cast<double>(entries) / static_cast<double>(heads);
    const std::int64_t p = std::min<std::int64_t>(extra(), entries / heads);
    const std::int64_t n = resolve(mean - static_cast<double>(p)) + p;
    const Index most = entries / heads;
    detail::require(n >= 1 && n <= most, where, "n_kept must be in [1, ", most, "] (the mean entries per KV head, ",
                    entries, " / ", heads, ", rounded down), got ", n, describe());
    return n;
  }

 private:
  std::int64_t resolve(double mean_length) const {
    if (kind_ == Kind::threshold) {
      const auto all = static_cast<std::int64_t>(mean_length);
      return scope_ == Scope::head ? std::max<std::int64_t>(1, std::min(all, hi_)) : all;
    }
    if (kind_ == Kind::keep_ratio) return static_cast<std::int64_t>(mean_length * value_);
    if (kind_ == Kind::compression_ratio) return static_cast<std::int64_t>(mean_length * (1.0 - value_));
    return tokens_;
  }
  Budget(Kind kind, double value, std::int64_t tokens) : kind_(kind), value_(value), tokens_(tokens) {}
  std::string describe() const {
    const std::string prefix =
        extra() > 0 ? detail::concat(" with ", prefix_, " protected prefix positions on top") : std::string();
    if (kind_ == Kind::keep_ratio) return detail::concat(" from keep ratio ", value_, prefix);
    if (kind_ == Kind::compression_ratio) return detail::concat(" from compression ratio ", value_, prefix);
    if (kind_ == Kind::threshold) return detail::concat(" from threshold ", value_, prefix);
    return prefix;
  }

  Kind kind_;
  double value_;
  std::int64_t tokens_;
  std::int64_t prefix_ = 0;
  PrefixBudget prefix_budget_ = PrefixBudget::counted;
  std::int64_t lo_ = 0, hi_ = std::numeric_limits<std::int64_t>::max();
  Scope scope_ = Scope::head;
};

}  // namespace kvevict
