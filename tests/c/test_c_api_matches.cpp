// The C API (include/kvevict/c/kvevict.h) against the C++ API it wraps: for every catalogue policy and every
// composition base x selector, on seeded random layers (GQA groups 1, 2 and 4, every cache dtype, heads-major,
// tokens-major, padded and copied layouts, ragged layers, attention rows instead of queries, the options; three seeds
// each), the selections of kvevict_select_layers equal kvevict::select_layers<S> of the catalogue entry over
// LayerInputs viewing the same data, with the queries and W_o converted to the arithmetic type S as the C API
// converts them (through float for f16 / bf16); an f16 or bf16 cache is compared with float storage of the same
// values, which selects exactly as half storage does (tests/test_half_storage.cpp). Errors are the same errors. Then:
// one policy handle used by 4 threads at once, and kvevict_last_error() per thread.
#include <catch2/catch.hpp>

#include <kvevict/c/kvevict.h>
#include <kvevict/kvevict.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "support/ragged_inputs.hpp"
#include "support/random_inputs.hpp"

namespace {

using kvevict::Index;
using kvevict_test::Rng;
using kvevict_test::sz;

// ---- typed storage ------------------------------------------------------------------------------------------------

/// Elements of one dtype, as a C caller holds them.
struct Buf {
  kvevict_dtype dt = KVEVICT_F32;
  std::variant<std::vector<float>, std::vector<double>, std::vector<Eigen::half>, std::vector<Eigen::bfloat16>> data;

  const void* ptr() const {
    return std::visit([](const auto& v) -> const void* { return v.data(); }, data);
  }
  template <class T>
  const T* typed() const {
    return std::get<std::vector<T>>(data).data();
  }
  std::size_t size() const {
    return std::visit([](const auto& v) { return v.size(); }, data);
  }
  /// Element i in the arithmetic type S, as the C API reads it: f16 and bf16 through float.
  template <class S>
  S at(std::int64_t i) const {
    return std::visit(
        [&](const auto& v) -> S {
          using T = typename std::decay_t<decltype(v)>::value_type;
          if constexpr (std::is_floating_point_v<T>)
            return static_cast<S>(v[sz(i)]);
          else
            return static_cast<S>(static_cast<float>(v[sz(i)]));
        },
        data);
  }
};

template <class T>
std::vector<T> cast_all(const std::vector<double>& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    if constexpr (std::is_floating_point_v<T>)
      out[i] = static_cast<T>(x[i]);
    else
      out[i] = static_cast<T>(static_cast<float>(x[i]));
  }
  return out;
}

Buf make_buf(kvevict_dtype dt, const std::vector<double>& x) {
  Buf b;
  b.dt = dt;
  switch (dt) {
    case KVEVICT_F32:
      b.data = cast_all<float>(x);
      break;
    case KVEVICT_F64:
      b.data = cast_all<double>(x);
      break;
    case KVEVICT_F16:
      b.data = cast_all<Eigen::half>(x);
      break;
    case KVEVICT_BF16:
      b.data = cast_all<Eigen::bfloat16>(x);
      break;
    case KVEVICT_I8:
    case KVEVICT_F8_E4M3:
    case KVEVICT_F8_E5M2:  // quantized caches: tests/c/test_c_api.c and python/tests compare them with float32
      FAIL("make_buf: the codes of a quantized cache are not floating values");
  }
  return b;
}

/// A tensor as the C API takes it: storage plus shape and strides (elements); absent when `buf` is unset.
struct Tensor {
  bool present = false;
  Buf buf;
  int rank = 3;
  std::int64_t shape[3] = {0, 0, 0}, strides[3] = {0, 0, 0};

  kvevict_tensor to_c() const {
    kvevict_tensor t;
    t.data = present ? buf.ptr() : nullptr;
    t.dtype = buf.dt;
    t.rank = rank;
    for (int i = 0; i < 3; ++i) t.shape[i] = shape[i], t.strides[i] = strides[i];
    return t;
  }
};

Tensor tensor(Buf buf, std::initializer_list<std::int64_t> shape, std::initializer_list<std::int64_t> strides) {
  Tensor t;
  t.present = true;
  t.buf = std::move(buf);
  t.rank = static_cast<int>(shape.size());
  std::copy(shape.begin(), shape.end(), t.shape);
  std::copy(strides.begin(), strides.end(), t.strides);
  return t;
}

// ---- random layers ----------------------------------------------------------------------------------------------

/// How keys and values are stored: the library's two layouts, rows padded, or [Hkv, d, L] (the C API copies it).
enum class Layout { heads_major, tokens_major, padded, transposed };
/// How positions are given (dense layers): none, or [Hkv, L] reversed in memory (negative strides: copied).
enum class Positions { none, reversed };

struct Spec {
  std::string label;
  int H = 4, Hkv = 2, L = 48, w = 4, d = 16, D = 16;
  kvevict_dtype kv = KVEVICT_F32, q = KVEVICT_F32, wo = KVEVICT_F32;
  Layout layout = Layout::heads_major;
  bool attention = false;      // window_attention [H, w, L] instead of q_window
  bool wo_transposed = false;  // W_o stored [H d, D] (strides {1, D}): copied
  Positions positions = Positions::none;
  bool ragged = false;  // lengths and (unless ragged_no_positions) positions, from support/ragged_inputs.hpp
  bool ragged_no_positions = false;
  int n_layers = 2;
  kvevict_budget budget{KVEVICT_BUDGET_TOKENS, 16};
  std::vector<std::pair<std::string, std::string>> options;
  bool errors_allowed = false;  // policies may refuse the case (with the C++ API's message, checked)
  std::uint64_t seed = 1;
};

