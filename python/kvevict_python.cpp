// The Python module `kvevict` (pybind11) over the C API (include/kvevict/c/kvevict.h): tensors from numpy arrays
// (buffer protocol) or any CPU object with __dlpack__ (PyTorch tensors, bfloat16 included) are read in place, with
// their strides; options are kvevict-select's, as keyword arguments. The GIL is released while selecting.
//
//   sel = kvevict.select("defensivekv", keys=K, values=V, q_window=Q, w_o=Wo, keep=0.1)
//   sel.indices, sel.offsets, sel.positions   # numpy int64

#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvevict/c/kvevict.h"

namespace py = pybind11;

namespace {

/// Raises the Python exception that matches a failed C call.
void check(kvevict_status status) {
  if (status == KVEVICT_OK) return;
  const std::string message = kvevict_last_error();
  if (status == KVEVICT_INVALID_ARGUMENT) throw py::value_error(message);
  if (status == KVEVICT_OUT_OF_MEMORY) throw std::bad_alloc();
  throw std::runtime_error(message);
}

/// A tensor argument as the C API reads it, with what keeps its memory alive (the array or the DLPack capsule).
struct Tensor {
  kvevict_tensor tensor{};
  py::object owner;
};

const char* const tensor_names[] = {"keys", "values",     "q_window",     "window_attention",
                                    "w_o",  "keys_scale", "values_scale", "scores"};

/// The dtype a uint8 array or tensor gets until the fp8= argument says which fp8 format its bytes hold (torch's
/// float8 tensors reach Python code as .view(torch.uint8)).
constexpr std::int32_t kBytes = -1;

/// The data pointer of a present tensor: never NULL (NULL means absent to the C API), so that an empty tensor, whose
/// producer may hand out NULL, reaches the C API's extent check.
const void* present(const void* data) {
  static const double empty_tensor = 0.0;
  return data ? data : &empty_tensor;
}

/// A numpy array (any strides) as a kvevict_tensor; other float dtypes and byte orders are refused. int8 arrays are
/// int8 codes, uint8 arrays fp8 codes (kBytes until fp8= names the format).
Tensor from_numpy(const py::array& array, const std::string& name) {
  Tensor t;
  const py::dtype dt = array.dtype();
  const char kind = dt.kind();
  const auto itemsize = static_cast<std::int64_t>(dt.itemsize());
  const bool codes = (kind == 'i' || kind == 'u') && itemsize == 1;
  if (!codes && (kind != 'f' || (itemsize != 2 && itemsize != 4 && itemsize != 8)))
    throw py::value_error(name + ": dtype " + dt.attr("name").cast<std::string>() +
                          " is not supported; expected float32, float64 or float16 (bfloat16 through __dlpack__), "
                          "or for a quantized cache int8 or uint8 (fp8 codes, with fp8='e4m3' or 'e5m2')");
  if (!dt.attr("isnative").cast<bool>())
    throw py::value_error(name + ": byte order of dtype " + dt.attr("name").cast<std::string>() +
                          " is not native; convert with .astype(dtype.newbyteorder('='))");
  if (array.ndim() > 3)
    throw py::value_error(name + " has " + std::to_string(array.ndim()) + " dimensions; expected at most 3");
  t.tensor.dtype = codes           ? (kind == 'i' ? KVEVICT_I8 : kBytes)
                   : itemsize == 4 ? KVEVICT_F32
                   : itemsize == 8 ? KVEVICT_F64
                                   : KVEVICT_F16;
  t.tensor.rank = static_cast<std::int32_t>(array.ndim());
  for (py::ssize_t i = 0; i < array.ndim(); ++i) {
    const auto stride = static_cast<std::int64_t>(array.strides(i));
    if (stride % itemsize != 0)  // unaligned strides (views into structured arrays): read a copy
      return from_numpy(py::array(py::module_::import("numpy").attr("ascontiguousarray")(array)), name);
    t.tensor.shape[i] = static_cast<std::int64_t>(array.shape(i));
    t.tensor.strides[i] = stride / itemsize;
  }
  t.tensor.data = present(array.data());
  t.owner = array;
  return t;
}

/// Any object with __dlpack__ on the CPU (a PyTorch tensor: float32/64, float16, bfloat16).
Tensor from_dlpack(const py::object& obj, const std::string& name) {
  py::object capsule = obj.attr("__dlpack__")();
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (!managed) throw py::error_already_set();
  const DLTensor& dl = managed->dl_tensor;
  if (dl.device.device_type != kDLCPU)
    throw py::value_error(name + " is on device type " + std::to_string(static_cast<int>(dl.device.device_type)) +
                          " (DLPack); expected a CPU tensor (move it with .cpu())");
  Tensor t;
  const bool codes = (dl.dtype.code == kDLInt || dl.dtype.code == kDLUInt) && dl.dtype.bits == 8;
  if (dl.dtype.lanes != 1 ||
      !((dl.dtype.code == kDLFloat && (dl.dtype.bits == 16 || dl.dtype.bits == 32 || dl.dtype.bits == 64)) ||
        (dl.dtype.code == kDLBfloat && dl.dtype.bits == 16) || codes))
    throw py::value_error(name + ": DLPack dtype (code " + std::to_string(dl.dtype.code) + ", " +
                          std::to_string(dl.dtype.bits) +
                          " bits) is not supported; expected float32, float64, float16 or bfloat16, or for a "
                          "quantized cache int8 or uint8 (fp8 codes: tensor.view(torch.uint8), with fp8='e4m3' or "
                          "'e5m2')");
  t.tensor.dtype = codes                        ? (dl.dtype.code == kDLInt ? KVEVICT_I8 : kBytes)
                   : dl.dtype.code == kDLBfloat ? KVEVICT_BF16
                   : dl.dtype.bits == 16        ? KVEVICT_F16
                   : dl.dtype.bits == 32        ? KVEVICT_F32
                                                : KVEVICT_F64;
  if (dl.ndim > 3) throw py::value_error(name + " has " + std::to_string(dl.ndim) + " dimensions; expected at most 3");
  t.tensor.rank = dl.ndim;
  std::int64_t stride = 1;
  for (int i = dl.ndim - 1; i >= 0; --i) {
    t.tensor.shape[i] = dl.shape[i];
    t.tensor.strides[i] = dl.strides ? dl.strides[i] : stride;
    stride *= dl.shape[i];
  }
  t.tensor.data = present(dl.data ? static_cast<const char*>(dl.data) + dl.byte_offset : nullptr);
  t.owner = capsule;  // the capsule's destructor returns the tensor to its producer
  return t;
}

Tensor to_tensor(const py::object& obj, const std::string& name) {
  if (py::isinstance<py::array>(obj)) return from_numpy(obj.cast<py::array>(), name);
  if (py::hasattr(obj, "__dlpack__")) return from_dlpack(obj, name);
  py::array array;
  try {
    array = py::module_::import("numpy").attr("asarray")(obj);
    if (array.dtype().kind() != 'f' && array.dtype().kind() != 'c')
      array = py::module_::import("numpy").attr("asarray")(obj, "float64");
  } catch (const py::error_already_set& e) {
    throw py::value_error(name + ": cannot be read as an array of floats (" + std::string(e.what()) +
                          "); expected a numpy array, a CPU tensor with __dlpack__ or nested lists of numbers");
  }
  return from_numpy(array, name);
}

/// [Hkv, L, d] from [L, Hkv, d] (layout="tokens"): the same memory with the first two dimensions swapped.
void swap_first_two(kvevict_tensor& t) {
  std::swap(t.shape[0], t.shape[1]);
  std::swap(t.strides[0], t.strides[1]);
}

/// An integer array (lengths, positions) as a contiguous int64 copy of exactly the expected shape.
py::array_t<std::int64_t> integers(const py::object& obj, const std::string& name, std::vector<py::ssize_t> expected,
                                   const std::string& what) {
  py::object np = py::module_::import("numpy");
  py::array array = np.attr("asarray")(obj);
  if (array.dtype().kind() != 'i' && array.dtype().kind() != 'u')
    throw py::value_error(name + ": dtype " + array.dtype().attr("name").cast<std::string>() +
                          " is not supported; expected " + "integers " + what);
  std::vector<py::ssize_t> shape(array.shape(), array.shape() + array.ndim());
  if (shape != expected) {
    std::string got = "[", want = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) got += (i ? ", " : "") + std::to_string(shape[i]);
    for (std::size_t i = 0; i < expected.size(); ++i) want += (i ? ", " : "") + std::to_string(expected[i]);
    throw py::value_error(name + " has shape " + got + "]; expected " + want + "] " + what);
  }
  if (array.dtype().kind() == 'u' && array.dtype().itemsize() == 8 && array.size() > 0 &&
      np.attr("any")(array.attr("__gt__")(np.attr("uint64")(INT64_MAX))).cast<bool>())
    throw py::value_error(name + " holds values above 2^63 - 1; expected int64 " + what);
  return py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>(array);
}

