// The README's engine snippet, compiled and run: evict one layer of a token-major KV cache in place.

#include <kvevict/kvevict.hpp>

#include <Eigen/Core>

#include <cstdio>
#include <random>
#include <vector>

// ---- the README snippet (keep in sync) ------------------------------------------------------------------------
// One layer, after its prefill attention ran with the full cache. Views, no copies:
//   q_win [H, w, d] post-RoPE queries of the last w prompt positions; k, v [L, Hkv, d] (token-major cache).
kvevict::Selection evict_layer(const float* q_win, float* k, float* v, const float* w_o, kvevict::Index H,
                               kvevict::Index Hkv, kvevict::Index L, kvevict::Index d, kvevict::Index hidden) {
  kvevict::LayerInputs<float> in;
  in.queries = kvevict::HeadsView<const float>::heads_major(q_win, H, 32, d);
  in.keys = kvevict::kv_tokens_major<const float>(k, L, Hkv, d);
  in.values = kvevict::kv_tokens_major<const float>(v, L, Hkv, d);
  in.w_o = kvevict::output_projection(w_o, hidden, H, d);  // W_o [hidden, H * d]

  static const kvevict::CriticalKV policy;  // window 32, avg pooling, kernel 5, alpha 0.2
  kvevict::Selection kept = policy.select(in, kvevict::Budget::keep_ratio(0.2));

  // Compact in place: head h's kept rows move to rows [0, kept.length(h)), original order kept.
  kept.compact(in.keys, kvevict::kv_tokens_major(k, L, Hkv, d));
  kept.compact(in.values, kvevict::kv_tokens_major(v, L, Hkv, d));
  return kept;  // kept.offsets() is cu_seqlens over heads; kept.indices() the original positions (for RoPE)
}
// ----------------------------------------------------------------------------------------------------------------

// ---- README: a Hugging Face cache (keep in sync) ---------------------------------------------------------------
// Head-major [Hkv, L, d] keys and values in fp16 (as DynamicCache holds them), fp32 window queries [H, w, d]:
// each group of tensors has its own storage type, LayerInputs<KV, Q = KV, W = Q>.
kvevict::Selection evict_hf_layer(const Eigen::half* k, const Eigen::half* v, const float* q_win, kvevict::Index H,
                                  kvevict::Index Hkv, kvevict::Index L, kvevict::Index d) {
  kvevict::LayerInputs<Eigen::half, float> in;
  in.queries = kvevict::HeadsView<const float>::heads_major(q_win, H, 32, d);
  in.keys = kvevict::kv_heads_major(k, Hkv, L, d);
  in.values = kvevict::kv_heads_major(v, Hkv, L, d);
  static const kvevict::AdaKV policy;                                 // attention only: values and W_o are not read
  return policy.select(in, kvevict::Budget::compression_ratio(0.8));  // n_kept = int(L * 0.2)
}
// ----------------------------------------------------------------------------------------------------------------

// ---- README: Layer-DefensiveKV over a model (keep in sync) ------------------------------------------------------
// One budget shared by all layers: score every layer (add, in model order), then allocate and select (apply).
std::vector<kvevict::Selection> evict_model(const std::vector<kvevict::LayerInputs<float>>& layers) {
  static const kvevict::LayerDefensiveKV policy;
  auto plan = policy.plan(kvevict::Budget::keep_ratio(0.1));
  for (const auto& layer : layers) plan.add(layer);  // each layer's queries may be dropped after its add()
  return plan.apply();                               // one Selection per layer, NL * Hkv * n_kept in all
}
// ----------------------------------------------------------------------------------------------------------------

// Decoding under a cap: the cache [Hkv, capacity, d] per layer never holds more than n tokens per KV head on average
// plus one step. The engine runs its forward pass and owns K and V; kvevict::CacheBook keeps each head's length and
// original positions (the cache is ragged after the first eviction) and evict_over_budget evicts what is over.
struct CappedLayer {
  std::vector<float> k, v;     // [Hkv, capacity, d], head-major; head h's entries are rows [0, book length(h))
  std::vector<float> q_win;    // [H, w, d]: the step's last w post-RoPE queries
  const float* w_o = nullptr;  // [hidden, H * d]
};