/// One layer as the C API takes it; `layout` says how the reference views the keys and values.
struct Layer {
  int H = 0, Hkv = 0, L = 0, w = 0, d = 0, D = 0;
  Layout layout = Layout::heads_major;
  bool attention = false;
  Tensor keys, values, obs, w_o, scores;  // scores [Hkv, L] in the queries' dtype, heads- or tokens-major
  std::vector<std::int64_t> lengths, positions;
  bool tokens_major_positions = false;
  Positions positions_kind = Positions::none;

  kvevict_layer to_c() const {
    kvevict_layer l = kvevict_layer_init();
    l.keys = keys.to_c();
    l.values = values.to_c();
    (attention ? l.window_attention : l.q_window) = obs.to_c();
    l.w_o = w_o.to_c();
    l.scores = scores.to_c();
    l.lengths = lengths.empty() ? nullptr : lengths.data();
    if (!positions.empty()) {
      if (positions_kind == Positions::reversed) {  // head h's row j at h L + (L - 1 - j)
        l.positions = positions.data() + (L - 1);
        l.positions_strides[0] = L, l.positions_strides[1] = -1;
      } else {
        l.positions = positions.data();
        l.positions_strides[0] = tokens_major_positions ? 1 : L;
        l.positions_strides[1] = tokens_major_positions ? Hkv : 1;
      }
    }
    return l;
  }
};

/// Keys or values [Hkv, L, d] (heads-major doubles) stored in `layout`.
Tensor kv_tensor(const std::vector<double>& x, kvevict_dtype dt, Layout layout, int Hkv, int L, int d) {
  switch (layout) {
    case Layout::heads_major:
      return tensor(make_buf(dt, x), {Hkv, L, d}, {L * d, d, 1});
    case Layout::tokens_major:
      return tensor(make_buf(dt, kvevict_test::to_tokens_major(x, Hkv, L, d)), {Hkv, L, d}, {d, Hkv * d, 1});
    case Layout::padded: {
      const int row = d + 3;
      std::vector<double> p(sz(Hkv) * sz(L) * sz(row), 1.0e4);  // junk the library must not read
      for (int h = 0; h < Hkv; ++h)
        for (int j = 0; j < L; ++j)
          for (int c = 0; c < d; ++c) p[sz((h * L + j) * row + c)] = x[sz((h * L + j) * d + c)];
      return tensor(make_buf(dt, p), {Hkv, L, d}, {L * row, row, 1});
    }
    case Layout::transposed: {
      std::vector<double> t(x.size());
      for (int h = 0; h < Hkv; ++h)
        for (int j = 0; j < L; ++j)
          for (int c = 0; c < d; ++c) t[sz((h * d + c) * L + j)] = x[sz((h * L + j) * d + c)];
      return tensor(make_buf(dt, t), {Hkv, L, d}, {d * L, 1, L});
    }
  }
  return {};
}

/// W_o [D, H d] (row-major doubles), stored as is or transposed.
Tensor wo_tensor(const std::vector<double>& x, kvevict_dtype dt, bool transposed, int D, int Hd) {
  if (!transposed) return tensor(make_buf(dt, x), {D, Hd}, {Hd, 1});
  std::vector<double> t(x.size());
  for (int r = 0; r < D; ++r)
    for (int c = 0; c < Hd; ++c) t[sz(c * D + r)] = x[sz(r * Hd + c)];
  return tensor(make_buf(dt, t), {D, Hd}, {1, D});
}

Layer dense_layer(const Spec& s, Rng& rng) {
  Layer l;
  l.H = s.H, l.Hkv = s.Hkv, l.L = s.L, l.w = s.w, l.d = s.d, l.D = s.D;
  l.layout = s.layout;
  l.attention = s.attention;
  const std::vector<double> q = kvevict_test::normal_vector(sz(s.H * s.w * s.d), rng, 1.5);
  const std::vector<double> k = kvevict_test::normal_vector(sz(s.Hkv * s.L * s.d), rng);
  const std::vector<double> v = kvevict_test::normal_vector(sz(s.Hkv * s.L * s.d), rng);
  const std::vector<double> w_o = kvevict_test::normal_vector(sz(s.D * s.H * s.d), rng, 0.5);
  l.keys = kv_tensor(k, s.kv, s.layout, s.Hkv, s.L, s.d);
  l.values = kv_tensor(v, s.kv, s.layout, s.Hkv, s.L, s.d);
  if (s.attention) {  // the softmax rows of the window, computed by the library in double
    const auto qv = kvevict::HeadsView<const double>::heads_major(q.data(), s.H, s.w, s.d);
    const auto kv = kvevict::kv_heads_major<const double>(k.data(), s.Hkv, s.L, s.d);
    l.obs = tensor(make_buf(s.q, kvevict_test::library_attention<double, double>(qv, kv)), {s.H, s.w, s.L},
                   {s.w * s.L, s.L, 1});
  } else {
    l.obs = tensor(make_buf(s.q, q), {s.H, s.w, s.d}, {s.w * s.d, s.d, 1});
  }
  l.w_o = wo_tensor(w_o, s.wo, s.wo_transposed, s.D, s.H * s.d);
  const std::vector<double> scores = kvevict_test::engine_scores<double>(s.Hkv, s.L);  // [Hkv, L]
  l.scores = s.layout == Layout::tokens_major
                 ? tensor(make_buf(s.q, kvevict_test::to_tokens_major(scores, s.Hkv, s.L, 1)), {s.Hkv, s.L}, {1, s.Hkv})
                 : tensor(make_buf(s.q, scores), {s.Hkv, s.L}, {s.L, 1});
  if (s.positions == Positions::reversed) {
    l.positions_kind = Positions::reversed;
    l.positions.resize(sz(s.Hkv * s.L));
    for (int h = 0; h < s.Hkv; ++h) {
      std::int64_t p = h;
      for (int j = 0; j < s.L; ++j) {
        p += 1 + static_cast<std::int64_t>(rng() % 3);
        l.positions[sz(h * s.L + (s.L - 1 - j))] = p;
      }
    }
  }
  return l;
}