/// One layer's arguments, held for the duration of a call.
struct LayerArgs {
  std::vector<Tensor> tensors;
  py::array_t<std::int64_t> lengths, positions;
  kvevict_layer layer = kvevict_layer_init();
};

bool is_integer(const py::handle& v);
bool is_real(const py::handle& v);

/// A dequantisation scale: a number (rounded to float32, the library's factor type) or an array of them.
Tensor to_scale(const py::object& obj, const std::string& name) {
  if (!py::isinstance<py::array>(obj) && (is_integer(obj) || is_real(obj)))  // arrays have __index__ too
    return from_numpy(py::module_::import("numpy").attr("asarray")(obj, "float32").cast<py::array>(), name);
  return to_tensor(obj, name);
}

/// `fp8`: "", "e4m3" or "e5m2", the format of uint8 keys and values.
void fill_layer(LayerArgs& args, const py::dict& d, const std::string& layout, const std::string& fp8,
                const std::string& where) {
  for (const auto& item : d) {
    const std::string key = py::str(item.first);
    bool known = key == "lengths" || key == "positions";
    for (const char* n : tensor_names) known = known || key == n;
    if (!known)
      throw py::value_error("unknown input '" + key + "'" +
                            (where.empty() ? "" : " in " + where.substr(0, where.size() - 1)) +
                            "; expected keys, values, q_window, window_attention, w_o, keys_scale, values_scale, "
                            "scores, lengths, positions");
  }
  const bool tokens = layout == "tokens";
  kvevict_tensor* slots[] = {
      &args.layer.keys, &args.layer.values,     &args.layer.q_window,     &args.layer.window_attention,
      &args.layer.w_o,  &args.layer.keys_scale, &args.layer.values_scale, &args.layer.scores};
  for (int i = 0; i < 8; ++i) {
    const char* n = tensor_names[i];
    if (!d.contains(n) || d[n].is_none()) continue;
    const auto obj = py::reinterpret_borrow<py::object>(d[n]);
    const bool scale = i == 5 || i == 6;
    args.tensors.push_back(scale ? to_scale(obj, where + n) : to_tensor(obj, where + n));
    kvevict_tensor& t = *slots[i] = args.tensors.back().tensor;
    const bool cache = i < 2;
    if (t.dtype == kBytes) {
      if (!cache)
        throw py::value_error(where + n +
                              ": dtype uint8 is not supported; expected floats (uint8 holds fp8 codes, "
                              "for the keys and values of a quantized cache only)");
      if (fp8.empty())
        throw py::value_error(where + n +
                              " is uint8: pass fp8='e4m3' or fp8='e5m2' to say which fp8 format its "
                              "bytes hold");
      t.dtype = fp8 == "e4m3" ? KVEVICT_F8_E4M3 : KVEVICT_F8_E5M2;
    } else if (cache && !fp8.empty()) {
      throw py::value_error("fp8='" + fp8 + "' says the cache holds fp8 codes as uint8, but " + where + n +
                            " is not uint8");
    }
    if (tokens && (cache || (i >= 5 && t.rank == 2))) {  // [L, Hkv, d], [L, Hkv] scales and scores
      if (cache && t.rank != 3)
        throw py::value_error(where + n + " has " + std::to_string(t.rank) +
                              " dimensions; expected [tokens, kv_heads, head_dim] (layout='tokens')");
      swap_first_two(t);
    }
  }
  const kvevict_tensor& keys = args.layer.keys;
  const bool has_keys = keys.data != nullptr && keys.rank == 3;
  const py::ssize_t Hkv = has_keys ? keys.shape[0] : 0, L = has_keys ? keys.shape[1] : 0;
  if (d.contains("lengths") && !d["lengths"].is_none()) {
    if (!has_keys) throw py::value_error(where + "lengths needs keys of rank 3 [kv_heads, tokens, head_dim]");
    args.lengths = integers(py::reinterpret_borrow<py::object>(d["lengths"]), where + "lengths", {Hkv},
                            "[kv_heads]: the entries held by each KV head");
    args.layer.lengths = args.lengths.data();
  }
  if (d.contains("positions") && !d["positions"].is_none()) {
    if (!has_keys) throw py::value_error(where + "positions needs keys of rank 3 [kv_heads, tokens, head_dim]");
    std::vector<py::ssize_t> shape = tokens ? std::vector<py::ssize_t>{L, Hkv} : std::vector<py::ssize_t>{Hkv, L};
    args.positions = integers(py::reinterpret_borrow<py::object>(d["positions"]), where + "positions", shape,
                              tokens ? "[tokens, kv_heads] (layout='tokens'): the original position of every row"
                                     : "[kv_heads, tokens]: the original position of every row");
    args.layer.positions = args.positions.data();
    args.layer.positions_strides[0] = tokens ? 1 : L;
    args.layer.positions_strides[1] = tokens ? Hkv : 1;
  }
}