void decode_step(std::vector<CappedLayer>& layers, kvevict::CacheBook& book, const kvevict::DefensiveKV& policy,
                 kvevict::Index H, kvevict::Index Hkv, kvevict::Index d, kvevict::Index hidden, kvevict::Index n) {
  const kvevict::Index capacity = book.layer(0).capacity();
  auto view = [&](std::vector<float>& x) { return kvevict::kv_heads_major(x.data(), Hkv, capacity, d); };
  // ... after the forward pass of this step's c >= w tokens wrote rows [length(h) - c, length(h)) of every head
  // (book.append(c) came first), evict every layer holding more than Hkv * n entries:
  kvevict::evict_over_budget(
      policy, book, n,
      [&](kvevict::Index l) {
        CappedLayer& x = layers[static_cast<std::size_t>(l)];
        kvevict::LayerInputs<float> in;  // the book adds each head's length and positions
        in.queries = kvevict::HeadsView<const float>::heads_major(x.q_win.data(), H, 32, d);
        in.keys = view(x.k);
        in.values = view(x.v);
        in.w_o = kvevict::output_projection(x.w_o, hidden, H, d);
        return in;
      },
      [&](kvevict::Index l, const kvevict::Selection& kept) {  // compacts K, V and the positions in place
        CappedLayer& x = layers[static_cast<std::size_t>(l)];
        book.layer(l).apply(kept, view(x.k), view(x.v));
      });
}

// ---- README: a paged cache, RoPE renumbering (keep in sync) ------------------------------------------------------
// Pages of 16 tokens hold every KV head of a token (vLLM, TensorRT-LLM): one kept set per layer, whole pages.
std::vector<kvevict::Selection> evict_pages(const std::vector<kvevict::LayerInputs<float>>& layers) {
  kvevict::LayerDefensiveKV::Params p;
  p.share = kvevict::Sharing::per_layer;  // one set for the layer's KV heads, ranked by the max of their scores
  p.block = 16;                           // whole pages; the last, partial page is always kept
  const kvevict::LayerDefensiveKV policy(p);
  return policy.select(layers, kvevict::Budget::keep_ratio(0.1));  // kept[l].head_blocks(0): layer l's pages
}

// StreamingLLM's position shift, llama.cpp's K-shift: after compaction, renumber the kept keys 0 .. length - 1.
void compact_renumbered(const kvevict::Selection& kept, kvevict::KVView<float> keys, double rope_theta) {
  kept.compact(kvevict::KVView<const float>(keys), keys);
  kvevict::Rope rope;  // rotate-half pairs (Hugging Face Llama) over the whole head
  rope.theta = rope_theta;
  kvevict::rerotate_kept(keys, kept, rope);  // row k of head h: from its original position to position k
}
// ----------------------------------------------------------------------------------------------------------------

