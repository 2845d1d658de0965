#pragma once
/// tinycode: configuration and weights of a byte-level Llama-style model (models/tinycode/MODEL.md), loaded from a
/// safetensors checkpoint. The float16 weights are converted once to float32 Eigen matrices at load time.

#include <Eigen/Core>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "safetensors.hpp"  // tools/safetensors.hpp (namespace safetensors)

namespace tinycode {

using Index = Eigen::Index;
/// Row-major float32 matrix, the layout of every activation ([tokens, features]) and weight ([out, in]).
using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
/// A per-feature weight vector (RMSNorm gains), multiplied into every row of an activation.
using RowVector = Eigen::Matrix<float, 1, Eigen::Dynamic>;

/// Hyper-parameters (config.json).
struct Config {
  Index d_model = 256;
  Index n_layer = 10;
  Index n_head = 8;     ///< query heads H
  Index n_kv_head = 2;  ///< key/value heads Hkv (GQA: query head j uses KV head j / group())
  Index head_dim = 32;  ///< d
  Index d_ff = 768;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  Index vocab = 256;
  Index ctx = 2048;  ///< longest sequence (RoPE positions 0 .. ctx-1)

  Index group() const { return n_head / n_kv_head; }

  /// Reads config.json; throws std::runtime_error on a missing field or inconsistent shapes.
  static Config load(const std::filesystem::path& file) {
    std::ifstream in(file);
    if (!in) throw std::runtime_error(file.string() + ": cannot open the model config");
    nlohmann::json j;
    try {
      in >> j;
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(file.string() + ": invalid JSON (" + e.what() + ")");
    }
    Config c;
    try {
      c.d_model = j.at("d_model").get<Index>();
      c.n_layer = j.at("n_layer").get<Index>();
      c.n_head = j.at("n_head").get<Index>();
      c.n_kv_head = j.at("n_kv_head").get<Index>();
      c.head_dim = j.at("head_dim").get<Index>();
      c.d_ff = j.at("d_ff").get<Index>();
      c.norm_eps = j.at("norm_eps").get<double>();
      c.rope_theta = j.at("rope_theta").get<double>();
      c.vocab = j.at("vocab").get<Index>();
      c.ctx = j.at("ctx").get<Index>();
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(file.string() + ": " + e.what());
    }
    c.validate(file.string());
    return c;
  }

  void validate(const std::string& where) const {
    const bool ok = d_model > 0 && n_layer > 0 && n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0 &&
                    head_dim > 0 && head_dim % 2 == 0 && d_ff > 0 && vocab > 0 && ctx > 0 && norm_eps > 0 &&
                    rope_theta > 0;
    if (!ok) throw std::runtime_error(where + ": inconsistent model config");
  }
};

/// Weights of one transformer block, float32, in PyTorch Linear layout [out, in] (y = x W^T).
struct LayerWeights {
  RowVector attn_norm;  ///< [d_model]
  Matrix wq;            ///< [n_head * head_dim, d_model]
  Matrix wk;            ///< [n_kv_head * head_dim, d_model]
  Matrix wv;            ///< [n_kv_head * head_dim, d_model]
  Matrix wo;            ///< [d_model, n_head * head_dim]; query head j uses columns j*d .. j*d+d-1
  RowVector mlp_norm;   ///< [d_model]
  Matrix w_gate;        ///< [d_ff, d_model]
  Matrix w_up;          ///< [d_ff, d_model]
  Matrix w_down;        ///< [d_model, d_ff]
};

/// The whole model. Immutable after load(); one Model can serve any number of engines.
struct Model {
  Config config;
  Matrix embed;          ///< [vocab, d_model]; also the output head (tied embeddings)
  RowVector final_norm;  ///< [d_model]
  std::vector<LayerWeights> layers;

  /// Loads `dir`/config.json and `dir`/model.safetensors. Throws std::runtime_error (or
  /// safetensors::error) on a missing file, a missing tensor or a shape mismatch.
  static Model load(const std::filesystem::path& dir) {
    Model m;
    m.config = Config::load(dir / "config.json");
    const Config& c = m.config;
    const auto st = safetensors::file::open((dir / "model.safetensors").string());
    const Index qd = c.n_head * c.head_dim, kvd = c.n_kv_head * c.head_dim;
    m.embed = matrix(st, "embed.weight", c.vocab, c.d_model);
    m.final_norm = vector(st, "final_norm.weight", c.d_model);
    m.layers.resize(static_cast<std::size_t>(c.n_layer));
    for (Index i = 0; i < c.n_layer; ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      LayerWeights& l = m.layers[static_cast<std::size_t>(i)];
      l.attn_norm = vector(st, p + "attn_norm.weight", c.d_model);
      l.wq = matrix(st, p + "wq.weight", qd, c.d_model);
      l.wk = matrix(st, p + "wk.weight", kvd, c.d_model);
      l.wv = matrix(st, p + "wv.weight", kvd, c.d_model);
      l.wo = matrix(st, p + "wo.weight", c.d_model, qd);
      l.mlp_norm = vector(st, p + "mlp_norm.weight", c.d_model);
      l.w_gate = matrix(st, p + "w_gate.weight", c.d_ff, c.d_model);
      l.w_up = matrix(st, p + "w_up.weight", c.d_ff, c.d_model);
      l.w_down = matrix(st, p + "w_down.weight", c.d_model, c.d_ff);
    }
    return m;
  }

 private:
  static std::vector<float> read(const safetensors::file& st, const std::string& name,
                                 const std::vector<std::int64_t>& shape) {
    const auto& info = st.at(name);
    if (info.shape != shape) {
      std::string want, got;
      for (auto s : shape) want += (want.empty() ? "" : ", ") + std::to_string(s);
      for (auto s : info.shape) got += (got.empty() ? "" : ", ") + std::to_string(s);
      throw std::runtime_error(st.source() + ": tensor '" + name + "' has shape [" + got + "]; expected [" + want +
                               "]");
    }
    return st.read_floats<float>(info);
  }
  static Matrix matrix(const safetensors::file& st, const std::string& name, Index rows, Index cols) {
    const std::vector<float> v = read(st, name, {rows, cols});
    return Eigen::Map<const Matrix>(v.data(), rows, cols);
  }
  static RowVector vector(const safetensors::file& st, const std::string& name, Index n) {
    const std::vector<float> v = read(st, name, {n});
    return Eigen::Map<const RowVector>(v.data(), n);
  }
};

}  // namespace tinycode