/// Python and numpy scalars: booleans (bool, numpy.bool_), integers (anything with __index__ but booleans) and
/// reals (float, numpy floating).
bool is_boolean(const py::handle& v) {
  return py::isinstance<py::bool_>(v) || py::isinstance(v, py::module_::import("numpy").attr("bool_"));
}
bool is_integer(const py::handle& v) { return !is_boolean(v) && PyIndex_Check(v.ptr()); }
bool is_real(const py::handle& v) {
  return py::isinstance<py::float_>(v) || py::isinstance(v, py::module_::import("numpy").attr("floating"));
}

/// The option value as kvevict-select's text: booleans as 1/0, numbers exactly (repr), strings as they are.
std::string option_text(const std::string& name, const py::handle& value) {
  if (is_boolean(value)) return py::bool_(py::reinterpret_borrow<py::object>(value)) ? "1" : "0";
  if (is_integer(value)) return py::repr(py::int_(py::reinterpret_borrow<py::object>(value)));
  if (is_real(value)) return py::repr(py::float_(py::reinterpret_borrow<py::object>(value)));
  if (py::isinstance<py::str>(value)) return value.cast<std::string>();
  const bool layer_list = name == "keep_whole" || name == "keep-whole";  // the one list option: "1,3"
  if (layer_list && (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value))) {
    std::string text;
    for (const py::handle item : value) text += (text.empty() ? "" : ",") + option_text(name, item);
    return text;
  }
  // The head list: [(layer, kv_head), ...] as "6:0,7:1".
  const bool head_list = name == "retrieval_heads" || name == "retrieval-heads";
  if (head_list && (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value))) {
    std::string text;
    for (const py::handle item : value) {
      if (!(py::isinstance<py::list>(item) || py::isinstance<py::tuple>(item)) || py::len(item) != 2)
        throw py::value_error(name + ": expected (layer, kv_head) pairs, got an item " +
                              std::string(py::str(py::repr(item))));
      const py::sequence pair = py::reinterpret_borrow<py::sequence>(item);
      text += (text.empty() ? "" : ",") + option_text(name, pair[0]) + ":" + option_text(name, pair[1]);
    }
    return text;
  }
  throw py::value_error(name + ": expected a number, a string or a boolean" +
                        (layer_list  ? ", or a list"
                         : head_list ? ", or a list of (layer, kv_head) pairs"
                                     : "") +
                        ", got " + std::string(py::str(value.get_type().attr("__name__"))));
}

