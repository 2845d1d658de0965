// Float64 reference of the open window (docs/algorithms.md#open-window), written from the text, on top of the
// DefensiveKV reference: the window's own tokens are scored like the prefix and only each head's newest entry is
// kept first.
#ifndef KVEVICT_TESTS_SUPPORT_REFERENCE_OPEN_WINDOW_HPP
#define KVEVICT_TESTS_SUPPORT_REFERENCE_OPEN_WINDOW_HPP

#include <algorithm>
#include <cstdint>
#include <vector>

#include "support/reference.hpp"

namespace kvevict_ref {

// M [Hkv][L]: columns j < P as defensive_scores (pooled, mass renormalised) and the window columns j >= P as the max
// over the G query heads and the w rows of attn[q][i][j], unpooled (the causal zeros included). The floor (when on)
// is the mean of the prefix columns before flooring, applied to all L columns.
inline std::vector<double> open_defensive_scores(const std::vector<double>& attn, int H, int Hkv, int w, int L,
                                                 int kernel, Pool pool, bool floor) {
  using detail::sz;
  const int G = H / Hkv, P = L - w;
  const std::vector<double> prefix = defensive_scores(attn, H, Hkv, w, L, kernel, pool, false);
  std::vector<double> m(sz(Hkv) * sz(L), 0.0);
  for (int h = 0; h < Hkv; ++h) {
    for (int j = 0; j < P; ++j) m[sz(h) * sz(L) + sz(j)] = prefix[sz(h) * sz(P) + sz(j)];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < w; ++i)
        for (int j = P; j < L; ++j) {
          double& dst = m[sz(h) * sz(L) + sz(j)];
          dst = std::max(dst, attn[(sz(h * G + g) * sz(w) + sz(i)) * sz(L) + sz(j)]);
        }
    if (!floor) continue;
    double mean = 0.0;
    for (int j = 0; j < P; ++j) mean += prefix[sz(h) * sz(P) + sz(j)];
    mean /= static_cast<double>(P);
    for (int j = 0; j < L; ++j) m[sz(h) * sz(L) + sz(j)] = std::max(m[sz(h) * sz(L) + sz(j)], mean);
  }
  return m;
}

// s' [Hkv][L - 1]: M[h][j] * N[h][j] / sum over h' of N[h'][j] (0 where that sum is 0; M itself without the value
// term) for every entry but the newest, which is kept first: the scores to give the DefensiveKV references with a
// window of 1 (defensivekv, layer_defensivekv).
inline std::vector<double> open_value_scores(const std::vector<double>& m, const std::vector<double>& n, int Hkv, int L,
                                             bool value_term) {
  using detail::sz;
  std::vector<double> out(sz(Hkv) * sz(L - 1), 0.0);
  for (int j = 0; j + 1 < L; ++j) {
    double sum = 0.0;
    for (int h = 0; h < Hkv; ++h) sum += n[sz(h) * sz(L) + sz(j)];
    for (int h = 0; h < Hkv; ++h) {
      const double nn = !value_term ? 1.0 : sum == 0.0 ? 0.0 : n[sz(h) * sz(L) + sz(j)] / sum;
      out[sz(h) * sz(L - 1) + sz(j)] = m[sz(h) * sz(L) + sz(j)] * nn;
    }
  }
  return out;
}

}  // namespace kvevict_ref

#endif  // KVEVICT_TESTS_SUPPORT_REFERENCE_OPEN_WINDOW_HPP
