// SPDX-License-Identifier: Apache-2.0
// tools/kvc/inputs.cpp: reading the inputs of `kvc`: .npy and .safetensors arrays (read_array), the keys' and values'
// tensors (load_tensor), the queries with their positions and RoPE table (load_queries), --rope, and the checks of
// the query rows a scorer reads.

#include "internal.hpp"
#include "io/json.hpp"

#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace kvc::cli {

kvc::RopeSpec parse_rope(std::string const& text) {
  kvc::RopeSpec spec;
  auto bad = [&](std::string const& why) {
    fail(exit_usage, "--rope '" + text + "': " + why + "; the form is theta=NUMBER,style=neox|interleaved");
  };
  bool seen_theta = false, seen_style = false;
  std::size_t start = 0;
  while (true) {
    std::size_t const comma = text.find(',', start);
    std::string const item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    std::size_t const eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      bad("'" + item + "' is not KEY=VALUE");
    std::string const key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "theta") {
      if (std::exchange(seen_theta, true))
        bad("theta given twice");
      char* end = nullptr;
      spec.theta = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !std::isfinite(spec.theta) || !(spec.theta > 1.0))
        bad("theta = '" + value + "': expected a number > 1");
    } else if (key == "style") {
      if (std::exchange(seen_style, true))
        bad("style given twice");
      if (value == "neox")
        spec.style = kvc::RopeStyle::neox;
      else if (value == "interleaved")
        spec.style = kvc::RopeStyle::interleaved;
      else
        bad("style = '" + value + "': expected neox or interleaved");
    } else {
      bad("unknown key '" + key + "'");
    }
    if (comma == std::string::npos)
      break;
    start = comma + 1;
  }
  return spec;
}

InputSpec input_spec(std::string const& arg) {
  constexpr std::string_view ext = ".safetensors";
  auto ends_with_ext = [&](std::string_view s) {
    return s.size() >= ext.size() && s.substr(s.size() - ext.size()) == ext;
  };
  if (ends_with_ext(arg))
    return {arg, {}, true, false};
  std::size_t const colon = arg.rfind(':');
  if (colon != std::string::npos && ends_with_ext(std::string_view(arg).substr(0, colon)))
    return {arg.substr(0, colon), arg.substr(colon + 1), true, true};
  return {arg, {}, false, false};
}

namespace {

/// "'a', 'b', 'c'" for the first 16 tensors of `h`, then "and N more".
std::string tensor_names(kvc::SafetensorsHeader const& h) {
  std::string names;
  for (std::size_t i = 0; i < h.tensors.size() && i < 16; ++i)
    names += (i ? ", '" : "'") + kvc::json::printable(h.tensors[i].name) + "'";
  if (h.tensors.size() > 16)
    names += " and " + std::to_string(h.tensors.size() - 16) + " more";
  return names;
}

}  // namespace

void read_array(std::string const& arg, std::string const& where, Array& out) {
  InputSpec const spec = input_spec(arg);
  std::string error;
  if (!spec.safetensors) {
    kvc::NpyArray a;
    if (!kvc::read_npy(spec.file, a, error, memory_bytes()))
      fail(exit_invalid, where + error);
    out.elem = a.dtype == kvc::NpyDtype::f32   ? Elem::f32
               : a.dtype == kvc::NpyDtype::f16 ? Elem::f16
               : a.dtype == kvc::NpyDtype::i64 ? Elem::i64
                                               : Elem::other;
    out.safetensors = false;
    out.dtype_text = std::string(kvc::npy_descr(a.dtype));
    out.shape = std::move(a.shape);
    out.data = std::move(a.data);
    return;
  }
  kvc::SafetensorsFile f;
  if (!kvc::read_safetensors(spec.file, f, error, memory_bytes()))
    fail(exit_invalid, where + error);
  kvc::SafetensorsTensor const* t = nullptr;
  if (spec.named) {
    t = f.header.find(spec.tensor);
    if (t == nullptr)
      fail(exit_invalid, where + "no tensor named '" + kvc::json::printable(spec.tensor) + "'; the file holds " +
                             (f.header.tensors.empty() ? std::string("no tensor") : tensor_names(f.header)));
  } else if (f.header.tensors.size() != 1) {
    fail(exit_invalid, where + "the file holds " + std::to_string(f.header.tensors.size()) + " tensors" +
                           (f.header.tensors.empty() ? std::string() : " (" + tensor_names(f.header) + ")") +
                           "; name one as " + spec.file + ":TENSOR");
  } else {
    t = &f.header.tensors[0];
  }
  using kvc::SafetensorsDtype;
  out.elem = t->dtype == SafetensorsDtype::f32       ? Elem::f32
             : t->dtype == SafetensorsDtype::f16     ? Elem::f16
             : t->dtype == SafetensorsDtype::bf16    ? Elem::bf16
             : t->dtype == SafetensorsDtype::f8_e4m3 ? Elem::f8_e4m3
             : t->dtype == SafetensorsDtype::f8_e5m2 ? Elem::f8_e5m2
             : t->dtype == SafetensorsDtype::i64     ? Elem::i64
                                                     : Elem::other;
  out.safetensors = true;
  out.dtype_text = std::string(kvc::safetensors_dtype_name(t->dtype));
  out.shape = t->shape;
  // The tensor's bytes, moved to the front of the file's buffer (no second copy of the file).
  auto const begin = static_cast<std::ptrdiff_t>(t->begin), bytes = static_cast<std::ptrdiff_t>(t->bytes);
  out.data = std::move(f.bytes);
  out.data.erase(out.data.begin(), out.data.begin() + begin);
  out.data.resize(static_cast<std::size_t>(bytes));
}