/// The kept entries of one layer (numpy int64 arrays, copied out of the C selection).
struct PySelection {
  py::array_t<std::int64_t> indices, offsets, positions, blocks, block_offsets;
  std::int64_t heads = 0;

  py::array_t<std::int64_t> head(std::int64_t h) const {
    if (h < 0 || h >= heads)
      throw py::index_error("head " + std::to_string(h) + " out of range [0, " + std::to_string(heads) + ")");
    const std::int64_t* o = offsets.data();
    return py::array_t<std::int64_t>(o[h + 1] - o[h], indices.data() + o[h]);
  }
};

py::array_t<std::int64_t> copy(const std::int64_t* data, std::int64_t n) {
  return py::array_t<std::int64_t>(static_cast<py::ssize_t>(n), data);
}

/// A Python communicator (an object with `rank`, `size` and `all_gather(data: bytes) -> bytes`, every rank's data
/// concatenated in rank order) as a kvevict_communicator; the call takes the GIL. A Python error fails the call and
/// is kept for the message.
struct PyCommunicator {
  py::object comm;
  std::string error;
  kvevict_communicator c{};

  PyCommunicator(py::object obj, const char* name) : comm(std::move(obj)) {
    for (const char* attr : {"rank", "size", "all_gather"})
      if (!py::hasattr(comm, attr))
        throw py::value_error(std::string("shard['") + name +
                              "'] needs rank, size and all_gather(data: bytes) -> "
                              "bytes (every rank's data in rank order); it has no " +
                              attr);
    c.context = this;
    c.rank = comm.attr("rank").cast<std::int32_t>();
    c.size = comm.attr("size").cast<std::int32_t>();
    c.all_gather = &PyCommunicator::all_gather;
  }
  static int all_gather(void* context, const void* send, size_t bytes, void* recv) {
    auto* self = static_cast<PyCommunicator*>(context);
    py::gil_scoped_acquire gil;
    try {
      const py::object got = self->comm.attr("all_gather")(py::bytes(static_cast<const char*>(send), bytes));
      const std::string data = py::bytes(py::module_::import("builtins").attr("bytes")(got));
      const std::size_t want = static_cast<std::size_t>(self->c.size) * bytes;
      if (data.size() != want) {
        self->error = "all_gather returned " + std::to_string(data.size()) + " bytes; expected size * " +
                      std::to_string(bytes) + " = " + std::to_string(want);
        return 1;
      }
      if (want > 0) std::memcpy(recv, data.data(), want);
      return 0;
    } catch (const std::exception& e) {
      self->error = e.what();
      return 1;
    }
  }
};