/// A ragged layer (support/ragged_inputs.hpp): heads hold different subsets of T positions, stored with spare rows.
Layer ragged_layer(const Spec& s, Rng& rng) {
  const kvevict_test::Ragged r = kvevict_test::random_ragged(rng, s.H, s.Hkv, s.w, s.d, s.L, 0.6);
  const Index capacity = kvevict_test::longest(r) + 2;
  const bool tokens_major = s.layout == Layout::tokens_major;
  const auto st = kvevict_test::store<double>(r, capacity, tokens_major, 0.5, /*shift=*/3, !s.ragged_no_positions);
  const int cap = static_cast<int>(capacity);
  Layer l;
  l.H = s.H, l.Hkv = s.Hkv, l.L = cap, l.w = s.w, l.d = s.d, l.D = r.D;
  l.layout = s.layout;
  const std::int64_t hs = tokens_major ? s.d : cap * s.d, rs = tokens_major ? s.Hkv * s.d : s.d;
  l.keys = tensor(make_buf(s.kv, st.k), {s.Hkv, cap, s.d}, {hs, rs, 1});
  l.values = tensor(make_buf(s.kv, st.v), {s.Hkv, cap, s.d}, {hs, rs, 1});
  l.obs = tensor(make_buf(s.q, st.q), {s.H, s.w, s.d}, {s.w * s.d, s.d, 1});
  l.w_o = wo_tensor(st.w_o, s.wo, s.wo_transposed, r.D, s.H * s.d);
  l.scores = tensor(
      make_buf(s.q, st.scores), {s.Hkv, cap},
      tokens_major ? std::initializer_list<std::int64_t>{1, s.Hkv} : std::initializer_list<std::int64_t>{cap, 1});
  l.lengths = st.lengths;
  if (!s.ragged_no_positions) {
    l.positions = st.positions;
    l.tokens_major_positions = tokens_major;
  }
  return l;
}

std::vector<Layer> make_layers(const Spec& s) {
  Rng rng(s.seed);
  std::vector<Layer> out;
  for (int i = 0; i < s.n_layers; ++i) out.push_back(s.ragged ? ragged_layer(s, rng) : dense_layer(s, rng));
  return out;
}

// ---- one selection's arrays ---------------------------------------------------------------------------------------

struct Kept {
  std::vector<std::int64_t> indices, offsets, positions, blocks, block_offsets;
  bool operator==(const Kept& o) const {
    return indices == o.indices && offsets == o.offsets && positions == o.positions && blocks == o.blocks &&
           block_offsets == o.block_offsets;
  }
};

struct Outcome {
  bool ok = false;
  std::string error;
  std::vector<Kept> layers;
};

std::string show(const std::vector<std::int64_t>& v) {
  std::ostringstream o;
  for (std::size_t i = 0; i < v.size(); ++i) o << (i ? " " : "") << v[i];
  return o.str();
}

std::string describe(const Outcome& r) {
  if (!r.ok) return "error: " + r.error;
  std::ostringstream o;
  for (std::size_t l = 0; l < r.layers.size(); ++l)
    o << "layer " << l << ": offsets [" << show(r.layers[l].offsets) << "] indices [" << show(r.layers[l].indices)
      << "] positions [" << show(r.layers[l].positions) << "] block_offsets [" << show(r.layers[l].block_offsets)
      << "] blocks [" << show(r.layers[l].blocks) << "]\n";
  return o.str();
}

Kept kept_of(const kvevict::Selection& s) {
  return {s.indices(), s.offsets(), s.positions(), s.blocks(), s.block_offsets()};
}

Kept kept_of(const kvevict_selection* s, std::size_t l) {
  const auto heads = kvevict_selection_heads(s, l), total = kvevict_selection_total(s, l),
             blocks = kvevict_selection_block_count(s, l);
  auto copy = [](const std::int64_t* p, std::int64_t n) { return std::vector<std::int64_t>(p, p + n); };
  return {copy(kvevict_selection_indices(s, l), total), copy(kvevict_selection_offsets(s, l), heads + 1),
          copy(kvevict_selection_positions(s, l), total), copy(kvevict_selection_blocks(s, l), blocks),
          copy(kvevict_selection_block_offsets(s, l), heads + 1)};
}