Input load_tensor(std::string const& path, char const* role, char const* dims, bool fp8) {
  Input in{path, {}};
  std::string const where = std::string(role) + " file " + path + ": ";
  read_array(path, where, in.array);
  auto const& s = in.array.shape;
  if (s.size() != 4)
    fail(exit_invalid,
         where + "field 'shape' has " + std::to_string(s.size()) + " dimensions, expected 4 (" + dims + ")");
  bool const accepted =
      in.array.elem == Elem::f32 || in.array.elem == Elem::f16 || in.array.elem == Elem::bf16 || (fp8 && in.fp8());
  if (!accepted)
    fail(exit_invalid, where + in.array.dtype_error("'<f4' (float32) or '<f2' (float16)",
                                                    fp8 ? "F32, F16, BF16, F8_E4M3 or F8_E5M2" : "F32, F16 or BF16"));
  if (std::find(s.begin(), s.end(), 0) != s.end())
    fail(exit_invalid, where + "field 'shape' is (" + std::to_string(s[0]) + ", " + std::to_string(s[1]) + ", " +
                           std::to_string(s[2]) + ", " + std::to_string(s[3]) +
                           "): every dimension must be >= 1 (an empty array holds nothing to score)");
  return in;
}

kvc::KVExtents extents_of(Input const& in) {
  auto const& s = in.array.shape;
  return {s[0], s[1], s[2], s[3]};
}

std::string short_number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", x);
  return text;
}

std::string range_text(kvc::Index dim) {
  return "beyond the exact range of attention logits in fp32 (head_dim * x^2 < 2^126: |x| < " +
         short_number(std::sqrt(0x1p126 / static_cast<double>(dim))) + " at head_dim " + std::to_string(dim) +
         "; see docs/numerics.md)";
}

KeyRange key_range(PolicyInfo const& policy) {
  return policy.reads_queries ? KeyRange::logits
                              : (std::string_view(policy.name) == "knorm" ? KeyRange::norms : KeyRange::finite);
}