/// shard={comm, layer_group, layers, kv_heads} as the C API's kvevict_shard (docs/algorithms.md#sharded).
struct PyShard {
  std::unique_ptr<PyCommunicator> model, group;
  std::vector<std::int64_t> layers, kv_heads;
  kvevict_shard c{};

  explicit PyShard(const py::dict& d) {
    for (const auto& item : d) {
      const std::string key = py::str(item.first);
      if (key != "comm" && key != "layer_group" && key != "layers" && key != "kv_heads")
        throw py::value_error("shard has an unknown key '" + key + "'; expected comm, layer_group, layers, kv_heads");
    }
    if (!d.contains("comm") || !d.contains("layers") || !d.contains("kv_heads"))
      throw py::value_error(
          "shard needs comm (every rank of the model), layers (this rank's layer ids) and kv_heads "
          "(its KV head ids); layer_group (its tensor-parallel group) is optional");
    model = std::make_unique<PyCommunicator>(d["comm"], "comm");
    if (d.contains("layer_group") && !d["layer_group"].is_none())
      group = std::make_unique<PyCommunicator>(d["layer_group"], "layer_group");
    layers = d["layers"].cast<std::vector<std::int64_t>>();
    kv_heads = d["kv_heads"].cast<std::vector<std::int64_t>>();
    c.model = model->c;
    if (group) c.layer_group = group->c;
    c.layer_ids = layers.data();
    c.kv_heads = kv_heads.data();
    c.n_kv_heads = kv_heads.size();
  }
  std::string error() const {
    const std::string e = model->error.empty() && group ? group->error : model->error;
    return e.empty() ? e : " (" + e + ")";
  }
};

