// SPDX-License-Identifier: Apache-2.0
// tools/eval/tokenizer_detail.hpp: the tokenizer's internals (tools/eval/tokenizer.hpp): its limits, UTF-8 steps,
// the GPT-2 pre-tokenizer split and tokenizer.json's field reader. Included by the tokenizer's sources and its tests.
#pragma once

#include "io/json.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace kvc::eval {

namespace tokenizer_detail {

/// U+FFFD REPLACEMENT CHARACTER in UTF-8: what invalid UTF-8 and out-of-range ids become.
inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
/// The largest file read (bytes): 64 MiB holds every tokenizer.json in use (Gemma's is about 33 MB).
inline constexpr std::uint64_t kMaxFileBytes = std::uint64_t{64} << 20;
/// The most JSON values a tokenizer.json may hold, bounded before parsing by counting ',', '[' and '{' (about
/// 128 bytes each in the DOM: 512 MiB at most; Llama 3's file has about 400 000).
inline constexpr std::size_t kMaxJsonValues = std::size_t{1} << 22;
/// The most tokens a vocabulary may have (ids are int32; real vocabularies have at most a few 100 000).
inline constexpr std::int64_t kMaxVocab = std::int64_t{1} << 24;
/// The longest llama2.c token accepted (bytes; sentencepiece's default max_sentencepiece_length is 16
/// characters). Bounds the cost of each pair encode() looks up.
inline constexpr std::int32_t kMaxTokenLength = 1024;
/// The longest string tokenizer.json may give a normalizer, a decoder or an added token (bytes, after
/// normalization for added tokens; real ones have a few), so that matching them costs at most this per byte.
inline constexpr std::size_t kMaxPattern = 1024;
/// The most bytes the added tokens' patterns may have together (each byte can be a node of the matching trie).
inline constexpr std::size_t kMaxAddedBytes = std::size_t{1} << 20;
/// The most times longer the normalizers and pre-tokenizers together, or the decoders, may make a text: each
/// Replace, Prepend, Metaspace or ByteLevel step can multiply its length, and a damaged file could chain many.
inline constexpr double kMaxGrowth = 1024;

/// One step of UTF-8 decoding at s[i] (i < s.size()): a valid sequence (RFC 3629: no overlong form, surrogate or
/// code point above U+10FFFF) and its length, or the length of the maximal ill-formed subpart there (>= 1), which
/// the Unicode standard (section 3.9, "U+FFFD substitution of maximal subparts"), Rust's String::from_utf8_lossy and
/// Python's bytes.decode("utf-8", "replace") each replace with one U+FFFD.
struct Utf8Step {
  std::size_t length = 1;
  bool valid = false;
  std::uint32_t code_point = 0;  // when valid
};

Utf8Step utf8_step(std::string_view s, std::size_t i) noexcept;

/// `s` with every ill-formed UTF-8 subpart replaced by U+FFFD (see Utf8Step).
std::string utf8_lossy(std::string_view s);

/// Whether `s` is valid UTF-8.
bool is_utf8(std::string_view s) noexcept;

/// The code points of valid UTF-8 `s` with their byte offsets; offsets has one more entry (s.size()).
struct CodePoints {
  std::vector<std::uint32_t> cps;
  std::vector<std::size_t> offsets;
};
CodePoints code_points(std::string_view s);

/// GPT-2's bytes_to_unicode(): byte b -> a printable code point (b itself for '!'..'~', 0xA1..0xAC, 0xAE..0xFF;
/// 256, 257, ... for the other bytes in increasing order). Used by ByteLevel to make every byte a character.
std::array<std::uint32_t, 256> const& byte_to_code_point();

/// The inverse of byte_to_code_point(): the byte, or -1 for a code point that stands for no byte.
int code_point_to_byte(std::uint32_t cp);

/// The character classes of the GPT-2 pre-tokenization regex. APPROXIMATION: \p{L}, \p{N} and \s are exact for
/// ASCII (letters A-Z a-z; digits 0-9; \s = TAB LF VT FF CR SPACE), and every non-ASCII code point counts as a
/// letter, so non-ASCII digits, punctuation (U+2019 ', U+2014 -, ...) and spaces (U+00A0, U+3000, ...) are
/// grouped with letters where the real regex (Oniguruma, Unicode tables) would split them off. ASCII text is split
/// exactly as tokenizers does.
enum class CharClass : std::uint8_t { letter, number, space, other };
CharClass gpt2_class(std::uint32_t cp) noexcept;

/// Splits valid UTF-8 `s` as tokenizers' ByteLevel pre-tokenizer does with the GPT-2 pattern
///   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
/// (alternatives tried in order at each position, leftmost-first; classes as gpt2_class()). The pattern matches at
/// every position, so the pieces cover `s` in order. Returns the pieces' byte lengths.
std::vector<std::size_t> gpt2_split(std::string_view s);

/// Every non-overlapping occurrence of `from` (non-empty) in `s`, left to right, replaced by `to`.
std::string replace_all(std::string_view s, std::string_view from, std::string_view to);

char const* kind_name(json::Kind k) noexcept;

/// Reads tokenizer.json's fields: every failure sets `error` to "FILE: PATH: what was expected" and returns false.
struct JsonReader {
  std::string_view file;
  std::string& error;

