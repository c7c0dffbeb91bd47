// SPDX-License-Identifier: Apache-2.0
// tools/io/safetensors.hpp: a hardened reader and a writer for .safetensors files
// (https://github.com/huggingface/safetensors): an 8-byte little-endian u64 header length N, N bytes of JSON header,
// then the data buffer.
//
// Files are untrusted input. The header is parsed with the strict kvc::json parser and checked as the reference
// implementation checks it, and more strictly: N in [1, 100 MB] and within the file; the header a JSON object
// starting with '{' (trailing spaces allowed, as the reference pads with them); every tensor an object with exactly
// `dtype` (a known name), `shape` (non-negative integers whose product times the item size fits in int64) and
// `data_offsets` ([begin, end], begin <= end, end - begin == that size); the tensors, sorted by offset, covering the
// data buffer exactly (no overlap, no hole, nothing after the last one); names unique and non-empty; `__metadata__`
// optional, an object of strings. Every size is checked against the file size before anything is allocated for it.
// Errors name the tensor and the field; callers prefix the file name. Tool code, not a hot path: it allocates.
#pragma once

#include <kvc/core/extents.hpp>

#include "io/file.hpp"
#include "io/json.hpp"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvc {

static_assert(std::endian::native == std::endian::little, "kvc::io assumes a little-endian host");

/// The element types kvc reads and writes (the safetensors names are in safetensors_dtype_name), including the OCP
/// 8-bit floats F8_E4M3 and F8_E5M2 (kvc::float8_e4m3, kvc::float8_e5m2). The reference's other F8_* (E8M0, the FNUZ
/// variants), F4, F6_* and complex types are refused by the reader, naming the dtype.
enum class SafetensorsDtype : std::uint8_t {
  boolean,
  u8,
  i8,
  u16,
  i16,
  u32,
  i32,
  u64,
  i64,
  f16,
  bf16,
  f32,
  f64,
  f8_e4m3,
  f8_e5m2
};

/// Bytes per element of `d` (BOOL is one byte).
constexpr std::size_t safetensors_dtype_bytes(SafetensorsDtype d) noexcept {
  switch (d) {
    case SafetensorsDtype::boolean:
    case SafetensorsDtype::u8:
    case SafetensorsDtype::i8:
    case SafetensorsDtype::f8_e4m3:
    case SafetensorsDtype::f8_e5m2: return 1;
    case SafetensorsDtype::u16:
    case SafetensorsDtype::i16:
    case SafetensorsDtype::f16:
    case SafetensorsDtype::bf16: return 2;
    case SafetensorsDtype::u32:
    case SafetensorsDtype::i32:
    case SafetensorsDtype::f32: return 4;
    case SafetensorsDtype::u64:
    case SafetensorsDtype::i64:
    case SafetensorsDtype::f64: return 8;
  }
  return 0;
}

/// The header's spelling of `d`: "BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16", "F32",
/// "F64", "F8_E4M3", "F8_E5M2" ("?" for a value outside the enum).
constexpr std::string_view safetensors_dtype_name(SafetensorsDtype d) noexcept {
  switch (d) {
    case SafetensorsDtype::boolean: return "BOOL";
    case SafetensorsDtype::u8: return "U8";
    case SafetensorsDtype::i8: return "I8";
    case SafetensorsDtype::u16: return "U16";
    case SafetensorsDtype::i16: return "I16";
    case SafetensorsDtype::u32: return "U32";
    case SafetensorsDtype::i32: return "I32";
    case SafetensorsDtype::u64: return "U64";
    case SafetensorsDtype::i64: return "I64";
    case SafetensorsDtype::f16: return "F16";
    case SafetensorsDtype::bf16: return "BF16";
    case SafetensorsDtype::f32: return "F32";
    case SafetensorsDtype::f64: return "F64";
    case SafetensorsDtype::f8_e4m3: return "F8_E4M3";
    case SafetensorsDtype::f8_e5m2: return "F8_E5M2";
  }
  return "?";
}

