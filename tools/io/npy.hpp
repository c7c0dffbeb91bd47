// SPDX-License-Identifier: Apache-2.0
// tools/io/npy.hpp: a hardened reader and a writer for NumPy .npy files (format versions 1.0, 2.0 and 3.0).
//
// Files are untrusted input. The parser bounds-checks every read, accepts only little-endian C-order float32,
// float16, float64, int64 and int32 arrays, rejects sizes that overflow 64 bits, and requires the data to be exactly
// shape-product * itemsize bytes. Errors name the field and what was expected; callers prefix the file name.
// This is tool code, not a hot path: it allocates.
#pragma once

#include <kvc/core/extents.hpp>

#include "io/file.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvc {

static_assert(std::endian::native == std::endian::little, "kvc::io assumes a little-endian host");

enum class NpyDtype : std::uint8_t { f32, f16, f64, i64, i32 };

/// Bytes per element of `d`.
constexpr Index npy_itemsize(NpyDtype d) noexcept {
  return d == NpyDtype::f16 ? 2 : (d == NpyDtype::i64 || d == NpyDtype::f64 ? 8 : 4);
}
/// The .npy `descr` string of `d` (little-endian).
constexpr std::string_view npy_descr(NpyDtype d) noexcept {
  switch (d) {
    case NpyDtype::f32: return "<f4";
    case NpyDtype::f16: return "<f2";
    case NpyDtype::f64: return "<f8";
    case NpyDtype::i64: return "<i8";
    case NpyDtype::i32: return "<i4";
  }
  return "?";
}

/// An array read from or written to a .npy file: C order, little-endian bytes.
struct NpyArray {
  NpyDtype dtype = NpyDtype::f32;
  std::vector<Index> shape;
  std::vector<std::byte> data;

  Index size() const noexcept {
    Index n = 1;
    for (Index s : shape)
      n *= s;
    return n;
  }
  template <class T>
  T const* as() const noexcept {
    return reinterpret_cast<T const*>(data.data());
  }
};

namespace detail {

/// A cursor over the header text with bounds-checked reads.
struct NpyHeaderParser {
  std::string_view text;
  std::size_t pos = 0;

  void skip_space() noexcept {
    while (pos < text.size() && (text[pos] == ' ' || text[pos] == '\t' || text[pos] == '\n' || text[pos] == '\r'))
      ++pos;
  }
  bool eat(char c) noexcept {
    skip_space();
    if (pos < text.size() && text[pos] == c) {
      ++pos;
      return true;
    }
    return false;
  }
  bool quoted(std::string_view& out) noexcept {
    skip_space();
    if (pos >= text.size() || (text[pos] != '\'' && text[pos] != '"'))
      return false;
    char const q = text[pos++];
    std::size_t const end = text.find(q, pos);
    if (end == std::string_view::npos)
      return false;
    out = text.substr(pos, end - pos);
    pos = end + 1;
    return true;
  }
  bool word(std::string_view w) noexcept {
    skip_space();
    if (text.substr(pos, w.size()) != w)
      return false;
    pos += w.size();
    return true;
  }
  bool integer(Index& out) noexcept {
    skip_space();
    std::size_t const start = pos;
    Index v = 0;
    while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') {
      if (pos - start >= 18)  // 10^18 < 2^63: more digits could overflow
        return false;
      v = v * 10 + (text[pos++] - '0');
    }
    if (pos < text.size() && text[pos] == 'L')  // Python 2 long suffix
      ++pos;
    out = v;
    return pos > start;
  }
};

inline bool npy_fail(std::string& error, std::string message) {
  error = std::move(message);
  return false;
}

}  // namespace detail

