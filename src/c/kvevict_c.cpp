// The C API (include/kvevict/c/kvevict.h): the opaque handles over the bindings' runtime (src/runtime/: options
// from the parameter table, the raw-tensor input contract, the compiled catalogue). Every entry point catches
// everything, records the message for kvevict_last_error() and returns a status.

#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include <vector>

#include "kvevict/c/kvevict.h"
#include "kvevict/kvevict.hpp"
#include "options.hpp"  // src/runtime/
#include "tensors.hpp"

struct kvevict_policy {
  kvevict::runtime::Options options;
};

struct kvevict_selection {
  std::vector<kvevict::Selection> layers;
};

namespace {

namespace runtime = kvevict::runtime;

thread_local std::string last_error;

void fail(const char* message) noexcept {
  try {
    last_error = message;
  } catch (...) {  // no memory for the message: keep the previous one
  }
}

/// The engine's all_gather failed (kvevict_communicator): KVEVICT_COLLECTIVE_FAILED.
struct collective_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Runs f, turning any exception into a status and its message.
template <class F>
kvevict_status guarded(F&& f) noexcept {
  try {
    f();
    return KVEVICT_OK;
  } catch (const kvevict::invalid_argument& e) {
    fail(e.what());
    return KVEVICT_INVALID_ARGUMENT;
  } catch (const runtime::usage_error& e) {
    fail(e.what());
    return KVEVICT_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    fail("out of memory");
    return KVEVICT_OUT_OF_MEMORY;
  } catch (const collective_error& e) {
    fail(e.what());
    return KVEVICT_COLLECTIVE_FAILED;
  } catch (const std::exception& e) {
    try {
      last_error = std::string("internal error: ") + e.what();
    } catch (...) {
    }
    return KVEVICT_INTERNAL_ERROR;
  } catch (...) {
    fail("internal error: unknown exception");
    return KVEVICT_INTERNAL_ERROR;
  }
}

void require(bool ok, const std::string& message) {
  if (!ok) throw kvevict::invalid_argument(message);
}

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

kvevict::Budget to_budget(const kvevict_budget& b) {
  switch (b.kind) {
    case KVEVICT_BUDGET_TOKENS:
      require(std::isfinite(b.value) && b.value == std::floor(b.value),
              "budget: tokens must be a whole number, got " + number(b.value));
      require(std::fabs(b.value) <= 9007199254740992.0,  // 2^53: every whole double below it is exact
              "budget: tokens " + number(b.value) + " is out of range (at most 2^53)");
      return kvevict::Budget::tokens(static_cast<kvevict::Index>(b.value));
    case KVEVICT_BUDGET_KEEP_RATIO:
      require(b.value > 0.0 && b.value <= 1.0, "budget: keep ratio must be in (0, 1], got " + number(b.value));
      return kvevict::Budget::keep_ratio(b.value);
    case KVEVICT_BUDGET_COMPRESSION_RATIO:
      require(b.value >= 0.0 && b.value < 1.0, "budget: compression ratio must be in [0, 1), got " + number(b.value));
      return kvevict::Budget::compression_ratio(b.value);
    case KVEVICT_BUDGET_THRESHOLD:
      require(std::isfinite(b.value), "budget: threshold must be finite, got " + number(b.value));
      return kvevict::Budget::threshold(b.value);
  }
  throw kvevict::invalid_argument("budget: unknown kind " + std::to_string(static_cast<int>(b.kind)) +
                                  "; expected KVEVICT_BUDGET_TOKENS, KVEVICT_BUDGET_KEEP_RATIO, "
                                  "KVEVICT_BUDGET_COMPRESSION_RATIO or KVEVICT_BUDGET_THRESHOLD");
}

const kvevict::Selection* layer_of(const kvevict_selection* s, size_t layer) {
  return s && layer < s->layers.size() ? &s->layers[layer] : nullptr;
}

}  // namespace

extern "C" {

const char* kvevict_version(void) {
#define KVEVICT_C_STR2(x) #x
#define KVEVICT_C_STR(x) KVEVICT_C_STR2(x)
  return KVEVICT_C_STR(KVEVICT_VERSION_MAJOR) "." KVEVICT_C_STR(KVEVICT_VERSION_MINOR) "." KVEVICT_C_STR(
      KVEVICT_VERSION_PATCH);
#undef KVEVICT_C_STR
#undef KVEVICT_C_STR2
}

const char* kvevict_last_error(void) { return last_error.c_str(); }

size_t kvevict_policy_count(void) {
  size_t n = 0;
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto&) { ++n; });
  return n;
}

const char* kvevict_policy_name(size_t i) {
  const char* name = nullptr;
  size_t k = 0;
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
    if (k++ == i) name = e.name.data();  // the catalogue's names are string literals
  });
  return name;
}

