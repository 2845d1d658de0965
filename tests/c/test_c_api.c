/* The C API (include/kvevict/c/kvevict.h) from C99: every catalogue policy on small random layers in every cache
 * dtype, layer-global and composed policies, token-major caches, ragged layers, the options, and every error path
 * (status, *out reset to NULL, and the message of kvevict_last_error()). No framework: CHECK counts and prints
 * failures; the last line is "N passed, M failed". The C++ side (tests/c/test_c_api_matches.cpp) checks that the
 * selections are those of the C++ API. */
#include <kvevict/c/kvevict.h>
#include <kvevict/version.hpp> /* only #defines: C-compatible */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int n_passed = 0, n_failed = 0;
static char context[256] = ""; /* what is being tested, printed with each failure */

static void check(int ok, const char* file, int line, const char* what) {
  if (ok) {
    ++n_passed;
  } else {
    ++n_failed;
    printf("%s:%d: %s%s%s\n", file, line, what, context[0] ? "  [" : "", context[0] ? context : "");
    if (context[0]) printf("  ]\n");
  }
}
#define CHECK(cond) check((cond) ? 1 : 0, __FILE__, __LINE__, "CHECK(" #cond ") failed")
#define CHECK_AT(cond, line) check((cond) ? 1 : 0, __FILE__, line, "CHECK(" #cond ") failed")

/* ---- data ---------------------------------------------------------------------------------------------------- */

#define HKV 2
#define H 4
#define L 40
#define D_HEAD 8
#define W 4
#define D_MODEL 16
#define N_KV (HKV * L * D_HEAD)
#define N_Q (H * W * D_HEAD)
#define N_WO (D_MODEL * H * D_HEAD)
#define BUDGET 12

/* A deterministic LCG (Knuth's MMIX constants); uniform in [0, 1) from the top 53 bits. */
static uint64_t lcg_state = 1;
static void lcg_seed(uint64_t seed) { lcg_state = seed * 2862933555777941757ULL + 3037000493ULL; }
static double lcg_uniform(void) {
  lcg_state = lcg_state * 6364136223846793005ULL + 1442695040888963407ULL;
  return (double)(lcg_state >> 11) * (1.0 / 9007199254740992.0);
}
/* Roughly standard normal (Irwin-Hall, 12 uniforms). */
static float lcg_normal(double scale) {
  double s = 0.0;
  int i;
  for (i = 0; i < 12; ++i) s += lcg_uniform();
  return (float)((s - 6.0) * scale);
}

typedef struct {
  float q[N_Q];
  float k[N_KV], v[N_KV];
  float w_o[N_WO];
  float scores[HKV * L]; /* the engine's score of each entry, [HKV, L] */
} Data;

static void make_data(Data* x, uint64_t seed) {
  int i;
  lcg_seed(seed);
  for (i = 0; i < N_Q; ++i) x->q[i] = lcg_normal(1.5);
  for (i = 0; i < N_KV; ++i) x->k[i] = lcg_normal(1.0);
  for (i = 0; i < N_KV; ++i) x->v[i] = lcg_normal(1.0);
  for (i = 0; i < N_WO; ++i) x->w_o[i] = lcg_normal(0.5);
  for (i = 0; i < HKV * L; ++i) x->scores[i] = (float)lcg_uniform();
}

/* IEEE half from float, round to nearest even (normal, subnormal, overflow to infinity). */
static uint16_t f32_to_f16(float f) {
  uint32_t x, sign, mant, h, rem;
  int32_t e;
  memcpy(&x, &f, sizeof x);
  sign = (x >> 16) & 0x8000u;
  e = (int32_t)((x >> 23) & 0xffu) - 127 + 15;
  mant = x & 0x7fffffu;
  if (((x >> 23) & 0xffu) == 0xffu) return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0u));
  if (e >= 31) return (uint16_t)(sign | 0x7c00u);
  if (e <= 0) {
    uint32_t shift, halfway;
    if (e < -10) return (uint16_t)sign;
    mant |= 0x800000u;
    shift = (uint32_t)(14 - e);
    h = mant >> shift;
    rem = mant & ((1u << shift) - 1u);
    halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return (uint16_t)(sign | h);
  }
  h = sign | ((uint32_t)e << 10) | (mant >> 13);
  rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h; /* a carry into the exponent is right */
  return (uint16_t)h;
}
static float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu, x;
  float f;
  if (e == 0) {
    f = (float)ldexp((double)mant, -24);
    return sign ? -f : f;
  }
  x = sign | ((e == 31 ? 255u : e - 15u + 127u) << 23) | (mant << 13);
  memcpy(&f, &x, sizeof f);
  return f;
}
/* bfloat16 from float, round to nearest even (finite inputs). */
static uint16_t f32_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}
static float bf16_to_f32(uint16_t b) {
  uint32_t x = (uint32_t)b << 16;
  float f;
  memcpy(&f, &x, sizeof f);
  return f;
}

static const int64_t KV_SHAPE[3] = {HKV, L, D_HEAD};
static const int64_t Q_SHAPE[3] = {H, W, D_HEAD};
static const int64_t WO_SHAPE[2] = {D_MODEL, N_WO / D_MODEL};

/* Keys, values, q_window, w_o and the engine's scores of `x`, all f32 and contiguous. */
static kvevict_layer layer_of(const Data* x) {
  static const int64_t scores_shape[2] = {HKV, L};
  kvevict_layer layer = kvevict_layer_init();
  layer.scores = kvevict_tensor_contiguous(x->scores, KVEVICT_F32, 2, scores_shape);
  layer.keys = kvevict_tensor_contiguous(x->k, KVEVICT_F32, 3, KV_SHAPE);
  layer.values = kvevict_tensor_contiguous(x->v, KVEVICT_F32, 3, KV_SHAPE);
  layer.q_window = kvevict_tensor_contiguous(x->q, KVEVICT_F32, 3, Q_SHAPE);
  layer.w_o = kvevict_tensor_contiguous(x->w_o, KVEVICT_F32, 2, WO_SHAPE);
  return layer;
}

/* ---- checks of a selection ------------------------------------------------------------------------------------ */

/* Structure of layer `l` of `sel` over a layer of L rows (lengths[h] rows for head h when lengths is non-NULL):
 * Hkv heads, offsets from 0 to total and non-decreasing, each head's rows strictly ascending within [0, L_h),
 * positions == indices (dense: positions NULL) or positions[h][row], blocks == indices without block mode. Returns
 * the layer's total. */
static int64_t check_structure(const kvevict_selection* sel, size_t l, const int64_t* lengths, const int64_t* positions,
                               int line) {
  const int64_t heads = kvevict_selection_heads(sel, l), total = kvevict_selection_total(sel, l);
  const int64_t *idx = kvevict_selection_indices(sel, l), *off = kvevict_selection_offsets(sel, l),
                *pos = kvevict_selection_positions(sel, l);
  int64_t h, i, bad_order = 0, bad_range = 0, bad_pos = 0;
  CHECK_AT(heads == HKV, line);
  CHECK_AT(total >= 1, line);
  CHECK_AT(off != NULL && idx != NULL && pos != NULL, line);
  if (heads != HKV || !off || !idx || !pos) return 0;
  CHECK_AT(off[0] == 0, line);
  CHECK_AT(off[heads] == total, line);
  for (h = 0; h < heads; ++h) {
    const int64_t len = lengths ? lengths[h] : L;
    CHECK_AT(off[h + 1] >= off[h], line);
    for (i = off[h]; i < off[h + 1]; ++i) {
      if (idx[i] < 0 || idx[i] >= len) ++bad_range;
      if (i > off[h] && idx[i] <= idx[i - 1]) ++bad_order;
      if (idx[i] >= 0 && idx[i] < L && pos[i] != (positions ? positions[h * L + idx[i]] : idx[i])) ++bad_pos;
    }
  }
  CHECK_AT(bad_range == 0, line);
  CHECK_AT(bad_order == 0, line);
  CHECK_AT(bad_pos == 0, line);
  return total;
}

/* Whether two layers of selections keep exactly the same rows. */
static int same_layer(const kvevict_selection* a, size_t la, const kvevict_selection* b, size_t lb) {
  const int64_t n = kvevict_selection_total(a, la), heads = kvevict_selection_heads(a, la);
  if (n != kvevict_selection_total(b, lb) || heads != kvevict_selection_heads(b, lb)) return 0;
  if (!kvevict_selection_indices(a, la) || !kvevict_selection_indices(b, lb)) return 0;
  return memcmp(kvevict_selection_indices(a, la), kvevict_selection_indices(b, lb), (size_t)n * sizeof(int64_t)) == 0 &&
         memcmp(kvevict_selection_offsets(a, la), kvevict_selection_offsets(b, lb),
                (size_t)(heads + 1) * sizeof(int64_t)) == 0;
}

