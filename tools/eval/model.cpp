// SPDX-License-Identifier: Apache-2.0
// tools/eval/model.cpp: loading a Llama-family decoder's weights and shape from an untrusted file (model.hpp).
#include "eval/model.hpp"

#include "io/file.hpp"
#include "io/json.hpp"
#include "io/safetensors.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace kvc::eval {

bool is_llama2c_tokenizer(std::filesystem::path const& p) {
  return p.extension() == ".bin" && p.filename().string().rfind("tok", 0) == 0;
}

namespace detail {

bool model_fail(std::string& error, std::string message) {
  error = std::move(message);
  return false;
}

/// Reads config.json field `key` as an integer in [lo, hi].
bool config_int(json::Value const& cfg, char const* key, Index lo, Index hi, Index& out, std::string& error,
                std::string const& file) {
  json::Value const* v = cfg.find(key);
  std::int64_t x = 0;
  if (v == nullptr || !json::to_int64(*v, x))
    return model_fail(error, file + ": field \"" + key + "\" must be an integer");
  if (x < lo || x > hi)
    return model_fail(error, file + ": field \"" + key + "\" = " + std::to_string(x) + " must be in [" +
                                 std::to_string(lo) + ", " + std::to_string(hi) + "]");
  out = x;
  return true;
}

bool config_number(json::Value const& cfg, char const* key, double lo, double hi, double& out, std::string& error,
                   std::string const& file) {
  json::Value const* v = cfg.find(key);
  if (v == nullptr || !v->is_number())
    return model_fail(error, file + ": field \"" + std::string(key) + "\" must be a number");
  double const x = v->as_double();
  if (!(x >= lo && x <= hi))
    return model_fail(
        error, file + ": field \"" + std::string(key) + "\" = " + std::string(v->number_text()) + " is out of range");
  out = x;
  return true;
}

/// Shape checks shared by both formats: the heads tile the width, GQA groups are whole, RoPE pairs are whole.
bool check_shape(ModelConfig const& c, std::string const& file, std::string& error) {
  if (c.heads % c.kv_heads != 0)
    return model_fail(error, file + ": query heads (" + std::to_string(c.heads) + ") must be a multiple of KV heads (" +
                                 std::to_string(c.kv_heads) + ")");
  if (c.head_dim % 2 != 0)
    return model_fail(error, file + ": head dim " + std::to_string(c.head_dim) + " must be even (RoPE pairs)");
  return true;
}

/// Whether a tensor's bytes can be read as floats where they lie: float32 at a 4-byte aligned address.
bool usable_in_place(SafetensorsTensor const& t, std::span<std::byte const> data) noexcept {
  return t.dtype == SafetensorsDtype::f32 && reinterpret_cast<std::uintptr_t>(data.data()) % alignof(float) == 0;
}

/// Widens `count` elements of a 16-bit or float32 little-endian tensor into `out`.
void widen_tensor(std::byte const* src, SafetensorsDtype dtype, std::size_t count, float* out) noexcept {
  for (std::size_t i = 0; i < count; ++i) {
    if (dtype == SafetensorsDtype::f32) {
      std::memcpy(out + i, src + 4 * i, 4);
    } else {
      std::uint16_t bits = 0;
      std::memcpy(&bits, src + 2 * i, 2);
      out[i] = dtype == SafetensorsDtype::f16 ? static_cast<float>(std::bit_cast<half>(bits))
                                              : static_cast<float>(std::bit_cast<bfloat16>(bits));
    }
  }
}

}  // namespace detail

bool Model::load(std::string const& path, Model& out, std::string& error) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path const p(path);
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "config.json", ec))
      return load_huggingface(p, out, error);
    // A llama2.c directory: one checkpoint .bin beside its tokenizer (tokenizer.bin or tok*.bin, skipped here).
    std::vector<fs::path> bins;
    for (auto const& entry : fs::directory_iterator(p, ec))
      if (entry.path().extension() == ".bin" && !is_llama2c_tokenizer(entry.path()))
        bins.push_back(entry.path());
    if (bins.size() == 1)
      return load_llama2c(bins[0], out, error);
    return detail::model_fail(error, path +
                                         ": expected a Hugging Face model directory (config.json + "
                                         "model.safetensors) or exactly one llama2.c .bin checkpoint (besides "
                                         "tok*.bin tokenizers); found " +
                                         std::to_string(bins.size()) + " checkpoint .bin files and no config.json");
  }
  if (!fs::exists(p, ec))
    return detail::model_fail(error, path + ": no such file or directory");
  return load_llama2c(p, out, error);
}

