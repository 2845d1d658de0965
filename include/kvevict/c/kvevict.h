/* kvevict's C API (C99): every policy of the catalogue over raw pointers, for C engines and foreign-function
 * interfaces. Link kvevict::c (static or shared). Mirrors kvevict-select: a policy by catalogue name (or a base and a
 * selector), options by the names of kvevict-select's options, one budget, tensors with shapes and strides.
 *
 *   kvevict_policy* policy = NULL;
 *   const char* keys[] = {"window"}, *values[] = {"32"};
 *   if (kvevict_policy_create("defensivekv", keys, values, 1, &policy) != KVEVICT_OK)
 *     fprintf(stderr, "%s\n", kvevict_last_error());
 *   kvevict_layer layer = kvevict_layer_init();
 *   layer.keys = kvevict_tensor_contiguous(K, KVEVICT_F16, 3, (int64_t[]){Hkv, L, d});
 *   ...values, q_window [H, w, d], w_o [D, H * d]...
 *   kvevict_selection* sel = NULL;
 *   kvevict_select_layers(policy, kvevict_keep_ratio(0.1), &layer, 1, &sel);
 *   const int64_t* rows = kvevict_selection_indices(sel, 0);  // kept rows, heads concatenated
 *   kvevict_selection_free(sel); kvevict_policy_free(policy);
 *
 * Every function that can fail returns a kvevict_status; the message of the calling thread's last failure is
 * kvevict_last_error(). No C++ exception crosses this boundary. A policy is immutable once created: any number of
 * threads may select with it at once (each with its own output). The semantics are those of the C++ API
 * (docs/algorithms.md); the option names and values those of `kvevict-select --help` (docs/bindings.md).
 */
#ifndef KVEVICT_C_KVEVICT_H
#define KVEVICT_C_KVEVICT_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32) && defined(KVEVICT_C_BUILDING)
#define KVEVICT_C_API __declspec(dllexport)
#elif defined(__GNUC__)
#define KVEVICT_C_API __attribute__((visibility("default")))
#else
#define KVEVICT_C_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvevict_status {
  KVEVICT_OK = 0,
  KVEVICT_INVALID_ARGUMENT = 1, /* bad option, shape, stride, dtype, budget or value: the message says which */
  KVEVICT_OUT_OF_MEMORY = 2,
  KVEVICT_INTERNAL_ERROR = 3,   /* a bug: please report the message */
  KVEVICT_COLLECTIVE_FAILED = 4 /* a sharded selection's all_gather returned non-zero (kvevict_communicator) */
} kvevict_status;

/* Element types of tensors. Keys and values share one; queries, attention and W_o may each have any of the first
 * four. The last three are the codes of a quantized KV cache (keys and values only), read through keys_scale and
 * values_scale (docs/algorithms.md#quantized). */
typedef enum kvevict_dtype {
  KVEVICT_F32 = 0,
  KVEVICT_F64 = 1,
  KVEVICT_F16 = 2,     /* IEEE half */
  KVEVICT_BF16 = 3,    /* bfloat16 */
  KVEVICT_I8 = 4,      /* int8 codes */
  KVEVICT_F8_E4M3 = 5, /* fp8 E4M3 codes (OCP, torch.float8_e4m3fn: no infinities, largest finite 448) */
  KVEVICT_F8_E5M2 = 6  /* fp8 E5M2 codes (OCP, torch.float8_e5m2) */
} kvevict_dtype;

/* A strided tensor of rank 0 to 3 (rank by its role below; rank 0: one element at data). strides are in elements,
 * not bytes; a tensor with data == NULL is absent. Any strides are accepted: the innermost dimension at stride 1 and
 * the others >= 0 are read in place; other layouts are copied first. */
typedef struct kvevict_tensor {
  const void* data;
  int32_t dtype; /* a kvevict_dtype (stored as int32_t: any value is checked, never undefined) */
  int32_t rank;
  int64_t shape[3];
  int64_t strides[3];
} kvevict_tensor;