/* Whether every head of layer l keeps the same rows as head 0. */
static int heads_agree(const kvevict_selection* sel, size_t l) {
  const int64_t heads = kvevict_selection_heads(sel, l);
  const int64_t *idx = kvevict_selection_indices(sel, l), *off = kvevict_selection_offsets(sel, l);
  int64_t h;
  for (h = 1; h < heads; ++h) {
    if (off[h + 1] - off[h] != off[1] - off[0]) return 0;
    if (memcmp(idx + off[h], idx, (size_t)(off[1] - off[0]) * sizeof(int64_t)) != 0) return 0;
  }
  return 1;
}

static kvevict_policy* create(const char* name, const char* const* keys, const char* const* values, size_t n,
                              int line) {
  kvevict_policy* p = NULL;
  const kvevict_status st = kvevict_policy_create(name, keys, values, n, &p);
  CHECK_AT(st == KVEVICT_OK, line);
  CHECK_AT(p != NULL, line);
  if (st != KVEVICT_OK) printf("  kvevict_policy_create: %s\n", kvevict_last_error());
  return p;
}

static kvevict_selection* select_ok(const kvevict_policy* p, kvevict_budget b, const kvevict_layer* layers, size_t n,
                                    int line) {
  kvevict_selection* s = NULL;
  const kvevict_status st = kvevict_select_layers(p, b, layers, n, &s);
  CHECK_AT(st == KVEVICT_OK, line);
  CHECK_AT(s != NULL, line);
  if (st != KVEVICT_OK) printf("  kvevict_select_layers: %s\n", kvevict_last_error());
  if (s) CHECK_AT(kvevict_selection_layers(s) == n, line);
  return s;
}

/* ---- the catalogue on every dtype --------------------------------------------------------------------------- */

/* policies whose budget is the model's: layer-global ones, and pyramidkv (each layer's share of it) */
static int is_layer_global(const char* name) {
  return strncmp(name, "layer", 5) == 0 || strcmp(name, "pyramidkv") == 0 || strcmp(name, "open-defensivekv") == 0;
}

static void test_every_policy(void) {
  static Data a, b;
  static uint16_t k16[N_KV], v16[N_KV], kb16[N_KV], vb16[N_KV];
  static double k64[N_KV], v64[N_KV];
  static float k16f[N_KV], v16f[N_KV], kbf[N_KV], vbf[N_KV];
  const size_t count = kvevict_policy_count();
  size_t i;
  int j;
  make_data(&a, 1);
  make_data(&b, 2);
  for (j = 0; j < N_KV; ++j) {
    k16[j] = f32_to_f16(a.k[j]), v16[j] = f32_to_f16(a.v[j]);
    kb16[j] = f32_to_bf16(a.k[j]), vb16[j] = f32_to_bf16(a.v[j]);
    k64[j] = a.k[j], v64[j] = a.v[j];
    k16f[j] = f16_to_f32(k16[j]), v16f[j] = f16_to_f32(v16[j]);
    kbf[j] = bf16_to_f32(kb16[j]), vbf[j] = bf16_to_f32(vb16[j]);
  }
  CHECK(count >= 8);
  CHECK(kvevict_policy_name(count) == NULL);
  CHECK(strcmp(kvevict_policy_name(0), "streamingllm") == 0);
  for (i = 0; i < count; ++i) {
    const char* name = kvevict_policy_name(i);
    kvevict_layer layers[2], half_layer, bf_layer, f64_layer, rounded_layer, bf_rounded_layer;
    kvevict_policy* p;
    kvevict_selection *one, *two, *s16, *sbf, *s64, *srounded, *sbf_rounded;
    int reads;
    CHECK(name != NULL);
    if (!name) continue;
    snprintf(context, sizeof context, "policy %s", name);
    p = create(name, NULL, NULL, 0, __LINE__);
    if (!p) continue;
    CHECK(strcmp(kvevict_policy_get_name(p), name) == 0);
    reads = kvevict_policy_reads(p);
    /* positional (streamingllm), key-only (knorm, keydiff) and engine-score policies read no window queries or
     * attention; the engine-score ones read the layers' scores */
    CHECK((reads & KVEVICT_READS_OBSERVATION) == (strcmp(name, "streamingllm") == 0 || strcmp(name, "knorm") == 0 ||
                                                          strcmp(name, "keydiff") == 0 || strstr(name, "engine-scores")
                                                      ? 0
                                                      : KVEVICT_READS_OBSERVATION));
    CHECK(((reads & KVEVICT_READS_SCORES) != 0) == (strstr(name, "engine-scores") != NULL));
    CHECK(((reads & KVEVICT_READS_VALUES) != 0) == (strncmp(name, "critical", 8) == 0 || strstr(name, "defensivekv") ||
                                                    strcmp(name, "expected-attention") == 0));
    /* Expected Attention takes the window queries' statistics: window_attention will not do */
    CHECK(((reads & KVEVICT_READS_QUERIES) != 0) == (strcmp(name, "expected-attention") == 0));
    layers[0] = layer_of(&a);
    layers[1] = layer_of(&b);

    /* f32, one layer */
    one = select_ok(p, kvevict_tokens(BUDGET), layers, 1, __LINE__);
    if (one) CHECK(check_structure(one, 0, NULL, NULL, __LINE__) <= HKV * BUDGET);
    if (one && !is_layer_global(name)) {
      int64_t h;
      /* per-layer policies: each KV head keeps the budget on average; head-scope ones (uniform) exactly */
      if (strcmp(name, "snapkv") == 0 || strcmp(name, "streamingllm") == 0 || strcmp(name, "criticalkv-snapkv") == 0)
        for (h = 0; h < HKV; ++h)
          CHECK(kvevict_selection_offsets(one, 0)[h + 1] - kvevict_selection_offsets(one, 0)[h] == BUDGET);
      else
        CHECK(kvevict_selection_total(one, 0) == HKV * BUDGET);
      CHECK(kvevict_selection_block_count(one, 0) == kvevict_selection_total(one, 0));
      CHECK(kvevict_selection_blocks(one, 0) == kvevict_selection_indices(one, 0));
      CHECK(kvevict_selection_block_offsets(one, 0) == kvevict_selection_offsets(one, 0));
    }

    /* f32, two layers: model-budget policies share one budget across them, the others select each alone */
    two = select_ok(p, kvevict_tokens(BUDGET), layers, 2, __LINE__);
    if (two) {
      const int64_t t0 = check_structure(two, 0, NULL, NULL, __LINE__),
                    t1 = check_structure(two, 1, NULL, NULL, __LINE__);
      CHECK(t0 + t1 <= 2 * HKV * BUDGET);
      if (!is_layer_global(name)) {
        CHECK(t0 <= HKV * BUDGET && t1 <= HKV * BUDGET);
        if (one) CHECK(same_layer(one, 0, two, 0));
      }
    }

    /* f16 and bf16 caches converted by hand, f64 */
    half_layer = bf_layer = f64_layer = rounded_layer = bf_rounded_layer = layers[0];
    half_layer.keys.data = k16, half_layer.values.data = v16;
    half_layer.keys.dtype = half_layer.values.dtype = KVEVICT_F16;
    bf_layer.keys.data = kb16, bf_layer.values.data = vb16;
    bf_layer.keys.dtype = bf_layer.values.dtype = KVEVICT_BF16;
    f64_layer.keys.data = k64, f64_layer.values.data = v64;
    f64_layer.keys.dtype = f64_layer.values.dtype = KVEVICT_F64;
    rounded_layer.keys.data = k16f, rounded_layer.values.data = v16f;
    bf_rounded_layer.keys.data = kbf, bf_rounded_layer.values.data = vbf;
    s16 = select_ok(p, kvevict_tokens(BUDGET), &half_layer, 1, __LINE__);
    sbf = select_ok(p, kvevict_tokens(BUDGET), &bf_layer, 1, __LINE__);
    s64 = select_ok(p, kvevict_tokens(BUDGET), &f64_layer, 1, __LINE__);
    srounded = select_ok(p, kvevict_tokens(BUDGET), &rounded_layer, 1, __LINE__);
    sbf_rounded = select_ok(p, kvevict_tokens(BUDGET), &bf_rounded_layer, 1, __LINE__);
    if (s16) CHECK(check_structure(s16, 0, NULL, NULL, __LINE__) <= HKV * BUDGET);
    if (sbf) CHECK(check_structure(sbf, 0, NULL, NULL, __LINE__) <= HKV * BUDGET);
    if (s64) CHECK(check_structure(s64, 0, NULL, NULL, __LINE__) <= HKV * BUDGET);
    /* the f16 and bf16 caches are read as the floats they hold: the same selection as those floats stored as f32;
     * likewise the f64 cache that holds the f32 one's values (the arithmetic is f32) */
    if (s16 && srounded) CHECK(same_layer(s16, 0, srounded, 0));
    if (sbf && sbf_rounded) CHECK(same_layer(sbf, 0, sbf_rounded, 0));
    if (s64 && one) CHECK(same_layer(s64, 0, one, 0));

    kvevict_selection_free(one);
    kvevict_selection_free(two);
    kvevict_selection_free(s16);
    kvevict_selection_free(sbf);
    kvevict_selection_free(s64);
    kvevict_selection_free(srounded);
    kvevict_selection_free(sbf_rounded);
    kvevict_policy_free(p);
  }
  context[0] = '\0';
}