  bool fail(std::string const& path, std::string const& what) {
    error = std::string(file) + ": " + path + ": " + what;
    return false;
  }
  bool expect(json::Value const& v, json::Kind kind, std::string const& path) {
    if (v.kind() == kind)
      return true;
    return fail(path, std::string("expected ") + kind_name(kind) + ", found " + kind_name(v.kind()));
  }
  /// Refuses members not in `known`: a field this reader does not know could change the tokenization.
  bool only(json::Value const& obj, std::string const& path, std::initializer_list<std::string_view> known) {
    for (json::Value::Member const& m : obj.members())
      if (std::find(known.begin(), known.end(), m.first) == known.end())
        return fail(path, "unsupported field \"" + json::printable(m.first) + "\"");
    return true;
  }
  /// A member that must be present (`fallback` null) or defaults to *fallback when absent or null.
  bool boolean(json::Value const& obj, std::string const& path, std::string_view key, bool& out,
               bool const* fallback = nullptr) {
    json::Value const* v = obj.find(key);
    if ((v == nullptr || v->is_null()) && fallback != nullptr) {
      out = *fallback;
      return true;
    }
    std::string const where = path + "." + std::string(key);
    if (v == nullptr)
      return fail(where, "missing (expected true or false)");
    if (!expect(*v, json::Kind::boolean, where))
      return false;
    out = v->as_bool();
    return true;
  }
  bool string(json::Value const& obj, std::string const& path, std::string_view key, std::string& out) {
    json::Value const* v = obj.find(key);
    std::string const where = path + "." + std::string(key);
    if (v == nullptr)
      return fail(where, "missing (expected a string)");
    if (!expect(*v, json::Kind::string, where))
      return false;
    out = v->as_string();
    if (out.size() > kMaxPattern)
      return fail(where, std::to_string(out.size()) + " bytes, more than the limit of " + std::to_string(kMaxPattern));
    return true;
  }
  /// A string of exactly one character (UTF-8).
  bool character(json::Value const& obj, std::string const& path, std::string_view key, std::string& out) {
    if (!string(obj, path, key, out))
      return false;
    if (out.empty() || utf8_step(out, 0).length != out.size())
      return fail(path + "." + std::string(key), "expected one character, found \"" + json::printable(out) + "\"");
    return true;
  }
  /// A non-negative integer no larger than `max`.
  bool count(json::Value const& obj, std::string const& path, std::string_view key, std::int64_t max,
             std::int64_t& out) {
    json::Value const* v = obj.find(key);
    std::string const where = path + "." + std::string(key);
    if (v == nullptr)
      return fail(where, "missing (expected a non-negative integer)");
    if (!json::to_int64(*v, out) || out < 0 || out > max)
      return fail(where, "expected an integer in 0.." + std::to_string(max) + ", found " +
                             (v->is_number() ? json::printable(v->number_text()) : kind_name(v->kind())));
    return true;
  }
  /// The "type" member of a component, which must be a string.
  bool type(json::Value const& obj, std::string const& path, std::string& out) {
    return expect(obj, json::Kind::object, path) && string(obj, path, "type", out);
  }
};

}  // namespace tokenizer_detail

}  // namespace kvc::eval