/* One layer's inputs (docs/algorithms.md, "Inputs"): Hkv KV heads of L entries, H = G Hkv query heads, window w.
 *   keys, values      [Hkv, L, d]  (a token-major cache [L, Hkv, d] is the same tensor with strides {d, Hkv d, 1})
 *   q_window          [H, w, d]    the window's queries, RoPE applied like the keys; or instead
 *   window_attention  [H, w, L]    the window's softmax rows
 *   w_o               [D, H d]     attention output projection (value-aware policies only)
 *   lengths           [Hkv] int64  ragged layers: head h holds rows [0, lengths[h]); NULL: every head holds L
 *   positions         [Hkv, L] int64 at positions_strides (elements): original positions, strictly increasing along
 *                     each head; NULL: row j is at position j
 *   keys_scale,       quantized caches (keys and values KVEVICT_I8, KVEVICT_F8_E4M3 or KVEVICT_F8_E5M2) only: F32
 *   values_scale      dequantisation factors, [] (rank 0) or [1] (one factor for the tensor, vLLM's k_scale /
 *                     v_scale), [L] (one per token, shared by the KV heads) or [Hkv, L] (one per KV head and token,
 *                     any strides); absent: 1. Entry j of KV head h holds float(code) * factor, and the selection
 *                     is exactly that of F32 keys and values holding those values (docs/algorithms.md#quantized)
 *   scores            [Hkv, L]     the score the engine computed for each entry (KVzip's replay, ...; rows past a
 *                     ragged head's length are not read), any of the first four dtypes and any strides; read by
 *                     the policies that rank the engine's scores (docs/algorithms.md#engine-scores)
 * Only what the policy reads needs to be present (kvevict_policy_reads). Fields were added at the end over time
 * (the scales, then scores last): start from kvevict_layer_init(). */
typedef struct kvevict_layer {
  kvevict_tensor keys, values, q_window, window_attention, w_o;
  const int64_t* lengths;
  const int64_t* positions;
  int64_t positions_strides[2];
  kvevict_tensor keys_scale, values_scale;
  kvevict_tensor scores;
} kvevict_layer;

typedef enum kvevict_budget_kind {
  KVEVICT_BUDGET_TOKENS = 0,            /* value = n_kept, tokens per KV head on average, window included */
  KVEVICT_BUDGET_KEEP_RATIO = 1,        /* value in (0, 1]: n_kept = floor(L value) */
  KVEVICT_BUDGET_COMPRESSION_RATIO = 2, /* value in [0, 1): n_kept = floor(L (1 - value)) */
  KVEVICT_BUDGET_THRESHOLD = 3 /* value finite: every entry whose score reaches it (options count_lower, count_upper,
                                  count_scope bound the count; docs/algorithms.md#threshold-budgets) */
} kvevict_budget_kind;

typedef struct kvevict_budget {
  int32_t kind; /* a kvevict_budget_kind */
  double value;
} kvevict_budget;

typedef struct kvevict_policy kvevict_policy;       /* opaque, immutable */
typedef struct kvevict_selection kvevict_selection; /* opaque: the kept entries of every layer */

/* What a policy reads (bit set): observation (q_window or window_attention), values and w_o, whether the
 * observation must be q_window (window_attention will not do: Expected Attention's query statistics), and the
 * engine's per-entry scores (engine-scores, layer-engine-scores, any base + "engine"). */
enum { KVEVICT_READS_OBSERVATION = 1, KVEVICT_READS_VALUES = 2, KVEVICT_READS_QUERIES = 4, KVEVICT_READS_SCORES = 8 };

/* The library version, "MAJOR.MINOR.PATCH". */
KVEVICT_C_API const char* kvevict_version(void);
/* The message of the calling thread's last failed call ("" if none); valid until its next failing call. */
KVEVICT_C_API const char* kvevict_last_error(void);

/* The catalogue: kvevict_policy_count() names, 0 <= i < count (NULL past the end). */
KVEVICT_C_API size_t kvevict_policy_count(void);
KVEVICT_C_API const char* kvevict_policy_name(size_t i);

/* The options (kvevict-select's parameter table): kvevict_option_count() of them, 0 <= i < count (NULL past the
 * end). Name in snake_case ("first_stage_ratio"; '-' is accepted too), and one line of help with the accepted range
 * and the default, as `kvevict-select --help` prints it. The names "policy", "base" and "selector" come first; the
 * budgets "budget", "keep" and "compression_ratio" are listed but given to kvevict_select_layers instead. */
KVEVICT_C_API size_t kvevict_option_count(void);
KVEVICT_C_API const char* kvevict_option_name(size_t i);
KVEVICT_C_API const char* kvevict_option_help(size_t i);

/* Creates a policy. `name` is a catalogue name, or NULL with the option "base" or "selector" or both (a composed
 * policy; the one not given defaults to snapkv / attention). Options are name/value pairs of kvevict_option_name's
 * names; a flag (no_covariance, reference_quirks, no_floor, open_window) takes "1"/"true" or "0"/"false". A bad
 * name or value fails with the message kvevict-select gives for it, the name spelled in snake_case.
 * `option_values` may be NULL when n_options is 0. Without "window" the window is the rows of each layer's q_window
 * / window_attention. */
KVEVICT_C_API kvevict_status kvevict_policy_create(const char* name, const char* const* option_names,
                                                   const char* const* option_values, size_t n_options,
                                                   kvevict_policy** out);
KVEVICT_C_API void kvevict_policy_free(kvevict_policy* policy);
/* The policy's name as kvevict-select records it ("snapkv", "snapkv+critical"). */
KVEVICT_C_API const char* kvevict_policy_get_name(const kvevict_policy* policy);
/* KVEVICT_READS_* bits. */
KVEVICT_C_API int kvevict_policy_reads(const kvevict_policy* policy);

