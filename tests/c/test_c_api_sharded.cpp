// kvevict_select_layers_sharded (include/kvevict/c/kvevict.h): this rank's part of a sharded model through the
// engine's kvevict_communicator callbacks (ranks are threads here, tests/support/thread_communicator.hpp) keeps exactly
// what kvevict_select_layers keeps for the whole model (docs/algorithms.md#sharded); callback failures and bad
// communicators are reported by status and message.
#include <catch2/catch.hpp>

#include <kvevict/c/kvevict.h>

#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "support/thread_communicator.hpp"

namespace {

using kvevict::shard::Communicator;

// A dense random model: per layer keys, values [Hkv, L, d], q_window [H, w, d], w_o [D, H d].
struct CModel {
  int layers = 3, Hkv = 2, G = 2, L = 40, w = 4, d = 8, D = 16;
  std::vector<std::vector<float>> k, v, q, o;
  explicit CModel(unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    const auto fill = [&](std::size_t size) {
      std::vector<float> x(size);
      for (float& e : x) e = n(rng);
      return x;
    };
    for (int l = 0; l < layers; ++l) {
      k.push_back(fill(static_cast<std::size_t>(Hkv * L * d)));
      v.push_back(fill(static_cast<std::size_t>(Hkv * L * d)));
      q.push_back(fill(static_cast<std::size_t>(Hkv * G * w * d)));
      o.push_back(fill(static_cast<std::size_t>(D * Hkv * G * d)));
    }
  }
  // Layer l's KV heads [h0, h0 + n): their rows of keys, values and queries and their columns of W_o (strided views).
  kvevict_layer part(int l, int h0, int n) const {
    kvevict_layer in = kvevict_layer_init();
    const auto view = [](const float* data, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t sa,
                         std::int64_t sb, std::int64_t sc) {
      kvevict_tensor t{};
      t.data = data;
      t.dtype = KVEVICT_F32;
      t.rank = c > 0 ? 3 : 2;
      t.shape[0] = a, t.shape[1] = b, t.shape[2] = c;
      t.strides[0] = sa, t.strides[1] = sb, t.strides[2] = sc;
      return t;
    };
    const auto at = [&](const std::vector<std::vector<float>>& x, std::int64_t offset) {
      return x[static_cast<std::size_t>(l)].data() + offset;
    };
    in.keys = view(at(k, h0 * L * d), n, L, d, L * d, d, 1);
    in.values = view(at(v, h0 * L * d), n, L, d, L * d, d, 1);
    in.q_window = view(at(q, h0 * G * w * d), n * G, w, d, w * d, d, 1);
    in.w_o = view(at(o, h0 * G * d), D, n * G * d, 0, Hkv * G * d, 1, 0);
    return in;
  }
};

// A thread communicator as a kvevict_communicator.
kvevict_communicator callbacks(Communicator& comm) {
  kvevict_communicator c{};
  c.context = &comm;
  c.rank = comm.rank();
  c.size = comm.size();
  c.all_gather = [](void* context, const void* send, size_t bytes, void* recv) {
    static_cast<Communicator*>(context)->all_gather(send, bytes, recv);
    return 0;
  };
  return c;
}

std::vector<std::vector<std::int64_t>> heads_of(const kvevict_selection* s, std::size_t layer) {
  std::vector<std::vector<std::int64_t>> out;
  const std::int64_t* idx = kvevict_selection_indices(s, layer);
  const std::int64_t* off = kvevict_selection_offsets(s, layer);
  for (std::int64_t h = 0; h < kvevict_selection_heads(s, layer); ++h) out.emplace_back(idx + off[h], idx + off[h + 1]);
  return out;
}

}  // namespace

