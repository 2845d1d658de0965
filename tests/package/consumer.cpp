// A downstream engine's use of kvevict, built by each consumer route (tests/package/): token-major keys as
// llama.cpp and vLLM hold them, SnapKV at half the context.
#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#if defined(KVEVICT_CONSUMER_EXPECTED_MAJOR)
static_assert(KVEVICT_VERSION_MAJOR == KVEVICT_CONSUMER_EXPECTED_MAJOR &&
                  KVEVICT_VERSION_MINOR == KVEVICT_CONSUMER_EXPECTED_MINOR &&
                  KVEVICT_VERSION_PATCH == KVEVICT_CONSUMER_EXPECTED_PATCH,
              "kvevict/version.hpp disagrees with the CMake package version");
#endif

int main() {
  try {
    constexpr kvevict::Index H = 8, Hkv = 2, w = 32, L = 128, d = 16;
    std::vector<float> queries(static_cast<std::size_t>(H * w * d));
    std::vector<float> keys(static_cast<std::size_t>(L * Hkv * d));
    std::uint32_t seed = 12345u;
    auto fill = [&seed](std::vector<float>& v) {
      for (float& x : v) {
        seed = seed * 1664525u + 1013904223u;
        x = static_cast<float>(static_cast<double>(seed >> 8) / 8388608.0 - 1.0);
      }
    };
    fill(queries);
    fill(keys);

    kvevict::LayerInputs<float> in;
    in.queries = kvevict::HeadsView<const float>::heads_major(queries.data(), H, w, d);
    in.keys = kvevict::kv_tokens_major<const float>(keys.data(), L, Hkv, d);

    const kvevict::SnapKV policy;
    const kvevict::Selection sel = policy.select(in, kvevict::Budget::keep_ratio(0.5));

    bool ok = sel.heads() == Hkv && sel.total() == Hkv * (L / 2) && sel.context_length() == L;
    for (kvevict::Index h = 0; ok && h < Hkv; ++h) {
      const auto idx = sel.head(h);
      for (kvevict::Index i = 1; i < idx.size(); ++i) ok = ok && idx[i - 1] < idx[i];
      for (kvevict::Index j = L - w; j < L; ++j) ok = ok && sel.kept(h, j);  // the window is always kept
    }
    std::printf("kvevict %d.%d.%d consumer: SnapKV kept %lld of %lld entries: %s\n", KVEVICT_VERSION_MAJOR,
                KVEVICT_VERSION_MINOR, KVEVICT_VERSION_PATCH, static_cast<long long>(sel.total()),
                static_cast<long long>(Hkv * L), ok ? "ok" : "WRONG");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: unexpected exception: %s\n", e.what());
    return 1;
  }
}