/* ---- quantized caches ------------------------------------------------------------------------------------------ */

/* The value of fp8 code b: E4M3 (exponent_bits 4: no infinities, S.1111.111 NaN) or E5M2 (IEEE-like), OCP. */
static float fp8_value(uint8_t b, int exponent_bits) {
  const int mantissa_bits = 7 - exponent_bits, bias = (1 << (exponent_bits - 1)) - 1;
  const int e = (b >> mantissa_bits) & ((1 << exponent_bits) - 1), m = b & ((1 << mantissa_bits) - 1);
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  if (exponent_bits == 4 && e == 15 && m == 7) return (float)nan("");
  if (exponent_bits == 5 && e == 31) return m == 0 ? (float)(sign * HUGE_VAL) : (float)nan("");
  if (e == 0) return (float)(sign * ldexp((double)m, 1 - bias - mantissa_bits));
  return (float)(sign * ldexp((double)((1 << mantissa_bits) + m), e - bias - mantissa_bits));
}
/* The finite fp8 code nearest x. */
static uint8_t fp8_code(float x, int exponent_bits) {
  int b, best = 0;
  double best_error = HUGE_VAL;
  for (b = 0; b < 256; ++b) {
    const float v = fp8_value((uint8_t)b, exponent_bits);
    if (v == v && fabs((double)v) != HUGE_VAL && fabs((double)v - x) < best_error) best = b, best_error = fabs(v - x);
  }
  return (uint8_t)best;
}

/* int8 (per KV head and token factors), fp8 e4m3 (one factor) and fp8 e5m2 (one factor per token) caches select
 * exactly what f32 caches holding their values (float(code) * factor, one float rounding) select, for every policy;
 * at precision f64 too. */
static void test_quantized(void) {
  static Data a;
  static int8_t k8[N_KV], v8[N_KV];
  static uint8_t k43[N_KV], v43[N_KV], k52[N_KV], v52[N_KV];
  static float k8f[N_KV], v8f[N_KV], k43f[N_KV], v43f[N_KV], k52f[N_KV], v52f[N_KV];
  static float head_token[HKV * L], token[L];
  const float tensor = 0.37f;
  const int64_t head_token_shape[2] = {HKV, L}, token_shape[1] = {L};
  const char* f64k[] = {"precision"};
  const char* f64v[] = {"f64"};
  const size_t count = kvevict_policy_count();
  size_t i;
  int j, f64;
  make_data(&a, 5);
  for (j = 0; j < HKV * L; ++j) head_token[j] = (float)(0.02 + 0.001 * (j % 37));
  for (j = 0; j < L; ++j) token[j] = (float)(0.5 + 0.01 * j);
  for (j = 0; j < N_KV; ++j) {
    const float hk = head_token[j / D_HEAD], tk = token[(j / D_HEAD) % L];
    double c = floor(a.k[j] / hk + 0.5);
    k8[j] = (int8_t)(c > 127 ? 127 : c < -127 ? -127 : c);
    c = floor(a.v[j] / hk + 0.5);
    v8[j] = (int8_t)(c > 127 ? 127 : c < -127 ? -127 : c);
    k8f[j] = (float)k8[j] * hk, v8f[j] = (float)v8[j] * hk;
    k43[j] = fp8_code(a.k[j] / tensor, 4), v43[j] = fp8_code(a.v[j] / tensor, 4);
    k43f[j] = fp8_value(k43[j], 4) * tensor, v43f[j] = fp8_value(v43[j], 4) * tensor;
    k52[j] = fp8_code(a.k[j] / tk, 5), v52[j] = fp8_code(a.v[j] / tk, 5);
    k52f[j] = fp8_value(k52[j], 5) * tk, v52f[j] = fp8_value(v52[j], 5) * tk;
  }
  for (f64 = 0; f64 < 2; ++f64)
    for (i = 0; i < count; ++i) {
      const char* name = kvevict_policy_name(i);
      kvevict_policy* p;
      int q;
      snprintf(context, sizeof context, "quantized, policy %s%s", name, f64 ? ", precision f64" : "");
      p = create(name, f64 ? f64k : NULL, f64 ? f64v : NULL, f64 ? 1 : 0, __LINE__);
      if (!p) continue;
      for (q = 0; q < 3; ++q) {
        kvevict_layer codes = layer_of(&a), floats = layer_of(&a);
        kvevict_selection *got, *want;
        const int32_t dtype = q == 0 ? KVEVICT_I8 : q == 1 ? KVEVICT_F8_E4M3 : KVEVICT_F8_E5M2;
        const void* kc = q == 0 ? (const void*)k8 : q == 1 ? (const void*)k43 : (const void*)k52;
        const void* vc = q == 0 ? (const void*)v8 : q == 1 ? (const void*)v43 : (const void*)v52;
        codes.keys = kvevict_tensor_contiguous(kc, dtype, 3, KV_SHAPE);
        codes.values = kvevict_tensor_contiguous(vc, dtype, 3, KV_SHAPE);
        if (q == 0) {
          codes.keys_scale = codes.values_scale =
              kvevict_tensor_contiguous(head_token, KVEVICT_F32, 2, head_token_shape);
        } else if (q == 1) {
          codes.keys_scale = codes.values_scale = kvevict_tensor_contiguous(&tensor, KVEVICT_F32, 0, NULL);
        } else {
          codes.keys_scale = codes.values_scale = kvevict_tensor_contiguous(token, KVEVICT_F32, 1, token_shape);
        }
        floats.keys.data = q == 0 ? k8f : q == 1 ? k43f : k52f;
        floats.values.data = q == 0 ? v8f : q == 1 ? v43f : v52f;
        got = select_ok(p, kvevict_tokens(BUDGET), &codes, 1, __LINE__);
        want = select_ok(p, kvevict_tokens(BUDGET), &floats, 1, __LINE__);
        if (got) check_structure(got, 0, NULL, NULL, __LINE__);
        if (got && want) CHECK(same_layer(got, 0, want, 0));
        kvevict_selection_free(got);
        kvevict_selection_free(want);
      }
      kvevict_policy_free(p);
    }
  context[0] = '\0';
}

/* ---- composed policies, token-major caches, attention rows, ragged layers --------------------------------------- */

static void test_composed(void) {
  static Data a;
  const char* keys[] = {"base", "selector"};
  const char* values[] = {"adakv", "critical"};
  kvevict_layer layer;
  kvevict_policy *p, *q, *named;
  kvevict_selection *s, *t;
  make_data(&a, 3);
  layer = layer_of(&a);
  snprintf(context, sizeof context, "composed adakv+critical");
  p = create(NULL, keys, values, 2, __LINE__);
  if (!p) return;
  CHECK(strcmp(kvevict_policy_get_name(p), "adakv+critical") == 0);
  CHECK(kvevict_policy_reads(p) == (KVEVICT_READS_OBSERVATION | KVEVICT_READS_VALUES));
  s = select_ok(p, kvevict_keep_ratio(0.25), &layer, 1, __LINE__);
  if (s) CHECK(check_structure(s, 0, NULL, NULL, __LINE__) == HKV * 10); /* floor(40 * 0.25) per head, on average */
  /* CriticalKV's preset is this composition */
  named = create("criticalkv", NULL, NULL, 0, __LINE__);
  t = named ? select_ok(named, kvevict_keep_ratio(0.25), &layer, 1, __LINE__) : NULL;
  if (s && t) CHECK(same_layer(s, 0, t, 0));
  kvevict_selection_free(s);
  kvevict_selection_free(t);
  kvevict_policy_free(named);
  kvevict_policy_free(p);

  /* no name and no options: snapkv + attention */
  snprintf(context, sizeof context, "composed by default");
  {
    const char* k2[] = {"selector"};
    const char* v2[] = {"attention"};
    q = create(NULL, k2, v2, 1, __LINE__);
    if (q) CHECK(strcmp(kvevict_policy_get_name(q), "snapkv+attention") == 0);
    kvevict_policy_free(q);
  }
  /* option "policy" names a catalogue policy like `name` */
  {
    const char* k3[] = {"policy"};
    const char* v3[] = {"adakv"};
    q = create(NULL, k3, v3, 1, __LINE__);
    if (q) CHECK(strcmp(kvevict_policy_get_name(q), "adakv") == 0);
    kvevict_policy_free(q);
  }
  context[0] = '\0';
}

