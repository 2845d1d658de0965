/* A C engine's use of kvevict through the C API (kvevict::c from find_package(kvevict CONFIG COMPONENTS c)):
 * SnapKV and DefensiveKV at a quarter of a token-major cache. Compiled as C99. */
#include <kvevict/c/kvevict.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { H = 4, HKV = 2, W = 8, L = 64, D = 8, HIDDEN = 16 };

static uint32_t seed = 12345u;
static void fill(float* v, size_t n) {
  size_t i;
  for (i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    v[i] = (float)((double)(seed >> 8) / 8388608.0 - 1.0);
  }
}

static int run(const char* name, const float* q, const float* k, const float* v, const float* wo) {
  kvevict_policy* policy = NULL;
  kvevict_selection* sel = NULL;
  kvevict_layer layer = kvevict_layer_init();
  const int64_t q_shape[3] = {H, W, D}, wo_shape[2] = {HIDDEN, H * D};
  const int64_t* offsets;
  int64_t h;
  /* token-major [L, Hkv, d] seen as [Hkv, L, d] */
  layer.keys.data = k;
  layer.keys.dtype = KVEVICT_F32;
  layer.keys.rank = 3;
  layer.keys.shape[0] = HKV, layer.keys.shape[1] = L, layer.keys.shape[2] = D;
  layer.keys.strides[0] = D, layer.keys.strides[1] = HKV * D, layer.keys.strides[2] = 1;
  layer.values = layer.keys;
  layer.values.data = v;
  layer.q_window = kvevict_tensor_contiguous(q, KVEVICT_F32, 3, q_shape);
  layer.w_o = kvevict_tensor_contiguous(wo, KVEVICT_F32, 2, wo_shape);
  if (kvevict_policy_create(name, NULL, NULL, 0, &policy) != KVEVICT_OK ||
      kvevict_select_layers(policy, kvevict_keep_ratio(0.25), &layer, 1, &sel) != KVEVICT_OK) {
    fprintf(stderr, "consumer_c: %s: %s\n", name, kvevict_last_error());
    kvevict_policy_free(policy);
    return 1;
  }
  offsets = kvevict_selection_offsets(sel, 0);
  for (h = 0; h < HKV; ++h)
    if (offsets[h + 1] - offsets[h] != L / 4) {
      fprintf(stderr, "consumer_c: %s: head %d keeps %d rows, expected %d\n", name, (int)h,
              (int)(offsets[h + 1] - offsets[h]), L / 4);
      return 1;
    }
  printf("consumer_c: %s keeps %d of %d entries\n", name, (int)kvevict_selection_total(sel, 0), HKV * L);
  kvevict_selection_free(sel);
  kvevict_policy_free(policy);
  return 0;
}

int main(void) {
  static float q[H * W * D], k[L * HKV * D], v[L * HKV * D], wo[HIDDEN * H * D];
  fill(q, sizeof q / sizeof *q);
  fill(k, sizeof k / sizeof *k);
  fill(v, sizeof v / sizeof *v);
  fill(wo, sizeof wo / sizeof *wo);
  if (strcmp(kvevict_version(), KVEVICT_CONSUMER_EXPECTED_VERSION) != 0) {
    fprintf(stderr, "consumer_c: kvevict_version() is %s, expected %s\n", kvevict_version(),
            KVEVICT_CONSUMER_EXPECTED_VERSION);
    return 1;
  }
  return run("snapkv", q, k, v, wo) || run("defensivekv", q, k, v, wo);
}