// ---- the two routes ---------------------------------------------------------------------------------------------

/// A catalogue policy by name, or the composition base + selector.
struct PolicyName {
  std::string name;
  bool composed = false;
  std::string base, selector;
};

std::vector<PolicyName> every_policy() {
  std::vector<PolicyName> out;
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
    out.push_back({std::string(e.name), false, "", ""});
  });
  kvevict::catalogue::for_each(kvevict::catalogue::bases(), [&](const auto& b) {
    kvevict::catalogue::for_each(kvevict::catalogue::selectors(), [&](const auto& s) {
      out.push_back({std::string(b.name) + "+" + std::string(s.name), true, std::string(b.name), std::string(s.name)});
    });
  });
  return out;
}

using Options = std::vector<std::pair<std::string, std::string>>;

/// The knobs and precision the options stand for (written here from kvevict-select's --help, not from its parser).
void apply_options(const Options& options, kvevict::Knobs& k, bool& f64) {
  for (const auto& [raw, v] : options) {
    std::string n = raw;
    for (char& ch : n)
      if (ch == '-') ch = '_';
    const bool on = v == "1" || v == "true";
    if (n == "window")
      k.window = std::stoll(v);
    else if (n == "pool")
      k.pooling = v == "max" ? kvevict::Pooling::max : kvevict::Pooling::avg;
    else if (n == "kernel")
      k.kernel = std::stoll(v);
    else if (n == "alpha")
      k.alpha = std::stod(v);
    else if (n == "adakv_variant")
      k.adakv_variant = v == "original" ? kvevict::HeadAdaptiveAllocation::Variant::original
                                        : kvevict::HeadAdaptiveAllocation::Variant::kvpress;
    else if (n == "sinks")
      k.sinks = std::stoll(v);
    else if (n == "redundancy")
      k.redundancy = std::stod(v);
    else if (n == "precision")
      f64 = v == "f64";
    else if (n == "reference_quirks") {
      if (on) k.reference_quirks = true;
    } else if (n == "share")
      k.share = v == "head"    ? kvevict::Sharing::per_head
                : v == "layer" ? kvevict::Sharing::per_layer
                               : kvevict::Sharing::per_model;
    else if (n == "reduce")
      k.reduce = v == "mean" ? kvevict::Reduce::mean : kvevict::Reduce::max;
    else if (n == "block")
      k.block = std::stoll(v);
    else if (n == "eps")
      k.eps = std::stod(v);
    else if (n == "first_stage_ratio")
      k.first_stage_ratio = std::stod(v);
    else if (n == "value_norm")
      k.value_norm = v == "l2" ? kvevict::ValueNorm::l2 : kvevict::ValueNorm::l1;
    else if (n == "mass_threshold")
      k.mass_threshold = std::stod(v);
    else if (n == "no_floor") {
      if (on) k.floor = false;
    } else if (n == "no_value_term") {
      if (on) k.value_term = false;
    } else
      FAIL("the test does not know option " << raw);
  }
}

kvevict::Budget budget_of(const kvevict_budget& b) {
  switch (b.kind) {
    case KVEVICT_BUDGET_TOKENS:
      return kvevict::Budget::tokens(static_cast<std::int64_t>(b.value));
    case KVEVICT_BUDGET_KEEP_RATIO:
      return kvevict::Budget::keep_ratio(b.value);
    case KVEVICT_BUDGET_COMPRESSION_RATIO:
      return kvevict::Budget::compression_ratio(b.value);
  }
  return kvevict::Budget::tokens(1);
}

/// What the reference reads of a layer, in KV (cache) and S (queries, attention, W_o).
template <class KV, class S>
struct Hold {
  std::vector<KV> k, v;            // the transposed layout, copied heads-major
  std::vector<KV> k_wide, v_wide;  // a half cache widened to KV (float), in its own layout
  std::vector<S> obs, w_o, scores;
  std::vector<std::int64_t> positions;
  kvevict::LayerInputs<KV, S, S> in;
};

/// The cache as KV storage; a cache held in another dtype (f16, bf16 as float) is widened into `wide` first.
template <class KV>
kvevict::KVView<const KV> view_kv(const Layer& l, const Tensor& t, std::vector<KV>& copy, std::vector<KV>& wide) {
  const KV* p = nullptr;
  if (std::holds_alternative<std::vector<KV>>(t.buf.data)) {
    p = t.buf.typed<KV>();
  } else {
    wide.resize(t.buf.size());
    for (std::size_t i = 0; i < wide.size(); ++i) wide[i] = t.buf.at<KV>(static_cast<std::int64_t>(i));
    p = wide.data();
  }
  switch (l.layout) {
    case Layout::heads_major:
      return kvevict::kv_heads_major<const KV>(p, l.Hkv, l.L, l.d);
    case Layout::tokens_major:
      return kvevict::kv_tokens_major<const KV>(p, l.L, l.Hkv, l.d);
    case Layout::padded:
      return kvevict::KVView<const KV>(p, l.Hkv, l.L, l.d, t.strides[0], t.strides[1]);
    case Layout::transposed:
      break;
  }
  copy.resize(sz(l.Hkv * l.L * l.d));
  for (int h = 0; h < l.Hkv; ++h)
    for (int j = 0; j < l.L; ++j)
      for (int c = 0; c < l.d; ++c) copy[sz((h * l.L + j) * l.d + c)] = p[(h * l.d + c) * l.L + j];
  return kvevict::kv_heads_major<const KV>(copy.data(), l.Hkv, l.L, l.d);
}

