// Independent float64 reference for H2O (docs/algorithms.md#h2o): the attention each entry received, and
// the heavy-hitter selection with the recent share; plus a whole decoding run under a cap, entry by entry.
// Written from the text of the section, sharing nothing with the library but the ranking rule of
// docs/algorithms.md#ties.
#ifndef KVEVICT_TESTS_SUPPORT_REFERENCE_H2O_HPP
#define KVEVICT_TESTS_SUPPORT_REFERENCE_H2O_HPP

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <vector>

#include "support/reference_ragged.hpp"

namespace kvevict_ref {
namespace h2o {

using ragged::KeptRows;
using ragged::Positions;
using ragged::Ragged;

// Attention received [Hkv][L_h]: KV head h holds keys [L_h][d] (heads[h].keys); q [H][c][d] are the queries of each
// head's last c entries (query i sees entries 0 .. L_h - c + i). received[h][j] = (1/G) sum over the G query heads of
// h and the c queries of softmax(q . k / sqrt(d))[j].
inline Ragged received(const ragged::Layer& l, const std::vector<double>& q, int c) {
  using detail::sz;
  assert(c >= 1 && l.H % l.Hkv == 0);
  assert(q.size() == sz(l.H) * sz(c) * sz(l.d));
  const int G = l.H / l.Hkv;
  Ragged out;
  for (int h = 0; h < l.Hkv; ++h) {
    const auto& head = l.heads[sz(h)];
    const int L = static_cast<int>(head.pos.size());
    assert(c <= L);
    std::vector<double> r(sz(L), 0.0);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < c; ++i) {
        const double* qi = &q[(sz(h * G + g) * sz(c) + sz(i)) * sz(l.d)];
        const int last = L - c + i;
        std::vector<double> logit(sz(last + 1));
        double m = -INFINITY;
        for (int j = 0; j <= last; ++j) {
          double dot = 0.0;
          for (int x = 0; x < l.d; ++x) dot += qi[x] * head.keys[sz(j) * sz(l.d) + sz(x)];
          logit[sz(j)] = dot / std::sqrt(static_cast<double>(l.d));
          m = std::max(m, logit[sz(j)]);
        }
        double sum = 0.0;
        for (double& v : logit) sum += (v = std::exp(v - m));
        for (int j = 0; j <= last; ++j) r[sz(j)] += logit[sz(j)] / sum;
      }
    for (double& v : r) v /= G;
    out.push_back(r);
  }
  return out;
}

// The uniform H2O selection: head h keeps b_h = min(n_kept, L_h) entries; its last r = max(w, floor(share * n_kept))
// entries (all if fewer) rank above the rest, newest first; the others by received[h][j] (the first P_h = L_h - w
// are read), ties to the higher position.
inline KeptRows select(const Ragged& received, const Positions& pos, int w, std::int64_t n_kept, double share) {
  using ragged::detail::Entry;
  const auto r = std::max<std::int64_t>(w, static_cast<std::int64_t>(std::floor(share * static_cast<double>(n_kept))));
  KeptRows kept(pos.size());
  for (std::size_t h = 0; h < pos.size(); ++h) {
    const auto L = static_cast<std::int64_t>(pos[h].size());
    std::vector<Entry> entries;
    for (std::int64_t j = 0; j < L; ++j) {
      const bool recent = j >= L - r || j >= L - w;
      entries.push_back({recent ? ragged::detail::kWindow : ragged::detail::kScored,
                         recent ? 0.0 : received[h][static_cast<std::size_t>(j)], pos[h][static_cast<std::size_t>(j)],
                         0, static_cast<std::int64_t>(h), j});
    }
    for (const Entry& e : ragged::detail::top_k(entries, std::min(n_kept, L))) kept[h].push_back(e.row);
    std::sort(kept[h].begin(), kept[h].end());
  }
  return kept;
}

// A decoding run of one layer under a cap, entry by entry in float64: keys [Hkv][T][d] and queries [H][T][d] of
// positions 0 .. T-1. Steps of `steps[s]` tokens: each step appends its tokens to every head, adds the attention its
// queries pay every held entry (received above), then, if the layer holds more than Hkv * n entries, keeps select()
// with window w. Returns the positions each head holds at the end.
inline Positions decode(const std::vector<double>& k, const std::vector<double>& q, int H, int Hkv, int d, int T,
                        const std::vector<int>& steps, int w, std::int64_t n, double share) {
  using detail::sz;
  Positions held(sz(Hkv));
  std::vector<std::vector<double>> score(sz(Hkv));  // received attention of each held entry
  int next = 0;
  for (int c : steps) {
    assert(next + c <= T);
    for (int h = 0; h < Hkv; ++h)
      for (int i = 0; i < c; ++i) held[sz(h)].push_back(next + i), score[sz(h)].push_back(0.0);
    ragged::Layer l;
    l.H = H;
    l.Hkv = Hkv;
    l.d = d;
    for (int h = 0; h < Hkv; ++h) {
      ragged::Head head;
      for (std::int64_t p : held[sz(h)])
        for (int x = 0; x < d; ++x) head.keys.push_back(k[(sz(h) * sz(T) + sz(p)) * sz(d) + sz(x)]);
      head.pos = held[sz(h)];
      l.heads.push_back(head);
    }
    std::vector<double> qs;
    for (int qh = 0; qh < H; ++qh)
      for (int i = 0; i < c; ++i)
        for (int x = 0; x < d; ++x) qs.push_back(q[(sz(qh) * sz(T) + sz(next + i)) * sz(d) + sz(x)]);
    const Ragged add = received(l, qs, c);
    std::int64_t entries = 0;
    for (int h = 0; h < Hkv; ++h) {
      for (std::size_t j = 0; j < add[sz(h)].size(); ++j) score[sz(h)][j] += add[sz(h)][j];
      entries += static_cast<std::int64_t>(held[sz(h)].size());
    }
    next += c;
    if (entries <= Hkv * n) continue;
    const KeptRows kept = select(score, held, w, n, share);
    for (int h = 0; h < Hkv; ++h) {
      std::vector<std::int64_t> p;
      std::vector<double> s;
      for (std::int64_t j : kept[sz(h)]) p.push_back(held[sz(h)][sz(j)]), s.push_back(score[sz(h)][sz(j)]);
      held[sz(h)] = p;
      score[sz(h)] = s;
    }
  }
  return held;
}

}  // namespace h2o
}  // namespace kvevict_ref

#endif  // KVEVICT_TESTS_SUPPORT_REFERENCE_H2O_HPP