/// One tensor of a parsed header. Its data is `bytes` bytes at file offset `begin`: row-major (C order),
/// little-endian elements of `dtype`.
struct SafetensorsTensor {
  std::string name;  // the header key (UTF-8, non-empty)
  SafetensorsDtype dtype = SafetensorsDtype::f32;
  std::vector<Index> shape;  // row-major; [] is a scalar (one element)
  std::uint64_t begin = 0;   // byte offset of the data in the FILE (8 + N + data_offsets[0])
  std::uint64_t bytes = 0;   // data_offsets[1] - data_offsets[0] == product(shape) * dtype bytes

  /// The number of elements: the product of `shape` (fits in int64: checked by the parser).
  Index elements() const noexcept {
    Index n = 1;
    for (Index s : shape)
      n *= s;
    return n;
  }
};

/// A parsed and checked header.
struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;                     // in the header's order
  std::vector<std::pair<std::string, std::string>> metadata;  // "__metadata__" (string -> string), file order
  std::uint64_t data_begin = 0;                               // 8 + N: the file offset of the data buffer

  /// The tensor named `name` (linear search), nullptr if absent.
  SafetensorsTensor const* find(std::string_view name) const noexcept {
    for (SafetensorsTensor const& t : tensors)
      if (t.name == name)
        return &t;
    return nullptr;
  }
};

/// The reference implementation's bound on N, the header length (safetensors' MAX_HEADER_SIZE).
inline constexpr std::uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