void load_queries(std::string const& path, std::string const& positions_path, kvc::KVExtents const* keys,
                  std::string const& keys_path, bool rotate, kvc::RopeSpec const& spec, Queries& q) {
  q.path = path;
  Input const in = load_tensor(q.path, "queries", "[batch, query_heads, window, head_dim]");
  q.ext = extents_of(in);
  q.file_bytes = in.array.data.size();
  std::string const where = "queries file " + q.path + ": field 'shape': ";
  // Without keys the queries' own extents stand in for them (every check below then holds).
  kvc::KVExtents const k = keys ? *keys : kvc::KVExtents{q.ext.batch, q.ext.heads, q.ext.tokens, q.ext.dim};
  if (q.ext.batch != k.batch)
    fail(exit_invalid, where + "batch (shape[0]) is " + std::to_string(q.ext.batch) + ", expected the keys' " +
                           std::to_string(k.batch));
  if (k.heads <= 0 || q.ext.heads <= 0 || q.ext.heads % k.heads != 0)
    fail(exit_invalid, where + "query heads (shape[1]) is " + std::to_string(q.ext.heads) +
                           ", expected a positive multiple of the keys' KV heads (" + std::to_string(k.heads) + ")");
  if (q.ext.dim != k.dim)
    fail(exit_invalid, where + "head_dim (shape[3]) is " + std::to_string(q.ext.dim) + ", expected the keys' " +
                           std::to_string(k.dim) + " (" + keys_path + ")");
  q.rows = buffer<float>(static_cast<std::size_t>(q.ext.rows() * q.ext.dim), "the fp32 copy of queries file " + q.path);
  for (std::size_t i = 0; i < q.rows.size(); ++i) {
    q.rows[i] = in.array.elem == Elem::f16    ? kvc::to_float(in.array.as<kvc::half>()[i])
                : in.array.elem == Elem::bf16 ? kvc::to_float(in.array.as<kvc::bfloat16>()[i])
                                              : in.array.as<float>()[i];
    if (!std::isfinite(q.rows[i]))
      fail(exit_invalid, "queries file " + q.path + ": field 'data' holds NaN or Inf (element " + std::to_string(i) +
                             "), expected finite values");
    if (keys && !kvc::in_exact_range(q.rows[i], q.ext.dim))
      fail(exit_invalid, "queries file " + q.path + ": field 'data': element " + std::to_string(i) + " is " +
                             short_number(q.rows[i]) + ", " + range_text(q.ext.dim));
  }

  kvc::Index max_position = k.tokens - 1;  // the default positions end at N - 1
  if (!positions_path.empty()) {
    q.positions_path = positions_path;
    std::string const pw = "positions file " + q.positions_path + ": ";
    Array p;
    read_array(q.positions_path, pw, p);
    if (p.elem != Elem::i64)
      fail(exit_invalid, pw + p.dtype_error("'<i8' (int64)", "I64"));
    if (p.shape != std::vector<kvc::Index>{q.ext.batch, q.ext.tokens})
      fail(exit_invalid, pw + "field 'shape' has " + std::to_string(p.shape.size()) +
                             " dimensions or other sizes, expected [batch, window] = [" + std::to_string(q.ext.batch) +
                             ", " + std::to_string(q.ext.tokens) + "] (the queries' shape[0] and shape[2])");
    q.positions = buffer<kvc::Index>(static_cast<std::size_t>(p.size()), "the positions of " + q.positions_path);
    std::copy_n(p.as<std::int64_t>(), p.size(), q.positions.data());
    max_position = 0;
    std::size_t const per_position = static_cast<std::size_t>(q.ext.dim) * sizeof(float);
    for (std::size_t i = 0; i < q.positions.size(); ++i) {
      kvc::Index const pos = q.positions[i];
      if (pos < 0)
        fail(exit_invalid, pw + "field 'data': position " + std::to_string(pos) + " (element " + std::to_string(i) +
                               ") is negative, expected >= 0");
      if (rotate && static_cast<std::size_t>(pos) >= max_rope_table_bytes / per_position)
        fail(exit_invalid, pw + "field 'data': position " + std::to_string(pos) +
                               " needs a RoPE table over 1 GiB; expected positions < " +
                               std::to_string(max_rope_table_bytes / per_position));
      max_position = std::max(max_position, pos);
    }
  }
  if (rotate)
    fill_query_rope(spec, max_position, q);
}

void fill_query_rope(kvc::RopeSpec const& spec, kvc::Index max_position, Queries& q) {
  std::string const where = "queries file " + q.path + ": field 'shape': ";
  if (auto const st = spec.check(q.ext.dim); !st.ok())
    fail(exit_invalid, where + "head_dim (shape[3]) is " + std::to_string(q.ext.dim) +
                           ": RoPE rotates pairs of channels, expected an even head_dim (or pass "
                           "--param queries=post_rope for queries already rotated)");
  kvc::Index const table_positions = std::max<kvc::Index>(1, max_position + 1);
  q.rope_storage = buffer<float>(static_cast<std::size_t>(kvc::rope_table_floats(table_positions, q.ext.dim)),
                                 "the RoPE table of queries file " + q.path);
  if (auto const st = kvc::fill_rope_table(spec, q.ext.dim, table_positions, q.rope_storage.data(), q.rope); !st.ok())
    fail(exit_invalid, "--rope: " + std::string(st.message()));
}

kvc::Index rows_used(kvc::SnapKVScorer const& s, kvc::Index) {
  return s.window_size;
}
kvc::Index rows_used(kvc::TOVAScorer const&, kvc::Index) {
  return 1;
}
kvc::Index rows_used(kvc::UNCompScorer<> const& s, kvc::Index) {
  return s.window_size;
}

void check_rows_used(kvc::Index used, std::string_view policy, kvc::Index tokens, Queries const& q,
                     std::string const& keys_path) {
  if (used > q.ext.tokens)
    fail(exit_invalid, "queries file " + q.path + ": field 'shape': window (shape[2]) is " +
                           std::to_string(q.ext.tokens) + ", but policy " + std::string(policy) + " reads the last " +
                           std::to_string(used) +
                           " query rows (--param window_size); pass more queries or a smaller window_size");
  if (q.positions.empty() && used > tokens)
    fail(exit_invalid, "keys file " + keys_path + ": field 'shape': tokens (shape[2]) is " + std::to_string(tokens) +
                           ", but the last " + std::to_string(used) + " query rows sit at positions N - " +
                           std::to_string(used) + " .. N - 1 (pass --positions P.npy)");
}

}  // namespace kvc::cli