static void test_token_major(void) {
  static Data a;
  static float k_tok[N_KV], v_tok[N_KV];
  const char* names[] = {"snapkv", "adakv", "criticalkv", "defensivekv", "streamingllm"};
  int h, j, c;
  size_t n;
  make_data(&a, 4);
  for (h = 0; h < HKV; ++h)
    for (j = 0; j < L; ++j)
      for (c = 0; c < D_HEAD; ++c) {
        k_tok[(j * HKV + h) * D_HEAD + c] = a.k[(h * L + j) * D_HEAD + c];
        v_tok[(j * HKV + h) * D_HEAD + c] = a.v[(h * L + j) * D_HEAD + c];
      }
  for (n = 0; n < sizeof names / sizeof names[0]; ++n) {
    kvevict_layer heads_major = layer_of(&a), tokens_major = heads_major;
    kvevict_policy* p;
    kvevict_selection *s, *t;
    snprintf(context, sizeof context, "token-major %s", names[n]);
    tokens_major.keys.data = k_tok, tokens_major.values.data = v_tok;
    tokens_major.keys.strides[0] = tokens_major.values.strides[0] = D_HEAD;
    tokens_major.keys.strides[1] = tokens_major.values.strides[1] = HKV * D_HEAD;
    tokens_major.keys.strides[2] = tokens_major.values.strides[2] = 1;
    p = create(names[n], NULL, NULL, 0, __LINE__);
    if (!p) continue;
    s = select_ok(p, kvevict_tokens(BUDGET), &heads_major, 1, __LINE__);
    t = select_ok(p, kvevict_tokens(BUDGET), &tokens_major, 1, __LINE__);
    if (s && t) CHECK(same_layer(s, 0, t, 0));
    kvevict_selection_free(s);
    kvevict_selection_free(t);
    /* a layout the library cannot view (keys [Hkv, d, L] read as [Hkv, L, d]: copied first) */
    {
      static float k_t[N_KV];
      kvevict_layer transposed = heads_major;
      for (h = 0; h < HKV; ++h)
        for (j = 0; j < L; ++j)
          for (c = 0; c < D_HEAD; ++c) k_t[(h * D_HEAD + c) * L + j] = a.k[(h * L + j) * D_HEAD + c];
      transposed.keys.data = k_t;
      transposed.keys.strides[0] = D_HEAD * L, transposed.keys.strides[1] = 1, transposed.keys.strides[2] = L;
      s = select_ok(p, kvevict_tokens(BUDGET), &heads_major, 1, __LINE__);
      t = select_ok(p, kvevict_tokens(BUDGET), &transposed, 1, __LINE__);
      if (s && t) CHECK(same_layer(s, 0, t, 0));
      kvevict_selection_free(s);
      kvevict_selection_free(t);
    }
    kvevict_policy_free(p);
  }
  context[0] = '\0';
}

static void test_window_attention(void) {
  static Data a;
  static float attn[H * W * L];
  const int64_t shape[3] = {H, W, L};
  kvevict_layer layer;
  kvevict_policy* p;
  kvevict_selection* s;
  int q, i, j, group = H / HKV, c;
  make_data(&a, 5);
  /* softmax(q k^T / sqrt(d)) over every key (a causal window: row i of the window sees keys [0, L - W + i]) */
  for (q = 0; q < H; ++q)
    for (i = 0; i < W; ++i) {
      double mx = -1e300, sum = 0.0, z[L];
      for (j = 0; j < L; ++j) {
        double dot = 0.0;
        for (c = 0; c < D_HEAD; ++c)
          dot += (double)a.q[(q * W + i) * D_HEAD + c] * a.k[((q / group) * L + j) * D_HEAD + c];
        z[j] = j <= L - W + i ? dot / sqrt((double)D_HEAD) : -1e300;
        if (z[j] > mx) mx = z[j];
      }
      for (j = 0; j < L; ++j) sum += z[j] > -1e299 ? exp(z[j] - mx) : 0.0;
      for (j = 0; j < L; ++j) attn[(q * W + i) * L + j] = (float)(z[j] > -1e299 ? exp(z[j] - mx) / sum : 0.0);
    }
  snprintf(context, sizeof context, "window_attention");
  layer = layer_of(&a);
  layer.q_window = kvevict_tensor_contiguous(NULL, KVEVICT_F32, 3, Q_SHAPE);
  layer.window_attention = kvevict_tensor_contiguous(attn, KVEVICT_F32, 3, shape);
  p = create("snapkv", NULL, NULL, 0, __LINE__);
  if (!p) return;
  s = select_ok(p, kvevict_tokens(BUDGET), &layer, 1, __LINE__);
  if (s) {
    int64_t h;
    CHECK(check_structure(s, 0, NULL, NULL, __LINE__) == HKV * BUDGET);
    for (h = 0; h < HKV; ++h) /* the window is always kept */
      CHECK(kvevict_selection_indices(s, 0)[kvevict_selection_offsets(s, 0)[h + 1] - 1] == L - 1);
  }
  kvevict_selection_free(s);
  kvevict_policy_free(p);
  context[0] = '\0';
}

static void test_ragged(void) {
  static Data a;
  static int64_t positions[HKV * L];
  const int64_t lengths[HKV] = {L, 27};
  const char* names[] = {"snapkv", "adakv", "criticalkv", "defensivekv", "streamingllm"};
  size_t n;
  int h, j;
  make_data(&a, 6);
  for (h = 0; h < HKV; ++h) {
    int64_t p = 3 * h;
    for (j = 0; j < L; ++j) {
      p += 1 + (int64_t)(lcg_uniform() * 3.0);
      positions[h * L + j] = p;
    }
  }
  for (n = 0; n < sizeof names / sizeof names[0]; ++n) {
    kvevict_layer layer = layer_of(&a);
    kvevict_policy* p;
    kvevict_selection* s;
    snprintf(context, sizeof context, "ragged %s", names[n]);
    layer.lengths = lengths;
    layer.positions = positions;
    layer.positions_strides[0] = L, layer.positions_strides[1] = 1;
    p = create(names[n], NULL, NULL, 0, __LINE__);
    if (!p) continue;
    s = select_ok(p, kvevict_keep_ratio(0.3), &layer, 1, __LINE__);
    if (s) check_structure(s, 0, lengths, positions, __LINE__);
    kvevict_selection_free(s);
    kvevict_policy_free(p);
  }
  context[0] = '\0';
}

/* ---- options ---------------------------------------------------------------------------------------------------- */

static void select_error(const char* what, const kvevict_policy* p, kvevict_budget b, const kvevict_layer* layers,
                         size_t n, const char* word, int line);

static void option_error(const char* what, const char* policy, const char* key, const char* value, const char* word,
                         int line);