bool parse_config(std::string_view text, std::string const& cfg_path, ModelConfig& out, std::string& error) {
  using detail::model_fail;
  json::Value cfg;
  if (!json::parse(text, cfg, error))
    return model_fail(error, cfg_path + ": " + error);
  if (!cfg.is_object())
    return model_fail(error, cfg_path + ": expected a JSON object");
  ModelConfig c;
  c.format = "huggingface";
  if (json::Value const* t = cfg.find("model_type"); t == nullptr || t->as_string() != "llama")
    return model_fail(error, cfg_path +
                                 ": field \"model_type\" must be \"llama\" (the Llama architecture: "
                                 "RMSNorm, SwiGLU, RoPE, GQA, no biases)");
  for (char const* bias : {"attention_bias", "mlp_bias"})
    if (json::Value const* b = cfg.find(bias); b != nullptr && b->as_bool())
      return model_fail(error, cfg_path + ": \"" + std::string(bias) + "\": true is not supported (no biases)");
  if (json::Value const* act = cfg.find("hidden_act"); act != nullptr && act->as_string() != "silu")
    return model_fail(error, cfg_path + ": field \"hidden_act\" must be \"silu\" (SwiGLU)");
  constexpr Index big = Index{1} << 20;
  if (!detail::config_int(cfg, "hidden_size", 1, big, c.hidden, error, cfg_path) ||
      !detail::config_int(cfg, "intermediate_size", 1, 4 * big, c.intermediate, error, cfg_path) ||
      !detail::config_int(cfg, "num_hidden_layers", 1, 4096, c.layers, error, cfg_path) ||
      !detail::config_int(cfg, "num_attention_heads", 1, 4096, c.heads, error, cfg_path) ||
      !detail::config_int(cfg, "vocab_size", 1, Index{1} << 24, c.vocab, error, cfg_path) ||
      !detail::config_int(cfg, "max_position_embeddings", 1, Index{1} << 24, c.context, error, cfg_path) ||
      !detail::config_number(cfg, "rms_norm_eps", 0.0, 1.0, c.rms_eps, error, cfg_path))
    return false;
  c.kv_heads = c.heads;
  if (cfg.find("num_key_value_heads") != nullptr &&
      !detail::config_int(cfg, "num_key_value_heads", 1, c.heads, c.kv_heads, error, cfg_path))
    return false;
  if (cfg.find("head_dim") != nullptr && !cfg.find("head_dim")->is_null()) {
    if (!detail::config_int(cfg, "head_dim", 2, 4096, c.head_dim, error, cfg_path))
      return false;
  } else {
    if (c.hidden % c.heads != 0)
      return model_fail(error, cfg_path + ": hidden_size must be a multiple of num_attention_heads");
    c.head_dim = c.hidden / c.heads;
  }
  c.rope_theta = 10000.0;
  if (cfg.find("rope_theta") != nullptr &&
      !detail::config_number(cfg, "rope_theta", 1.0 + 1e-9, 1e12, c.rope_theta, error, cfg_path))
    return false;
  if (!detail::check_shape(c, cfg_path, error))
    return false;
  if (json::Value const* s = cfg.find("rope_scaling"); s != nullptr && !s->is_null()) {
    json::Value const* type = s->find("rope_type");
    if (type == nullptr)
      type = s->find("type");
    std::string const kind = type ? type->as_string() : std::string();
    double factor = 1;
    if (!detail::config_number(*s, "factor", 1e-6, 1e6, factor, error, cfg_path + " rope_scaling"))
      return false;
    c.inv_freq.resize(static_cast<std::size_t>(c.head_dim / 2));
    if (kind == "llama3") {
      double low = 0, high = 0, original = 0;
      if (!detail::config_number(*s, "low_freq_factor", 1e-6, 1e6, low, error, cfg_path + " rope_scaling") ||
          !detail::config_number(*s, "high_freq_factor", 1e-6, 1e6, high, error, cfg_path + " rope_scaling") ||
          !detail::config_number(*s, "original_max_position_embeddings", 1, 1e9, original, error,
                                 cfg_path + " rope_scaling"))
        return false;
      if (!(high > low))
        return model_fail(error, cfg_path + ": rope_scaling: high_freq_factor must be > low_freq_factor");
      llama3_inv_freq(c.rope_theta, c.head_dim, factor, low, high, original, c.inv_freq.data());
    } else if (kind == "linear") {
      for (Index i = 0; i < c.head_dim / 2; ++i)
        c.inv_freq[static_cast<std::size_t>(i)] = static_cast<float>(
            std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(c.head_dim)) / factor);
    } else {
      return model_fail(error, cfg_path + ": rope_scaling type '" + kind +
                                   "' is not supported (expected null, \"linear\" or \"llama3\")");
    }
  }
  if (json::Value const* t = cfg.find("tie_word_embeddings"); t != nullptr && !t->is_bool())
    return model_fail(error, cfg_path + ": field \"tie_word_embeddings\" must be true or false");
  c.tied_embeddings = cfg.find("tie_word_embeddings") != nullptr && cfg.find("tie_word_embeddings")->as_bool();
  for (char const* bias : {"attention_bias", "mlp_bias"})
    if (json::Value const* b = cfg.find(bias); b != nullptr && !b->is_bool())
      return model_fail(error, cfg_path + ": field \"" + std::string(bias) + "\" must be true or false");
  std::int64_t id = -1;
  if (json::Value const* b = cfg.find("bos_token_id"); b && json::to_int64(*b, id) && id >= 0 && id < c.vocab)
    c.bos = static_cast<std::int32_t>(id);
  // eos_token_id may be a list (Llama 3 Instruct: end of text and end of turn): the first one is the text's end.
  json::Value const* eos = cfg.find("eos_token_id");
  if (eos != nullptr && eos->is_array() && !eos->items().empty())
    eos = &eos->items().front();
  if (eos != nullptr && json::to_int64(*eos, id) && id >= 0 && id < c.vocab)
    c.eos = static_cast<std::int32_t>(id);
  out = std::move(c);
  return true;
}