size_t kvevict_option_count(void) { return runtime::parameters().size(); }

const char* kvevict_option_name(size_t i) {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const runtime::Parameter& p : runtime::parameters()) out.push_back(p.spelled(runtime::Spelling::api));
    return out;
  }();
  return i < names.size() ? names[i].c_str() : nullptr;
}

const char* kvevict_option_help(size_t i) {
  static const std::vector<std::string> help = [] {
    std::vector<std::string> out;
    for (const runtime::Parameter& p : runtime::parameters()) out.push_back(p.description());
    return out;
  }();
  return i < help.size() ? help[i].c_str() : nullptr;
}

kvevict_status kvevict_policy_create(const char* name, const char* const* option_names,
                                     const char* const* option_values, size_t n_options, kvevict_policy** out) {
  if (out) *out = nullptr;
  return guarded([&] {
    require(out != nullptr, "kvevict_policy_create: out must not be NULL");
    require(n_options == 0 || (option_names && option_values),
            "kvevict_policy_create: option_names and option_values must not be NULL when n_options (" +
                std::to_string(n_options) + ") > 0");
    runtime::OptionSet set(runtime::Spelling::api);
    if (name) set.set("policy", name);
    for (size_t i = 0; i < n_options; ++i) {
      require(option_names[i] && option_values[i],
              "kvevict_policy_create: option " + std::to_string(i) + " has a NULL name or value");
      const std::string n = option_names[i];
      if (n == "budget" || n == "keep" || n == "compression_ratio" || n == "compression-ratio" || n == "threshold")
        throw kvevict::invalid_argument("option '" + n +
                                        "': the budget is given to kvevict_select_layers (kvevict_tokens, "
                                        "kvevict_keep_ratio, kvevict_compression_ratio or kvevict_threshold), not to "
                                        "the policy");
      set.set(n, option_values[i]);
    }
    auto policy = std::make_unique<kvevict_policy>();
    policy->options = set.finish(/*needs_budget=*/false);
    *out = policy.release();
  });
}

void kvevict_policy_free(kvevict_policy* policy) { delete policy; }

const char* kvevict_policy_get_name(const kvevict_policy* policy) {
  return policy ? policy->options.policy.c_str() : nullptr;
}

int kvevict_policy_reads(const kvevict_policy* policy) {
  if (!policy) return 0;
  return (policy->options.reads_observation ? KVEVICT_READS_OBSERVATION : 0) |
         (policy->options.reads_values ? KVEVICT_READS_VALUES : 0) |
         (policy->options.reads_queries ? KVEVICT_READS_QUERIES : 0) |
         (policy->options.reads_scores ? KVEVICT_READS_SCORES : 0);
}

kvevict_budget kvevict_tokens(int64_t n_kept) { return {KVEVICT_BUDGET_TOKENS, static_cast<double>(n_kept)}; }
kvevict_budget kvevict_keep_ratio(double keep) { return {KVEVICT_BUDGET_KEEP_RATIO, keep}; }
kvevict_budget kvevict_compression_ratio(double ratio) { return {KVEVICT_BUDGET_COMPRESSION_RATIO, ratio}; }
kvevict_budget kvevict_threshold(double tau) { return {KVEVICT_BUDGET_THRESHOLD, tau}; }

kvevict_layer kvevict_layer_init(void) {
  kvevict_layer layer;
  std::memset(&layer, 0, sizeof layer);
  return layer;
}

kvevict_tensor kvevict_tensor_contiguous(const void* data, int32_t dtype, int32_t rank, const int64_t* shape) {
  kvevict_tensor t;
  std::memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dtype;
  t.rank = rank;
  if (!shape || rank < 1 || rank > 3) return t;  // kvevict_select_layers names the bad rank
  int64_t stride = 1;
  for (int32_t i = rank - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    stride *= shape[i];
  }
  return t;
}

kvevict_status kvevict_select_layers(const kvevict_policy* policy, kvevict_budget budget, const kvevict_layer* layers,
                                     size_t n_layers, kvevict_selection** out) {
  if (out) *out = nullptr;
  return guarded([&] {
    require(policy != nullptr, "kvevict_select_layers: policy must not be NULL");
    require(out != nullptr, "kvevict_select_layers: out must not be NULL");
    require(layers != nullptr && n_layers > 0, "kvevict_select_layers: expected at least one layer, got " +
                                                   std::to_string(n_layers) + (layers ? "" : " (layers is NULL)"));
    const kvevict::Budget b = to_budget(budget);
    auto result = std::make_unique<kvevict_selection>();
    result->layers = runtime::select_tensors(policy->options, b, layers, n_layers);
    *out = result.release();
  });
}