namespace detail {

/// Parses the header of a whole .npy file image into out.dtype and out.shape and checks that the data after it is
/// exactly what the shape needs; `data_start` is where that data begins. out.data is not touched.
inline bool parse_npy_header(std::span<std::byte const> bytes, NpyArray& out, std::size_t& data_start,
                             std::string& error) {
  constexpr unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (bytes.size() < 10 || std::memcmp(bytes.data(), magic, 6) != 0)
    return npy_fail(error, "not a .npy file (the magic string \\x93NUMPY is missing)");
  auto const byte = [&](std::size_t i) { return static_cast<std::uint32_t>(bytes[i]); };
  std::uint32_t const major = byte(6);
  if (major < 1 || major > 3)
    return npy_fail(error, "unsupported .npy format version " + std::to_string(major) + " (expected 1, 2 or 3)");
  std::size_t header_start = 10, header_len = byte(8) | (byte(9) << 8);
  if (major >= 2) {
    if (bytes.size() < 12)
      return npy_fail(error, "truncated header (expected at least 12 bytes for format version 2+)");
    header_start = 12;
    header_len = byte(8) | (byte(9) << 8) | (byte(10) << 16) | (byte(11) << 24);
  }
  if (header_len > bytes.size() - header_start)
    return npy_fail(error, "truncated header (header_len " + std::to_string(header_len) + " exceeds the file)");
  data_start = header_start + header_len;

  detail::NpyHeaderParser p{{reinterpret_cast<char const*>(bytes.data() + header_start), header_len}};
  if (!p.eat('{'))
    return npy_fail(error, "malformed header (expected a Python dict starting with '{')");
  bool have_descr = false, have_order = false, have_shape = false;
  std::string_view descr;
  while (!p.eat('}')) {
    std::string_view key;
    if (!p.quoted(key) || !p.eat(':'))
      return npy_fail(error, "malformed header (expected 'key': value)");
    if (key == "descr") {
      if (!p.quoted(descr))
        return npy_fail(error, "malformed header field 'descr' (expected a quoted dtype string)");
      have_descr = true;
    } else if (key == "fortran_order") {
      if (p.word("True"))
        return npy_fail(error,
                        "field 'fortran_order' is True: Fortran order is not supported (save a C-order "
                        "array, e.g. np.ascontiguousarray)");
      if (!p.word("False"))
        return npy_fail(error, "malformed header field 'fortran_order' (expected True or False)");
      have_order = true;
    } else if (key == "shape") {
      out.shape.clear();
      if (!p.eat('('))
        return npy_fail(error, "malformed header field 'shape' (expected a tuple)");
      while (!p.eat(')')) {
        Index d = 0;
        if (!p.integer(d))
          return npy_fail(error, "malformed header field 'shape' (expected non-negative integers below 10^18)");
        if (out.shape.size() >= 32)
          return npy_fail(error, "field 'shape' has more than 32 dimensions");
        out.shape.push_back(d);
        if (!p.eat(',') && !(p.skip_space(), p.pos < p.text.size() && p.text[p.pos] == ')'))
          return npy_fail(error, "malformed header field 'shape' (expected ',' or ')')");
      }
      have_shape = true;
    } else {
      return npy_fail(error, "unexpected header key '" + std::string(key) + "'");
    }
    if (!p.eat(',')) {
      if (!p.eat('}'))
        return npy_fail(error, "malformed header (expected ',' or '}')");
      break;
    }
  }
  if (!have_descr || !have_order || !have_shape)
    return npy_fail(error, "header lacks one of 'descr', 'fortran_order', 'shape'");
  p.skip_space();  // numpy pads the dict with spaces and ends it with '\n'; anything else is not a .npy header
  if (p.pos != p.text.size())
    return npy_fail(error, "unexpected text after the header dict (expected only spaces and a newline)");

  if (descr == "<f4")
    out.dtype = NpyDtype::f32;
  else if (descr == "<f2")
    out.dtype = NpyDtype::f16;
  else if (descr == "<f8")
    out.dtype = NpyDtype::f64;
  else if (descr == "<i8")
    out.dtype = NpyDtype::i64;
  else if (descr == "<i4")
    out.dtype = NpyDtype::i32;
  else
    return npy_fail(error, "unsupported dtype '" + std::string(descr) +
                               "' (expected little-endian '<f4', '<f2', '<f8', '<i8' or '<i4')");

  // As numpy: the product of the non-zero dimensions, in bytes, must fit in 64 bits, so that an empty array cannot
  // declare sizes a caller would multiply into garbage (a (0, 2^57, 2^57) header is refused, not read as empty).
  Index nonzero = 1, nonzero_bytes = 0;
  bool empty = false;
  for (Index d : out.shape) {
    empty = empty || d == 0;
    if (d != 0 && __builtin_mul_overflow(nonzero, d, &nonzero))
      return npy_fail(error, "field 'shape': the product of the dimensions overflows 64 bits");
  }
  if (__builtin_mul_overflow(nonzero, npy_itemsize(out.dtype), &nonzero_bytes))
    return npy_fail(error, "field 'shape': the data size overflows 64 bits");
  Index const data_bytes = empty ? 0 : nonzero_bytes;
  auto const available = static_cast<Index>(bytes.size() - data_start);
  if (available < data_bytes)
    return npy_fail(error, "truncated data: shape needs " + std::to_string(data_bytes) + " bytes, file has " +
                               std::to_string(available));
  if (available > data_bytes)
    return npy_fail(error, "unexpected " + std::to_string(available - data_bytes) + " bytes after the data");
  return true;
}

}  // namespace detail