bool Model::load_huggingface(std::filesystem::path const& dir, Model& out, std::string& error) {
  using detail::model_fail;
  std::string const cfg_path = (dir / "config.json").string();
  std::vector<std::byte> bytes;
  if (!read_regular_file(cfg_path, bytes, error, 16u << 20))
    return model_fail(error, cfg_path + ": " + error);
  ModelConfig c;
  if (!parse_config({reinterpret_cast<char const*>(bytes.data()), bytes.size()}, cfg_path, c, error))
    return false;
  std::string const st_path = (dir / "model.safetensors").string();
  if (!map_safetensors(st_path, out.safetensors_, error))
    return model_fail(error, st_path + ": " + error);
  SafetensorsHeader const& header = out.safetensors_.header;
  // Tied (tie_word_embeddings: true) reads one [vocab, hidden] tensor, whichever name the exporter kept; untied
  // needs both. An untied config without lm_head.weight is refused below (missing tensor), as transformers would.
  if (header.find("lm_head.weight") != nullptr && header.find("model.embed_tokens.weight") == nullptr)
    c.tied_embeddings = true;  // only the head was saved: the exporter tied them
  out.weights_path = st_path;

  // First pass: check every tensor and count the floats that must be owned (so owned_ never reallocates).
  struct Want {
    std::string name;
    Index rows, cols;  // cols == 0: a vector
  };
  std::vector<Want> wants;
  auto const layer_name = [](Index l, char const* what) { return "model.layers." + std::to_string(l) + "." + what; };
  Index const q_out = c.heads * c.head_dim, kv_out = c.kv_heads * c.head_dim;
  for (Index l = 0; l < c.layers; ++l) {
    wants.push_back({layer_name(l, "input_layernorm.weight"), c.hidden, 0});
    wants.push_back({layer_name(l, "self_attn.q_proj.weight"), q_out, c.hidden});
    wants.push_back({layer_name(l, "self_attn.k_proj.weight"), kv_out, c.hidden});
    wants.push_back({layer_name(l, "self_attn.v_proj.weight"), kv_out, c.hidden});
    wants.push_back({layer_name(l, "self_attn.o_proj.weight"), c.hidden, q_out});
    wants.push_back({layer_name(l, "post_attention_layernorm.weight"), c.hidden, 0});
    wants.push_back({layer_name(l, "mlp.gate_proj.weight"), c.intermediate, c.hidden});
    wants.push_back({layer_name(l, "mlp.up_proj.weight"), c.intermediate, c.hidden});
    wants.push_back({layer_name(l, "mlp.down_proj.weight"), c.hidden, c.intermediate});
  }
  wants.push_back({"model.norm.weight", c.hidden, 0});
  std::string const embed_name =
      header.find("model.embed_tokens.weight") ? "model.embed_tokens.weight" : "lm_head.weight";
  wants.push_back({embed_name, c.vocab, c.hidden});
  if (!c.tied_embeddings)
    wants.push_back({"lm_head.weight", c.vocab, c.hidden});

  std::size_t owned = 0;
  std::vector<SafetensorsTensor const*> found;
  for (Want const& w : wants) {
    SafetensorsTensor const* t = header.find(w.name);
    if (t == nullptr)
      return model_fail(error, st_path + ": tensor \"" + w.name + "\" is missing");
    std::vector<Index> const shape = w.cols ? std::vector<Index>{w.rows, w.cols} : std::vector<Index>{w.rows};
    if (t->shape != shape) {
      std::string s;
      for (Index d : t->shape)
        s += (s.empty() ? "" : ", ") + std::to_string(d);
      return model_fail(error, st_path + ": tensor \"" + w.name + "\" has shape [" + s + "], expected [" +
                                   std::to_string(w.rows) + (w.cols ? ", " + std::to_string(w.cols) : "") +
                                   "] from config.json");
    }
    if (t->dtype != SafetensorsDtype::f32 && t->dtype != SafetensorsDtype::f16 && t->dtype != SafetensorsDtype::bf16)
      return model_fail(error, st_path + ": tensor \"" + w.name + "\" has dtype " +
                                   std::string(safetensors_dtype_name(t->dtype)) + ", expected F32, F16 or BF16");
    if (!detail::usable_in_place(*t, out.safetensors_.data(*t)))
      owned += static_cast<std::size_t>(w.rows * (w.cols ? w.cols : 1));
    found.push_back(t);
  }
  out.owned_.resize(owned);
  std::size_t next = 0;
  auto const floats = [&](std::size_t i) -> float const* {
    SafetensorsTensor const& t = *found[i];
    std::span<std::byte const> const data = out.safetensors_.data(t);
    std::size_t const count = data.size() / safetensors_dtype_bytes(t.dtype);
    if (detail::usable_in_place(t, data))
      return reinterpret_cast<float const*>(data.data());
    float* dst = out.owned_.data() + next;
    detail::widen_tensor(data.data(), t.dtype, count, dst);
    next += count;
    return dst;
  };
  std::size_t i = 0;
  out.layers.clear();
  for (Index l = 0; l < c.layers; ++l) {
    LayerWeights w;
    w.attn_norm = Weight{floats(i++), c.hidden};
    w.wq = Weight{floats(i++), q_out, c.hidden};
    w.wk = Weight{floats(i++), kv_out, c.hidden};
    w.wv = Weight{floats(i++), kv_out, c.hidden};
    w.wo = Weight{floats(i++), c.hidden, q_out};
    w.ffn_norm = Weight{floats(i++), c.hidden};
    w.gate = Weight{floats(i++), c.intermediate, c.hidden};
    w.up = Weight{floats(i++), c.intermediate, c.hidden};
    w.down = Weight{floats(i++), c.hidden, c.intermediate};
    out.layers.push_back(w);
  }
  out.final_norm = Weight{floats(i++), c.hidden};
  out.embed = Weight{floats(i++), c.vocab, c.hidden};
  if (c.tied_embeddings)
    out.lm_head = out.embed;
  else
    out.lm_head = Weight{floats(i++), c.vocab, c.hidden};
  out.config = std::move(c);
  return true;
}