KVEVICT_C_API kvevict_budget kvevict_tokens(int64_t n_kept);
KVEVICT_C_API kvevict_budget kvevict_keep_ratio(double keep);
KVEVICT_C_API kvevict_budget kvevict_compression_ratio(double ratio);
KVEVICT_C_API kvevict_budget kvevict_threshold(double tau);

/* A layer with every tensor absent and dense positions. */
KVEVICT_C_API kvevict_layer kvevict_layer_init(void);
/* A contiguous (row-major) tensor of rank 2 or 3 over data. */
KVEVICT_C_API kvevict_tensor kvevict_tensor_contiguous(const void* data, int32_t dtype, int32_t rank,
                                                       const int64_t* shape);

/* Selects every layer at once: per-layer policies each layer, layer-global ones (and share=model) one budget over
 * all of them. On success *out owns one selection per layer; on failure *out is NULL. */
KVEVICT_C_API kvevict_status kvevict_select_layers(const kvevict_policy* policy, kvevict_budget budget,
                                                   const kvevict_layer* layers, size_t n_layers,
                                                   kvevict_selection** out);
KVEVICT_C_API void kvevict_selection_free(kvevict_selection* selection);

/* Sharded selection (docs/algorithms.md#sharded): a collective the engine supplies over its ranks. all_gather writes
 * recv [size * bytes] with every rank's `bytes` bytes at `send`, in rank order (every rank passes the same `bytes`),
 * and returns 0 (anything else fails the selection on this rank: a failing collective should fail on every rank, or
 * abort, never leave the others waiting). */
typedef struct kvevict_communicator {
  void* context; /* passed back to all_gather */
  int32_t rank;  /* this rank, in [0, size) */
  int32_t size;  /* the number of ranks, >= 1 */
  int (*all_gather)(void* context, const void* send, size_t bytes, void* recv);
} kvevict_communicator;

/* This rank's part of a model split across pipeline stages and tensor-parallel ranks. */
typedef struct kvevict_shard {
  kvevict_communicator model;       /* every rank of the model */
  kvevict_communicator layer_group; /* the ranks that hold this rank's layers (all_gather NULL: this rank alone) */
  const int64_t* layer_ids;         /* [n_layers]: the global id of each layer passed, ascending; the option
                                       keep_whole names global ids */
  const int64_t* kv_heads;          /* [n_kv_heads]: the global ids of the KV heads this rank holds of each layer,
                                       ascending; each layer's tensors hold these heads (their query heads, W_o's
                                       columns) */
  size_t n_kv_heads;
} kvevict_shard;

/* kvevict_select_layers on this rank's part of a sharded model: keeps, for its layers and heads, exactly what the
 * one-rank call keeps. Every rank calls it with its own part; a failure is reported on every rank of shard->model
 * with the same message. float32 and float64 caches (any cache at option precision f64). */
KVEVICT_C_API kvevict_status kvevict_select_layers_sharded(const kvevict_policy* policy, kvevict_budget budget,
                                                           const kvevict_layer* layers, size_t n_layers,
                                                           const kvevict_shard* shard, kvevict_selection** out);

/* Reading a selection: layer in [0, layers). The arrays live as long as the selection. */
KVEVICT_C_API size_t kvevict_selection_layers(const kvevict_selection* selection);
KVEVICT_C_API int64_t kvevict_selection_heads(const kvevict_selection* selection, size_t layer);
/* Kept entries of the layer (all heads). */
KVEVICT_C_API int64_t kvevict_selection_total(const kvevict_selection* selection, size_t layer);
/* Kept rows [total], heads concatenated, each head ascending. */
KVEVICT_C_API const int64_t* kvevict_selection_indices(const kvevict_selection* selection, size_t layer);
/* [heads + 1]: head h's rows are indices[offsets[h] .. offsets[h + 1]). */
KVEVICT_C_API const int64_t* kvevict_selection_offsets(const kvevict_selection* selection, size_t layer);
/* [total]: the kept entries' original positions, parallel to indices. */
KVEVICT_C_API const int64_t* kvevict_selection_positions(const kvevict_selection* selection, size_t layer);
/* Block mode (option block B): kept block ids (block b = rows [bB, bB + B)), heads concatenated, and their
 * [heads + 1] offsets; with B = 1 these are indices and offsets. */
KVEVICT_C_API int64_t kvevict_selection_block_count(const kvevict_selection* selection, size_t layer);
KVEVICT_C_API const int64_t* kvevict_selection_blocks(const kvevict_selection* selection, size_t layer);
KVEVICT_C_API const int64_t* kvevict_selection_block_offsets(const kvevict_selection* selection, size_t layer);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVEVICT_C_KVEVICT_H */