namespace {

/// A kvevict_communicator as a shard::Communicator: a failed all_gather throws on this rank.
class CallbackCommunicator : public kvevict::shard::Communicator {
 public:
  CallbackCommunicator(const kvevict_communicator& c, const char* name) : c_(c), name_(name) {
    require(c.all_gather != nullptr,
            std::string("kvevict_select_layers_sharded: shard->") + name + ".all_gather must not be NULL");
    require(c.size >= 1 && c.rank >= 0 && c.rank < c.size,
            std::string("kvevict_select_layers_sharded: shard->") + name + " has rank " + std::to_string(c.rank) +
                " of size " + std::to_string(c.size) + "; expected 0 <= rank < size");
  }
  int rank() const override { return c_.rank; }
  int size() const override { return c_.size; }
  void all_gather(const void* send, std::size_t bytes, void* recv) override {
    const int status = c_.all_gather(c_.context, send, bytes, recv);
    if (status != 0)
      throw collective_error(std::string("kvevict_select_layers_sharded: shard->") + name_ +
                             ".all_gather failed (returned " + std::to_string(status) + ")");
  }

 private:
  kvevict_communicator c_;
  const char* name_;
};

}  // namespace

kvevict_status kvevict_select_layers_sharded(const kvevict_policy* policy, kvevict_budget budget,
                                             const kvevict_layer* layers, size_t n_layers, const kvevict_shard* shard,
                                             kvevict_selection** out) {
  if (out) *out = nullptr;
  return guarded([&] {
    require(policy != nullptr, "kvevict_select_layers_sharded: policy must not be NULL");
    require(out != nullptr, "kvevict_select_layers_sharded: out must not be NULL");
    require(shard != nullptr, "kvevict_select_layers_sharded: shard must not be NULL");
    require(layers != nullptr || n_layers == 0, "kvevict_select_layers_sharded: layers is NULL");
    require(shard->layer_ids != nullptr || n_layers == 0,
            "kvevict_select_layers_sharded: shard->layer_ids must hold one id per layer");
    require(shard->kv_heads != nullptr && shard->n_kv_heads > 0,
            "kvevict_select_layers_sharded: shard->kv_heads must hold this rank's KV head ids");
    CallbackCommunicator model(shard->model, "model");
    std::unique_ptr<CallbackCommunicator> group;
    if (shard->layer_group.all_gather)
      group = std::make_unique<CallbackCommunicator>(shard->layer_group, "layer_group");
    kvevict::shard::ModelShard part{&model, group.get(), {}, {}};
    part.layers.assign(shard->layer_ids, shard->layer_ids + n_layers);
    part.kv_heads.assign(shard->kv_heads, shard->kv_heads + shard->n_kv_heads);
    runtime::Options options = policy->options;
    options.shard = &part;
    auto result = std::make_unique<kvevict_selection>();
    result->layers = runtime::select_tensors(options, to_budget(budget), layers, n_layers);
    *out = result.release();
  });
}

void kvevict_selection_free(kvevict_selection* selection) { delete selection; }

size_t kvevict_selection_layers(const kvevict_selection* s) { return s ? s->layers.size() : 0; }

int64_t kvevict_selection_heads(const kvevict_selection* s, size_t layer) {
  const kvevict::Selection* sel = layer_of(s, layer);
  return sel ? sel->heads() : 0;
}
int64_t kvevict_selection_total(const kvevict_selection* s, size_t layer) {
  const kvevict::Selection* sel = layer_of(s, layer);
  return sel ? sel->total() : 0;
}
const int64_t* kvevict_selection_indices(const kvevict_selection* s, size_t layer) {
  const kvevict::Selection* sel = layer_of(s, layer);
  return sel ? sel->indices().data() : nullptr;
}
const int64_t* kvevict_selection_offsets(const kvevict_selection* s, size_t layer) {
  const kvevict::Selection* sel = layer_of(s, layer);
  return sel ? sel->offsets().data() : nullptr;
}
const int64_t* kvevict_selection_positions(const kvevict_selection* s, size_t layer) {
  const kvevict::Selection* sel = layer_of(s, layer);
  return sel ? sel->positions().data() : nullptr;
}
int64_t kvevict_selection_block_count(const kvevict_selection* s, size_t layer) {
  const kvevict::Selection* sel = layer_of(s, layer);
  return sel ? static_cast<int64_t>(sel->blocks().size()) : 0;
}
const int64_t* kvevict_selection_blocks(const kvevict_selection* s, size_t layer) {
  const kvevict::Selection* sel = layer_of(s, layer);
  return sel ? sel->blocks().data() : nullptr;
}
const int64_t* kvevict_selection_block_offsets(const kvevict_selection* s, size_t layer) {
  const kvevict::Selection* sel = layer_of(s, layer);
  return sel ? sel->block_offsets().data() : nullptr;
}

}  // extern "C"