namespace detail {

inline bool st_fail(std::string& error, std::string message) {
  error = std::move(message);
  return false;
}

/// 'name', printable. (Appended, not `"'" + string`: GCC 12 at -O2 reports a false -Wrestrict on that form.)
inline std::string st_quoted(std::string_view name) {
  std::string q(1, '\'');
  q += json::printable(name);
  q += '\'';
  return q;
}

inline bool st_dtype(std::string_view name, SafetensorsDtype& out) noexcept {
  for (int d = 0; d <= static_cast<int>(SafetensorsDtype::f8_e5m2); ++d) {
    auto const dt = static_cast<SafetensorsDtype>(d);
    if (safetensors_dtype_name(dt) == name) {
      out = dt;
      return true;
    }
  }
  return false;
}

/// The byte size of `shape` elements of `itemsize` bytes into `bytes`; false when the product of the non-zero
/// dimensions times the item size overflows int64 (as for .npy: a zero dimension does not excuse absurd others).
inline bool st_shape_bytes(std::span<Index const> shape, std::size_t itemsize, Index& bytes) noexcept {
  Index nonzero = 1;
  bool empty = false;
  for (Index d : shape) {
    empty = empty || d == 0;
    if (d != 0 && __builtin_mul_overflow(nonzero, d, &nonzero))
      return false;
  }
  if (__builtin_mul_overflow(nonzero, static_cast<Index>(itemsize), &bytes))
    return false;
  if (empty)
    bytes = 0;
  return true;
}

/// Parses one tensor entry (`name`: `v`) against a data buffer of `buffer` bytes into `t` (begin relative to the
/// buffer; the caller adds data_begin).
inline bool st_tensor(std::string const& name, json::Value const& v, std::uint64_t buffer, SafetensorsTensor& t,
                      std::string& error) {
  std::string const who = "tensor " + st_quoted(name) + ": ";
  if (name.empty())
    return st_fail(error, "a tensor has an empty name");
  if (!v.is_object())
    return st_fail(error, who + "expected an object with 'dtype', 'shape' and 'data_offsets'");
  json::Value const *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
  for (json::Value::Member const& m : v.members()) {
    if (m.first == "dtype")
      dtype = &m.second;
    else if (m.first == "shape")
      shape = &m.second;
    else if (m.first == "data_offsets")
      offsets = &m.second;
    else
      return st_fail(error, who + "unexpected field " + st_quoted(m.first) +
                                " (expected only 'dtype', 'shape' and 'data_offsets')");
  }
  if (dtype == nullptr || shape == nullptr || offsets == nullptr)
    return st_fail(error, who + "missing field '" +
                              (dtype == nullptr   ? "dtype"
                               : shape == nullptr ? "shape"
                                                  : "data_offsets") +
                              "'");
  t.name = name;
  if (!dtype->is_string())
    return st_fail(error, who + "field 'dtype' is not a string");
  if (!st_dtype(dtype->as_string(), t.dtype))
    return st_fail(error, who + "unsupported dtype " + st_quoted(dtype->as_string()) +
                              " (expected BOOL, U8, I8, U16, I16, U32, I32, U64, I64, F16, BF16, F32 or F64)");
  if (!shape->is_array())
    return st_fail(error, who + "field 'shape' is not an array");
  t.shape.clear();
  t.shape.reserve(shape->items().size());  // bounded by the header's size, already in memory
  for (json::Value const& d : shape->items()) {
    std::int64_t dim = 0;
    if (!json::to_int64(d, dim) || dim < 0)
      return st_fail(error, who + "field 'shape' holds " +
                                (d.is_number() ? json::printable(d.number_text()) : std::string("a non-number")) +
                                " (expected non-negative integers)");
    t.shape.push_back(dim);
  }
  Index size = 0;
  if (!st_shape_bytes(t.shape, safetensors_dtype_bytes(t.dtype), size))
    return st_fail(error, who + "field 'shape': the data size overflows 64 bits");
  if (!offsets->is_array() || offsets->items().size() != 2)
    return st_fail(error, who + "field 'data_offsets' is not an array of two integers [begin, end]");
  std::int64_t range[2] = {0, 0};
  for (int i = 0; i < 2; ++i)
    if (!json::to_int64(offsets->items()[static_cast<std::size_t>(i)], range[i]) || range[i] < 0)
      return st_fail(error, who + "field 'data_offsets' " + (i == 0 ? "begin" : "end") +
                                " is not a non-negative integer below 2^63");
  auto const begin = static_cast<std::uint64_t>(range[0]), end = static_cast<std::uint64_t>(range[1]);
  if (begin > end)
    return st_fail(error, who + "field 'data_offsets' begin " + std::to_string(begin) + " is after its end " +
                              std::to_string(end));
  if (end > buffer)
    return st_fail(error, who + "field 'data_offsets' end " + std::to_string(end) + " is past the data buffer of " +
                              std::to_string(buffer) + " bytes");
  if (end - begin != static_cast<std::uint64_t>(size))
    return st_fail(error, who + "field 'data_offsets' spans " + std::to_string(end - begin) + " bytes, but shape " +
                              "and dtype " + std::string(safetensors_dtype_name(t.dtype)) + " need " +
                              std::to_string(size));
  t.begin = begin;
  t.bytes = end - begin;
  return true;
}

}  // namespace detail