/// Parses a whole .npy file image. On failure returns false and sets `error` (the file name is not included).
inline bool parse_npy(std::span<std::byte const> bytes, NpyArray& out, std::string& error) {
  std::size_t data_start = 0;
  if (!detail::parse_npy_header(bytes, out, data_start, error))
    return false;
  out.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(data_start), bytes.end());
  return true;
}

/// Reads and parses the regular file `path` of at most `max_bytes` (see read_regular_file: no FIFOs, devices or
/// directories; the file's size bounds every allocation). On failure returns false and sets `error` (without the
/// path).
inline bool read_npy(std::string const& path, NpyArray& out, std::string& error, std::uint64_t max_bytes = UINT64_MAX) {
  std::vector<std::byte> bytes;
  std::size_t data_start = 0;
  if (!read_regular_file(path, bytes, error, max_bytes) || !detail::parse_npy_header(bytes, out, data_start, error))
    return false;
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(data_start));  // the data, without a copy
  out.data = std::move(bytes);
  return true;
}

/// The .npy header (format 1.0, padded to a multiple of 64 bytes) of an array of `dtype` and `shape`.
inline std::vector<std::byte> npy_header(NpyDtype dtype, std::span<Index const> shape) {
  std::string header = "{'descr': '" + std::string(npy_descr(dtype)) + "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i)
    header += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1)
    header += ',';  // a 1-tuple is "(5,)"
  header += "), }";
  std::size_t const total = (10 + header.size() + 1 + 63) / 64 * 64;
  header.append(total - 10 - header.size() - 1, ' ');
  header += '\n';
  std::vector<std::byte> out(10 + header.size());
  constexpr unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  std::memcpy(out.data(), magic, 8);
  out[8] = static_cast<std::byte>(header.size() & 0xff);
  out[9] = static_cast<std::byte>(header.size() >> 8);
  std::memcpy(out.data() + 10, header.data(), header.size());
  return out;
}

namespace detail {
/// The data of an array: shape-product * itemsize bytes at `data`.
inline std::span<std::byte const> npy_data(NpyDtype dtype, std::span<Index const> shape, void const* data) {
  Index elements = 1;
  for (Index s : shape)
    elements *= s;
  return {static_cast<std::byte const*>(data), static_cast<std::size_t>(elements * npy_itemsize(dtype))};
}
}  // namespace detail

/// Serialises an array to .npy bytes (the header, then the data).
inline std::vector<std::byte> serialize_npy(NpyDtype dtype, std::span<Index const> shape, void const* data) {
  std::vector<std::byte> out = npy_header(dtype, shape);
  auto const bytes = detail::npy_data(dtype, shape, data);
  out.insert(out.end(), bytes.begin(), bytes.end());
  return out;
}

/// Writes an array into a staged output for `path` (opened, written and finished, not committed): the caller
/// commits it, alone or once a group of outputs is whole. On failure returns false and sets `error`.
inline bool stage_npy(StagedFile& file, std::string const& path, NpyDtype dtype, std::span<Index const> shape,
                      void const* data, std::string& error) {
  return file.open(path, error) && file.write(npy_header(dtype, shape), error) &&
         file.write(detail::npy_data(dtype, shape, data), error) && file.finish(error);
}

/// Writes an array to `path` atomically: a reader sees the old file or the whole new one. On failure returns false
/// and sets `error`.
inline bool write_npy(std::string const& path, NpyDtype dtype, std::span<Index const> shape, void const* data,
                      std::string& error) {
  StagedFile file;
  return stage_npy(file, path, dtype, shape, data, error) && file.commit(error);
}

}  // namespace kvc