template <class KV, class S>
void hold(const Layer& l, bool reads_observation, bool reads_values, Hold<KV, S>& h) {
  h.in.keys = view_kv<KV>(l, l.keys, h.k, h.k_wide);
  h.in.values = view_kv<KV>(l, l.values, h.v, h.v_wide);
  if (reads_observation) {
    const int cols = l.attention ? l.L : l.d;
    h.obs.resize(sz(l.H * l.w * cols));
    for (std::size_t i = 0; i < h.obs.size(); ++i) h.obs[i] = l.obs.buf.at<S>(static_cast<std::int64_t>(i));
    (l.attention ? h.in.attention : h.in.queries) =
        kvevict::HeadsView<const S>::heads_major(h.obs.data(), l.H, l.w, cols);
  }
  if (reads_values) {
    const int Hd = l.H * l.d;
    h.w_o.resize(sz(l.D * Hd));
    for (int r = 0; r < l.D; ++r)
      for (int c = 0; c < Hd; ++c) h.w_o[sz(r * Hd + c)] = l.w_o.buf.at<S>(r * l.w_o.strides[0] + c * l.w_o.strides[1]);
    h.in.w_o = kvevict::output_projection<const S>(h.w_o.data(), l.D, l.H, l.d);
  }
  h.scores.resize(sz(l.Hkv * l.L));  // as the C API reads them: [Hkv, L] in S
  for (int a = 0; a < l.Hkv; ++a)
    for (int j = 0; j < l.L; ++j)
      h.scores[sz(a * l.L + j)] = l.scores.buf.at<S>(a * l.scores.strides[0] + j * l.scores.strides[1]);
  h.in.scores = kvevict::HeadsView<const S>::heads_major(h.scores.data(), l.Hkv, l.L, 1);
  h.in.lengths = l.lengths.empty() ? nullptr : l.lengths.data();
  if (!l.positions.empty()) {
    if (l.positions_kind == Positions::reversed) {
      h.positions.resize(l.positions.size());
      for (int a = 0; a < l.Hkv; ++a)
        for (int j = 0; j < l.L; ++j) h.positions[sz(a * l.L + j)] = l.positions[sz(a * l.L + (l.L - 1 - j))];
      h.in.positions = kvevict::positions_heads_major(h.positions.data(), l.Hkv, l.L);
    } else {
      h.in.positions = l.tokens_major_positions ? kvevict::positions_tokens_major(l.positions.data(), l.L, l.Hkv)
                                                : kvevict::positions_heads_major(l.positions.data(), l.Hkv, l.L);
    }
  }
}

template <class KV, class S>
Outcome reference_typed(const PolicyName& p, const kvevict::Knobs& knobs, const std::vector<Layer>& layers,
                        const kvevict_budget& budget) {
  Outcome out;
  auto run = [&](const auto& entry) {
    try {
      using P = typename std::decay_t<decltype(entry)>::policy_type;
      kvevict::Knobs k = knobs;  // no window option: the data's, for a policy that reads the observation
      if (!k.window && P::reads_observation()) k.window = layers[0].w;
      const auto policy = entry.make(k);
      std::vector<Hold<KV, S>> holds(layers.size());
      std::vector<kvevict::LayerInputs<KV, S, S>> inputs;
      for (std::size_t i = 0; i < layers.size(); ++i) {
        hold(layers[i], policy.reads_observation(), policy.reads_values(), holds[i]);
        inputs.push_back(holds[i].in);
      }
      for (const kvevict::Selection& s : kvevict::select_layers<S>(policy, inputs, budget_of(budget)))
        out.layers.push_back(kept_of(s));
      out.ok = true;
    } catch (const kvevict::invalid_argument& e) {
      out.error = e.what();
    }
  };
  const bool found =
      p.composed ? kvevict::catalogue::compose(p.base, p.selector, run) : kvevict::catalogue::visit(p.name, run);
  REQUIRE(found);
  return out;
}

template <class S>
Outcome reference_in(const PolicyName& p, const kvevict::Knobs& knobs, const std::vector<Layer>& layers,
                     const kvevict_budget& budget) {
  switch (layers[0].keys.buf.dt) {
    case KVEVICT_F32:
      return reference_typed<float, S>(p, knobs, layers, budget);
    case KVEVICT_F64:
      return reference_typed<double, S>(p, knobs, layers, budget);
    case KVEVICT_F16:
    case KVEVICT_BF16:  // float storage of the same values: the same selection (tests/test_half_storage.cpp)
      return reference_typed<float, S>(p, knobs, layers, budget);
    case KVEVICT_I8:
    case KVEVICT_F8_E4M3:
    case KVEVICT_F8_E5M2:
      FAIL("reference_in: quantized caches are compared with float32 caches elsewhere (tests/c/test_c_api.c)");
  }
  return {};
}