bool parse_llama2c_header(std::span<std::byte const> bytes, std::string const& path, ModelConfig& out,
                          Llama2cLayout& layout, std::string& error) {
  using detail::model_fail;
  constexpr std::size_t header_bytes = Llama2cLayout::header_bytes;
  if (bytes.size() < header_bytes)
    return model_fail(error, path + ": " + std::to_string(bytes.size()) +
                                 " bytes is shorter than a llama2.c checkpoint header (7 int32)");
  std::array<std::int32_t, 7> h{};
  std::memcpy(h.data(), bytes.data(), header_bytes);
  char const* const names[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
  constexpr std::int32_t limits[7] = {1 << 16, 1 << 18, 4096, 4096, 4096, 1 << 24, 1 << 24};
  for (int k = 0; k < 7; ++k) {
    std::int64_t const v = k == 5 ? std::abs(static_cast<std::int64_t>(h[k])) : h[k];
    if (v < 1 || v > limits[k])
      return model_fail(error, path + ": header field " + names[k] + " = " + std::to_string(h[k]) + " must be in [1, " +
                                   std::to_string(limits[k]) + "]" + (k == 5 ? " in absolute value" : "") +
                                   " (is this a llama2.c checkpoint?)");
  }
  ModelConfig c;
  c.format = "llama2.c";
  c.hidden = h[0];
  c.intermediate = h[1];
  c.layers = h[2];
  c.heads = h[3];
  c.kv_heads = h[4];
  c.vocab = std::abs(h[5]);
  c.tied_embeddings = h[5] > 0;
  c.context = h[6];
  c.rms_eps = 1e-5;
  c.rope_style = RopeStyle::interleaved;
  c.rope_theta = 10000.0;
  c.bos = 1;
  c.eos = 2;
  if (c.hidden % c.heads != 0)
    return model_fail(error, path + ": dim (" + std::to_string(c.hidden) + ") must be a multiple of n_heads (" +
                                 std::to_string(c.heads) + ")");
  if (c.kv_heads > c.heads)
    return model_fail(error, path + ": n_kv_heads must be <= n_heads");
  c.head_dim = c.hidden / c.heads;
  if (!detail::check_shape(c, path, error))
    return false;
  // Every count below is a product of header fields bounded above, so 64-bit arithmetic cannot overflow
  // (at most 2^16 * 2^18 * 2^12 floats per tensor group).
  Index const d = c.hidden, kv = c.kv_heads * c.head_dim, f = c.intermediate, L = c.layers;
  Index const sizes[] = {
      c.vocab * d,                          // token_embedding_table
      L * d,                                // rms_att_weight
      L * d * d,                            // wq
      L * kv * d,                           // wk
      L * kv * d,                           // wv
      L * d * d,                            // wo
      L * d,                                // rms_ffn_weight
      L * f * d,                            // w1 (gate)
      L * d * f,                            // w2 (down)
      L * f * d,                            // w3 (up)
      d,                                    // rms_final_weight
      c.context * c.head_dim,               // freq_cis_real + freq_cis_imag ([seq_len, head_size / 2] each; unused)
      c.tied_embeddings ? 0 : c.vocab * d,  // wcls
  };
  Index total = 0;
  for (Index s : sizes)
    total += s;
  std::uint64_t const expected = header_bytes + static_cast<std::uint64_t>(total) * sizeof(float);
  if (bytes.size() != expected)
    return model_fail(error, path + ": " + std::to_string(bytes.size()) + " bytes, but the header (dim " +
                                 std::to_string(d) + ", hidden_dim " + std::to_string(f) + ", n_layers " +
                                 std::to_string(L) + ", n_heads " + std::to_string(c.heads) + ", n_kv_heads " +
                                 std::to_string(c.kv_heads) + ", vocab_size " + std::to_string(h[5]) + ", seq_len " +
                                 std::to_string(c.context) + ") implies " + std::to_string(expected));
  Index at = 0;
  for (std::size_t k = 0; k < std::size(sizes); ++k) {
    layout.offset[k] = at;
    layout.size[k] = sizes[k];
    at += sizes[k];
  }
  out = std::move(c);
  return true;
}

bool Model::load_llama2c(std::filesystem::path const& file, Model& out, std::string& error) {
  using detail::model_fail;
  std::string const path = file.string();
  if (!map_regular_file(path, out.file_, error))
    return model_fail(error, path + ": " + error);
  std::span<std::byte const> const bytes = out.file_.bytes();
  ModelConfig c;
  Llama2cLayout layout;
  if (!parse_llama2c_header(bytes, path, c, layout, error))
    return false;
  constexpr std::size_t header_bytes = Llama2cLayout::header_bytes;
  Index const d = c.hidden, kv = c.kv_heads * c.head_dim, f = c.intermediate, L = c.layers;
  float const* base = reinterpret_cast<float const*>(bytes.data() + header_bytes);  // mmap: page-aligned + 28
  auto const ptr = [&](int k, Index l) { return base + layout.offset[k] + l * (layout.size[k] / L); };
  out.layers.clear();
  for (Index l = 0; l < L; ++l) {
    LayerWeights w;
    w.attn_norm = Weight{ptr(1, l), d};
    w.wq = Weight{ptr(2, l), d, d};
    w.wk = Weight{ptr(3, l), kv, d};
    w.wv = Weight{ptr(4, l), kv, d};
    w.wo = Weight{ptr(5, l), d, d};
    w.ffn_norm = Weight{ptr(6, l), d};
    w.gate = Weight{ptr(7, l), f, d};
    w.down = Weight{ptr(8, l), d, f};
    w.up = Weight{ptr(9, l), f, d};
    out.layers.push_back(w);
  }
  out.embed = Weight{base, c.vocab, d};
  out.final_norm = Weight{base + layout.offset[10], d};
  out.lm_head = Weight{c.tied_embeddings ? base : base + layout.offset[12], c.vocab, d};
  out.weights_path = path;
  out.config = std::move(c);
  return true;
}

}  // namespace kvc::eval