TEST_CASE("sharded: kvevict_select_layers_sharded over callbacks equals kvevict_select_layers", "[c_api][shard]") {
  const CModel m(20261207);
  for (const char* name : {"layer-defensivekv", "open-defensivekv", "snapkv", "defensivekv"}) {
    kvevict_policy* policy = nullptr;
    REQUIRE(kvevict_policy_create(name, nullptr, nullptr, 0, &policy) == KVEVICT_OK);
    std::vector<kvevict_layer> whole;
    for (int l = 0; l < m.layers; ++l) whole.push_back(m.part(l, 0, m.Hkv));
    kvevict_selection* want = nullptr;
    REQUIRE(kvevict_select_layers(policy, kvevict_keep_ratio(0.3), whole.data(), whole.size(), &want) == KVEVICT_OK);
    for (const auto& split : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}, {2, 2}}) {
      const int tp = split.first, pp = split.second;  // (C++17 lambdas cannot capture structured bindings)
      INFO(name << ", TP " << tp << " x PP " << pp);
      std::mutex mutex;
      int compared = 0;
      std::vector<std::string> failures;
      kvevict_test::run_split_ranks(tp, pp, [&](Communicator& model, Communicator& stage) {
        const int s = model.rank() / tp, t = model.rank() % tp;
        const int h0 = t * m.Hkv / tp, n = m.Hkv / tp;
        std::vector<std::int64_t> ids, heads;
        std::vector<kvevict_layer> mine;
        for (int l = m.layers * s / pp; l < m.layers * (s + 1) / pp; ++l) {
          ids.push_back(l);
          mine.push_back(m.part(l, h0, n));
        }
        for (int h = h0; h < h0 + n; ++h) heads.push_back(h);
        kvevict_shard shard{};
        shard.model = callbacks(model);
        if (tp > 1) shard.layer_group = callbacks(stage);
        shard.layer_ids = ids.data();
        shard.kv_heads = heads.data();
        shard.n_kv_heads = heads.size();
        kvevict_selection* got = nullptr;
        const kvevict_status status =
            kvevict_select_layers_sharded(policy, kvevict_keep_ratio(0.3), mine.data(), mine.size(), &shard, &got);
        std::lock_guard<std::mutex> lock(mutex);
        if (status != KVEVICT_OK) {
          failures.push_back(kvevict_last_error());
          return;
        }
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const auto mine_heads = heads_of(got, i), all = heads_of(want, static_cast<std::size_t>(ids[i]));
          for (int j = 0; j < n; ++j, ++compared)
            if (mine_heads[static_cast<std::size_t>(j)] != all[static_cast<std::size_t>(h0 + j)])
              failures.push_back("layer " + std::to_string(ids[i]) + ", KV head " + std::to_string(h0 + j));
        }
        kvevict_selection_free(got);
      });
      CHECK(failures == std::vector<std::string>{});
      CHECK(compared == m.layers * m.Hkv);
    }
    kvevict_selection_free(want);
    kvevict_policy_free(policy);
  }
}

TEST_CASE("sharded: a failed all_gather and bad communicators are reported", "[c_api][shard][errors]") {
  const CModel m(5);
  kvevict_policy* policy = nullptr;
  REQUIRE(kvevict_policy_create("layer-defensivekv", nullptr, nullptr, 0, &policy) == KVEVICT_OK);
  std::vector<kvevict_layer> layers;
  for (int l = 0; l < m.layers; ++l) layers.push_back(m.part(l, 0, m.Hkv));
  const std::int64_t ids[] = {0, 1, 2}, heads[] = {0, 1};
  kvevict_shard shard{};
  shard.model.rank = 0;
  shard.model.size = 1;
  shard.model.all_gather = [](void*, const void*, size_t, void*) { return 7; };
  shard.layer_ids = ids;
  shard.kv_heads = heads;
  shard.n_kv_heads = 2;
  kvevict_selection* out = nullptr;
  CHECK(kvevict_select_layers_sharded(policy, kvevict_keep_ratio(0.3), layers.data(), layers.size(), &shard, &out) ==
        KVEVICT_COLLECTIVE_FAILED);
  CHECK_THAT(kvevict_last_error(), Catch::Matchers::Contains("shard->model.all_gather failed (returned 7)"));
  CHECK(out == nullptr);
  shard.model.rank = 2;
  CHECK(kvevict_select_layers_sharded(policy, kvevict_keep_ratio(0.3), layers.data(), layers.size(), &shard, &out) ==
        KVEVICT_INVALID_ARGUMENT);
  CHECK_THAT(kvevict_last_error(), Catch::Matchers::Contains("shard->model has rank 2 of size 1"));
  shard.model.all_gather = nullptr;
  CHECK(kvevict_select_layers_sharded(policy, kvevict_keep_ratio(0.3), layers.data(), layers.size(), &shard, &out) ==
        KVEVICT_INVALID_ARGUMENT);
  CHECK_THAT(kvevict_last_error(), Catch::Matchers::Contains("shard->model.all_gather must not be NULL"));
  CHECK(kvevict_select_layers_sharded(policy, kvevict_keep_ratio(0.3), layers.data(), layers.size(), nullptr, &out) ==
        KVEVICT_INVALID_ARGUMENT);
  CHECK_THAT(kvevict_last_error(), Catch::Matchers::Contains("shard must not be NULL"));
  kvevict_policy_free(policy);
}