/// The C++ API's selections; without a window option, the window of the data (as the C API sets it) for a policy
/// that reads the observation, the preset's for one that does not (key-only: the C API does not read it either).
Outcome reference(const PolicyName& p, const Options& options, const std::vector<Layer>& layers,
                  const kvevict_budget& budget) {
  kvevict::Knobs knobs;
  bool f64 = false;
  apply_options(options, knobs, f64);
  return f64 ? reference_in<double>(p, knobs, layers, budget) : reference_in<float>(p, knobs, layers, budget);
}

/// A policy of the C API (the handle owned by the caller); nullptr with `error` set when refused.
kvevict_policy* c_policy(const PolicyName& p, const Options& options, std::string& error) {
  Options all = options;
  if (p.composed) all.insert(all.begin(), {{"base", p.base}, {"selector", p.selector}});
  std::vector<const char*> names, values;
  for (const auto& [n, v] : all) names.push_back(n.c_str()), values.push_back(v.c_str());
  kvevict_policy* policy = nullptr;
  if (kvevict_policy_create(p.composed ? nullptr : p.name.c_str(), names.data(), values.data(), all.size(), &policy) !=
      KVEVICT_OK) {
    error = kvevict_last_error();
    return nullptr;
  }
  return policy;
}

Outcome c_select(const kvevict_policy* policy, const std::vector<Layer>& layers, const kvevict_budget& budget) {
  Outcome out;
  std::vector<kvevict_layer> c_layers;
  for (const Layer& l : layers) c_layers.push_back(l.to_c());
  kvevict_selection* sel = nullptr;
  const kvevict_status st = kvevict_select_layers(policy, budget, c_layers.data(), c_layers.size(), &sel);
  if (st != KVEVICT_OK) {
    out.error = kvevict_last_error();
    if (st != KVEVICT_INVALID_ARGUMENT) out.error = "status " + std::to_string(static_cast<int>(st)) + ": " + out.error;
    return out;
  }
  out.ok = true;
  for (std::size_t l = 0; l < kvevict_selection_layers(sel); ++l) out.layers.push_back(kept_of(sel, l));
  kvevict_selection_free(sel);
  return out;
}

/// The options policy p runs with on the spec's layers: a key-only selector composed with a base, and the
/// engine-score policies, read no q_window, so their window is not taken from it and the default (32) is too long for
/// these layers: the data's window unless one is given; TOVA's default sharing (one set per layer) refuses
/// reference_quirks: per head.
Options options_for(const PolicyName& p, const Spec& s) {
  Options o = s.options;
  const auto given = [&](const char* name) {
    return std::any_of(o.begin(), o.end(), [&](const auto& kv) { return kv.first == name; });
  };
  const bool engine_scores = p.selector == "engine" || p.name == "engine-scores" || p.name == "layer-engine-scores";
  if (((p.composed && (p.selector == "knorm" || p.selector == "keydiff")) || engine_scores) && !given("window"))
    o.emplace_back("window", std::to_string(s.w));
  if (p.name == "tova" && given("reference_quirks") && !given("share")) o.emplace_back("share", "head");
  return o;
}

/// Every policy (named and composed) on the spec's layers: the C API's outcome is the C++ API's. Returns the
/// number of policies that selected.
int check_layers(const Spec& s) {
  const std::vector<Layer> layers = make_layers(s);
  int selected = 0;
  for (const PolicyName& p : every_policy()) {
    INFO("case: " << s.label << " (seed " << s.seed << "), policy " << p.name);
    const Options options = options_for(p, s);
    std::string error;
    kvevict_policy* policy = c_policy(p, options, error);
    Outcome c;
    bool needs_queries = false;
    if (policy) {
      CHECK(std::string(kvevict_policy_get_name(policy)) == p.name);
      needs_queries = (kvevict_policy_reads(policy) & KVEVICT_READS_QUERIES) != 0;
      c = c_select(policy, layers, s.budget);
      kvevict_policy_free(policy);
    } else {
      c.error = error;
    }
    const Outcome want = reference(p, options, layers, s.budget);
    INFO("C API: " << describe(c));
    INFO("C++ API: " << describe(want));
    CHECK(c.ok == want.ok);
    if (c.ok && want.ok) {
      CHECK(c.layers.size() == sz(s.n_layers));
      CHECK(c.layers == want.layers);
      ++selected;
    } else if (!c.ok && !want.ok) {
      CHECK(c.error == want.error);
    }
    // TOVA shares one set per layer by default, which heads at their own positions refuse, and Expected Attention
    // needs q_window, not attention rows (the same refusals in both APIs, checked above); every other policy must
    // select.
    const bool own_positions = s.ragged || s.positions != Positions::none;
    if (s.attention && needs_queries)
      CHECK_FALSE(c.ok);
    else if (!s.errors_allowed && !(p.name == "tova" && own_positions))
      CHECK(c.ok);
  }
  return selected;
}

/// check_layers on three seeds.
int check_spec(const Spec& s) {
  int selected = 0;
  for (std::uint64_t rep = 0; rep < 3; ++rep) {
    Spec t = s;
    t.seed = s.seed + 1000 * rep;
    selected += check_layers(t);
  }
  return selected;
}

Spec spec(std::string label, std::uint64_t seed) {
  Spec s;
  s.label = std::move(label);
  s.seed = seed;
  return s;
}

}  // namespace

// ---- dense layers -----------------------------------------------------------------------------------------------

