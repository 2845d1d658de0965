#!/usr/bin/env python3
"""Writes the fuzzers' seed corpus (tests/fuzz/corpus/): small valid and broken safetensors files, and
kvevict-select inputs (arguments, NUL NUL, a layer dump) for every policy. Deterministic; rerun after changing
it and commit the result. Only the standard library."""
import json
import os
import random
import struct
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}


def pack(dtype, values):
    fmt = {"F64": "d", "F32": "f", "F16": "e", "I64": "q", "I32": "i"}
    if dtype == "BF16":
        return b"".join(struct.pack("<f", v)[2:] for v in values)
    return struct.pack("<%d%s" % (len(values), fmt[dtype]), *values)


def safetensors(tensors, metadata=None, header_override=None):
    """tensors: list of (name, dtype, shape, values)."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, values in tensors:
        raw = pack(dtype, values)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = header_override if header_override is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def write(sub, name, blob):
    d = os.path.join(HERE, "corpus", sub)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(blob)


def rand(rng, n, scale=1.0):
    return [rng.uniform(-scale, scale) for _ in range(n)]


def layer_tensors(rng, i, H, Hkv, w, L, d, D, dtype="F32", attention=False, w_o=True):
    p = "layers.%d." % i
    out = [(p + "keys", dtype, [Hkv, L, d], rand(rng, Hkv * L * d)),
           (p + "values", dtype, [Hkv, L, d], rand(rng, Hkv * L * d))]
    if attention:
        rows = []
        for _ in range(H * w):
            r = [rng.random() for _ in range(L)]
            s = sum(r)
            rows += [x / s for x in r]
        out.append((p + "window_attention", dtype, [H, w, L], rows))
    else:
        out.append((p + "q_window", dtype, [H, w, d], rand(rng, H * w * d)))
    if w_o:
        out.append((p + "w_o", dtype, [D, H * d], rand(rng, D * H * d, 0.3)))
    return out


def main():
    shutil.rmtree(os.path.join(HERE, "corpus"), ignore_errors=True)
    rng = random.Random(2026)

    # ---- the reader ----
    st = "safetensors"
    write(st, "valid_f32", safetensors([("a", "F32", [2, 3], rand(rng, 6))]))
    write(st, "valid_all_dtypes", safetensors([(n.lower(), n, [2, 2], [1, 2, 3, 4]) for n in SIZES],
                                              metadata={"format": "pt", "k": "v"}))
    write(st, "valid_scalar_and_empty", safetensors([("s", "F32", [], [1.5]), ("e", "F16", [0, 4], [])]))
    write(st, "valid_rank4", safetensors([("t", "BF16", [1, 2, 1, 2], [0.5, -1, 2, 1e30])]))
    ok = safetensors([("a", "F32", [4], [1, 2, 3, 4])])
    write(st, "truncated", ok[:-3])
    write(st, "header_beyond_file", struct.pack("<Q", 10 ** 6) + ok[8:])
    write(st, "short_length_prefix", ok[:5])
    write(st, "not_json", safetensors([], header_override=b"{\"a\": [1, 2"))
    write(st, "not_object", safetensors([], header_override=b"[1, 2, 3]"))
    write(st, "duplicate_key", safetensors([], header_override=b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                                                                 b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}') + b"\0" * 4)
    write(st, "overlap", safetensors([], header_override=b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                                                          b'"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}') + b"\0" * 12)
    write(st, "offsets_outside", safetensors([], header_override=b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}') + b"\0" * 8)
    write(st, "shape_overflow", safetensors([], header_override=b'{"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 16], "data_offsets": [0, 16]}}') + b"\0" * 16)
    write(st, "shape_vs_bytes", safetensors([], header_override=b'{"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}') + b"\0" * 16)
    write(st, "unknown_dtype", safetensors([], header_override=b'{"a": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}}') + b"\0" * 2)
    write(st, "negative_shape", safetensors([], header_override=b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}') + b"\0" * 4)
    write(st, "gap_in_data", safetensors([], header_override=b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}') + b"\0" * 8)

    # ---- kvevict-select ----
    def sel(name, args, tensors):
        write("select", name, b"".join(a.encode() + b"\0" for a in args) + b"\0" + safetensors(tensors))

    one = layer_tensors(rng, 0, 4, 2, 3, 12, 4, 8)
    two = one + layer_tensors(rng, 1, 4, 2, 3, 12, 4, 8)
    for policy in ["snapkv", "adakv", "streamingllm", "criticalkv", "criticalkv-snapkv", "defensivekv",
                   "layer-defensivekv", "adakv-defensive"]:
        sel(policy, ["--policy", policy, "--keep", "0.5"], two)
    sel("quirks_defensive", ["--policy", "defensivekv", "--compression-ratio", "0.5", "--reference-quirks"], two)
    sel("quirks_critical", ["--policy", "criticalkv", "--budget", "6", "--reference-quirks", "--value-norm", "l2"], one)
    sel("composed_layer_critical", ["--base", "layer", "--selector", "critical", "--keep", "0.3", "--precision", "f64"], two)
    sel("composed_snapkv_defensive", ["--base", "snapkv", "--selector", "defensive", "--budget", "5", "--pool", "max",
                                      "--kernel", "3"], one)
    sel("adakv_original", ["--policy", "adakv", "--budget", "4", "--adakv-variant", "original", "--alpha", "0.5"], one)
    sel("attention_input", ["--policy", "snapkv", "--keep", "0.5"], layer_tensors(rng, 0, 2, 1, 3, 10, 4, 8, attention=True))
    sel("bf16", ["--policy", "criticalkv", "--keep", "0.5"], layer_tensors(rng, 0, 4, 2, 3, 12, 4, 8, dtype="BF16"))
    sel("f16_gqa8", ["--policy", "defensivekv", "--keep", "0.4"], layer_tensors(rng, 0, 8, 1, 2, 9, 2, 4, dtype="F16"))
    sel("d1", ["--policy", "layer-defensivekv", "--budget", "3"], layer_tensors(rng, 0, 2, 2, 1, 5, 1, 2))
    sel("budget_equals_L", ["--policy", "adakv", "--budget", "12"], one)
    bad = [t for t in one if not t[0].endswith("w_o")]
    sel("missing_w_o", ["--policy", "criticalkv", "--keep", "0.5"], bad)
    sel("wrong_rank", ["--policy", "snapkv", "--keep", "0.5"], [("layers.0.keys", "F32", [2, 12], rand(rng, 24))] + one[1:])
    sel("values_shape", ["--policy", "snapkv", "--keep", "0.5"], [one[0], ("layers.0.values", "F32", [2, 11, 4], rand(rng, 88))] + one[2:])
    sel("window_too_long", ["--policy", "snapkv", "--keep", "0.5", "--window", "20"], one)
    sel("nan_keys", ["--policy", "snapkv", "--keep", "0.5"], [("layers.0.keys", "F32", [2, 12, 4], [float("nan")] * 96)] + one[1:])
    sel("layer_gap", ["--policy", "snapkv", "--keep", "0.5"], one + [("layers.2.keys", "F32", [1], [0.0])])
    sel("i64_keys", ["--policy", "snapkv", "--keep", "0.5"], [("layers.0.keys", "I64", [2, 12, 4], [1] * 96)] + one[1:])

    # ---- ragged layers (docs/algorithms.md#ragged): lengths and positions, padding never read ----
    def ragged(i, lengths, dtype="I64"):
        t = layer_tensors(rng, i, 4, 2, 3, 12, 4, 8)
        pos = []
        for n in lengths:
            start = rng.randrange(0, 5)
            row = sorted(rng.sample(range(start, start + 40), n))
            pos += row + [0] * (12 - n)
        return t + [("layers.%d.lengths" % i, dtype, [2], lengths), ("layers.%d.positions" % i, dtype, [2, 12], pos)]

    rag = ragged(0, [12, 7]) + ragged(1, [5, 10])
    for policy in ["snapkv", "adakv", "streamingllm", "criticalkv", "defensivekv", "layer-defensivekv"]:
        sel("ragged_" + policy, ["--policy", policy, "--budget", "4"], rag)
    sel("ragged_i32_keep", ["--policy", "adakv-defensive", "--keep", "0.5"], ragged(0, [9, 12], "I32"))
    sel("ragged_over_capacity", ["--policy", "snapkv", "--budget", "3"], ragged(0, [13, 5])[:-1] +
        [("layers.0.positions", "I64", [2, 12], list(range(24)))])
    sel("ragged_positions_not_increasing", ["--policy", "snapkv", "--budget", "3"],
        layer_tensors(rng, 0, 4, 2, 3, 12, 4, 8) + [("layers.0.positions", "I64", [2, 12], [5] * 24)])

    # ---- layouts (docs/algorithms.md#layouts): shared sets, whole blocks, reductions (own generator) ----
    lay = random.Random(8)
    shared = layer_tensors(lay, 0, 4, 2, 3, 20, 4, 8) + layer_tensors(lay, 1, 4, 2, 3, 20, 4, 8)
    sel("layout_layer_block", ["--policy", "layer-defensivekv", "--budget", "9", "--share", "layer", "--block", "4"],
        shared)
    sel("layout_model_mean", ["--policy", "criticalkv", "--budget", "8", "--share", "model", "--block", "3",
                              "--reduce", "mean"], shared)
    sel("layout_head_block", ["--policy", "streamingllm", "--budget", "8", "--block", "5"], shared)
    sel("layout_ragged_shared", ["--policy", "adakv", "--budget", "4", "--share", "layer"], rag)  # refused


if __name__ == "__main__":
    main()