static void test_options(void) {
  static Data a, b;
  kvevict_layer layers[2];
  make_data(&a, 7);
  make_data(&b, 8);
  layers[0] = layer_of(&a);
  layers[1] = layer_of(&b);
  { /* window: the q rows, '-' or '_' alike; pool, kernel */
    const char* k[] = {"window", "pool", "kernel", "reference-quirks", "adakv_variant"};
    const char* v[] = {"4", "max", "3", "false", "original"};
    kvevict_policy* p;
    kvevict_selection* s;
    snprintf(context, sizeof context, "options window/pool/kernel");
    p = create("adakv", k, v, 5, __LINE__);
    s = p ? select_ok(p, kvevict_tokens(BUDGET), layers, 1, __LINE__) : NULL;
    if (s) check_structure(s, 0, NULL, NULL, __LINE__); /* the original variant rounds each head's budget */
    kvevict_selection_free(s);
    kvevict_policy_free(p);
  }
  { /* protect_prefix: every entry at a position < 12 stays, counted in the budget or on top (prefix_budget) */
    const char* k[] = {"protect_prefix", "prefix_budget", "share", "block"};
    const char* counted_v[] = {"12", "counted", "layer", "4"};
    const char* extra_v[] = {"12", "extra", "layer", "4"};
    int variant;
    for (variant = 0; variant < 2; ++variant) {
      kvevict_policy* p = create("defensivekv", k, variant ? extra_v : counted_v, 4, __LINE__);
      kvevict_selection* s;
      snprintf(context, sizeof context, "option protect_prefix (%s)", variant ? "extra" : "counted");
      s = p ? select_ok(p, kvevict_tokens(variant ? 4 : 16), layers, 2, __LINE__) : NULL;
      if (s) {
        size_t l;
        for (l = 0; l < 2; ++l) {
          const int64_t* off = kvevict_selection_offsets(s, l);
          const int64_t* pos = kvevict_selection_positions(s, l);
          int h;
          for (h = 0; h < HKV; ++h) {
            int64_t i, below = 0;
            for (i = off[h]; i < off[h + 1]; ++i) below += pos[i] < 12;
            CHECK(below == 12);
            CHECK(off[h + 1] - off[h] == 16);
          }
        }
      }
      kvevict_selection_free(s);
      if (p && !variant) /* counted, 8 cannot hold the 12 protected entries (3 blocks of 4) */
        select_error("protected prefix over the budget", p, kvevict_tokens(8), layers, 2, "its protected prefix",
                     __LINE__);
      kvevict_policy_free(p);
    }
  }
  { /* threshold: bounds that pin each head's count select as the token budget (docs/algorithms.md#threshold-budgets);
       without bounds a higher threshold keeps fewer; bounds on a count budget are refused */
    const char* k[] = {"count_lower", "count_upper", "count_scope"};
    const char* v[] = {"12", "12", "head"};
    const char* upper_k[] = {"count_upper"};
    const char* upper_v[] = {"5"};
    kvevict_policy *pinned = create("snapkv", k, v, 3, __LINE__), *plain = create("snapkv", NULL, NULL, 0, __LINE__),
                   *capped = create("snapkv", upper_k, upper_v, 1, __LINE__);
    kvevict_selection *s = NULL, *t = NULL, *low = NULL, *high = NULL;
    snprintf(context, sizeof context, "threshold budget");
    if (pinned && plain && capped) {
      s = select_ok(pinned, kvevict_threshold(0.01), layers, 2, __LINE__);
      t = select_ok(plain, kvevict_tokens(BUDGET), layers, 2, __LINE__);
      if (s && t) CHECK(same_layer(s, 0, t, 0) && same_layer(s, 1, t, 1));
      low = select_ok(plain, kvevict_threshold(0.001), layers, 1, __LINE__);
      high = select_ok(plain, kvevict_threshold(0.05), layers, 1, __LINE__);
      if (low && high) CHECK(kvevict_selection_total(high, 0) <= kvevict_selection_total(low, 0));
      select_error("count bounds on a token budget", capped, kvevict_tokens(BUDGET), layers, 1,
                   "count_upper bounds a threshold budget, got a count budget", __LINE__);
      select_error("threshold NaN", plain, kvevict_threshold(nan("")), layers, 1, "threshold must be finite", __LINE__);
    }
    option_error("threshold as a policy option", "snapkv", "threshold", "0.1", "kvevict_threshold", __LINE__);
    kvevict_selection_free(s);
    kvevict_selection_free(t);
    kvevict_selection_free(low);
    kvevict_selection_free(high);
    kvevict_policy_free(pinned);
    kvevict_policy_free(plain);
    kvevict_policy_free(capped);
  }
  { /* retrieval_heads (docs/algorithms.md#retrieval-heads): layer 1's KV head 0 forced, kept whole by one budget
       across layers (attention scores: no mass-forced entries compete with it); a head beyond the layer refused */
    const char* k[] = {"base", "selector", "retrieval_heads"};
    const char* one_v[] = {"layer", "attention", "1:0"};
    const char* bad_v[] = {"layer", "attention", "0:2"};
    kvevict_policy *forced = create(NULL, k, one_v, 3, __LINE__), *beyond = create(NULL, k, bad_v, 3, __LINE__);
    kvevict_selection* s = NULL;
    snprintf(context, sizeof context, "option retrieval_heads");
    if (forced && beyond) {
      s = select_ok(forced, kvevict_tokens(16), layers, 2, __LINE__);
      if (s) CHECK(kvevict_selection_offsets(s, 1)[1] == L);
      select_error("retrieval_heads beyond the layer", beyond, kvevict_tokens(BUDGET), layers, 2,
                   "retrieval_heads names KV head 2, expected a KV head of the layer in [0, 2)", __LINE__);
    }
    option_error("retrieval_heads not pairs", "snapkv", "retrieval_heads", "1", "retrieval_heads expects layer:head",
                 __LINE__);
    kvevict_selection_free(s);
    kvevict_policy_free(forced);
    kvevict_policy_free(beyond);
  }
  { /* keep_whole: layer 1 of 2 kept whole (a hybrid model's sliding-window layer), layer 0 selected as alone */
    const char* k[] = {"keep_whole"};
    const char* one_v[] = {"1"};
    const char* two_v[] = {"2"};
    kvevict_policy *hybrid = create("snapkv", k, one_v, 1, __LINE__),
                   *plain = create("snapkv", NULL, NULL, 0, __LINE__),
                   *beyond = create("snapkv", k, two_v, 1, __LINE__);
    kvevict_selection *s = NULL, *t = NULL;
    snprintf(context, sizeof context, "option keep_whole");
    if (hybrid && plain && beyond) {
      s = select_ok(hybrid, kvevict_tokens(BUDGET), layers, 2, __LINE__);
      t = select_ok(plain, kvevict_tokens(BUDGET), layers, 1, __LINE__);
      if (s && t) {
        CHECK(same_layer(s, 0, t, 0));
        CHECK(kvevict_selection_total(s, 1) == HKV * L);
      }
      select_error("keep_whole beyond the model", beyond, kvevict_tokens(BUDGET), layers, 2,
                   "the layers kept whole name layer 2; the model has 2 layers", __LINE__);
    }
    option_error("keep_whole not a list", "snapkv", "keep_whole", "1,a", "keep_whole expects layer indices", __LINE__);
    kvevict_selection_free(s);
    kvevict_selection_free(t);
    kvevict_policy_free(hybrid);
    kvevict_policy_free(plain);
    kvevict_policy_free(beyond);
  }
  { /* share=layer: every head of a layer keeps one set; share=model: every head of every layer */
    const char* k[] = {"share"};
    const char* layer_v[] = {"layer"};
    const char* model_v[] = {"model"};
    kvevict_policy *p = create("snapkv", k, layer_v, 1, __LINE__), *m = create("snapkv", k, model_v, 1, __LINE__);
    kvevict_selection* s;
    snprintf(context, sizeof context, "option share");
    s = p ? select_ok(p, kvevict_tokens(BUDGET), layers, 2, __LINE__) : NULL;
    if (s) {
      CHECK(check_structure(s, 0, NULL, NULL, __LINE__) == HKV * BUDGET);
      CHECK(heads_agree(s, 0) && heads_agree(s, 1));
    }
    kvevict_selection_free(s);
    s = m ? select_ok(m, kvevict_tokens(BUDGET), layers, 2, __LINE__) : NULL;
    if (s) {
      CHECK(check_structure(s, 0, NULL, NULL, __LINE__) == HKV * BUDGET);
      CHECK(heads_agree(s, 0) && heads_agree(s, 1) && same_layer(s, 0, s, 1));
    }
    kvevict_selection_free(s);
    kvevict_policy_free(p);
    kvevict_policy_free(m);
  }
  { /* block=4: whole blocks of 4 rows, blocks and block offsets consistent with the rows */
    const char* k[] = {"block", "reduce"};
    const char* v[] = {"4", "mean"};
    const char* names[] = {"snapkv", "adakv", "defensivekv", "layer-defensivekv"};
    size_t n;
    for (n = 0; n < sizeof names / sizeof names[0]; ++n) {
      kvevict_policy* p = create(names[n], k, v, 2, __LINE__);
      kvevict_selection* s;
      snprintf(context, sizeof context, "option block, %s", names[n]);
      s = p ? select_ok(p, kvevict_tokens(BUDGET), layers, 2, __LINE__) : NULL;
      if (s) {
        size_t l;
        for (l = 0; l < 2; ++l) {
          const int64_t total = check_structure(s, l, NULL, NULL, __LINE__);
          const int64_t nb = kvevict_selection_block_count(s, l);
          const int64_t *blocks = kvevict_selection_blocks(s, l), *boff = kvevict_selection_block_offsets(s, l),
                        *idx = kvevict_selection_indices(s, l), *off = kvevict_selection_offsets(s, l);
          int64_t h, i, r, bad = 0;
          CHECK(nb * 4 == total); /* L = 40: no tail block */
          CHECK(boff[0] == 0 && boff[HKV] == nb);
          for (h = 0; h < HKV; ++h) {
            CHECK(4 * (boff[h + 1] - boff[h]) == off[h + 1] - off[h]);
            if (4 * (boff[h + 1] - boff[h]) != off[h + 1] - off[h]) continue;
            for (i = boff[h]; i < boff[h + 1]; ++i) {
              if (blocks[i] < 0 || blocks[i] >= L / 4 || (i > boff[h] && blocks[i] <= blocks[i - 1])) ++bad;
              for (r = 0; r < 4; ++r)
                if (idx[off[h] + 4 * (i - boff[h]) + r] != 4 * blocks[i] + r) ++bad;
            }
          }
          CHECK(bad == 0);
        }
      }
      kvevict_selection_free(s);
      kvevict_policy_free(p);
    }
  }
  { /* every other option, valid values */
    const char* k[] = {"alpha", "eps", "first_stage_ratio", "value-norm", "precision"};
    const char* v[] = {"0.3", "1e-3", "0.25", "l2", "f64"};
    const char* k2[] = {"mass_threshold", "no-floor", "value_norm", "reference_quirks"};
    const char* v2[] = {"0.8", "1", "l1", "0"};
    const char* k3[] = {"sinks"};
    const char* v3[] = {"2"};
    kvevict_policy *p = create("criticalkv", k, v, 5, __LINE__), *d = create("defensivekv", k2, v2, 4, __LINE__),
                   *st = create("streamingllm", k3, v3, 1, __LINE__);
    kvevict_selection* s;
    snprintf(context, sizeof context, "other options");
    s = p ? select_ok(p, kvevict_tokens(BUDGET), layers, 1, __LINE__) : NULL;
    if (s) CHECK(check_structure(s, 0, NULL, NULL, __LINE__) == HKV * BUDGET);
    kvevict_selection_free(s);
    s = d ? select_ok(d, kvevict_compression_ratio(0.5), layers, 1, __LINE__) : NULL;
    if (s) CHECK(check_structure(s, 0, NULL, NULL, __LINE__) == HKV * 20);
    kvevict_selection_free(s);
    s = st ? select_ok(st, kvevict_tokens(BUDGET), layers, 1, __LINE__) : NULL;
    if (s) { /* 2 sinks and the 10 most recent */
      const int64_t* idx = kvevict_selection_indices(s, 0);
      CHECK(check_structure(s, 0, NULL, NULL, __LINE__) == HKV * BUDGET);
      CHECK(idx[0] == 0 && idx[1] == 1 && idx[2] == L - 10 && idx[BUDGET - 1] == L - 1);
    }
    kvevict_selection_free(s);
    kvevict_policy_free(p);
    kvevict_policy_free(d);
    kvevict_policy_free(st);
  }
  context[0] = '\0';
}