TEST_CASE("matches: the catalogue names are the C++ catalogue's", "[c_api]") {
  std::vector<std::string> want;
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) { want.emplace_back(e.name); });
  std::vector<std::string> got;
  for (std::size_t i = 0; i < kvevict_policy_count(); ++i) got.emplace_back(kvevict_policy_name(i));
  CHECK(got == want);
  CHECK(kvevict_policy_name(want.size()) == nullptr);
  for (const PolicyName& p : every_policy()) {
    INFO(p.name);
    std::string error;
    kvevict_policy* policy = c_policy(p, {}, error);
    REQUIRE(policy != nullptr);
    bool observation = false, values = false, queries = false, scores = false;
    auto reads = [&](const auto& entry) {
      const auto made = entry.make();
      observation = made.reads_observation();
      values = made.reads_values();
      queries = made.reads_queries();
      scores = made.reads_scores();
    };
    REQUIRE((p.composed ? kvevict::catalogue::compose(p.base, p.selector, reads)
                        : kvevict::catalogue::visit(p.name, reads)));
    CHECK(kvevict_policy_reads(policy) ==
          ((observation ? KVEVICT_READS_OBSERVATION : 0) | (values ? KVEVICT_READS_VALUES : 0) |
           (queries ? KVEVICT_READS_QUERIES : 0) | (scores ? KVEVICT_READS_SCORES : 0)));
    kvevict_policy_free(policy);
  }
}

TEST_CASE("matches: dense layers, GQA groups 1 2 and 4, every cache dtype", "[c_api]") {
  {
    Spec s = spec("G=2, f32, heads-major, tokens", 11);
    CHECK(check_spec(s) > 0);
  }
  {
    Spec s = spec("G=1, f64 cache and queries, keep ratio", 12);
    s.H = 2, s.Hkv = 2, s.L = 40, s.d = 8;
    s.kv = s.q = s.wo = KVEVICT_F64;
    s.budget = kvevict_keep_ratio(0.3);
    check_spec(s);
  }
  {
    Spec s = spec("G=4, f16 tokens-major cache, bf16 W_o, compression ratio", 13);
    s.H = 8, s.Hkv = 2, s.L = 56, s.w = 8;
    s.kv = KVEVICT_F16, s.wo = KVEVICT_BF16;
    s.layout = Layout::tokens_major;
    s.budget = kvevict_compression_ratio(0.6);
    check_spec(s);
  }
  {
    Spec s = spec("G=4, bf16 cache, f16 queries, precision f64", 14);
    s.H = 4, s.Hkv = 1, s.L = 40;
    s.kv = KVEVICT_BF16, s.q = KVEVICT_F16;
    s.budget = kvevict_tokens(12);
    s.options = {{"precision", "f64"}};
    check_spec(s);
  }
  {
    Spec s = spec("G=2, f32 cache, f64 queries and W_o, precision f64, one layer", 15);
    s.q = s.wo = KVEVICT_F64;
    s.n_layers = 1;
    s.options = {{"precision", "f64"}};
    check_spec(s);
  }
}

TEST_CASE("matches: window attention rows instead of q_window", "[c_api]") {
  {
    Spec s = spec("attention f32, window given", 21);
    s.attention = true;
    s.options = {{"window", "4"}};
    check_spec(s);
  }
  {
    Spec s = spec("attention f16, f64 cache, precision f64, G=4", 22);
    s.attention = true;
    s.H = 8, s.Hkv = 2, s.w = 6;
    s.kv = KVEVICT_F64, s.q = KVEVICT_F16;
    s.options = {{"precision", "f64"}};
    s.budget = kvevict_keep_ratio(0.4);
    check_spec(s);
  }
}

TEST_CASE("matches: layouts the library views and layouts the C API copies", "[c_api]") {
  {
    Spec s = spec("padded rows, W_o transposed", 31);
    s.layout = Layout::padded;
    s.wo_transposed = true;
    check_spec(s);
  }
  {
    Spec s = spec("keys and values [Hkv, d, L], f16", 32);
    s.layout = Layout::transposed;
    s.kv = KVEVICT_F16;
    check_spec(s);
  }
  {
    Spec s = spec("positions at negative strides", 33);
    s.positions = Positions::reversed;
    check_spec(s);
  }
}

// ---- ragged layers ----------------------------------------------------------------------------------------------

TEST_CASE("matches: ragged layers with lengths and positions", "[c_api]") {
  {
    Spec s = spec("ragged heads-major f32", 41);
    s.ragged = true;
    s.L = 64;  // positions in the layer
    s.budget = kvevict_keep_ratio(0.5);
    check_spec(s);
  }
  {
    Spec s = spec("ragged tokens-major f16, W_o transposed", 42);
    s.ragged = true;
    s.L = 64;
    s.layout = Layout::tokens_major;
    s.kv = KVEVICT_F16;
    s.wo_transposed = true;
    s.budget = kvevict_keep_ratio(0.5);
    check_spec(s);
  }
  {
    Spec s = spec("ragged bf16, lengths without positions, G=2 Hkv=4", 43);
    s.ragged = true;
    s.ragged_no_positions = true;
    s.H = 8, s.Hkv = 4, s.L = 56;
    s.kv = KVEVICT_BF16;
    s.budget = kvevict_tokens(14);
    check_spec(s);
  }
}

// ---- options ----------------------------------------------------------------------------------------------------