int main() {
  const kvevict::Index H = 8, Hkv = 2, L = 1000, d = 64, hidden = 512;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto random = [&](std::size_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = normal(rng);
    return x;
  };
  const std::vector<float> q = random(static_cast<std::size_t>(H * 32 * d)),
                           w_o = random(static_cast<std::size_t>(hidden * H * d));
  std::vector<float> k = random(static_cast<std::size_t>(L * Hkv * d)), v = random(k.size());
  const std::vector<float> k0 = k;

  const kvevict::Selection kept = evict_layer(q.data(), k.data(), v.data(), w_o.data(), H, Hkv, L, d, hidden);

  // Check: the budget is met exactly and head h's compacted row r is the original row kept.head(h)[r].
  int errors = kept.total() == Hkv * 200 ? 0 : 1;
  for (kvevict::Index h = 0; h < Hkv; ++h)
    for (kvevict::Index r = 0; r < kept.length(h); ++r)
      for (kvevict::Index c = 0; c < d; ++c) {
        const auto j = static_cast<kvevict::Index>(kept.head(h)[r]);
        errors +=
            k[static_cast<std::size_t>((r * Hkv + h) * d + c)] != k0[static_cast<std::size_t>((j * Hkv + h) * d + c)];
      }
  // The Hugging Face layout in fp16: the same selection as float storage of the same values.
  const std::vector<Eigen::half> kh(k0.begin(), k0.end()), vh(v.begin(), v.end());
  const kvevict::Selection hf = evict_hf_layer(kh.data(), vh.data(), q.data(), H, Hkv, L, d);
  errors += hf.total() == Hkv * 199 ? 0 : 1;  // int(1000 * (1 - 0.8)) = 199: the reference's rounding
  // Layer-DefensiveKV over three layers: the model keeps 3 * Hkv * n_kept entries, n_kept = int(L * 0.1).
  std::vector<float> kh_float(kh.begin(), kh.end()), vh_float(vh.begin(), vh.end());
  kvevict::LayerInputs<float> layer;
  layer.queries = kvevict::HeadsView<const float>::heads_major(q.data(), H, 32, d);
  layer.keys = kvevict::kv_heads_major<const float>(kh_float.data(), Hkv, L, d);
  layer.values = kvevict::kv_heads_major<const float>(vh_float.data(), Hkv, L, d);
  layer.w_o = kvevict::output_projection(w_o.data(), hidden, H, d);
  const std::vector<kvevict::Selection> model = evict_model({layer, layer, layer});
  kvevict::Index model_total = 0;
  for (const auto& sel : model) model_total += sel.total();
  errors += model_total == 3 * Hkv * 100 ? 0 : 1;
  // Capped decoding over two layers: 20 steps of 40 tokens, n = 100 per KV head; never more than Hkv * (n + 40).
  {
    const kvevict::Index capacity = 400, steps = 20, c = 40, n = 100;
    kvevict::CacheBook book(2, Hkv, capacity);
    std::vector<CappedLayer> layers(2);
    for (CappedLayer& x : layers) {
      x.k.assign(static_cast<std::size_t>(Hkv * capacity * d), 0.f);
      x.v = x.k;
      x.w_o = w_o.data();
    }
    const kvevict::DefensiveKV policy;
    for (kvevict::Index s = 0; s < steps; ++s) {
      book.append(c);  // the forward pass: c new rows per head, here random keys and values
      for (kvevict::Index l = 0; l < 2; ++l) {
        CappedLayer& x = layers[static_cast<std::size_t>(l)];
        for (kvevict::Index h = 0; h < Hkv; ++h)
          for (kvevict::Index r = book.layer(l).length(h) - c; r < book.layer(l).length(h); ++r)
            for (kvevict::Index e = 0; e < d; ++e) {
              x.k[static_cast<std::size_t>((h * capacity + r) * d + e)] = normal(rng);
              x.v[static_cast<std::size_t>((h * capacity + r) * d + e)] = normal(rng);
            }
        x.q_win = random(static_cast<std::size_t>(H * 32 * d));
      }
      errors += book.entries() <= 2 * Hkv * (n + c) ? 0 : 1;
      decode_step(layers, book, policy, H, Hkv, d, hidden, n);
      errors += book.layer(0).entries() <= Hkv * n && book.layer(1).entries() <= Hkv * n ? 0 : 1;
    }
    // The last step's window (its last 32 positions) is in every head, at the end.
    for (kvevict::Index l = 0; l < 2; ++l)
      for (kvevict::Index h = 0; h < Hkv; ++h)
        errors += book.layer(l).position(h, book.layer(l).length(h) - 1) == steps * c - 1 ? 0 : 1;
  }
  // Pages: every layer keeps whole pages of 16 shared by both heads, within the model budget.
  {
    const std::vector<kvevict::Selection> pages = evict_pages({layer, layer, layer});
    kvevict::Index kept_rows = 0;
    for (const auto& sel : pages) {
      errors += std::equal(sel.head(0).begin(), sel.head(0).end(), sel.head(1).begin(), sel.head(1).end()) ? 0 : 1;
      errors += sel.total() % (16 * Hkv) == 8 * Hkv ? 0 : 1;  // whole pages plus the partial page (1000 = 62 * 16 + 8)
      kept_rows += sel.length(0);
    }
    errors += kept_rows <= 3 * 100 ? 0 : 1;
    // Renumbering: keys kept from positions P land at 0 .. length - 1; a key rotated back by -k returns to the
    // one compacted at its original position, rotated by -P.
    std::vector<float> renumbered(kh_float), original(kh_float);
    const auto view = [&](std::vector<float>& x) { return kvevict::kv_heads_major(x.data(), Hkv, L, d); };
    compact_renumbered(pages[0], view(renumbered), 10000.0);
    pages[0].compact(kvevict::KVView<const float>(view(original)), view(original));
    errors += renumbered != original ? 0 : 1;  // rotated (the kept pages are not at 0 .. length - 1)
  }
  std::printf("quickstart: kept %ld of %ld tokens per KV head on average (heads: %ld, %ld), %d errors\n",
              static_cast<long>(kept.total() / Hkv), static_cast<long>(L), static_cast<long>(kept.length(0)),
              static_cast<long>(kept.length(1)), errors);
  return errors == 0 ? 0 : 1;
}
