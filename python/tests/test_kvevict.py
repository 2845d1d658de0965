# Tests of the Python module kvevict (python/kvevict_python.cpp, pybind11 over the C API).
#
#   PYTHONPATH=build/mine/python KVEVICT_SELECT=build/mine/tools/kvevict-select \
#       /usr/bin/python3 -m pytest python/tests -q
#
# 1. The module selects exactly what kvevict-select selects: every catalogue policy and composed base+selector, on
#    random layers (GQA groups 1/2/4, 1-3 layers, head_dim 4-16, ragged layers with lengths and positions, float32 /
#    float64 / float16 storage) written as safetensors in pure Python, and with the tool's options.
# 2. Inputs: dtypes, non-contiguous numpy views (transposed, stepped, negative and zero strides, unaligned), the
#    tokens layout, torch tensors through __dlpack__ (bfloat16 included), window_attention in place of q_window.
# 3. Bad inputs raise ValueError whose message names the offending thing (never a crash).
# 4. The GIL is released while selecting: concurrent selections give the single-threaded results.
#
# The tool comparisons need KVEVICT_SELECT (the kvevict-select executable) and are skipped without it; torch tests
# are skipped without torch.

import ctypes
import json
import math
import re
import struct
import subprocess
import threading

import numpy as np
import pytest

import kvevict

try:
    import torch
except ImportError:  # the DLPack tests are skipped
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (DLPack tests)")

# ----------------------------------------------------------------------------------------------------------------
# safetensors in pure Python: 8-byte little-endian header length, JSON header, raw little-endian data.

_ST_NAMES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int8): "I8",
}
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "BF16": "<u2"}


class BF16:
    """bfloat16 data for st_write, as its raw bits (uint16)."""

    def __init__(self, bits):
        self.bits = np.ascontiguousarray(bits, dtype=np.uint16)


class FP8:
    """fp8 data for st_write: its codes (uint8) and format, "e4m3" or "e5m2"."""

    def __init__(self, codes, fmt):
        self.bits = np.ascontiguousarray(codes, dtype=np.uint8)
        self.fmt = fmt