/// Parses the header of a file of `file_size` bytes whose first bytes are `prefix` (at least 8 + N of them; the
/// whole file is fine). Checks everything against file_size before allocating: N in [1, 100 MB] with 8 + N within
/// the file, the JSON header, and that the tensors cover the data buffer [8 + N, file_size) exactly. On success
/// `out` holds the tensors in the header's order (begin is a FILE offset); on failure returns false, leaves `out`
/// unspecified and sets `error` (without the path).
inline bool parse_safetensors_header(std::span<std::byte const> prefix, std::uint64_t file_size, SafetensorsHeader& out,
                                     std::string& error) {
  using detail::st_fail;
  out = SafetensorsHeader();
  if (file_size < 8)
    return st_fail(
        error, "not a .safetensors file: " + std::to_string(file_size) + " bytes, fewer than the 8-byte header length");
  if (prefix.size() < 8)
    return st_fail(error,
                   "only " + std::to_string(prefix.size()) + " bytes given, fewer than the 8-byte header length");
  if (prefix.size() > file_size)
    return st_fail(error, std::to_string(prefix.size()) + " bytes given for a file of " + std::to_string(file_size));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | static_cast<std::uint64_t>(prefix[static_cast<std::size_t>(i)]);
  if (n == 0)
    return st_fail(error, "header length N is 0 (expected a JSON header of at least 2 bytes)");
  if (n > kSafetensorsMaxHeaderBytes)
    return st_fail(error, "header length N is " + std::to_string(n) + " bytes, more than the limit of " +
                              std::to_string(kSafetensorsMaxHeaderBytes));
  if (n > file_size - 8)
    return st_fail(error, "truncated header: header length N is " + std::to_string(n) + " bytes, the file has " +
                              std::to_string(file_size - 8) + " after the 8-byte length");
  if (n > prefix.size() - 8)
    return st_fail(error,
                   "only " + std::to_string(prefix.size()) + " bytes given, the header needs " + std::to_string(8 + n));
  std::string_view const text(reinterpret_cast<char const*>(prefix.data()) + 8, static_cast<std::size_t>(n));
  if (text[0] != '{')
    return st_fail(error, "the header does not start with '{' (expected a JSON object)");
  json::Value root;
  std::string json_error;
  // Depth: the header is 3 levels deep (object, tensor, shape); a little slack for metadata errors to be specific.
  if (!json::parse(text, root, json_error, json::ParseLimits{8}))
    return st_fail(error, "the header is not valid JSON: " + json_error);
  if (!root.is_object())  // not reached: it starts with '{'
    return st_fail(error, "the header is not a JSON object");

  std::uint64_t const buffer = file_size - 8 - n;
  out.data_begin = 8 + n;
  try {
    out.tensors.reserve(root.members().size());
    for (json::Value::Member const& m : root.members()) {
      if (m.first == "__metadata__") {
        if (!m.second.is_object())
          return st_fail(error, "'__metadata__' is not an object of strings");
        for (json::Value::Member const& kv : m.second.members()) {
          if (!kv.second.is_string())
            return st_fail(error, "'__metadata__' entry " + detail::st_quoted(kv.first) +
                                      " is not a string (expected string values only)");
          out.metadata.emplace_back(kv.first, kv.second.as_string());
        }
        continue;
      }
      SafetensorsTensor t;
      if (!detail::st_tensor(m.first, m.second, buffer, t, error))
        return false;
      out.tensors.push_back(std::move(t));
    }

    // Coverage: sorted by (begin, end), each tensor must start where the previous one ended, and the last one end
    // at the end of the buffer. Zero-byte tensors may sit at any boundary, as in the reference.
    std::vector<std::size_t> order(out.tensors.size());
    for (std::size_t i = 0; i < order.size(); ++i)
      order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      auto const& x = out.tensors[a];
      auto const& y = out.tensors[b];
      return x.begin != y.begin ? x.begin < y.begin : x.bytes < y.bytes;
    });
    std::uint64_t covered = 0;
    SafetensorsTensor const* previous = nullptr;
    for (std::size_t i : order) {
      SafetensorsTensor const& t = out.tensors[i];
      if (t.begin < covered)
        return st_fail(error, "tensor " + detail::st_quoted(t.name) + ": data_offsets [" + std::to_string(t.begin) +
                                  ", " + std::to_string(t.begin + t.bytes) + ") overlap tensor " +
                                  detail::st_quoted(previous->name) + " (ending at " + std::to_string(covered) + ")");
      if (t.begin > covered)
        return st_fail(error, "tensor " + detail::st_quoted(t.name) + ": data_offsets begin " +
                                  std::to_string(t.begin) + " leaves a hole of " + std::to_string(t.begin - covered) +
                                  " bytes after " +
                                  (previous ? "tensor " + detail::st_quoted(previous->name)
                                            : std::string("the start of the data buffer")));
      covered = t.begin + t.bytes;
      previous = &t;
    }
    if (covered != buffer)
      return st_fail(error, "the tensors cover " + std::to_string(covered) + " bytes of the data buffer, which has " +
                                std::to_string(buffer) + " (expected a fully indexed buffer)");
    for (SafetensorsTensor& t : out.tensors)
      t.begin += out.data_begin;
  } catch (std::bad_alloc const&) {
    return st_fail(error, "out of memory reading the header");
  }
  return true;
}

