// SPDX-License-Identifier: Apache-2.0
// tools/eval/model.hpp: the weights and shape of a Llama-family decoder, loaded from an untrusted file.
//
// Two formats:
//   Hugging Face directory: config.json (model_type "llama") + model.safetensors (F32, F16 or BF16 tensors), tied
//     or untied embeddings, rotate-half (NeoX) RoPE with rope_theta and rope_scaling (null, "linear", "llama3").
//   llama2.c legacy checkpoint (.bin): 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
//     seq_len; vocab_size < 0 means an unshared classifier), then float32 weights in llama2.c's order; interleaved
//     RoPE, theta 10000, RMSNorm eps 1e-5.
// The weights file is memory-mapped (MAP_PRIVATE, read-only); float32 tensors aligned to 4 bytes are used in place,
// others (16-bit, or unaligned) are widened once into owned float storage. Every size and offset is checked
// against the file before anything is allocated; errors name the file and the field.
#pragma once

#include <kvc/core/element.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/rope.hpp>

#include "io/file.hpp"
#include "io/json.hpp"
#include "io/safetensors.hpp"

#include <Eigen/Core>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace kvc::eval {

/// A row-major float matrix read in place (weights: [out_features, in_features], as both formats store them).
using MatrixMap = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> const>;
using RowVectorMap = Eigen::Map<Eigen::RowVectorXf const>;

/// A weight tensor: row-major float [rows, cols] (cols = 1 for a vector), in the mapping or in owned storage.
struct Weight {
  float const* data = nullptr;
  Index rows = 0;
  Index cols = 1;

  MatrixMap matrix() const noexcept { return {data, rows, cols}; }
  RowVectorMap vector() const noexcept { return {data, rows * cols}; }
};

/// The shape of the model (what the forward pass and the cache need).
struct ModelConfig {
  std::string format;  ///< "huggingface" or "llama2.c"
  Index hidden = 0;    ///< model width
  Index intermediate = 0;
  Index layers = 0;
  Index heads = 0;     ///< query heads
  Index kv_heads = 0;  ///< KV heads (GQA: heads is a multiple)
  Index head_dim = 0;
  Index vocab = 0;
  Index context = 0;  ///< the positions the model was trained on (max_position_embeddings / seq_len)
  double rms_eps = 1e-6;
  RopeStyle rope_style = RopeStyle::neox;
  double rope_theta = 10000.0;
  std::vector<float> inv_freq;  ///< [head_dim / 2] when rope_scaling changes the frequencies, else empty
  std::int32_t bos = -1, eos = -1;
  bool tied_embeddings = false;

  RopeSpec rope() const noexcept {
    return {.theta = rope_theta, .style = rope_style, .inv_freq = inv_freq.empty() ? nullptr : inv_freq.data()};
  }
};

/// llama2.c's convention: a checkpoint's tokenizer sits beside it as tokenizer.bin or tok<vocab>.bin.
bool is_llama2c_tokenizer(std::filesystem::path const& p);

/// Where llama2.c's tensors lie: element offsets and sizes (floats, after the 28-byte header) of its 13 groups in
/// file order: token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, freq_cis (real + imag,
/// unused), wcls (0 floats when shared).
struct Llama2cLayout {
  static constexpr std::size_t header_bytes = 7 * sizeof(std::int32_t);
  Index offset[13] = {};
  Index size[13] = {};
};

/// Parses a Hugging Face config.json (text of the file `cfg_path`, for messages) into `out`: model_type llama, no
/// biases, silu, sizes in sane ranges, GQA and RoPE shapes consistent, rope_scaling null / linear / llama3.
bool parse_config(std::string_view text, std::string const& cfg_path, ModelConfig& out, std::string& error);

/// Parses and checks a llama2.c checkpoint's header against the file's size (`bytes` is the whole file): every
/// field in range, heads tiling the width, and the size exactly what the header implies. Fills `out` and `layout`.
bool parse_llama2c_header(std::span<std::byte const> bytes, std::string const& path, ModelConfig& out,
                          Llama2cLayout& layout, std::string& error);

/// One decoder layer's weights (views into the mapping or into owned storage).
struct LayerWeights {
  Weight attn_norm;       ///< [hidden]
  Weight wq, wk, wv, wo;  ///< [Hq * d, hidden], [Hkv * d, hidden] (twice), [hidden, Hq * d]
  Weight ffn_norm;        ///< [hidden]
  Weight gate, up, down;  ///< [intermediate, hidden] (twice), [hidden, intermediate]
};

/// A loaded model: its shape, the mapping and the views. Move-only (the views point into it).
class Model {
 public:
  ModelConfig config;
  std::vector<LayerWeights> layers;
  Weight embed;              ///< [vocab, hidden]
  Weight lm_head;            ///< [vocab, hidden] (the embedding's storage when tied)
  Weight final_norm;         ///< [hidden]
  std::string weights_path;  ///< the file the weights came from (for messages)

  Model() = default;
  Model(Model&&) = default;
  Model& operator=(Model&&) = default;

  /// Loads `path`: a Hugging Face directory (config.json + model.safetensors), a llama2.c .bin checkpoint, or a
  /// directory holding exactly one .bin checkpoint. Returns false with `error` naming the file and the field.
  static bool load(std::string const& path, Model& out, std::string& error);

  /// Bytes of float storage the loader allocated (0 when every tensor is used in place from the mapping).
  std::size_t owned_bytes() const noexcept { return owned_.size() * sizeof(float); }

 private:
  MappedFile file_;
  MappedSafetensors safetensors_;
  std::vector<float> owned_;  // widened 16-bit (or unaligned) tensors, back to back

  static bool load_huggingface(std::filesystem::path const& dir, Model& out, std::string& error);
  static bool load_llama2c(std::filesystem::path const& file, Model& out, std::string& error);
};

}  // namespace kvc::eval