def st_write(path, tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        if isinstance(array, BF16):
            dtype, data = "BF16", array.bits.astype("<u2")
        elif isinstance(array, FP8):
            dtype, data = "F8_" + array.fmt.upper(), array.bits
        else:
            array = np.asarray(array)
            dtype = _ST_NAMES[array.dtype]
            data = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<")))
        raw = data.tobytes()
        header[name] = {"dtype": dtype, "shape": list(data.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the customary padding to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def st_read(path):
    """{name: numpy array} and the metadata of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    metadata = header.pop("__metadata__", {})
    data = raw[8 + n :]
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype=_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return out, metadata


# ----------------------------------------------------------------------------------------------------------------
# Random layers.

F32, F64, F16 = np.float32, np.float64, np.float16


def make_layers(seed, Hkv, G, Ls, d, w, ragged=False, kv=F32, q=F32, wo=None, D=12, int32_ragged=False):
    """Layers as dicts of select_layers (keys, values [Hkv, L, d], q_window [H, w, d], w_o [D, H d], the engine's
    scores [Hkv, L] (from a generator of their own, so that the other tensors are those of the seed alone); ragged
    layers also lengths [Hkv] and positions [Hkv, L], strictly increasing over every row, padding included)."""
    rng = np.random.default_rng(seed)
    score_rng = np.random.default_rng([seed, 1])
    H = Hkv * G
    layers = []
    for L in Ls:
        layer = {
            "keys": rng.standard_normal((Hkv, L, d)).astype(kv),
            "values": rng.standard_normal((Hkv, L, d)).astype(kv),
            "q_window": rng.standard_normal((H, w, d)).astype(q),
            "w_o": (rng.standard_normal((D, H * d)) / math.sqrt(H * d)).astype(wo or q),
            "scores": score_rng.random((Hkv, L)).astype(q),
        }
        if ragged:
            lengths = rng.integers(max(w + 2, L // 2), L + 1, size=Hkv)
            lengths[rng.integers(Hkv)] = L  # the longest head fills the capacity
            steps = rng.integers(1, 4, size=(Hkv, L))
            positions = np.cumsum(steps, axis=1) + rng.integers(0, 5, size=(Hkv, 1)) - 1
            itype = np.int32 if int32_ragged else np.int64
            layer["lengths"] = lengths.astype(itype)
            layer["positions"] = positions.astype(itype)
        layers.append(layer)
    return layers


# name: make_layers arguments. GQA groups 1/2/4, 1-3 layers, head_dim 4-16, ragged and dense, every storage dtype.
CONFIGS = {
    "g1-1layer-d4-f32": dict(seed=1, Hkv=2, G=1, Ls=[24], d=4, w=4),
    "g2-2layers-d8-ragged-f32": dict(seed=2, Hkv=2, G=2, Ls=[32, 40], d=8, w=4, ragged=True),
    "g4-3layers-d16-f64": dict(seed=3, Hkv=1, G=4, Ls=[20, 20, 28], d=16, w=3, kv=F64, q=F64),
    "g4-2layers-d8-ragged-f16": dict(seed=4, Hkv=4, G=4, Ls=[36, 30], d=8, w=5, ragged=True, kv=F16, q=F16),
    "g2-1layer-d6-ragged-mixed": dict(seed=5, Hkv=3, G=2, Ls=[45], d=6, w=2, ragged=True, kv=F32, q=F64, wo=F16,
                                      int32_ragged=True),
    "g1-3layers-d12-ragged-f64": dict(seed=6, Hkv=2, G=1, Ls=[26, 34, 30], d=12, w=6, ragged=True, kv=F64, q=F32),
}
# The options' layers: dense, every layer alike (share=model needs it); and a ragged pair.
OPTS = dict(seed=11, Hkv=2, G=2, Ls=[40, 40], d=8, w=4)
OPTS_RAGGED = dict(seed=12, Hkv=2, G=2, Ls=[40, 36], d=8, w=4, ragged=True)

POLICIES = list(kvevict.policies())
BASES = ["snapkv", "adakv", "defensivekv", "layer", "pyramidkv"]
SELECTORS = ["attention", "critical", "defensive", "knorm", "keydiff", "expected", "h2o", "engine"]
COMPOSED = [(b, s) for b in BASES for s in SELECTORS]
ALL_POLICIES = POLICIES + COMPOSED


def policy_id(p):
    return p if isinstance(p, str) else "%s+%s" % p


def policy_kwargs(p):
    """select_layers' policy argument and keywords for a policy spec (a name, or (base, selector))."""
    return (p, {}) if isinstance(p, str) else (None, {"base": p[0], "selector": p[1]})


def per_head_tova(p, layers, options):
    """The options the tests run a policy with on `layers`:
    - TOVA shares one set per layer by default, which needs every KV head at the same positions and refuses
      reference_quirks: on ragged layers (heads with their own lengths or positions), and with reference_quirks, it
      runs per head unless the options choose the sharing;
    - a key-only selector (knorm, keydiff) or the engine's scores (engine) composed with a base reads no q_window,
      so the window is not taken from it: the base's default (32) is too long for these layers, so it gets the
      data's window unless given one."""
    options = options or {}
    ragged = any("lengths" in layer or "positions" in layer for layer in layers)
    if p == "tova" and (ragged or options.get("reference_quirks")) and "share" not in options:
        return dict(options, share="head")
    obs = layers[0].get("q_window", layers[0].get("window_attention"))
    if not isinstance(p, str) and p[1] in ("knorm", "keydiff", "engine") and "window" not in options and obs is not None:
        return dict(options, window=int(obs.shape[1]))
    return options


def select_layers(p, layers, budget, options=None, layout="heads"):
    name, extra = policy_kwargs(p)
    options = per_head_tova(p, layers, options)
    return kvevict.select_layers(name, layers, layout=layout, **budget, **extra, **options)


def cli_args(p, budget, options):
    args = ["--policy", p] if isinstance(p, str) else ["--base", p[0], "--selector", p[1]]
    for key, value in list(budget.items()) + list((options or {}).items()):
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            continue
        else:
            args += [flag, repr(value) if isinstance(value, float) else str(value)]
    return args


def layers_file(layers, path):
    tensors = {}
    for i, layer in enumerate(layers):
        for name, value in layer.items():
            tensors["layers.%d.%s" % (i, name)] = value
    st_write(path, tensors, {"producer": "python/tests/test_kvevict.py"})
    return path


def run_cli(exe, in_path, out_path, p, budget, options=None):
    return subprocess.run([exe] + cli_args(p, budget, options) + [str(in_path), str(out_path)],
                          capture_output=True, text=True, timeout=60)


# ----------------------------------------------------------------------------------------------------------------
# Comparisons.


def assert_same_as_cli(sels, out, block=1):
    """The module's selections equal the tool's output tensors, and the tool wrote no others."""
    expected = set()
    for i, s in enumerate(sels):
        fields = [("kept_indices", s.indices), ("kept_offsets", s.offsets), ("kept_positions", s.positions)]
        if block > 1:
            fields += [("kept_blocks", s.blocks), ("kept_block_offsets", s.block_offsets)]
        for field, got in fields:
            name = "layers.%d.%s" % (i, field)
            expected.add(name)
            assert name in out, "kvevict-select wrote no %s" % name
            assert got.dtype == np.int64, name
            np.testing.assert_array_equal(got, out[name], err_msg="%s: module vs kvevict-select" % name)
    assert set(out) == expected, "kvevict-select wrote %s; the module has %d layers" % (sorted(set(out) - expected),
                                                                                        len(sels))


def assert_same_selections(a, b, what=""):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        for field in ("indices", "offsets", "positions", "blocks", "block_offsets"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field),
                                          err_msg="%s layer %d %s" % (what, i, field))
        assert x.heads == y.heads and x.total == y.total


def check_selection(sel, layer, block=1):
    """A Selection's invariants on its layer: shapes, head slices, ascending rows inside the heads' lengths, the
    original positions of the kept rows, blocks equal to the rows without --block."""
    Hkv, L = layer["keys"].shape[0], layer["keys"].shape[1]
    assert sel.heads == Hkv
    for name in ("indices", "offsets", "positions", "blocks", "block_offsets"):
        assert getattr(sel, name).dtype == np.int64, name
    off = sel.offsets
    assert off.shape == (Hkv + 1,) and off[0] == 0 and off[-1] == sel.total == len(sel.indices) == len(sel.positions)
    lengths = np.asarray(layer.get("lengths", np.full(Hkv, L)))
    positions = layer.get("positions")
    for h in range(Hkv):
        rows = sel.indices[off[h] : off[h + 1]]
        np.testing.assert_array_equal(sel.head(h), rows)
        assert np.all(np.diff(rows) > 0), "head %d rows not ascending: %s" % (h, rows)
        assert rows.size == 0 or (rows[0] >= 0 and rows[-1] < lengths[h])
        want = rows if positions is None else np.asarray(positions)[h, rows]
        np.testing.assert_array_equal(sel.positions[off[h] : off[h + 1]], want)
    if block == 1:
        np.testing.assert_array_equal(sel.blocks, sel.indices)
        np.testing.assert_array_equal(sel.block_offsets, sel.offsets)
    assert repr(sel) == "<kvevict.Selection heads=%d total=%d>" % (Hkv, sel.total)


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """Input files written once per set of layers: files(key, layers) -> path."""
    folder = tmp_path_factory.mktemp("inputs")
    cache = {}

    def get(key, layers):
        if key not in cache:
            cache[key] = layers_file(layers, folder / ("%s.safetensors" % re.sub(r"[^\w.-]", "_", key)))
        return cache[key]

    return get


def compare_with_cli(exe, files, tmp_path, key, layers, p, budget, options=None, layout_layers=None):
    """Runs the tool and the module on the same layers: identical selections, or the same refusal."""
    in_path = files(key, layers)
    out_path = tmp_path / "out.safetensors"
    options = per_head_tova(p, layers, options)
    proc = run_cli(exe, in_path, out_path, p, budget, options)
    block = (options or {}).get("block", 1)
    if proc.returncode != 0:
        with pytest.raises(ValueError) as err:
            select_layers(p, layers, budget, options)
        pytest.fail("kvevict-select and the module both refuse %s %s %s:\n  tool: %s  module: %s"
                    % (policy_id(p), budget, options, proc.stderr, err.value))
    sels = select_layers(p, layers, budget, options)
    out, metadata = st_read(out_path)
    assert_same_as_cli(sels, out, block)
    for sel, layer in zip(sels, layers):
        check_selection(sel, layer, block)
    assert metadata.get("policy") == policy_id(p)
    return sels


# ----------------------------------------------------------------------------------------------------------------
# 1. Same as kvevict-select.


def test_catalogue_and_version(kvevict_select):
    help_text = subprocess.run([kvevict_select, "--help"], capture_output=True, text=True, timeout=30).stdout
    listed = re.search(r"policies:\n(.*?)\nbases", help_text, re.S).group(1)
    assert POLICIES == [line.split()[0] for line in listed.splitlines()]
    bases = re.search(r"bases \(.*?\n(.*?)\nselectors: ([^\n]*)\n", help_text, re.S)
    assert BASES == [line.split()[0] for line in bases.group(1).splitlines()]
    assert SELECTORS == [s.strip() for s in bases.group(2).split(",")]


def test_options_table_is_the_clis(kvevict_select):
    """--help, the C API and Python derive their options from one table: each option's help line is --help's."""
    help_text = subprocess.run([kvevict_select, "--help"], capture_output=True, text=True, timeout=30).stdout
    options = kvevict.options()
    assert list(options)[:6] == ["policy", "base", "selector", "budget", "keep", "compression_ratio"]
    for name, text in options.items():
        if name in ("policy", "base", "selector"):
            continue  # in the usage line
        line = re.search(r"^  --" + re.escape(name.replace("_", "-")) + r"\b[^\n]*$", help_text, re.M)
        assert line, name
        assert line.group(0).endswith(" " + text), (name, line.group(0), text)
        assert name in kvevict.__doc__


BAD_VALUES = ["x", "", "-7", "0", "4", "0.5", "1.5", "1e400", "nan", "l3"]


def test_option_messages_agree_with_cli(kvevict_select, tmp_path):
    """A bad value gets the same message from kvevict-select, the C API and Python (the name spelled by each)."""
    compared = 0
    for name in kvevict.options():
        if name in ("policy", "base", "selector", "budget", "keep", "compression_ratio", "threshold"):
            continue
        for value in BAD_VALUES:
            try:
                kvevict.select("snapkv", keys=K0, values=V0, q_window=Q0, w_o=W0, keep=0.5, **{name: value})
                continue  # a valid value here
            except ValueError as e:
                api = str(e)
            if api.startswith("the layers kept whole name layer"):
                continue  # checked against the model's layers, which kvevict-select reads after its options
            flag = "--" + name.replace("_", "-")
            if name in ("no_covariance", "reference_quirks", "no_floor", "open_window", "no_value_term"):
                assert api == "%s expects a boolean (1, true, 0 or false), got '%s'" % (name, value)
                continue  # a flag takes no value on the command line
            cli = subprocess.run([kvevict_select, "--policy", "snapkv", "--keep", "0.5", flag, value,
                                  str(tmp_path / "none.safetensors"), str(tmp_path / "out.safetensors")],
                                 capture_output=True, text=True, timeout=30)
            assert cli.returncode == 2, (flag, value, cli.stderr)
            assert cli.stderr == "kvevict-select: %s (see --help)\n" % api.replace(name, flag, 1), (api, cli.stderr)
            compared += 1
    assert compared >= 40


def test_version_and_policies():
    assert re.fullmatch(r"\d+\.\d+\.\d+", kvevict.__version__)
    assert len(POLICIES) == len(set(POLICIES)) >= 8
    for name in ("streamingllm", "snapkv", "adakv", "criticalkv", "defensivekv", "layer-defensivekv"):
        assert name in POLICIES


@pytest.mark.parametrize("p", ALL_POLICIES, ids=policy_id)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_same_as_cli(kvevict_select, files, tmp_path, config, p):
    layers = make_layers(**CONFIGS[config])
    compare_with_cli(kvevict_select, files, tmp_path, config, layers, p, {"keep": 0.5})


# (id, budget, options, ragged) on OPTS; those marked ragged also on OPTS_RAGGED. Every catalogue policy, and one
# composed policy per base (each selector once at least).
OPTION_POLICIES = POLICIES + [("snapkv", "critical"), ("adakv", "defensive"), ("defensivekv", "attention"),
                              ("layer", "critical")]
OPTION_CASES = [
    ("window", {"keep": 0.5}, {"window": 4}, True),
    ("pool-max", {"keep": 0.5}, {"pool": "max"}, True),
    ("kernel-3", {"keep": 0.5}, {"kernel": 3}, True),
    ("kernel-1", {"keep": 0.5}, {"kernel": 1}, False),
    ("share-layer", {"keep": 0.5}, {"share": "layer"}, False),
    ("share-layer-mean", {"keep": 0.5}, {"share": "layer", "reduce": "mean"}, False),
    ("share-model", {"keep": 0.5}, {"share": "model"}, False),
    ("block-4", {"keep": 0.5}, {"block": 4}, True),
    ("block-4-share-layer", {"keep": 0.5}, {"block": 4, "share": "layer"}, False),
    ("precision-f64", {"keep": 0.5}, {"precision": "f64"}, True),
    ("value-norm-l2", {"keep": 0.5}, {"value_norm": "l2"}, True),
    ("alpha", {"keep": 0.5}, {"alpha": 0.5}, True),
    ("adakv-original", {"keep": 0.5}, {"adakv_variant": "original"}, True),
    ("sinks", {"keep": 0.5}, {"sinks": 2}, True),
    ("eps", {"keep": 0.5}, {"eps": 0.001}, False),
    ("first-stage-ratio", {"keep": 0.5}, {"first_stage_ratio": 0.25}, True),
    ("mass-threshold", {"keep": 0.5}, {"mass_threshold": 0.5}, True),
    ("no-floor", {"keep": 0.5}, {"no_floor": True}, True),
    ("no-floor-false", {"keep": 0.5}, {"no_floor": False}, False),
    ("open-window", {"keep": 0.5}, {"open_window": True}, True),
    ("no-value-term", {"keep": 0.5}, {"no_value_term": True}, True),
    ("retrieval-heads", {"keep": 0.5}, {"retrieval_heads": "1:0,0:1"}, True),
    ("reference-quirks", {"compression_ratio": 0.5}, {"reference_quirks": True}, False),
    ("budget-N", {"budget": 13}, {}, True),
    ("budget-1", {"budget": 1}, {}, False),
    ("budget-L", {"budget": 40}, {}, False),
    ("compression-ratio", {"compression_ratio": 0.6}, {}, True),
    ("keep-1", {"keep": 1.0}, {}, True),
    ("keep-0.3", {"keep": 0.3}, {}, True),
]


@pytest.mark.parametrize("p", OPTION_POLICIES, ids=policy_id)
@pytest.mark.parametrize("case", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_options_same_as_cli(kvevict_select, files, tmp_path, case, p):
    _, budget, options, _ = case
    compare_with_cli(kvevict_select, files, tmp_path, "opts", make_layers(**OPTS), p, budget, options)


RAGGED_OPTION_CASES = [c for c in OPTION_CASES if c[3]]


@pytest.mark.parametrize("p", OPTION_POLICIES, ids=policy_id)
@pytest.mark.parametrize("case", RAGGED_OPTION_CASES, ids=[c[0] for c in RAGGED_OPTION_CASES])
def test_options_same_as_cli_ragged(kvevict_select, files, tmp_path, case, p):
    _, budget, options, _ = case
    compare_with_cli(kvevict_select, files, tmp_path, "opts-ragged", make_layers(**OPTS_RAGGED), p, budget, options)


# ----------------------------------------------------------------------------------------------------------------
# Quantized caches: int8 codes, and fp8 codes as uint8 with fp8='e4m3' / 'e5m2' (torch: tensor.view(torch.uint8)).


def _fp8_value(b, exponent_bits):
    """The value of fp8 code b (OCP E4M3 with exponent_bits 4: no infinities, S.1111.111 NaN; E5M2: IEEE-like)."""
    mantissa_bits = 7 - exponent_bits
    bias = (1 << (exponent_bits - 1)) - 1
    e, m = (b >> mantissa_bits) & ((1 << exponent_bits) - 1), b & ((1 << mantissa_bits) - 1)
    sign = -1.0 if b & 0x80 else 1.0
    if exponent_bits == 4 and e == 15 and m == 7:
        return math.nan
    if exponent_bits == 5 and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * math.ldexp(m, 1 - bias - mantissa_bits)
    return sign * math.ldexp((1 << mantissa_bits) + m, e - bias - mantissa_bits)


FP8_VALUES = {"e4m3": np.array([_fp8_value(b, 4) for b in range(256)], F32),
              "e5m2": np.array([_fp8_value(b, 5) for b in range(256)], F32)}


def quantize(x, fmt):
    """Codes near the float values x: int8 (round, clip to [-127, 127]) or the nearest finite fp8 code."""
    if fmt == "i8":
        return np.clip(np.rint(x), -127, 127).astype(np.int8)
    table = FP8_VALUES[fmt]
    finite = np.flatnonzero(np.isfinite(table))
    nearest = np.abs(table[finite][None, :] - np.asarray(x, F32).reshape(-1, 1)).argmin(axis=1)
    return finite[nearest].astype(np.uint8).reshape(np.shape(x))


def dequantize(codes, fmt, scale):
    """float32 values of a quantized cache [Hkv, L, d]: float(code) * factor, one float32 rounding (the library's
    rule, docs/algorithms.md#quantized); scale None, a number, [L] or [Hkv, L]."""
    values = codes.astype(F32) if fmt == "i8" else FP8_VALUES[fmt][codes]
    if scale is None:
        return values
    factor = np.asarray(scale, F32)
    if factor.ndim == 1:
        factor = factor[None, :]
    return (values * (factor[..., None] if factor.ndim == 2 else factor)).astype(F32)


def quantized_layers(fmt, scale_kind, seed=31, Hkv=2, G=2, Ls=(40, 36), d=8, w=4, ragged=False):
    """(quantized layers, the float32 layers holding their values): codes near N(0, 4) keys and values (int8: N(0,
    40)), scales of scale_kind ("none", "tensor" (a number), "tensor-1" ([1]), "token", "head-token") near
    0.05-0.3, fp8 codes as uint8."""
    rng = np.random.default_rng(seed)
    quantized, floats = [], []
    for layer in make_layers(seed=seed, Hkv=Hkv, G=G, Ls=list(Ls), d=d, w=w, ragged=ragged):
        L = layer["keys"].shape[1]
        q, f = dict(layer), dict(layer)
        for name in ("keys", "values"):
            codes = quantize(layer[name] * (40.0 if fmt == "i8" else 4.0), fmt)
            scale = {"none": None, "tensor": F32(rng.uniform(0.05, 0.3)),
                     "tensor-1": rng.uniform(0.05, 0.3, size=1).astype(F32),
                     "token": rng.uniform(0.05, 0.3, size=L).astype(F32),
                     "head-token": rng.uniform(0.05, 0.3, size=(Hkv, L)).astype(F32)}[scale_kind]
            q[name] = codes
            if scale is not None:
                q[name + "_scale"] = scale
            f[name] = dequantize(codes, fmt, scale)
        quantized.append(q)
        floats.append(f)
    return quantized, floats


QUANTIZED_POLICIES = POLICIES + [("snapkv", "critical"), ("adakv", "defensive"), ("layer", "expected")]
SCALE_KINDS = ["none", "tensor", "tensor-1", "token", "head-token"]


@pytest.mark.parametrize("fmt", ["i8", "e4m3", "e5m2"])
@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
def test_quantized_cache_selects_as_float32(fmt, scale_kind):
    """int8 and fp8 caches select exactly what float32 storage holding the dequantized values selects, for every
    policy, at precision f32 and f64, dense and ragged."""
    fp8 = None if fmt == "i8" else fmt
    for ragged in (False, True):
        quantized, floats = quantized_layers(fmt, scale_kind, seed=31 + ragged, ragged=ragged)
        for p in QUANTIZED_POLICIES:
            name, extra = policy_kwargs(p)
            options = per_head_tova(p, floats, {})
            for precision in ("f32", "f64"):
                want = kvevict.select_layers(name, floats, keep=0.5, precision=precision, **extra, **options)
                got = kvevict.select_layers(name, quantized, keep=0.5, precision=precision, fp8=fp8, **extra,
                                            **options)
                assert_same_selections(want, got, "%s %s %s %s ragged=%s" % (policy_id(p), fmt, scale_kind,
                                                                             precision, ragged))
    # the scales matter: reading the codes without them selects otherwise for some policy
    if scale_kind != "none":
        quantized, _ = quantized_layers(fmt, scale_kind, seed=31)
        unscaled = [{k: v for k, v in layer.items() if not k.endswith("_scale")} for layer in quantized]
        assert any(not np.array_equal(kvevict.select_layers(p, quantized, keep=0.5, fp8=fp8)[0].indices,
                                      kvevict.select_layers(p, unscaled, keep=0.5, fp8=fp8)[0].indices)
                   for p in ("snapkv", "criticalkv", "defensivekv"))


@pytest.mark.parametrize("fmt", ["i8", "e4m3", "e5m2"])
def test_quantized_cache_layouts(fmt):
    """The tokens layout ([L, Hkv, d] codes, [L, Hkv] scales), strided codes and one-layer select()."""
    fp8 = None if fmt == "i8" else fmt
    quantized, floats = quantized_layers(fmt, "head-token", seed=41, Ls=(40,))
    want = kvevict.select_layers("defensivekv", floats, keep=0.5)
    tokens = dict(quantized[0])
    for name in ("keys", "values"):
        tokens[name] = np.ascontiguousarray(quantized[0][name].transpose(1, 0, 2))
        tokens[name + "_scale"] = np.ascontiguousarray(quantized[0][name + "_scale"].T)
    assert_same_selections(want, kvevict.select_layers("defensivekv", [tokens], keep=0.5, layout="tokens", fp8=fp8))
    strided = dict(quantized[0])
    for name in ("keys", "values"):
        wide = np.zeros(quantized[0][name].shape[:2] + (16,), quantized[0][name].dtype)
        wide[:, :, ::2] = quantized[0][name]
        strided[name] = wide[:, :, ::2]  # head_dim at stride 2: the C API copies the codes
        strided[name + "_scale"] = np.asfortranarray(quantized[0][name + "_scale"])
    assert_same_selections(want, [kvevict.select("defensivekv", **strided, keep=0.5, fp8=fp8)])


@pytest.mark.parametrize("fmt", ["i8", "e4m3", "e5m2"])
@pytest.mark.parametrize("p", POLICIES + [("snapkv", "critical")], ids=policy_id)
def test_quantized_cache_same_as_cli(kvevict_select, files, tmp_path, fmt, p):
    """The module on int8 / fp8 codes selects what kvevict-select selects from the same codes in safetensors (I8,
    F8_E4M3, F8_E5M2 with keys_scale / values_scale), which dequantizes them its own way."""
    quantized, _ = quantized_layers(fmt, "head-token" if fmt == "i8" else "token", seed=51, ragged=True)
    stored = [{k: (FP8(v, fmt) if fmt != "i8" and k in ("keys", "values") else v) for k, v in layer.items()}
              for layer in quantized]
    in_path = files("quantized-" + fmt, stored)
    out_path = tmp_path / "out.safetensors"
    options = per_head_tova(p, quantized, {})
    proc = run_cli(kvevict_select, in_path, out_path, p, {"keep": 0.5}, options)
    assert proc.returncode == 0, proc.stderr
    name, extra = policy_kwargs(p)
    sels = kvevict.select_layers(name, quantized, keep=0.5, fp8=None if fmt == "i8" else fmt, **extra, **options)
    assert_same_as_cli(sels, st_read(out_path)[0])


def test_quantized_cache_errors():
    (q,), _ = quantized_layers("e4m3", "token", seed=61, Ls=(24,))
    (i,), _ = quantized_layers("i8", "token", seed=61, Ls=(24,))
    cases = [
        (dict(q), {}, r"keys is uint8: pass fp8='e4m3' or fp8='e5m2'"),
        (dict(q), {"fp8": "e3m4"}, r"fp8 must be 'e4m3' or 'e5m2'.*'e3m4'"),
        (dict(i), {"fp8": "e4m3"}, r"fp8='e4m3' says the cache holds fp8 codes as uint8, but keys is not uint8"),
        (dict(q, values=q["values"].view(np.int8)), {"fp8": "e4m3"}, r"values is not uint8"),
        (dict(i, values=i["values"].astype(F32), values_scale=None), {},
         r"values are f32 and keys i8; expected one dtype for both"),
        (dict(q, q_window=q["keys"]), {"fp8": "e4m3"}, r"q_window: dtype uint8 is not supported"),
        (dict(i, q_window=i["keys"]), {}, r"q_window is i8: quantized codes are for the keys and values only"),
        (dict(i, keys_scale=i["keys_scale"][:-1]), {}, r"keys_scale has shape \[23\]; expected \[\] \(one "
                                                       r"factor\), \[24\] \(one per token\) or \[2, 24\]"),
        (dict(i, keys_scale=i["keys_scale"].astype(F64)), {}, r"keys_scale is f64; expected F32"),
        (dict(i, keys_scale=np.ones((2, 24, 1), F32)), {}, r"keys_scale has rank 3"),
        (dict(i, keys=i["keys"].astype(F32), values=i["values"].astype(F32)), {},
         r"keys_scale is given and the cache is f32; expected scales only for quantized caches"),
        (dict(i, keys_scale=np.full(24, np.inf, F32)), {}, r"keys_scale\[0\] is inf; expected finite"),
        (dict(i, keys_scale=float("nan")), {}, r"keys_scale is nan; expected finite dequantisation factors"),
        (dict(i, values_scale=np.full((2, 24), 1e37, F32)), {},
         r"values\[0, 0, \d\] is not finite \(inf = stored -?\d+ x scale 1e\+37"),
        (dict(q, keys=np.full_like(q["keys"], 0x7F)), {"fp8": "e4m3"}, r"keys\[0, 0, 0\] is not finite \(nan = stored"),
    ]
    for layer, extra, message in cases:
        args = {k: v for k, v in layer.items() if v is not None}
        for precision in ("f32", "f64"):
            with pytest.raises(ValueError, match=message):
                kvevict.select("defensivekv", **args, **extra, keep=0.5, precision=precision)


def test_select_equals_select_layers():
    (layer,) = make_layers(**CONFIGS["g1-1layer-d4-f32"])
    for p in POLICIES:
        one = kvevict.select(p, **layer, keep=0.5)
        assert_same_selections([one], kvevict.select_layers(p, [layer], keep=0.5), p)
    one = kvevict.select(None, base="adakv", selector="critical", **layer, budget=7)
    assert_same_selections([one], kvevict.select_layers(None, [layer], base="adakv", selector="critical", budget=7))


def test_protected_prefix():
    """docs/algorithms.md#protected-prefix: protect_prefix=P keeps every entry at a position < P, counted in the
    budget or on top of it (prefix_budget="extra"); a counted budget that cannot hold it is refused by name."""
    layers = make_layers(**CONFIGS["g1-1layer-d4-f32"])  # 2 KV heads, 24 entries at positions 0 .. 23
    for p in POLICIES:
        for budget, kwargs in ((12, {}), (4, {"prefix_budget": "extra"})):
            (sel,) = kvevict.select_layers(p, layers, budget=budget, protect_prefix=8, share="layer", block=4, **kwargs)
            for h in range(2):
                kept = sel.positions[sel.offsets[h]:sel.offsets[h + 1]]
                assert set(range(8)) <= set(kept.tolist()), (p, budget, kwargs)
                assert len(kept) == 12, (p, budget, kwargs)
    with pytest.raises(ValueError, match="fewer than the 2 blocks that hold its protected prefix"):
        kvevict.select_layers("snapkv", layers, budget=4, protect_prefix=8, share="layer", block=4)
    with pytest.raises(ValueError, match="protect_prefix must be >= 0, got -2"):
        kvevict.select_layers("snapkv", layers, budget=4, protect_prefix=-2)



def test_threshold_budget():
    """docs/algorithms.md#threshold-budgets: threshold=T keeps every entry whose score reaches T (engine scores:
    exactly those), count_lower / count_upper / count_scope bound the count; PyramidKV and bounds on a count budget
    are refused by name."""
    rng = np.random.default_rng(35)
    keys = rng.standard_normal((2, 30, 4)).astype(np.float32)
    scores = rng.random((2, 30)).astype(np.float32)
    sel = kvevict.select("engine-scores", keys=keys, values=keys, scores=scores, threshold=0.6)
    for h in range(2):
        kept = sel.indices[sel.offsets[h]:sel.offsets[h + 1]]
        np.testing.assert_array_equal(kept, np.nonzero(scores[h].astype(np.float64) >= 0.6)[0])
    pinned = kvevict.select("engine-scores", keys=keys, values=keys, scores=scores, threshold=0.6, count_lower=20,
                            count_upper=20, count_scope="layer")
    assert pinned.total == 20
    layers = make_layers(**CONFIGS["g1-1layer-d4-f32"])
    for p in POLICIES:
        if p == "pyramidkv":
            with pytest.raises(ValueError, match="a threshold budget decides its counts from the scores"):
                kvevict.select_layers(p, layers, threshold=0.02)
            continue
        (sel,) = kvevict.select_layers(p, layers, threshold=0.02, count_upper=6)
        assert all(sel.offsets[h + 1] - sel.offsets[h] <= 6 for h in range(2)), p
    with pytest.raises(ValueError, match="count_upper bounds a threshold budget, got a count budget"):
        kvevict.select_layers("snapkv", layers, budget=4, count_upper=3)
    with pytest.raises(ValueError, match="give exactly one of budget, keep, compression_ratio and threshold"):
        kvevict.select_layers("snapkv", layers, budget=4, threshold=0.1)


def test_keep_whole():
    """docs/algorithms.md#hybrid-models: keep_whole=[1] keeps layer 1 whole (it needs only its keys); layer 0 selects
    as a model of itself alone; a layer beyond the model is refused by name."""
    layers = make_layers(**CONFIGS["g1-1layer-d4-f32"]) * 2
    whole = dict(keys=layers[1]["keys"], values=layers[1]["values"])
    for p in POLICIES:
        sel = kvevict.select_layers(p, [layers[0], whole], budget=6, keep_whole=[1])
        (alone,) = kvevict.select_layers(p, [layers[0]], budget=6)
        np.testing.assert_array_equal(sel[0].indices, alone.indices)
        assert sel[1].total == layers[1]["keys"].shape[0] * layers[1]["keys"].shape[1], p
    with pytest.raises(ValueError, match="the layers kept whole name layer 2; the model has 2 layers"):
        kvevict.select_layers("snapkv", layers, budget=6, keep_whole="2")


def test_retrieval_heads():
    """docs/algorithms.md#retrieval-heads: (layer, kv_head) pairs as a list or as the tool's text select alike, and
    change the selection; a malformed item is refused by name."""
    layers = make_layers(**OPTS)
    for p in ["layer-defensivekv", "adakv", "snapkv"]:
        as_list = kvevict.select_layers(p, layers, budget=16, retrieval_heads=[(1, 0), (0, 1)])
        as_text = kvevict.select_layers(p, layers, budget=16, retrieval_heads="0:1,1:0")
        for a, b in zip(as_list, as_text):
            np.testing.assert_array_equal(a.indices, b.indices)
    # One budget across layers on attention (no mass-forced entries compete): layer 0's KV head 1 kept whole, its 40
    # entries of the model's 64 beside the other heads' windows of 4.
    plain = kvevict.select_layers(None, layers, budget=16, base="layer", selector="attention")
    forced = kvevict.select_layers(None, layers, budget=16, base="layer", selector="attention",
                                   retrieval_heads=[(0, 1)])
    assert forced[0].offsets[2] - forced[0].offsets[1] == 40
    assert not np.array_equal(plain[0].indices, forced[0].indices)
    with pytest.raises(ValueError, match=r"retrieval_heads: expected \(layer, kv_head\) pairs, got an item 3"):
        kvevict.select_layers("snapkv", layers, budget=12, retrieval_heads=[3])
    with pytest.raises(ValueError, match="retrieval_heads names a head twice"):
        kvevict.select_layers("snapkv", layers, budget=12, retrieval_heads=[(0, 1), (0, 1)])


# ----------------------------------------------------------------------------------------------------------------
# 2. Inputs.

VIEW_POLICIES = ["snapkv", "adakv", "criticalkv", "defensivekv", "layer-defensivekv"]


def _transposed(a, axes):
    """A non-contiguous view equal to `a`: a contiguous copy in the order `axes`, viewed back."""
    inverse = np.argsort(axes)
    view = np.ascontiguousarray(a.transpose(axes)).transpose(inverse)
    assert not view.flags.c_contiguous and np.array_equal(view, a)
    return view


def _stepped(a, steps):
    """A view of `a` inside a larger array, every dimension taken with a step."""
    big = np.zeros(tuple(n * s + 1 for n, s in zip(a.shape, steps)), dtype=a.dtype)
    index = tuple(slice(1, None, s) for s in steps)
    big[index] = a
    view = big[index]
    assert not view.flags.c_contiguous and np.array_equal(view, a)
    return view


def _reversed(a, axis):
    """A view with a negative stride along `axis`, equal to `a`: a reversed copy, reversed back."""
    index = tuple(slice(None, None, -1) if i == axis else slice(None) for i in range(a.ndim))
    view = a[index].copy()[index]
    assert view.strides[axis] < 0 and np.array_equal(view, a)
    return view


def _view_variants(layer):
    K, V, Q, W, P, N = (layer[n] for n in ("keys", "values", "q_window", "w_o", "positions", "lengths"))
    return {
        "transposed": dict(keys=_transposed(K, (1, 0, 2)), values=_transposed(V, (2, 1, 0)),
                           q_window=_transposed(Q, (1, 2, 0)), w_o=np.asfortranarray(W),
                           positions=_transposed(P, (1, 0))),
        "stepped": dict(keys=_stepped(K, (2, 3, 2)), values=_stepped(V, (1, 2, 1)), q_window=_stepped(Q, (3, 1, 2)),
                        w_o=_stepped(W, (2, 3)), positions=_stepped(P, (2, 3)), lengths=_stepped(N, (3,))),
        "reversed-heads": dict(keys=_reversed(K, 0), values=_reversed(V, 0), q_window=_reversed(Q, 0),
                               w_o=_reversed(W, 0), positions=_reversed(P, 0), lengths=_reversed(N, 0)),
        "reversed-rows": dict(keys=_reversed(K, 1), values=_reversed(V, 1), q_window=_reversed(Q, 1),
                              w_o=_reversed(W, 1), positions=_reversed(P, 1)),
        "reversed-dims": dict(keys=_reversed(K, 2), values=_reversed(V, 2), q_window=_reversed(Q, 2),
                              w_o=_reversed(_reversed(W, 0), 1)),
    }


@pytest.mark.parametrize("dtype", [F32, F64, F16], ids=["f32", "f64", "f16"])
@pytest.mark.parametrize("variant", ["transposed", "stepped", "reversed-heads", "reversed-rows", "reversed-dims"])
def test_noncontiguous_views(variant, dtype):
    layers = make_layers(seed=21, Hkv=2, G=2, Ls=[30, 26], d=8, w=4, ragged=True, kv=dtype, q=dtype)
    viewed = [dict(layer, **_view_variants(layer)[variant]) for layer in layers]
    for p in VIEW_POLICIES:
        want = kvevict.select_layers(p, layers, keep=0.4)
        assert_same_selections(want, kvevict.select_layers(p, viewed, keep=0.4), "%s %s" % (p, variant))


def test_zero_strides_and_unaligned():
    """Broadcast views (stride 0: one head's keys for every head, one query row for every window row) and views
    into structured arrays (strides that are no multiple of the element size) equal their contiguous copies."""
    (layer,) = make_layers(seed=22, Hkv=3, G=2, Ls=[28], d=8, w=4)
    K0 = np.broadcast_to(layer["keys"][:1], layer["keys"].shape)
    Q0 = np.broadcast_to(layer["q_window"][:, :1], layer["q_window"].shape)
    assert K0.strides[0] == 0 and Q0.strides[1] == 0
    record = np.zeros(layer["values"].shape, dtype=[("pad", "u1"), ("v", "<f4")])
    record["v"] = layer["values"]
    V_unaligned = record["v"]
    assert V_unaligned.strides[2] == 5
    broadcast = dict(layer, keys=K0, q_window=Q0, values=V_unaligned)
    copied = dict(layer, keys=np.ascontiguousarray(K0), q_window=np.ascontiguousarray(Q0),
                  values=np.ascontiguousarray(V_unaligned))
    for p in VIEW_POLICIES:
        assert_same_selections([kvevict.select(p, **copied, keep=0.5)], [kvevict.select(p, **broadcast, keep=0.5)], p)


def test_dtypes_hold_the_same_values():
    """float16 and float64 storage holding float32-representable values select what float32 storage does
    (precision f32), and float64 storage at precision f64 what float32 storage does at f64."""
    layers = make_layers(seed=23, Hkv=2, G=2, Ls=[33, 29], d=8, w=4, ragged=True, kv=F16, q=F16)

    def as_(dtype):
        return [{k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in layer.items()} for layer in layers]

    for p in VIEW_POLICIES + ["streamingllm", "criticalkv-snapkv", "adakv-defensive"]:
        want = kvevict.select_layers(p, as_(F32), keep=0.5)
        assert_same_selections(want, kvevict.select_layers(p, layers, keep=0.5), p + " f16 vs f32")
        assert_same_selections(want, kvevict.select_layers(p, as_(F64), keep=0.5), p + " f64 vs f32")
        assert_same_selections(kvevict.select_layers(p, as_(F32), keep=0.5, precision="f64"),
                               kvevict.select_layers(p, as_(F64), keep=0.5, precision="f64"), p + " f64 precision")


def _tokens_major(layers, contiguous=True):
    out = []
    for layer in layers:
        t = dict(layer)
        for name in ("keys", "values"):
            t[name] = layer[name].transpose(1, 0, 2)
            if contiguous:
                t[name] = np.ascontiguousarray(t[name])
        if "positions" in layer:
            t["positions"] = np.ascontiguousarray(layer["positions"].T)
        if "scores" in layer:
            t["scores"] = np.ascontiguousarray(layer["scores"].T) if contiguous else layer["scores"].T
        out.append(t)
    return out


@pytest.mark.parametrize("config", ["g2-2layers-d8-ragged-f32", "g4-2layers-d8-ragged-f16", "g4-3layers-d16-f64"])
def test_layout_tokens(config):
    layers = make_layers(**CONFIGS[config])
    tokens = _tokens_major(layers)
    tokens_views = _tokens_major(layers, contiguous=False)  # [L, Hkv, d] views of the heads-major arrays
    for p in ALL_POLICIES:
        want = select_layers(p, layers, {"keep": 0.5})
        assert_same_selections(want, select_layers(p, tokens, {"keep": 0.5}, layout="tokens"), policy_id(p))
        assert_same_selections(want, select_layers(p, tokens_views, {"keep": 0.5}, layout="tokens"), policy_id(p))
    (one,) = _tokens_major(make_layers(**CONFIGS["g2-1layer-d6-ragged-mixed"]))
    heads = make_layers(**CONFIGS["g2-1layer-d6-ragged-mixed"])[0]
    assert_same_selections([kvevict.select("defensivekv", **heads, keep=0.3)],
                           [kvevict.select("defensivekv", layout="tokens", **one, keep=0.3)])


def _softmax_rows(layer):
    """window_attention [H, w, L] of a layer, in float64: row i of query head q sits at entry P_h + i of KV head
    h = q / G and sees entries 0 .. P_h + i (softmax over them), columns from L_h on are zero."""
    K, Q = layer["keys"].astype(F64), layer["q_window"].astype(F64)
    Hkv, L, d = K.shape
    H, w, _ = Q.shape
    G = H // Hkv
    lengths = layer.get("lengths", np.full(Hkv, L))
    A = np.zeros((H, w, L))
    for q in range(H):
        h = q // G
        Lh = int(lengths[h])
        logits = Q[q] @ K[h, :Lh].T / math.sqrt(d)
        for i in range(w):
            seen = Lh - w + i + 1
            row = np.exp(logits[i, :seen] - logits[i, :seen].max())
            A[q, i, :seen] = row / row.sum()
    return A


@pytest.mark.parametrize("config", ["g1-1layer-d4-f32", "g2-2layers-d8-ragged-f32", "g4-3layers-d16-f64"])
def test_window_attention(kvevict_select, files, tmp_path, config):
    layers = make_layers(**CONFIGS[config])
    attention = []
    for layer in layers:
        a = dict(layer)
        del a["q_window"]
        a["window_attention"] = _softmax_rows(layer).astype(layer["q_window"].dtype)
        attention.append(a)
    for p in ["snapkv", "adakv", "defensivekv", ("adakv", "critical")]:
        sels = compare_with_cli(kvevict_select, files, tmp_path, config + "-attention", attention, p, {"keep": 0.5})
        if p == "snapkv":  # the module's own softmax rows select the same
            assert_same_selections(select_layers(p, layers, {"keep": 0.5}), sels, "q_window vs window_attention")


def test_window_attention_snapkv_module_only():
    """Without the tool: snapkv on softmax rows computed here equals snapkv on the queries."""
    for config in ["g2-2layers-d8-ragged-f32", "g1-3layers-d12-ragged-f64"]:
        layers = make_layers(**CONFIGS[config])
        attention = [dict({k: v for k, v in layer.items() if k != "q_window"}, window_attention=_softmax_rows(layer))
                     for layer in layers]
        assert_same_selections(kvevict.select_layers("snapkv", layers, keep=0.5),
                               kvevict.select_layers("snapkv", attention, keep=0.5), config)


@needs_torch
def test_torch_float_tensors():
    layers = make_layers(seed=31, Hkv=2, G=2, Ls=[30, 24], d=8, w=4, ragged=True)
    for dtype, np_dtype in [(torch.float32, F32), (torch.float64, F64), (torch.float16, F16)]:
        as_np = [{k: (v.astype(np_dtype) if v.dtype.kind == "f" else v) for k, v in layer.items()} for layer in layers]
        as_torch = [{k: (torch.from_numpy(np.array(v)) if v.dtype.kind == "f" else v) for k, v in layer.items()}
                    for layer in as_np]
        for p in VIEW_POLICIES:
            assert_same_selections(kvevict.select_layers(p, as_np, keep=0.5),
                                   kvevict.select_layers(p, as_torch, keep=0.5), "%s %s" % (p, dtype))
    # lengths and positions as torch integer tensors too
    t = [dict(layer, lengths=torch.from_numpy(layer["lengths"]), positions=torch.from_numpy(layer["positions"]))
         for layer in layers]
    assert_same_selections(kvevict.select_layers("adakv", layers, keep=0.5),
                           kvevict.select_layers("adakv", t, keep=0.5))


def _bf16_rounded(a):
    return torch.from_numpy(np.ascontiguousarray(a, dtype=F32)).to(torch.bfloat16)


@needs_torch
def test_torch_bfloat16(kvevict_select, files, tmp_path):
    """bfloat16 keys and values equal float32 ones holding the bf16-rounded values, and kvevict-select on a BF16
    file."""
    layers = make_layers(seed=32, Hkv=2, G=4, Ls=[34, 28], d=8, w=4, ragged=True)
    bf16 = [dict(layer, keys=_bf16_rounded(layer["keys"]), values=_bf16_rounded(layer["values"])) for layer in layers]
    rounded = [dict(layer, keys=b["keys"].float().numpy(), values=b["values"].float().numpy())
               for layer, b in zip(layers, bf16)]
    assert not np.array_equal(rounded[0]["keys"], layers[0]["keys"])  # the rounding is real
    in_file = [dict(layer, keys=BF16(b["keys"].view(torch.int16).numpy().view(np.uint16)),
                    values=BF16(b["values"].view(torch.int16).numpy().view(np.uint16)))
               for layer, b in zip(layers, bf16)]
    in_path = layers_file(in_file, tmp_path / "bf16.safetensors")
    for p in ALL_POLICIES:
        want = select_layers(p, rounded, {"keep": 0.5})
        got = select_layers(p, bf16, {"keep": 0.5})
        assert_same_selections(want, got, policy_id(p) + " bf16 vs f32")
        proc = run_cli(kvevict_select, in_path, tmp_path / "out.safetensors", p, {"keep": 0.5},
                       per_head_tova(p, layers, None))
        assert proc.returncode == 0, proc.stderr
        assert_same_as_cli(got, st_read(tmp_path / "out.safetensors")[0])


@needs_torch
def test_torch_noncontiguous_views():
    layers = make_layers(seed=33, Hkv=2, G=2, Ls=[30, 26], d=8, w=4, ragged=True)
    views = []
    for layer in layers:
        K, V, Q, W = (torch.from_numpy(layer[n]) for n in ("keys", "values", "q_window", "w_o"))
        k_view = K.transpose(0, 1).contiguous().transpose(0, 1)  # strides (d, Hkv d, 1)
        big = torch.zeros((V.shape[0], V.shape[1] * 2 + 1, V.shape[2] * 3))
        big[:, 1::2, ::3] = V
        v_view = big[:, 1::2, ::3]  # storage offset, steps
        q_view = Q.permute(2, 0, 1).contiguous().permute(1, 2, 0)  # innermost stride != 1
        w_view = W.t().contiguous().t()
        assert not any(t.is_contiguous() for t in (k_view, v_view, q_view, w_view))
        assert v_view.storage_offset() > 0
        views.append(dict(layer, keys=k_view, values=v_view, q_window=q_view, w_o=w_view))
    for p in VIEW_POLICIES:
        assert_same_selections(kvevict.select_layers(p, layers, keep=0.5), kvevict.select_layers(p, views, keep=0.5), p)
    # bfloat16 views (copied by the C API) and the tokens layout from a torch [L, Hkv, d] tensor
    bf = [dict(layer, keys=_bf16_rounded(layer["keys"]).transpose(0, 1).contiguous().transpose(0, 1),
               values=_bf16_rounded(layer["values"])[:, :, :]) for layer in layers]
    rounded = [dict(layer, keys=_bf16_rounded(layer["keys"]).float().numpy(),
                    values=_bf16_rounded(layer["values"]).float().numpy()) for layer in layers]
    tokens = [dict(layer, keys=torch.from_numpy(layer["keys"]).transpose(0, 1),
                   values=torch.from_numpy(np.ascontiguousarray(layer["values"].transpose(1, 0, 2))),
                   positions=layer["positions"].T) for layer in layers]
    for p in ["snapkv", "defensivekv"]:
        assert_same_selections(kvevict.select_layers(p, rounded, keep=0.5), kvevict.select_layers(p, bf, keep=0.5), p)
        assert_same_selections(kvevict.select_layers(p, layers, keep=0.5),
                               kvevict.select_layers(p, tokens, layout="tokens", keep=0.5), p + " tokens")


# ----------------------------------------------------------------------------------------------------------------
# 3. Errors.


def _base_layer(Hkv=2, G=2, L=24, d=8, w=4):
    (layer,) = make_layers(seed=41, Hkv=Hkv, G=G, Ls=[L], d=d, w=w)
    return layer


def _with(layer, **changes):
    out = dict(layer)
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


L0 = _base_layer()
K0, V0, Q0, W0 = L0["keys"], L0["values"], L0["q_window"], L0["w_o"]
POS0 = np.tile(np.arange(24), (2, 1))


def _positions_with(h, j, value):
    p = POS0.copy()
    p[h, j] = value
    return p


# (id, policy, select() keywords (layer changes and options), budget, message regex). Each raises ValueError.
ERROR_CASES = [
    # ranks and shapes
    ("keys-rank-2", "snapkv", dict(keys=K0[0]), {"keep": 0.5}, r"keys has rank 2; expected rank 3"),
    ("keys-rank-4", "snapkv", dict(keys=K0[None]), {"keep": 0.5}, r"keys has 4 dimensions"),
    ("keys-scalar", "snapkv", dict(keys=np.float32(1)), {"keep": 0.5}, r"keys has rank 0"),
    ("keys-empty", "snapkv", dict(keys=K0[:, :0]), {"keep": 0.5}, r"keys has extent 0 in dimension 1"),
    ("q-rank-2", "snapkv", dict(q_window=Q0[0]), {"keep": 0.5}, r"q_window has rank 2"),
    ("q-rank-4", "snapkv", dict(q_window=Q0[None]), {"keep": 0.5}, r"q_window has 4 dimensions"),
    ("attention-rank-2", "snapkv", dict(q_window=None, window_attention=np.ones((4, 24), F32)), {"keep": 0.5},
     r"window_attention has rank 2"),
    ("w_o-rank-3", "defensivekv", dict(w_o=W0[None]), {"keep": 0.5}, r"w_o has rank 3; expected rank 2"),
    ("values-rank-2", "snapkv", dict(values=V0[0]), {"keep": 0.5}, r"values has rank 2"),
    ("values-tokens", "snapkv", dict(values=V0[:, :-1]), {"keep": 0.5}, r"values have shape \[2, 23, 8\]"),
    ("values-heads", "snapkv", dict(values=V0[:1]), {"keep": 0.5}, r"values have shape \[1, 24, 8\]"),
    ("q-head-dim", "snapkv", dict(q_window=Q0[..., :4]), {"keep": 0.5}, r"queries head_dim \(4\)"),
    ("q-heads-not-multiple", "snapkv", dict(q_window=Q0[:3]), {"keep": 0.5},
     r"queries heads \(3\) must be a multiple of the KV heads \(2\)"),
    ("w_o-columns", "defensivekv", dict(w_o=W0[:, :-1]), {"keep": 0.5}, r"w_o has shape \[12, 31\]"),
    # the engine's scores
    ("scores-missing", "engine-scores", dict(scores=None), {"keep": 0.5},
     r"layers\[0\]\.scores \[kv_heads, tokens\] is missing; the engine-scores policy ranks the score the engine "
     r"computed for each entry"),
    ("scores-rank-3", "layer-engine-scores", dict(scores=np.ones((2, 24, 1), F32)), {"keep": 0.5},
     r"scores has rank 3; expected rank 2 \[kv_heads, tokens\]"),
    ("scores-shape", "engine-scores", dict(scores=np.ones((2, 23), F32)), {"keep": 0.5},
     r"scores has shape \[2, 23\]; expected \[2, 24\] \(kv_heads, tokens\) like the keys"),
    ("scores-nan", "engine-scores", dict(scores=np.full((2, 24), np.nan, F32)), {"keep": 0.5},
     r"scores\[0, 0\] is not finite \(nan\); the engine's scores must be finite"),
    ("scores-codes", "engine-scores", dict(scores=np.ones((2, 24), np.int8)), {"keep": 0.5},
     r"scores is i8: quantized codes are for the keys and values only"),
    ("attention-columns", "snapkv", dict(q_window=None, window_attention=np.full((4, 4, 23), 1 / 23, F32)),
     {"keep": 0.5}, r"attention columns \(23\)"),
    ("q-and-attention", "snapkv", dict(window_attention=np.full((4, 4, 24), 1 / 24, F32)), {"keep": 0.5},
     r"q_window and .*window_attention are both given"),
    ("no-observation", "snapkv", dict(q_window=None), {"keep": 0.5}, r"q_window .* is missing"),
    ("window-too-large", "snapkv", dict(q_window=np.zeros((4, 24, 8), F32)), {"keep": 0.5},
     r"window \(24\) must be smaller than the context length \(24\)"),
    # dtypes
    ("keys-int", "snapkv", dict(keys=K0.astype(np.int32)), {"keep": 0.5}, r"keys: dtype int32 is not supported"),
    ("keys-int64", "snapkv", dict(keys=K0.astype(np.int64)), {"keep": 0.5}, r"keys: dtype int64 is not supported"),
    ("q-complex", "snapkv", dict(q_window=Q0.astype(np.complex64)), {"keep": 0.5},
     r"q_window: dtype complex64 is not supported"),
    ("values-bool", "snapkv", dict(values=V0 > 0), {"keep": 0.5}, r"values: dtype bool is not supported"),
    ("w_o-longdouble", "defensivekv", dict(w_o=W0.astype(np.longdouble)), {"keep": 0.5},
     r"w_o: dtype float\d+ is not supported"),
    ("keys-big-endian", "snapkv", dict(keys=K0.astype(">f4")), {"keep": 0.5}, r"keys: byte order"),
    ("keys-values-dtypes", "snapkv", dict(values=V0.astype(F64)), {"keep": 0.5},
     r"values are f64 and keys f32"),
    ("keys-string", "snapkv", dict(keys="abc"), {"keep": 0.5}, r"keys"),
    ("keys-nan", "snapkv", dict(keys=np.where(K0 > 2, np.nan, K0).astype(F32)), {"keep": 0.5},
     r"keys\[.*\] is not finite"),
    ("q-inf", "snapkv", dict(q_window=np.where(Q0 > 2, np.inf, Q0).astype(F32)), {"keep": 0.5},
     r"queries\[.*\] is not finite"),
    # options
    ("unknown-option", "snapkv", dict(windw=4), {"keep": 0.5}, r"unknown option 'windw'"),
    ("window-0", "snapkv", dict(window=0), {"keep": 0.5}, r"window must be >= 1, got 0"),
    ("window-mismatch", "snapkv", dict(window=3), {"keep": 0.5}, r"window 3 does not match the 4 rows"),
    ("pool", "snapkv", dict(pool="min"), {"keep": 0.5}, r"pool must be avg or max, got 'min'"),
    ("kernel-even", "snapkv", dict(kernel=4), {"keep": 0.5}, r"kernel must be an odd number >= 1, got 4"),
    ("kernel-float", "snapkv", dict(kernel=3.5), {"keep": 0.5}, r"kernel expects an integer, got '3.5'"),
    ("kernel-text", "snapkv", dict(kernel="three"), {"keep": 0.5}, r"kernel expects an integer, got 'three'"),
    ("kernel-list", "snapkv", dict(kernel=[3]), {"keep": 0.5}, r"kernel: expected a number, a string or a boolean"),
    ("alpha-range", "adakv", dict(alpha=1.5), {"keep": 0.5}, r"alpha must be in \[0, 1\], got 1.5"),
    ("alpha-nan", "adakv", dict(alpha=float("nan")), {"keep": 0.5}, r"alpha expects a finite number"),
    ("adakv-variant", "adakv", dict(adakv_variant="new"), {"keep": 0.5}, r"adakv_variant must be kvpress or original"),
    ("sinks", "streamingllm", dict(sinks=-1), {"keep": 0.5}, r"sinks must be >= 0, got -1"),
    ("precision", "snapkv", dict(precision="f16"), {"keep": 0.5}, r"precision must be f32 or f64, got 'f16'"),
    ("share", "snapkv", dict(share="all"), {"keep": 0.5}, r"share must be head, layer or model, got 'all'"),
    ("reduce", "snapkv", dict(reduce="min"), {"keep": 0.5}, r"reduce must be max or mean, got 'min'"),
    ("block-0", "snapkv", dict(block=0), {"keep": 0.5}, r"block must be >= 1, got 0"),
    ("block-over-budget", "snapkv", dict(block=16), {"keep": 0.5}, r"block \(16\) must be <= n_kept \(12\)"),
    ("eps", "criticalkv", dict(eps=-1.0), {"keep": 0.5}, r"eps must be >= 0"),
    ("first-stage-ratio", "criticalkv", dict(first_stage_ratio=2), {"keep": 0.5}, r"first_stage_ratio must be in"),
    ("value-norm", "defensivekv", dict(value_norm="l3"), {"keep": 0.5}, r"value_norm must be l1 or l2, got 'l3'"),
    ("mass-threshold", "defensivekv", dict(mass_threshold=-0.5), {"keep": 0.5}, r"mass_threshold must be in"),
    ("no-floor", "defensivekv", dict(no_floor="yes"), {"keep": 0.5}, r"no_floor expects a boolean"),
    ("reference-quirks-keep", "defensivekv", dict(reference_quirks=True), {"keep": 0.5},
     r"reference_quirks needs the budget as a compression ratio"),
    ("share-ragged", "snapkv", dict(share="layer", lengths=[24, 20]), {"keep": 0.5}, r"per_layer sharing"),
    ("budget-as-option", "snapkv", {"compression-ratio": 0.5}, {"keep": 0.5}, r"option 'compression-ratio'"),
    # budgets
    ("no-budget", "snapkv", {}, {}, r"a budget is required: budget=N, keep=R, compression_ratio=CR or threshold=T"),
    ("two-budgets", "snapkv", {}, {"keep": 0.5, "budget": 4},
     r"give exactly one of budget, keep, compression_ratio and threshold"),
    ("three-budgets", "snapkv", {}, {"keep": 0.5, "budget": 4, "compression_ratio": 0.5}, r"give exactly one of"),
    ("keep-0", "snapkv", {}, {"keep": 0.0}, r"keep ratio must be in \(0, 1\], got 0"),
    ("keep-above-1", "snapkv", {}, {"keep": 1.5}, r"keep ratio must be in \(0, 1\], got 1.5"),
    ("keep-negative", "snapkv", {}, {"keep": -0.5}, r"keep ratio must be in \(0, 1\]"),
    ("keep-nan", "snapkv", {}, {"keep": float("nan")}, r"keep ratio must be in \(0, 1\], got nan"),
    ("keep-rounds-to-0", "snapkv", {}, {"keep": 0.01}, r"got 0 from keep ratio 0.01"),
    ("keep-text", "snapkv", {}, {"keep": "0.5"}, r"keep must be a number, got '0.5'"),
    ("keep-bool", "snapkv", {}, {"keep": True}, r"keep must be a number, got True"),
    ("compression-ratio-1", "snapkv", {}, {"compression_ratio": 1.0}, r"compression ratio must be in \[0, 1\)"),
    ("compression-ratio-negative", "snapkv", {}, {"compression_ratio": -0.1}, r"compression ratio must be in"),
    ("budget-0", "snapkv", {}, {"budget": 0}, r"tokens must be >= 1, got 0"),
    ("budget-negative", "snapkv", {}, {"budget": -3}, r"tokens must be >= 1, got -3"),
    ("budget-over-L", "snapkv", {}, {"budget": 25}, r"n_kept must be in \[1, 24\].*got 25"),
    ("budget-float", "snapkv", {}, {"budget": 4.0}, r"budget must be an integer .*got 4.0"),
    ("budget-text", "snapkv", {}, {"budget": "4"}, r"budget must be an integer .*got '4'"),
    ("budget-bool", "snapkv", {}, {"budget": True}, r"budget must be an integer .*got True"),
    # policies
    ("unknown-policy", "snapvk", {}, {"keep": 0.5}, r"unknown policy 'snapvk' \(expected one of streamingllm"),
    ("no-policy", None, {}, {"keep": 0.5}, r"a policy is required"),
    ("policy-and-base", "snapkv", dict(base="adakv"), {"keep": 0.5}, r"give either policy or base/selector"),
    ("unknown-base", None, dict(base="streamingllm", selector="attention"), {"keep": 0.5}, r"unknown base"),
    ("unknown-selector", None, dict(base="snapkv", selector="value"), {"keep": 0.5}, r"unknown selector 'value'"),
    # value-aware policies without values or w_o
    ("criticalkv-no-values", "criticalkv", dict(values=None), {"keep": 0.5}, r"values .* is missing; the criticalkv"),
    ("defensivekv-no-w_o", "defensivekv", dict(w_o=None), {"keep": 0.5}, r"w_o .* is missing; the defensivekv"),
    ("composed-no-w_o", None, dict(base="snapkv", selector="critical", w_o=None), {"keep": 0.5},
     r"w_o .* is missing; the snapkv\+critical"),
    ("layer-defensivekv-no-values", "layer-defensivekv", dict(values=None, w_o=None), {"keep": 0.5},
     r"values .* is missing"),
    # ragged
    ("lengths-shape", "snapkv", dict(lengths=[24]), {"keep": 0.5}, r"lengths has shape \[1\]; expected \[2\]"),
    ("lengths-2d", "snapkv", dict(lengths=[[24, 24]]), {"keep": 0.5}, r"lengths has shape \[1, 2\]"),
    ("lengths-float", "snapkv", dict(lengths=np.array([24.0, 24.0])), {"keep": 0.5}, r"lengths: dtype float64"),
    ("lengths-bool", "snapkv", dict(lengths=np.array([True, True])), {"keep": 0.5}, r"lengths: dtype bool"),
    ("lengths-over-capacity", "snapkv", dict(lengths=[25, 24]), {"keep": 0.5}, r"lengths\[0\] must be in \[1, 24\]"),
    ("lengths-0", "snapkv", dict(lengths=[24, 0]), {"keep": 0.5}, r"lengths\[1\] must be in \[1, 24\].*got 0"),
    ("lengths-negative", "snapkv", dict(lengths=[-1, 24]), {"keep": 0.5}, r"lengths\[0\] .*got -1"),
    ("lengths-within-window", "snapkv", dict(lengths=[24, 4]), {"keep": 0.5},
     r"window \(4\) must be smaller than the entries of KV head 1 \(4\)"),
    ("positions-shape", "snapkv", dict(positions=POS0[:, :-1]), {"keep": 0.5},
     r"positions has shape \[2, 23\]; expected \[2, 24\]"),
    ("positions-transposed", "snapkv", dict(positions=POS0.T), {"keep": 0.5}, r"positions has shape \[24, 2\]"),
    ("positions-float", "snapkv", dict(positions=POS0.astype(F64)), {"keep": 0.5}, r"positions: dtype float64"),
    ("positions-repeated", "snapkv", dict(positions=_positions_with(1, 5, 4)), {"keep": 0.5},
     r"positions of KV head 1 must be strictly increasing, got 4 then 4 at entry 5"),
    ("positions-decreasing", "adakv", dict(positions=_positions_with(0, 10, 3)), {"keep": 0.5},
     r"positions of KV head 0 must be strictly increasing"),
    ("lengths-without-keys", "snapkv", dict(keys=None, lengths=[24, 24]), {"keep": 0.5}, r"keys"),
    # layout
    ("layout", "snapkv", dict(layout="rows"), {"keep": 0.5}, r"layout must be 'heads' .* or 'tokens' .*got 'rows'"),
    ("layout-tokens-rank", "snapkv", dict(layout="tokens", keys=K0[0]), {"keep": 0.5},
     r"keys has 2 dimensions; expected \[tokens, kv_heads, head_dim\] \(layout='tokens'\)"),
    ("layout-tokens-positions", "snapkv", dict(layout="tokens", keys=K0.transpose(1, 0, 2), values=None,
                                               positions=POS0), {"keep": 0.5},
     r"positions has shape \[2, 24\]; expected \[24, 2\] \[tokens, kv_heads\] \(layout='tokens'\)"),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors(case):
    _, policy, changes, budget, message = case
    args = dict(L0)
    for k, v in changes.items():
        if v is None:
            args.pop(k, None)
        else:
            args[k] = v
    with pytest.raises(ValueError, match=message):
        kvevict.select(policy, **args, **budget)


def test_errors_of_select_layers():
    layer = dict(L0)
    with pytest.raises(ValueError, match=r"unknown input 'query'"):
        kvevict.select_layers("snapkv", [layer, dict(layer, query=Q0)], keep=0.5)
    with pytest.raises(ValueError, match=r"unknown input 'query' in layers\[1\]"):
        kvevict.select_layers("snapkv", [layer, dict(layer, query=Q0)], keep=0.5)
    with pytest.raises(ValueError, match=r"unknown input 'Keys'"):
        kvevict.select_layers("snapkv", [dict(layer, Keys=K0)], keep=0.5)
    with pytest.raises(ValueError, match=r"expected at least one layer"):
        kvevict.select_layers("snapkv", [], keep=0.5)
    with pytest.raises(ValueError, match=r"layers\[1\]\.keys is missing"):
        kvevict.select_layers("snapkv", [layer, _with(layer, keys=None)], keep=0.5)
    with pytest.raises(ValueError, match=r"layers\[1\]\.keys are f64; expected f32 like layers\[0\]\.keys"):
        kvevict.select_layers("snapkv", [layer, dict(layer, keys=K0.astype(F64), values=V0.astype(F64))], keep=0.5)
    with pytest.raises(ValueError, match=r"layers\[1\]\.lengths has shape \[3\]"):
        kvevict.select_layers("snapkv", [layer, dict(layer, lengths=[24, 24, 24])], keep=0.5)
    with pytest.raises(ValueError, match=r"layers\[0\]\.q_window"):
        kvevict.select_layers("snapkv", [_with(layer, q_window=None), layer], keep=0.5)
    with pytest.raises(ValueError, match=r"per_model sharing"):  # every layer must hold the same entries
        kvevict.select_layers("snapkv", [layer, make_layers(seed=3, Hkv=2, G=2, Ls=[30], d=8, w=4)[0]], keep=0.5,
                              share="model")
    with pytest.raises(ValueError, match=r"keys is required"):
        kvevict.select("snapkv", q_window=Q0, keep=0.5)
    with pytest.raises(TypeError):  # not a dict: pybind11's argument conversion
        kvevict.select_layers("snapkv", [K0], keep=0.5)


def test_selection_head_out_of_range():
    sel = kvevict.select("snapkv", **L0, keep=0.5)
    for h in (-1, sel.heads):
        with pytest.raises(IndexError, match=r"head %d out of range \[0, 2\)" % h):
            sel.head(h)


def test_errors_leave_the_module_usable():
    """After every refusal the module still selects, and what it selects does not change."""
    want = kvevict.select("defensivekv", **L0, keep=0.5)
    for case in ERROR_CASES:
        with pytest.raises(ValueError):
            kvevict.select(case[1], **{k: v for k, v in dict(L0, **case[2]).items() if v is not None}, **case[3])
    assert_same_selections([want], [kvevict.select("defensivekv", **L0, keep=0.5)])


@needs_torch
def test_torch_errors():
    K = torch.from_numpy(K0)
    # requires_grad: torch refuses to export it (RuntimeError); the interpreter survives
    for name in ("keys", "values", "q_window", "w_o"):
        t = torch.from_numpy(L0[name].copy()).requires_grad_()
        with pytest.raises((ValueError, RuntimeError)) as err:
            kvevict.select("defensivekv", **dict(L0, **{name: t}), keep=0.5)
        assert "grad" in str(err.value) or name in str(err.value)
    with pytest.raises(ValueError, match=r"keys: DLPack dtype \(code 0, 32 bits\) is not supported"):
        kvevict.select("snapkv", **dict(L0, keys=K.int()), keep=0.5)
    with pytest.raises(ValueError, match=r"q_window: DLPack dtype \(code 5, 64 bits\)"):
        kvevict.select("snapkv", **dict(L0, q_window=torch.from_numpy(Q0).to(torch.complex64)), keep=0.5)
    with pytest.raises(ValueError, match=r"keys has 4 dimensions"):
        kvevict.select("snapkv", **dict(L0, keys=K[None]), keep=0.5)
    with pytest.raises(ValueError, match=r"keys has rank 2"):
        kvevict.select("snapkv", **dict(L0, keys=K[0]), keep=0.5)
    with pytest.raises(ValueError, match=r"values are bf16 and keys f32"):
        kvevict.select("snapkv", **dict(L0, values=torch.from_numpy(V0).bfloat16()), keep=0.5)
    with pytest.raises((ValueError, RuntimeError)):  # torch: "Bool type is not supported by dlpack"
        kvevict.select("snapkv", **dict(L0, values=torch.from_numpy(V0) > 0), keep=0.5)
    # the meta device: torch 1.13 refuses to export it ("Cannot pack tensors on meta"); a torch that exports it
    # gives a non-CPU DLPack device, which the module refuses
    meta = torch.empty(K0.shape, device="meta")
    try:
        meta.__dlpack__()
        exports_meta = True
    except Exception:
        exports_meta = False
    with pytest.raises((ValueError, RuntimeError)) as err:
        kvevict.select("snapkv", **dict(L0, keys=meta), keep=0.5)
    if exports_meta:
        assert err.type is ValueError and "device" in str(err.value)
    # still alive, same answers
    assert_same_selections([kvevict.select("snapkv", **L0, keep=0.5)], [kvevict.select("snapkv", **dict(L0, keys=K),
                                                                                         keep=0.5)])


@needs_torch
@pytest.mark.parametrize("name", ["keys", "values", "q_window", "w_o"])
def test_torch_empty_tensor(name):
    """A torch tensor with a zero extent is refused like a numpy one (its extent named), never taken as absent:
    torch gives such a tensor a NULL data pointer, which the C API reads as "no tensor"."""
    policy = "defensivekv" if name == "w_o" else "snapkv"
    array = L0[name]
    index = (slice(None),) * (array.ndim - 1) + (slice(0, 0),)
    with pytest.raises(ValueError, match=r"%s has extent 0" % name):  # what numpy gets
        kvevict.select(policy, **dict(L0, **{name: array[index]}), keep=0.5)
    with pytest.raises(ValueError, match=r"%s has extent 0" % name):
        kvevict.select(policy, **dict(L0, **{name: torch.from_numpy(array)[index]}), keep=0.5)


# A DLPack producer written with ctypes (DLPack 0.6 layout), to reach the module's checks of what torch never
# exports: another device, several lanes, no strides.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


class FakeDLPack:
    """An object whose __dlpack__ exports a float32 numpy array as DLPack, with the given device, lanes and
    strides (None: a NULL strides pointer, meaning row-major)."""

    _NAME = ctypes.create_string_buffer(b"dltensor")  # the capsule keeps a pointer to its name

    def __init__(self, array, device_type=1, lanes=1, strides=True, byte_offset=0, code=2, bits=32):
        self.array = array
        self.shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        self.strides = (ctypes.c_int64 * array.ndim)(*[s // array.itemsize for s in array.strides])
        t = _DLManagedTensor()
        t.dl_tensor.data = array.ctypes.data - byte_offset
        t.dl_tensor.device = _DLDevice(device_type, 0)
        t.dl_tensor.ndim = array.ndim
        t.dl_tensor.dtype = _DLDataType(code, bits, lanes)
        t.dl_tensor.shape = self.shape
        t.dl_tensor.strides = self.strides if strides else None
        t.dl_tensor.byte_offset = byte_offset
        self.managed = t

    def __dlpack__(self, stream=None):
        return _PyCapsule_New(ctypes.addressof(self.managed), ctypes.addressof(self._NAME), None)

    def __dlpack_device__(self):
        return (self.managed.dl_tensor.device.device_type, 0)


def test_dlpack_producer_checks():
    want = kvevict.select("snapkv", **L0, keep=0.5)
    # a plain CPU producer: row-major without strides, with strides, with a byte offset
    for fake in (FakeDLPack(K0, strides=False), FakeDLPack(K0), FakeDLPack(K0, byte_offset=64)):
        assert_same_selections([want], [kvevict.select("snapkv", **dict(L0, keys=fake), keep=0.5)])
    transposed = np.ascontiguousarray(K0.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert_same_selections([want], [kvevict.select("snapkv", **dict(L0, keys=FakeDLPack(transposed)), keep=0.5)])
    with pytest.raises(ValueError, match=r"keys is on device type 2 \(DLPack\); expected a CPU tensor"):
        kvevict.select("snapkv", **dict(L0, keys=FakeDLPack(K0, device_type=2)), keep=0.5)
    with pytest.raises(ValueError, match=r"q_window is on device type 13"):
        kvevict.select("snapkv", **dict(L0, q_window=FakeDLPack(Q0, device_type=13)), keep=0.5)
    with pytest.raises(ValueError, match=r"keys: DLPack dtype .* is not supported"):
        kvevict.select("snapkv", **dict(L0, keys=FakeDLPack(K0, lanes=4)), keep=0.5)
    with pytest.raises(ValueError, match=r"keys: DLPack dtype \(code 2, 8 bits\)"):
        kvevict.select("snapkv", **dict(L0, keys=FakeDLPack(K0, bits=8)), keep=0.5)
    with pytest.raises(ValueError, match=r"keys: DLPack dtype \(code 4, 32 bits\)"):  # bfloat of 32 bits
        kvevict.select("snapkv", **dict(L0, keys=FakeDLPack(K0, code=4)), keep=0.5)


def test_numpy_scalars_and_sequences():
    """Inputs that are not numpy arrays: nested lists (converted to float64), numpy scalars for options."""
    want = kvevict.select("snapkv", **L0, keep=0.5)
    as_lists = dict(L0, keys=K0.astype(F64).tolist(), values=None, q_window=Q0.tolist(), lengths=[24, 24],
                    positions=POS0.tolist())
    assert_same_selections([kvevict.select("snapkv", **dict(L0, keys=K0.astype(F64), values=None), keep=0.5)],
                           [kvevict.select("snapkv", **as_lists, keep=0.5)])
    assert_same_selections([want], [kvevict.select("snapkv", **L0, keep=np.float64(0.5))])  # a float subclass
    assert_same_selections([want], [kvevict.select("snapkv", **L0, keep=0.5, window=None)])  # None: not given
    assert_same_selections([want], [kvevict.select("snapkv", **L0, keep=0.5, lengths=np.array([24, 24], np.uint8))])


@pytest.mark.parametrize("value", ["np.int64(12) budget", "np.float32(0.5) keep", "np.int64(3) kernel",
                                   "np.bool_(True) no_floor"])
def test_numpy_scalar_options(value):
    """numpy scalars for integer, float and boolean options are accepted like the Python numbers they hold."""
    expr, name = value.split(" ")
    scalar = eval(expr)
    python = scalar.item()
    budget = {"budget": scalar} if name == "budget" else {"keep": scalar} if name == "keep" else {"keep": 0.5}
    options = {} if name in ("budget", "keep") else {name: scalar}
    want_budget = {k: python if v is scalar else v for k, v in budget.items()}
    want_options = {k: python for k in options}
    want = kvevict.select("defensivekv", **L0, **want_budget, **want_options)
    assert_same_selections([want], [kvevict.select("defensivekv", **L0, **budget, **options)])


def test_huge_budget_is_a_value_error():
    for budget in (2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 70, -(2 ** 70)):
        with pytest.raises(ValueError, match=r"budget"):
            kvevict.select("snapkv", **L0, budget=budget)


def test_unsigned_positions_beyond_int64():
    """uint64 positions at or above 2**63 cannot be int64 positions: refused, or returned unchanged."""
    positions = np.tile(np.arange(24, dtype=np.uint64) + np.uint64(2 ** 63), (2, 1))
    try:
        sel = kvevict.select("snapkv", **L0, keep=0.5, positions=positions)
    except ValueError as e:
        assert "positions" in str(e)
    else:
        assert np.all(sel.positions >= 0), "uint64 positions %s came back as %s" % (positions[0, :2],
                                                                                    sel.positions[:2])


# ----------------------------------------------------------------------------------------------------------------
# 4. The GIL is released while selecting: threads give the single-threaded results.


def test_threads():
    (big,) = make_layers(seed=51, Hkv=4, G=2, Ls=[640], d=32, w=16, D=64)
    (small,) = make_layers(seed=52, Hkv=2, G=4, Ls=[200], d=16, w=8, ragged=True)
    jobs = [("defensivekv", big, {"keep": 0.2}), ("criticalkv", big, {"budget": 100}),
            ("snapkv", small, {"keep": 0.3}), ("adakv", small, {"compression_ratio": 0.5})]
    want = [kvevict.select(p, **layer, **budget) for p, layer, budget in jobs]
    errors = ["unknown policy 'nope'", "keep ratio must be in (0, 1], got 2"]
    results, failures = {}, []
    barrier = threading.Barrier(len(jobs) + len(errors))

    def work(i):
        try:
            barrier.wait()
            p, layer, budget = jobs[i]
            results[i] = [kvevict.select(p, **layer, **budget) for _ in range(2)]
        except Exception as e:  # reported below
            failures.append((i, repr(e)))

    def fail(i):  # each thread's message is its own (kvevict_last_error is per thread)
        try:
            barrier.wait()
            for _ in range(20):
                try:
                    if i == 0:
                        kvevict.select("nope", **small, keep=0.5)
                    else:
                        kvevict.select("snapkv", **small, keep=2.0)
                    failures.append(("error %d" % i, "no exception"))
                except ValueError as e:
                    if errors[i] not in str(e):
                        failures.append(("error %d" % i, str(e)))
        except Exception as e:
            failures.append(("error %d" % i, repr(e)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    threads += [threading.Thread(target=fail, args=(i,)) for i in range(len(errors))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures
    for i, w in enumerate(want):
        for got in results[i]:
            assert_same_selections([w], [got], jobs[i][0])


def test_two_threads_same_large_layer():
    (big,) = make_layers(seed=53, Hkv=4, G=2, Ls=[768], d=32, w=16, D=64)
    want = kvevict.select("defensivekv", **big, keep=0.2)
    out = [None, None]
    barrier = threading.Barrier(2)

    def run(i):
        barrier.wait()
        out[i] = kvevict.select("defensivekv", **big, keep=0.2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for got in out:
        assert got is not None
        assert_same_selections([want], [got])