/// A whole .safetensors file in memory (read_regular_file): for the `kvc` CLI.
struct SafetensorsFile {
  SafetensorsHeader header;
  std::vector<std::byte> bytes;  // the whole file

  /// The data of `t` (a tensor of this file's header): t.bytes bytes; empty if it lies outside the file.
  std::span<std::byte const> data(SafetensorsTensor const& t) const noexcept {
    if (t.begin > bytes.size() || t.bytes > bytes.size() - t.begin)
      return {};
    return std::span<std::byte const>(bytes).subspan(static_cast<std::size_t>(t.begin),
                                                     static_cast<std::size_t>(t.bytes));
  }
};

/// Reads and checks the regular file `path` of at most `max_bytes` (see read_regular_file: no FIFOs, devices or
/// directories; the file's size bounds every allocation). On failure returns false and sets `error` (without the
/// path).
inline bool read_safetensors(std::string const& path, SafetensorsFile& out, std::string& error,
                             std::uint64_t max_bytes = UINT64_MAX) {
  out = SafetensorsFile();
  if (!read_regular_file(path, out.bytes, error, max_bytes) ||
      !parse_safetensors_header(out.bytes, out.bytes.size(), out.header, error)) {
    out = SafetensorsFile();
    return false;
  }
  return true;
}

/// A memory-mapped .safetensors file (map_regular_file): for model weights. The tensors' data are the file's pages;
/// see MappedFile for what happens if the file is truncated while mapped (SIGBUS). Move-only.
struct MappedSafetensors {
  MappedFile file;
  SafetensorsHeader header;

  /// The data of `t` (a tensor of this file's header): t.bytes bytes; empty if it lies outside the mapping.
  std::span<std::byte const> data(SafetensorsTensor const& t) const noexcept {
    auto const all = file.bytes();
    if (t.begin > all.size() || t.bytes > all.size() - t.begin)
      return {};
    return all.subspan(static_cast<std::size_t>(t.begin), static_cast<std::size_t>(t.bytes));
  }
};

/// Maps and checks the regular file `path` of at most `max_bytes` (checked against its size at open). On failure
/// returns false, leaves `out` empty and sets `error` (without the path).
inline bool map_safetensors(std::string const& path, MappedSafetensors& out, std::string& error,
                            std::uint64_t max_bytes = UINT64_MAX) {
  out = MappedSafetensors();
  if (!map_regular_file(path, out.file, error, max_bytes) ||
      !parse_safetensors_header(out.file.bytes(), out.file.size(), out.header, error)) {
    out = MappedSafetensors();
    return false;
  }
  return true;
}

/// One tensor to write: `data` points at product(shape) * dtype bytes, row-major, little-endian (may be null for
/// zero bytes).
struct SafetensorsView {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::f32;
  std::vector<Index> shape;
  void const* data = nullptr;
};