/* ---- errors ----------------------------------------------------------------------------------------------------- */

static double sentinel_storage[4]; /* *out is set to this before each failing call: it must come back NULL */
#define SENTINEL_POLICY ((kvevict_policy*)(void*)sentinel_storage)
#define SENTINEL_SELECTION ((kvevict_selection*)(void*)sentinel_storage)

/* A failing call whose message the next one must replace. */
static void reset_last_error(void) {
  kvevict_policy* p = NULL;
  (void)kvevict_policy_create("reset-marker", NULL, NULL, 0, &p);
}

/* The message is fresh (not the marker's), non-empty and contains `word`; printed once for review. */
static void check_message(const char* what, const char* word, int line) {
  const char* msg = kvevict_last_error();
  CHECK_AT(msg != NULL, line);
  if (!msg) return;
  CHECK_AT(msg[0] != '\0', line);
  CHECK_AT(strstr(msg, "reset-marker") == NULL, line);
  CHECK_AT(strstr(msg, word) != NULL, line);
  if (!strstr(msg, word)) printf("  expected '%s' in the message\n", word);
  printf("  %-38s -> %s\n", what, msg);
}

static void create_error(const char* what, const char* name, const char* const* keys, const char* const* values,
                         size_t n, const char* word, int line) {
  kvevict_policy* p = SENTINEL_POLICY;
  kvevict_status st;
  snprintf(context, sizeof context, "create error: %s", what);
  reset_last_error();
  st = kvevict_policy_create(name, keys, values, n, &p);
  CHECK_AT(st == KVEVICT_INVALID_ARGUMENT, line);
  CHECK_AT(p == NULL, line);
  if (st == KVEVICT_OK && p != SENTINEL_POLICY) kvevict_policy_free(p);
  check_message(what, word, line);
}

static void option_error(const char* what, const char* policy, const char* key, const char* value, const char* word,
                         int line) {
  const char* keys[1];
  const char* values[1];
  keys[0] = key, values[0] = value;
  create_error(what, policy, keys, values, 1, word, line);
}

static void select_error(const char* what, const kvevict_policy* p, kvevict_budget b, const kvevict_layer* layers,
                         size_t n, const char* word, int line) {
  kvevict_selection* s = SENTINEL_SELECTION;
  kvevict_status st;
  snprintf(context, sizeof context, "select error: %s", what);
  reset_last_error();
  st = kvevict_select_layers(p, b, layers, n, &s);
  CHECK_AT(st == KVEVICT_INVALID_ARGUMENT, line);
  CHECK_AT(s == NULL, line);
  if (st == KVEVICT_OK && s != SENTINEL_SELECTION) kvevict_selection_free(s);
  check_message(what, word, line);
}

/* The option table (kvevict-select's, shared): names in snake_case with a help line each, NULL past the end, and a
 * bad value for a listed name refused with a message that starts with that name. */
static void test_option_table(void) {
  const size_t count = kvevict_option_count();
  size_t i;
  printf("option table: %zu options\n", count);
  CHECK(count >= 30);
  CHECK(strcmp(kvevict_option_name(0), "policy") == 0);
  CHECK(kvevict_option_name(count) == NULL && kvevict_option_help(count) == NULL);
  for (i = 0; i < count; ++i) {
    const char* name = kvevict_option_name(i);
    const char* help = kvevict_option_help(i);
    CHECK(name != NULL && help != NULL && strlen(help) > 8);
    CHECK(strchr(name, '-') == NULL);
    if (strcmp(name, "window") == 0 || strcmp(name, "kernel") == 0 || strcmp(name, "first_stage_ratio") == 0) {
      const char* names[] = {name};
      const char* values[] = {"x"};
      kvevict_policy* policy = NULL;
      CHECK(kvevict_policy_create("criticalkv", names, values, 1, &policy) == KVEVICT_INVALID_ARGUMENT);
      CHECK(policy == NULL);
      CHECK(strncmp(kvevict_last_error(), name, strlen(name)) == 0);
    }
  }
}

static void test_create_errors(void) {
  const char* two_keys[] = {"window", "pool"};
  const char* null_value[] = {"4", NULL};
  const char* base_sel[] = {"base", "selector"};
  const char* bad_base[] = {"nosuch-base", "critical"};
  const char* bad_sel[] = {"snapkv", "nosuch-selector"};
  kvevict_status st;
  printf("error messages:\n");
  st = kvevict_policy_create("snapkv", NULL, NULL, 0, NULL);
  CHECK(st == KVEVICT_INVALID_ARGUMENT);
  check_message("create: out NULL", "out", __LINE__);
  create_error("unknown policy", "nosuch", NULL, NULL, 0, "nosuch", __LINE__);
  create_error("no policy", NULL, NULL, NULL, 0, "policy", __LINE__);
  create_error("option names NULL", "snapkv", NULL, NULL, 2, "NULL", __LINE__);
  create_error("option value NULL", "snapkv", two_keys, null_value, 2, "NULL", __LINE__);
  create_error("unknown base", NULL, base_sel, bad_base, 2, "nosuch-base", __LINE__);
  create_error("unknown selector", NULL, base_sel, bad_sel, 2, "nosuch-selector", __LINE__);
  option_error("name and base", "snapkv", "base", "adakv", "base", __LINE__);
  option_error("unknown option", "snapkv", "windw", "4", "windw", __LINE__);
  option_error("unknown option (the names listed)", "snapkv", "--window", "4", "first_stage_ratio", __LINE__);
  option_error("window 0", "snapkv", "window", "0", "window", __LINE__);
  option_error("window not a number", "snapkv", "window", "four", "window", __LINE__);
  option_error("window 4x", "snapkv", "window", "4x", "window", __LINE__);
  option_error("pool median", "snapkv", "pool", "median", "pool", __LINE__);
  option_error("kernel even", "snapkv", "kernel", "4", "kernel", __LINE__);
  option_error("alpha 2", "adakv", "alpha", "2", "alpha", __LINE__);
  option_error("alpha nan", "adakv", "alpha", "nan", "alpha", __LINE__);
  option_error("adakv-variant", "adakv", "adakv-variant", "new", "adakv_variant", __LINE__);
  option_error("sinks -1", "streamingllm", "sinks", "-1", "sinks", __LINE__);
  option_error("precision f16", "snapkv", "precision", "f16", "precision", __LINE__);
  option_error("reference_quirks maybe", "snapkv", "reference_quirks", "maybe", "reference_quirks", __LINE__);
  option_error("no_floor maybe ('-' spelled '_')", "defensivekv", "no-floor", "maybe", "no_floor", __LINE__);
  option_error("eps -1", "criticalkv", "eps", "-1", "eps", __LINE__);
  option_error("first_stage_ratio 1.5", "criticalkv", "first-stage-ratio", "1.5", "first_stage_ratio", __LINE__);
  option_error("value_norm l3", "criticalkv", "value_norm", "l3", "value_norm", __LINE__);
  option_error("mass_threshold 2", "defensivekv", "mass_threshold", "2", "mass_threshold", __LINE__);
  option_error("share all", "snapkv", "share", "all", "share", __LINE__);
  option_error("reduce min", "snapkv", "reduce", "min", "reduce", __LINE__);
  option_error("block 0", "snapkv", "block", "0", "block", __LINE__);
  option_error("budget option", "snapkv", "budget", "10", "kvevict_select_layers", __LINE__);
  option_error("keep option", "snapkv", "keep", "0.5", "kvevict_select_layers", __LINE__);
  option_error("compression_ratio option", "snapkv", "compression_ratio", "0.5", "kvevict_select_layers", __LINE__);
  option_error("compression-ratio option", "snapkv", "compression-ratio", "0.5", "kvevict_select_layers", __LINE__);
}