std::vector<PySelection> run(const py::object& policy_name, const std::vector<py::dict>& layers,
                             const std::string& layout, const py::object& fp8_format, py::kwargs options,
                             const py::object& shard_args = py::none()) {
  if (layout != "heads" && layout != "tokens")
    throw py::value_error(
        "layout must be 'heads' ([kv_heads, tokens, head_dim]) or 'tokens' ([tokens, kv_heads, "
        "head_dim]), got '" +
        layout + "'");
  const std::string fp8 = fp8_format.is_none() ? std::string() : py::str(fp8_format).cast<std::string>();
  if (!fp8_format.is_none() && fp8 != "e4m3" && fp8 != "e5m2")
    throw py::value_error("fp8 must be 'e4m3' or 'e5m2' (the format of uint8 keys and values), got " +
                          std::string(py::repr(fp8_format)));
  // Budget: exactly one of budget / keep / compression_ratio / threshold.
  kvevict_budget budget{};
  int budgets = 0;
  std::vector<std::string> names, values;
  for (const auto& item : options) {
    const std::string name = py::str(item.first);
    if (item.second.is_none()) continue;
    if (name == "budget") {
      if (!is_integer(item.second))
        throw py::value_error("budget must be an integer (tokens per KV head), got " +
                              std::string(py::repr(item.second)));
      const py::int_ n(py::reinterpret_borrow<py::object>(item.second));
      std::int64_t tokens = 0;
      try {
        tokens = n.cast<std::int64_t>();
      } catch (const py::cast_error&) {
        throw py::value_error("budget " + py::repr(n).cast<std::string>() + " is out of range (tokens per KV head)");
      }
      budget = kvevict_tokens(tokens);
      ++budgets;
    } else if (name == "keep" || name == "compression_ratio" || name == "threshold") {
      if (!is_integer(item.second) && !is_real(item.second))
        throw py::value_error(name + " must be a number, got " + std::string(py::repr(item.second)));
      const double v = py::float_(py::reinterpret_borrow<py::object>(item.second));
      budget = name == "keep"                ? kvevict_keep_ratio(v)
               : name == "compression_ratio" ? kvevict_compression_ratio(v)
                                             : kvevict_threshold(v);
      ++budgets;
    } else {
      names.push_back(name);
      values.push_back(option_text(name, item.second));
    }
  }
  if (budgets != 1)
    throw py::value_error(budgets == 0 ? "a budget is required: budget=N, keep=R, compression_ratio=CR or threshold=T"
                                       : "give exactly one of budget, keep, compression_ratio and threshold");
  if (layers.empty()) throw py::value_error("expected at least one layer");

  std::vector<const char*> name_ptrs, value_ptrs;
  for (std::size_t i = 0; i < names.size(); ++i) {
    name_ptrs.push_back(names[i].c_str());
    value_ptrs.push_back(values[i].c_str());
  }
  const std::string policy = policy_name.is_none() ? std::string() : py::str(policy_name).cast<std::string>();
  kvevict_policy* raw_policy = nullptr;
  check(kvevict_policy_create(policy_name.is_none() ? nullptr : policy.c_str(), name_ptrs.data(), value_ptrs.data(),
                              names.size(), &raw_policy));
  const std::unique_ptr<kvevict_policy, void (*)(kvevict_policy*)> owned_policy(raw_policy, kvevict_policy_free);

  std::vector<LayerArgs> args(layers.size());
  std::vector<kvevict_layer> c_layers;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    fill_layer(args[l], layers[l], layout, fp8, layers.size() == 1 ? "" : "layers[" + std::to_string(l) + "].");
    c_layers.push_back(args[l].layer);
  }
  kvevict_selection* raw = nullptr;
  kvevict_status status;
  std::unique_ptr<PyShard> shard;
  if (!shard_args.is_none()) {
    if (!py::isinstance<py::dict>(shard_args))
      throw py::value_error("shard must be a dict(comm=..., layer_group=..., layers=[...], kv_heads=[...])");
    shard = std::make_unique<PyShard>(shard_args.cast<py::dict>());
    if (shard->layers.size() != layers.size())
      throw py::value_error("shard['layers'] names " + std::to_string(shard->layers.size()) +
                            " layer ids; expected one per layer passed (" + std::to_string(layers.size()) + ")");
  }
  {
    py::gil_scoped_release release;
    status = shard
                 ? kvevict_select_layers_sharded(raw_policy, budget, c_layers.data(), c_layers.size(), &shard->c, &raw)
                 : kvevict_select_layers(raw_policy, budget, c_layers.data(), c_layers.size(), &raw);
  }
  if (status == KVEVICT_COLLECTIVE_FAILED) throw std::runtime_error(kvevict_last_error() + shard->error());
  check(status);
  const std::unique_ptr<kvevict_selection, void (*)(kvevict_selection*)> owned(raw, kvevict_selection_free);
  std::vector<PySelection> out;
  for (std::size_t l = 0; l < kvevict_selection_layers(raw); ++l) {
    PySelection s;
    s.heads = kvevict_selection_heads(raw, l);
    const std::int64_t total = kvevict_selection_total(raw, l);
    s.indices = copy(kvevict_selection_indices(raw, l), total);
    s.offsets = copy(kvevict_selection_offsets(raw, l), s.heads + 1);
    s.positions = copy(kvevict_selection_positions(raw, l), total);
    s.blocks = copy(kvevict_selection_blocks(raw, l), kvevict_selection_block_count(raw, l));
    s.block_offsets = copy(kvevict_selection_block_offsets(raw, l), s.heads + 1);
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(kvevict, m) {
  std::string option_names;  // the parameter table's (kvevict_option_name), as keyword arguments
  for (std::size_t i = 0; i < kvevict_option_count(); ++i)
    option_names += std::string(i ? ", " : "") + kvevict_option_name(i);
  m.doc() =
      "kvevict: KV-cache eviction policies (SnapKV, AdaKV, CriticalKV, DefensiveKV, Layer-DefensiveKV, "
      "StreamingLLM, composed base+selector).\n\n"
      "select(policy, keys=K, values=V, q_window=Q, w_o=Wo, keep=0.1, **options) -> Selection\n"
      "select_layers(policy, [dict(keys=..., ...), ...], keep=0.1, **options) -> [Selection]\n"
      "Keyword options (kvevict.options() gives each one's help; kvevict-select's options in snake_case): " +
      option_names + ". See docs/bindings.md.";
  m.attr("__version__") = kvevict_version();

  py::class_<PySelection>(m, "Selection", "The kept entries of one layer.")
      .def_readonly("indices", &PySelection::indices, "int64 [total]: kept rows, heads concatenated, each ascending")
      .def_readonly("offsets", &PySelection::offsets,
                    "int64 [kv_heads + 1]: head h is indices[offsets[h]:offsets[h+1]]")
      .def_readonly("positions", &PySelection::positions, "int64 [total]: original positions, parallel to indices")
      .def_readonly("blocks", &PySelection::blocks,
                    "int64: kept block ids with block=B > 1 (block b = rows [bB, bB + B)); else the indices")
      .def_readonly("block_offsets", &PySelection::block_offsets, "int64 [kv_heads + 1]: head h's blocks")
      .def_readonly("heads", &PySelection::heads, "KV heads")
      .def_property_readonly(
          "total", [](const PySelection& s) { return s.indices.size(); }, "kept entries")
      .def("head", &PySelection::head, py::arg("h"), "int64: the kept rows of KV head h")
      .def("__repr__", [](const PySelection& s) {
        return "<kvevict.Selection heads=" + std::to_string(s.heads) + " total=" + std::to_string(s.indices.size()) +
               ">";
      });

  m.def(
      "options",
      [] {
        py::dict out;
        for (std::size_t i = 0; i < kvevict_option_count(); ++i) out[kvevict_option_name(i)] = kvevict_option_help(i);
        return out;
      },
      "The options by keyword name (the parameter table kvevict-select's --help and the C API share), each with its "
      "help: what it does, the accepted range and the default.");

  m.def(
      "policies",
      [] {
        std::vector<std::string> names;
        for (std::size_t i = 0; i < kvevict_policy_count(); ++i) names.emplace_back(kvevict_policy_name(i));
        return names;
      },
      "The catalogue's policy names.");

  m.def(
      "select",
      [](const py::object& policy, const std::string& layout, py::object keys, py::object values, py::object q_window,
         py::object window_attention, py::object w_o, py::object lengths, py::object positions, py::object keys_scale,
         py::object values_scale, py::object scores, py::object fp8, py::kwargs options) {
        py::dict layer;
        layer["keys"] = keys, layer["values"] = values, layer["q_window"] = q_window;
        layer["window_attention"] = window_attention, layer["w_o"] = w_o;
        layer["lengths"] = lengths, layer["positions"] = positions;
        layer["keys_scale"] = keys_scale, layer["values_scale"] = values_scale, layer["scores"] = scores;
        if (keys.is_none()) throw py::value_error("keys is required: [kv_heads, tokens, head_dim]");
        return run(policy, {layer}, layout, fp8, std::move(options)).front();
      },
      py::arg("policy") = py::none(), py::kw_only(), py::arg("layout") = "heads", py::arg("keys") = py::none(),
      py::arg("values") = py::none(), py::arg("q_window") = py::none(), py::arg("window_attention") = py::none(),
      py::arg("w_o") = py::none(), py::arg("lengths") = py::none(), py::arg("positions") = py::none(),
      py::arg("keys_scale") = py::none(), py::arg("values_scale") = py::none(), py::arg("scores") = py::none(),
      py::arg("fp8") = py::none(),
      "Selects one layer: policy (a catalogue name, or None with base=/selector=), tensors keys/values [Hkv, L, d] "
      "(layout='heads') or [L, Hkv, d] (layout='tokens'), q_window [H, w, d] or window_attention [H, w, L], "
      "w_o [D, H*d]; optional lengths [Hkv] and positions; a quantized cache: int8 keys/values, or uint8 holding "
      "fp8 codes with fp8='e4m3' or 'e5m2', and optional float32 keys_scale/values_scale: a number, [L] or "
      "[Hkv, L] ([L, Hkv] with layout='tokens'); scores [Hkv, L] ([L, Hkv] with layout='tokens'), the engine's "
      "per-entry scores for engine-scores, layer-engine-scores and the engine selector; exactly one of budget=N, "
      "keep=R, compression_ratio=CR, threshold=T (count_lower, count_upper, count_scope bound its count); "
      "other options as kvevict-select's. Returns a Selection.");

  m.def(
      "select_layers",
      [](const py::object& policy, const std::vector<py::dict>& layers, const std::string& layout,
         const py::object& fp8, const py::object& shard,
         py::kwargs options) { return run(policy, layers, layout, fp8, std::move(options), shard); },
      py::arg("policy"), py::arg("layers"), py::kw_only(), py::arg("layout") = "heads", py::arg("fp8") = py::none(),
      py::arg("shard") = py::none(),
      "Selects every layer at once (layer-global policies share one budget across them): layers is a list of dicts "
      "with the tensors of select() (keys_scale, values_scale and scores included); fp8= as for select(). "
      "shard=dict(comm=C, layer_group=G, layers=[ids], kv_heads=[ids]): this rank's part of a sharded model "
      "(docs/algorithms.md#sharded), the layers passed holding the KV heads kv_heads of layers `layers`; C (every "
      "rank) and G (the ranks holding the same layers, or None) have rank, size and all_gather(data: bytes) -> bytes "
      "(every rank's data in rank order). Returns a list of Selection, one per layer.");
}