/// The header bytes (8-byte length, then the JSON padded with spaces to a multiple of 8 bytes, as the reference
/// pads it) for `tensors` stored contiguously in the given order, and `metadata` (omitted when empty). Refuses, with
/// `error`, what the reader would refuse: empty, duplicate, non-UTF-8 or "__metadata__" names, negative or
/// overflowing shapes, duplicate metadata keys.
inline bool safetensors_header_bytes(std::span<SafetensorsView const> tensors,
                                     std::span<std::pair<std::string, std::string> const> metadata,
                                     std::vector<std::byte>& out, std::string& error) {
  using detail::st_fail;
  std::string h = "{";
  if (!metadata.empty()) {
    std::vector<std::string_view> keys;
    h += "\"__metadata__\":{";
    for (std::size_t i = 0; i < metadata.size(); ++i) {
      if (i)
        h += ',';
      if (!json::append_string(h, metadata[i].first))
        return st_fail(error, "metadata key " + detail::st_quoted(metadata[i].first) + " is not valid UTF-8");
      h += ':';
      if (!json::append_string(h, metadata[i].second))
        return st_fail(error, "metadata value of " + detail::st_quoted(metadata[i].first) + " is not valid UTF-8");
      keys.push_back(metadata[i].first);
    }
    std::sort(keys.begin(), keys.end());
    if (auto d = std::adjacent_find(keys.begin(), keys.end()); d != keys.end())
      return st_fail(error, "metadata key " + detail::st_quoted(*d) + " appears twice");
    h += '}';
  }
  std::vector<std::string_view> names;
  std::uint64_t offset = 0;
  for (SafetensorsView const& t : tensors) {
    std::string const who = "tensor " + detail::st_quoted(t.name) + ": ";
    if (t.name.empty() || t.name == "__metadata__")
      return st_fail(error, who + "invalid name (expected a non-empty name other than '__metadata__')");
    if (safetensors_dtype_bytes(t.dtype) == 0)
      return st_fail(error, who + "invalid dtype");
    for (Index d : t.shape)
      if (d < 0)
        return st_fail(error, who + "negative dimension " + std::to_string(d) + " in the shape");
    Index size = 0;
    if (!detail::st_shape_bytes(t.shape, safetensors_dtype_bytes(t.dtype), size) ||
        __builtin_add_overflow(offset, static_cast<std::uint64_t>(size), &offset) ||
        offset > static_cast<std::uint64_t>(INT64_MAX))
      return st_fail(error, who + "the data size overflows 64 bits");
    if (size > 0 && t.data == nullptr)
      return st_fail(error, who + "no data for " + std::to_string(size) + " bytes");
    if (h.size() > 1)
      h += ',';
    if (!json::append_string(h, t.name))
      return st_fail(error, who + "the name is not valid UTF-8");
    h += ":{\"dtype\":\"" + std::string(safetensors_dtype_name(t.dtype)) + "\",\"shape\":[";
    for (std::size_t i = 0; i < t.shape.size(); ++i)
      h += (i ? "," : "") + std::to_string(t.shape[i]);
    h += "],\"data_offsets\":[" + std::to_string(offset - static_cast<std::uint64_t>(size)) + "," +
         std::to_string(offset) + "]}";
    names.push_back(t.name);
  }
  std::sort(names.begin(), names.end());
  if (auto d = std::adjacent_find(names.begin(), names.end()); d != names.end())
    return st_fail(error, "tensor " + detail::st_quoted(*d) + " appears twice");
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');
  if (h.size() > kSafetensorsMaxHeaderBytes)
    return st_fail(error, "the header would have " + std::to_string(h.size()) + " bytes, more than the limit of " +
                              std::to_string(kSafetensorsMaxHeaderBytes));
  out.assign(8 + h.size(), std::byte{});
  std::uint64_t const n = h.size();
  for (std::size_t i = 0; i < 8; ++i)
    out[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, h.data(), h.size());
  return true;
}

/// Writes `tensors` (and `metadata`, a "__metadata__" object, omitted when empty) to `path` atomically through a
/// StagedFile: a reader sees the old file or the whole new one. The header is padded with spaces to a multiple of 8
/// bytes; the tensors' data follow in the given order, contiguous. On failure returns false and sets `error`.
inline bool write_safetensors(std::string const& path, std::span<SafetensorsView const> tensors, std::string& error,
                              std::span<std::pair<std::string, std::string> const> metadata = {}) {
  std::vector<std::byte> header;
  if (!safetensors_header_bytes(tensors, metadata, header, error))
    return false;
  StagedFile file;
  if (!file.open(path, error) || !file.write(header, error))
    return false;
  for (SafetensorsView const& t : tensors) {
    Index size = 0;
    detail::st_shape_bytes(t.shape, safetensors_dtype_bytes(t.dtype), size);  // checked above
    if (size > 0 && !file.write({static_cast<std::byte const*>(t.data), static_cast<std::size_t>(size)}, error))
      return false;
  }
  return file.finish(error) && file.commit(error);
}

}  // namespace kvc