static void test_select_errors(void) {
  static Data a, b;
  static double k64[N_KV];
  static uint16_t v16[N_KV];
  static float wide_wo[D_MODEL * (H + 1) * D_HEAD];
  static float attn[H * W * L];
  static int64_t positions[HKV * L];
  const int64_t wide_wo_shape[2] = {D_MODEL, (H + 1) * D_HEAD};
  const int64_t attn_shape[3] = {H, W, L};
  const int64_t odd_q_shape[3] = {3, W, D_HEAD};
  const int64_t wrong_d_shape[3] = {H, W, D_HEAD - 1};
  const int64_t short_shape[3] = {HKV, W, D_HEAD};
  const int64_t short_values_shape[3] = {HKV, L - 1, D_HEAD};
  int64_t lengths[HKV] = {L + 1, L};
  const char* wk[] = {"window"};
  const char* wv[] = {"5"};
  const char* bk[] = {"block"};
  const char* bv[] = {"8"};
  kvevict_policy *snap = create("snapkv", NULL, NULL, 0, __LINE__),
                 *crit = create("criticalkv", NULL, NULL, 0, __LINE__),
                 *window5 = create("snapkv", wk, wv, 1, __LINE__), *block8 = create("snapkv", bk, bv, 1, __LINE__),
                 *global = create("layer-defensivekv", NULL, NULL, 0, __LINE__),
                 *engine = create("engine-scores", NULL, NULL, 0, __LINE__);
  const char* f64k[] = {"precision"};
  const char* f64v[] = {"f64"};
  kvevict_policy* snap64 = create("snapkv", f64k, f64v, 1, __LINE__);
  kvevict_layer good, bad, two[2];
  kvevict_budget budget = kvevict_tokens(BUDGET), weird;
  int j;
  make_data(&a, 9);
  make_data(&b, 10);
  for (j = 0; j < N_KV; ++j) k64[j] = b.k[j], v16[j] = f32_to_f16(a.v[j]);
  for (j = 0; j < H * W * L; ++j) attn[j] = 1.0f / L;
  for (j = 0; j < HKV * L; ++j) positions[j] = j % L;
  good = layer_of(&a);
  if (!snap || !crit || !window5 || !block8 || !global || !snap64) return;

  /* quantized caches */
  {
    static int8_t codes[N_KV];
    static const float one = 1.0f, scales[HKV * L] = {0};
    static const double wide = 1.0;
    const int64_t scale_shape[2] = {HKV, L - 1}, scale3[3] = {HKV, L, 1};
    kvevict_layer q = good;
    q.keys = kvevict_tensor_contiguous(codes, KVEVICT_I8, 3, KV_SHAPE);
    q.values = kvevict_tensor_contiguous(codes, KVEVICT_I8, 3, KV_SHAPE);
    bad = good;
    bad.keys_scale = kvevict_tensor_contiguous(&one, KVEVICT_F32, 0, NULL);
    select_error("scale for an f32 cache", snap, budget, &bad, 1, "quantized caches", __LINE__);
    select_error("scale for an f32 cache, f64", snap64, budget, &bad, 1, "quantized caches", __LINE__);
    bad = good;
    bad.values = kvevict_tensor_contiguous(v16, KVEVICT_F16, 3, KV_SHAPE);
    bad.keys = bad.values;
    bad.values_scale = kvevict_tensor_contiguous(&one, KVEVICT_F32, 0, NULL);
    select_error("values scale for an f16 cache", snap, budget, &bad, 1, "values_scale is given", __LINE__);
    select_error("values scale for an f16 cache, f64", snap64, budget, &bad, 1, "values_scale is given", __LINE__);
    bad = q;
    bad.values.data = NULL;
    bad.values_scale = kvevict_tensor_contiguous(&wide, KVEVICT_F64, 0, NULL);
    select_error("values scale f64, no values", snap, budget, &bad, 1, "values_scale is f64", __LINE__);
    select_error("values scale f64, no values, f64", snap64, budget, &bad, 1, "values_scale is f64", __LINE__);
    bad = q;
    bad.values = good.values;
    select_error("i8 keys, f32 values", snap, budget, &bad, 1, "one dtype", __LINE__);
    bad = q;
    bad.q_window.dtype = KVEVICT_I8;
    select_error("i8 q_window", snap, budget, &bad, 1, "keys and values only", __LINE__);
    bad = q;
    bad.keys_scale = kvevict_tensor_contiguous(scales, KVEVICT_F32, 2, scale_shape);
    select_error("scale [Hkv, L - 1]", snap, budget, &bad, 1, "keys_scale has shape", __LINE__);
    bad.keys_scale = kvevict_tensor_contiguous(scales, KVEVICT_F32, 3, scale3);
    select_error("scale of rank 3", snap, budget, &bad, 1, "rank 3", __LINE__);
    bad.keys_scale = kvevict_tensor_contiguous(&wide, KVEVICT_F64, 0, NULL);
    select_error("scale f64", snap, budget, &bad, 1, "expected F32", __LINE__);
    bad = q;
    bad.values_scale = kvevict_tensor_contiguous(&wide, KVEVICT_F64, 0, NULL);
    select_error("values scale f64", crit, budget, &bad, 1, "values_scale is f64", __LINE__);
    bad = q;
    bad.keys.dtype = 7;
    select_error("keys dtype 7", snap, budget, &bad, 1, "KVEVICT_F8_E5M2", __LINE__);
  }

  /* the arguments */
  CHECK(kvevict_select_layers(snap, budget, &good, 1, NULL) == KVEVICT_INVALID_ARGUMENT);
  check_message("select: out NULL", "out", __LINE__);
  select_error("policy NULL", NULL, budget, &good, 1, "policy", __LINE__);
  select_error("layers NULL", snap, budget, NULL, 1, "layers", __LINE__);
  select_error("n_layers 0", snap, budget, &good, 0, "layer", __LINE__);
  /* budgets */
  weird.kind = 7, weird.value = 10.0;
  select_error("budget kind 7", snap, weird, &good, 1, "kind", __LINE__);
  select_error("keep 0", snap, kvevict_keep_ratio(0.0), &good, 1, "keep", __LINE__);
  select_error("keep 1.5", snap, kvevict_keep_ratio(1.5), &good, 1, "keep", __LINE__);
  select_error("keep NaN", snap, kvevict_keep_ratio(nan("")), &good, 1, "keep", __LINE__);
  select_error("compression ratio 1", snap, kvevict_compression_ratio(1.0), &good, 1, "compression", __LINE__);
  select_error("compression ratio -0.1", snap, kvevict_compression_ratio(-0.1), &good, 1, "compression", __LINE__);
  weird.kind = KVEVICT_BUDGET_TOKENS, weird.value = 2.5;
  select_error("tokens 2.5", snap, weird, &good, 1, "tokens", __LINE__);
  weird.value = 1e300;
  select_error("tokens 1e300", snap, weird, &good, 1, "tokens", __LINE__);
  select_error("tokens 0", snap, kvevict_tokens(0), &good, 1, "0", __LINE__);
  select_error("tokens -3", snap, kvevict_tokens(-3), &good, 1, "-3", __LINE__);
  select_error("tokens 41 > L", snap, kvevict_tokens(L + 1), &good, 1, "41", __LINE__);
  select_error("block 8 > budget 6", block8, kvevict_tokens(6), &good, 1, "block", __LINE__);

  /* tensors */
  bad = good, bad.keys.data = NULL;
  select_error("keys missing", snap, budget, &bad, 1, "keys", __LINE__);
  bad = good, bad.keys.rank = 2;
  select_error("keys rank 2", snap, budget, &bad, 1, "rank", __LINE__);
  bad = good, bad.keys = kvevict_tensor_contiguous(a.k, KVEVICT_F32, 4, KV_SHAPE);
  select_error("keys rank 4 (contiguous)", snap, budget, &bad, 1, "rank", __LINE__);
  bad = good, bad.keys.shape[2] = 0;
  select_error("keys extent 0", snap, budget, &bad, 1, "extent", __LINE__);
  bad = good, bad.keys.shape[1] = -5;
  select_error("keys extent -5", snap, budget, &bad, 1, "extent", __LINE__);
  bad = good, bad.keys.dtype = 9;
  select_error("keys dtype 9", snap, budget, &bad, 1, "dtype", __LINE__);
  bad = good, bad.q_window.dtype = -1;
  select_error("q_window dtype -1", snap, budget, &bad, 1, "dtype", __LINE__);
  bad = good, bad.values.dtype = 5;
  select_error("values dtype 5", snap, budget, &bad, 1, "dtype", __LINE__);
  bad = good, bad.values.data = v16, bad.values.dtype = KVEVICT_F16;
  select_error("values f16, keys f32", snap, budget, &bad, 1, "dtype", __LINE__);
  bad = good, bad.values = kvevict_tensor_contiguous(a.v, KVEVICT_F32, 3, short_values_shape);
  select_error("values [2, 39, 8]", snap, budget, &bad, 1, "values", __LINE__);
  bad = good, bad.values.shape[0] = 1;
  select_error("values [1, 40, 8]", snap, budget, &bad, 1, "values", __LINE__);
  bad = good, bad.window_attention = kvevict_tensor_contiguous(attn, KVEVICT_F32, 3, attn_shape);
  select_error("q_window and window_attention", snap, budget, &bad, 1, "both", __LINE__);
  bad = good, bad.q_window.data = NULL;
  select_error("q_window missing", snap, budget, &bad, 1, "q_window", __LINE__);
  bad = good, bad.q_window.rank = 2;
  select_error("q_window rank 2", snap, budget, &bad, 1, "rank", __LINE__);
  bad = good, bad.q_window = kvevict_tensor_contiguous(a.q, KVEVICT_F32, 3, odd_q_shape);
  select_error("3 query heads, 2 KV heads", snap, budget, &bad, 1, "heads", __LINE__);
  bad = good, bad.q_window = kvevict_tensor_contiguous(a.q, KVEVICT_F32, 3, wrong_d_shape);
  select_error("q_window head_dim 7", snap, budget, &bad, 1, "head_dim", __LINE__);
  bad = good, bad.keys = kvevict_tensor_contiguous(a.k, KVEVICT_F32, 3, short_shape);
  bad.values.data = NULL;
  select_error("window (4) = L (4)", snap, budget, &bad, 1, "window", __LINE__);
  bad = good, bad.values.data = NULL;
  select_error("values missing (criticalkv)", crit, budget, &bad, 1, "values", __LINE__);
  bad = good, bad.w_o.data = NULL;
  select_error("w_o missing (criticalkv)", crit, budget, &bad, 1, "w_o", __LINE__);
  bad = good, bad.w_o = kvevict_tensor_contiguous(wide_wo, KVEVICT_F32, 2, wide_wo_shape);
  select_error("w_o [16, 40]", crit, budget, &bad, 1, "w_o", __LINE__);
  bad = good, bad.w_o.rank = 3;
  select_error("w_o rank 3", crit, budget, &bad, 1, "rank", __LINE__);
  select_error("window 5, q_window rows 4", window5, budget, &good, 1, "window", __LINE__);
  bad = good, bad.q_window.data = NULL;
  bad.window_attention = kvevict_tensor_contiguous(attn, KVEVICT_F32, 3, attn_shape);
  select_error("window 5, attention rows 4", window5, budget, &bad, 1, "window", __LINE__);
  two[0] = good, two[1] = good;
  two[1].keys.data = k64, two[1].keys.dtype = KVEVICT_F64, two[1].values.data = NULL;
  select_error("layers[1] keys f64, layers[0] f32", global, budget, two, 2, "layers[1]", __LINE__);
  two[1] = good, two[1].q_window.data = NULL;
  select_error("layers[1] q_window missing", global, budget, two, 2, "layers[1]", __LINE__);

  /* ragged layers */
  bad = good, bad.lengths = lengths;
  select_error("lengths[0] = L + 1", snap, budget, &bad, 1, "lengths", __LINE__);
  lengths[0] = 0;
  select_error("lengths[0] = 0", snap, budget, &bad, 1, "lengths", __LINE__);
  lengths[0] = W;
  select_error("lengths[0] = window", snap, budget, &bad, 1, "window", __LINE__);
  bad = good, bad.positions = positions, bad.positions_strides[0] = L, bad.positions_strides[1] = 1;
  positions[5] = positions[4];
  select_error("positions not increasing", snap, budget, &bad, 1, "increasing", __LINE__);
  positions[5] = 5;
  bad.positions_strides[1] = 0; /* every row of a head at one position */
  select_error("positions stride 0", snap, budget, &bad, 1, "positions", __LINE__);
  bad.positions_strides[0] = 0; /* both left at kvevict_layer_init's zeros */
  select_error("positions strides unset", snap, budget, &bad, 1, "positions_strides", __LINE__);
  CHECK(strlen(kvevict_last_error()) > 0); /* still the last failure's message */

  /* the engine's scores: missing, another shape, codes */
  bad = good;
  bad.scores.data = NULL;
  select_error("scores missing", engine, budget, &bad, 1, "layers[0].scores [kv_heads, tokens] is missing", __LINE__);
  two[0] = good, two[1] = good, two[1].scores.data = NULL;
  select_error("scores missing in layer 1", engine, budget, two, 2, "layers[1].scores", __LINE__);
  bad = good;
  bad.scores.shape[1] = L - 1;
  select_error("scores shape", engine, budget, &bad, 1, "scores has shape [2, 39]; expected [2, 40]", __LINE__);
  bad = good;
  bad.scores.dtype = KVEVICT_I8;
  select_error("scores as codes", engine, budget, &bad, 1, "quantized codes are for the keys and values only",
               __LINE__);
  bad = good;
  bad.scores.rank = 3;
  select_error("scores rank 3", engine, budget, &bad, 1, "scores has rank 3; expected rank 2", __LINE__);
  /* a policy that reads no scores ignores them, and one that reads them ignores a missing q_window */
  bad = good;
  bad.q_window.data = NULL;
  snprintf(context, sizeof context, "engine-scores without q_window");
  {
    kvevict_selection* s = select_ok(engine, budget, &bad, 1, __LINE__);
    if (s) kvevict_selection_free(s);
  }

  kvevict_policy_free(snap);
  kvevict_policy_free(crit);
  kvevict_policy_free(window5);
  kvevict_policy_free(block8);
  kvevict_policy_free(global);
  kvevict_policy_free(engine);
  kvevict_policy_free(snap64);
  context[0] = '\0';
}