TEST_CASE("matches: the options", "[c_api]") {
  {
    Spec s = spec("share=layer reduce=mean", 51);
    s.options = {{"share", "layer"}, {"reduce", "mean"}};
    check_spec(s);
  }
  {
    Spec s = spec("share=model", 52);
    s.options = {{"share", "model"}};
    check_spec(s);
  }
  {
    Spec s = spec("block=4", 53);
    s.options = {{"block", "4"}};
    check_spec(s);
  }
  {
    Spec s = spec("block=4, ragged", 54);
    s.ragged = true;
    s.L = 64;
    s.budget = kvevict_tokens(20);
    s.options = {{"block", "4"}};
    check_spec(s);
  }
  {
    Spec s = spec("block=4 share=layer reduce=max, G=4 f16 tokens-major", 59);
    s.H = 8, s.kv = KVEVICT_F16, s.layout = Layout::tokens_major;
    s.options = {{"block", "4"}, {"share", "layer"}, {"reduce", "max"}};
    check_spec(s);
  }
  {
    Spec s = spec("share=layer over a ragged layer: every policy refuses it alike", 60);
    s.ragged = true;
    s.L = 64;
    s.budget = kvevict_keep_ratio(0.5);
    s.options = {{"share", "layer"}};
    s.errors_allowed = true;
    CHECK(check_spec(s) == 0);
  }
  {
    Spec s = spec("pool=max kernel=3 alpha=0.1 adakv-variant=original sinks=2", 55);
    s.options = {{"pool", "max"}, {"kernel", "3"}, {"alpha", "0.1"}, {"adakv-variant", "original"}, {"sinks", "2"}};
    check_spec(s);
  }
  {
    Spec s = spec("value_norm=l2 eps first_stage_ratio mass_threshold no_floor", 56);
    s.options = {{"value_norm", "l2"},
                 {"eps", "1e-3"},
                 {"first-stage-ratio", "0.3"},
                 {"mass_threshold", "0.8"},
                 {"no_floor", "true"}};
    check_spec(s);
  }
  {
    Spec s = spec("no_value_term (with the L2 norm it would read)", 62);
    s.options = {{"no-value-term", "1"}, {"value_norm", "l2"}};
    check_spec(s);
  }
  {
    Spec s = spec("reference_quirks with a compression ratio", 57);
    s.options = {{"reference_quirks", "1"}};
    s.budget = kvevict_compression_ratio(0.5);
    check_spec(s);
  }
  {
    Spec s = spec("block=8 over a budget of 6: every policy refuses it alike", 58);
    s.options = {{"block", "8"}};
    s.budget = kvevict_tokens(6);
    s.errors_allowed = true;
    CHECK(check_spec(s) == 0);
  }
}

// ---- threads ----------------------------------------------------------------------------------------------------

TEST_CASE("matches: one policy handle from 4 threads at once gives the same selections", "[c_api][threads]") {
  Spec s = spec("threads: G=2 f16 tokens-major", 61);
  s.kv = KVEVICT_F16;
  s.layout = Layout::tokens_major;
  const std::vector<Layer> layers = make_layers(s);
  for (const char* name : {"criticalkv", "layer-defensivekv"}) {
    INFO(name);
    std::string error;
    kvevict_policy* policy = c_policy({name, false, "", ""}, {{"value_norm", "l2"}}, error);
    REQUIRE(policy != nullptr);
    const Outcome want = c_select(policy, layers, s.budget);
    REQUIRE(want.ok);
    std::atomic<int> ready{0}, mismatches{0}, runs{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&] {
        ++ready;
        while (ready.load() < 4) std::this_thread::yield();  // start together
        for (int i = 0; i < 6; ++i) {
          const Outcome got = c_select(policy, layers, s.budget);
          if (!got.ok || !(got.layers == want.layers)) ++mismatches;
          ++runs;
        }
      });
    for (std::thread& t : threads) t.join();
    kvevict_policy_free(policy);
    CHECK(runs.load() == 24);
    CHECK(mismatches.load() == 0);
  }
}

TEST_CASE("matches: kvevict_last_error is the calling thread's", "[c_api][threads]") {
  kvevict_policy* p = nullptr;
  REQUIRE(kvevict_policy_create("main-thread-policy", nullptr, nullptr, 0, &p) == KVEVICT_INVALID_ARGUMENT);
  std::atomic<int> failed{0};
  std::vector<std::string> fresh(4), own(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      fresh[sz(t)] = kvevict_last_error();  // nothing failed in this thread yet
      const std::string name = "thread-" + std::to_string(t) + "-policy";
      kvevict_policy* q = nullptr;
      (void)kvevict_policy_create(name.c_str(), nullptr, nullptr, 0, &q);
      ++failed;
      while (failed.load() < 4) std::this_thread::yield();  // every thread has failed before any reads
      own[sz(t)] = kvevict_last_error();
    });
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < 4; ++t) {
    INFO("thread " << t << ": " << own[sz(t)]);
    CHECK(fresh[sz(t)].empty());
    CHECK(own[sz(t)].find("'thread-" + std::to_string(t) + "-policy'") != std::string::npos);
    for (int u = 0; u < 4; ++u)
      if (u != t) CHECK(own[sz(t)].find("thread-" + std::to_string(u) + "-") == std::string::npos);
  }
  CHECK(std::string(kvevict_last_error()).find("'main-thread-policy'") != std::string::npos);
}