/* ---- accessors, helpers, version ---------------------------------------------------------------------------- */

static void test_accessors(void) {
  static Data a;
  kvevict_layer layer;
  kvevict_policy* p = create("snapkv", NULL, NULL, 0, __LINE__);
  kvevict_selection* s;
  kvevict_tensor t;
  const int64_t shape[3] = {2, 3, 5};
  kvevict_budget b;
  snprintf(context, sizeof context, "accessors");
  CHECK(kvevict_selection_layers(NULL) == 0);
  CHECK(kvevict_selection_heads(NULL, 0) == 0);
  CHECK(kvevict_selection_total(NULL, 0) == 0);
  CHECK(kvevict_selection_indices(NULL, 0) == NULL);
  CHECK(kvevict_selection_offsets(NULL, 0) == NULL);
  CHECK(kvevict_selection_positions(NULL, 0) == NULL);
  CHECK(kvevict_selection_block_count(NULL, 0) == 0);
  CHECK(kvevict_selection_blocks(NULL, 0) == NULL);
  CHECK(kvevict_selection_block_offsets(NULL, 0) == NULL);
  CHECK(kvevict_policy_get_name(NULL) == NULL);
  CHECK(kvevict_policy_reads(NULL) == 0);
  kvevict_selection_free(NULL);
  kvevict_policy_free(NULL);
  make_data(&a, 11);
  layer = layer_of(&a);
  s = p ? select_ok(p, kvevict_tokens(BUDGET), &layer, 1, __LINE__) : NULL;
  if (s) {
    CHECK(kvevict_selection_layers(s) == 1);
    CHECK(kvevict_selection_heads(s, 1) == 0);
    CHECK(kvevict_selection_total(s, 1) == 0);
    CHECK(kvevict_selection_indices(s, 1) == NULL);
    CHECK(kvevict_selection_offsets(s, 1) == NULL);
    CHECK(kvevict_selection_positions(s, 1) == NULL);
    CHECK(kvevict_selection_block_count(s, 1) == 0);
    CHECK(kvevict_selection_blocks(s, 1) == NULL);
    CHECK(kvevict_selection_block_offsets(s, (size_t)-1) == NULL);
  }
  kvevict_selection_free(s);
  kvevict_policy_free(p);

  t = kvevict_tensor_contiguous(&a, KVEVICT_F16, 3, shape);
  CHECK(t.data == (const void*)&a && t.dtype == KVEVICT_F16 && t.rank == 3);
  CHECK(t.shape[0] == 2 && t.shape[1] == 3 && t.shape[2] == 5);
  CHECK(t.strides[0] == 15 && t.strides[1] == 5 && t.strides[2] == 1);
  t = kvevict_tensor_contiguous(&a, KVEVICT_F64, 2, shape);
  CHECK(t.rank == 2 && t.strides[0] == 3 && t.strides[1] == 1 && t.shape[2] == 0);
  layer = kvevict_layer_init();
  CHECK(layer.keys.data == NULL && layer.values.data == NULL && layer.q_window.data == NULL &&
        layer.window_attention.data == NULL && layer.w_o.data == NULL && layer.lengths == NULL &&
        layer.positions == NULL);
  b = kvevict_tokens(7);
  CHECK(b.kind == KVEVICT_BUDGET_TOKENS && b.value == 7.0);
  b = kvevict_keep_ratio(0.25);
  CHECK(b.kind == KVEVICT_BUDGET_KEEP_RATIO && b.value == 0.25);
  b = kvevict_compression_ratio(0.75);
  CHECK(b.kind == KVEVICT_BUDGET_COMPRESSION_RATIO && b.value == 0.75);
  context[0] = '\0';
}

static void test_version(void) {
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", KVEVICT_VERSION_MAJOR, KVEVICT_VERSION_MINOR, KVEVICT_VERSION_PATCH);
  CHECK(kvevict_version() != NULL);
  CHECK(strcmp(kvevict_version(), want) == 0);
  printf("kvevict_version() = %s\n", kvevict_version());
}

int main(void) {
  /* before any failure the message is empty */
  CHECK(kvevict_last_error() != NULL && kvevict_last_error()[0] == '\0');
  test_version();
  test_every_policy();
  test_quantized();
  test_composed();
  test_token_major();
  test_window_attention();
  test_ragged();
  test_options();
  test_accessors();
  test_option_table();
  test_create_errors();
  test_select_errors();
  printf("%d passed, %d failed\n", n_passed, n_failed);
  return n_failed == 0 ? 0 : 1;
}
