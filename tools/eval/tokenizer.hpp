// SPDX-License-Identifier: Apache-2.0
// tools/eval/tokenizer.hpp: the tokenizers of kvc-eval's small Llama-family models, read from untrusted files.
//
// Two formats:
//   Hugging Face tokenizer.json (the `tokenizers` library, v0.22 semantics) with a BPE model: added tokens split out
//     first (LeftmostLongest, non-normalized ones in the raw text, normalized ones in the normalized text, as
//     tokenizers' AddedVocabulary does), normalizers Prepend/Replace(String)/Sequence, pre-tokenizers
//     Metaspace/ByteLevel/Sequence, BPE with byte fallback and unk, decoders Replace/ByteFallback/Fuse/Strip/
//     ByteLevel/Metaspace/Sequence. Any other component, and options that change the tokenization but are not
//     implemented (continuing_subword_prefix, dropout, added-token lstrip/rstrip/single_word, truncation...), are
//     refused with "unsupported ...", never tokenized differently.
//   llama2.c tokenizer.bin (run.c's build_tokenizer): int32 max_token_length, then vocab_size records of
//     {float32 score, int32 len, len bytes} (little-endian); encode and decode as run.c's encode() and decode().
// Every size, offset and id is checked before it is used or allocated; errors name the file and the field.
// Tool code, not a hot path: it allocates.
#pragma once

#include "io/file.hpp"
#include "io/json.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
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

inline Utf8Step utf8_step(std::string_view s, std::size_t i) noexcept {
  auto const byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned const b0 = byte(i);
  if (b0 < 0x80)
    return {1, true, b0};
  std::size_t need = 0;           // bytes in the sequence
  unsigned lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    lo = b0 == 0xE0 ? 0xA0 : 0x80;  // no overlong form
    hi = b0 == 0xED ? 0x9F : 0xBF;  // no surrogate
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    lo = b0 == 0xF0 ? 0x90 : 0x80;  // no overlong form
    hi = b0 == 0xF4 ? 0x8F : 0xBF;  // nothing above U+10FFFF
  } else {
    return {1, false, 0};  // a continuation byte, an overlong lead (C0, C1), or F5-FF
  }
  std::uint32_t cp = b0 & (need == 2 ? 0x1Fu : need == 3 ? 0x0Fu : 0x07u);
  std::size_t n = 1;
  for (; n < need && i + n < s.size(); ++n) {
    unsigned const b = byte(i + n);
    if (n == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF))
      return {n, false, 0};
    cp = (cp << 6) | (b & 0x3Fu);
  }
  if (n < need)
    return {n, false, 0};  // truncated at the end of the text
  return {need, true, cp};
}

/// `s` with every ill-formed UTF-8 subpart replaced by U+FFFD (see Utf8Step).
inline std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    Utf8Step const step = utf8_step(s, i);
    if (step.valid)
      out.append(s.substr(i, step.length));
    else
      out.append(kReplacement);
    i += step.length;
  }
  return out;
}

/// Whether `s` is valid UTF-8.
inline bool is_utf8(std::string_view s) noexcept {
  for (std::size_t i = 0; i < s.size();) {
    Utf8Step const step = utf8_step(s, i);
    if (!step.valid)
      return false;
    i += step.length;
  }
  return true;
}

/// The code points of valid UTF-8 `s` with their byte offsets; offsets has one more entry (s.size()).
struct CodePoints {
  std::vector<std::uint32_t> cps;
  std::vector<std::size_t> offsets;
};
inline CodePoints code_points(std::string_view s) {
  CodePoints r;
  for (std::size_t i = 0; i < s.size();) {
    Utf8Step const step = utf8_step(s, i);
    r.cps.push_back(step.valid ? step.code_point : 0xFFFD);
    r.offsets.push_back(i);
    i += step.length;
  }
  r.offsets.push_back(s.size());
  return r;
}

/// GPT-2's bytes_to_unicode(): byte b -> a printable code point (b itself for '!'..'~', 0xA1..0xAC, 0xAE..0xFF;
/// 256, 257, ... for the other bytes in increasing order). Used by ByteLevel to make every byte a character.
inline std::array<std::uint32_t, 256> const& byte_to_code_point() {
  static std::array<std::uint32_t, 256> const table = [] {
    std::array<std::uint32_t, 256> t{};
    std::uint32_t next = 256;
    for (std::uint32_t b = 0; b < 256; ++b) {
      bool const printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

/// The inverse of byte_to_code_point(): the byte, or -1 for a code point that stands for no byte.
inline int code_point_to_byte(std::uint32_t cp) {
  static std::array<std::int16_t, 324> const table = [] {
    std::array<std::int16_t, 324> t{};
    t.fill(-1);
    for (int b = 0; b < 256; ++b)
      t[byte_to_code_point()[static_cast<std::size_t>(b)]] = static_cast<std::int16_t>(b);
    return t;
  }();
  return cp < table.size() ? table[cp] : -1;
}

/// The character classes of the GPT-2 pre-tokenization regex. APPROXIMATION: \p{L}, \p{N} and \s are exact for
/// ASCII (letters A-Z a-z; digits 0-9; \s = TAB LF VT FF CR SPACE), and every non-ASCII code point counts as a
/// letter, so non-ASCII digits, punctuation (U+2019 ', U+2014 -, ...) and spaces (U+00A0, U+3000, ...) are
/// grouped with letters where the real regex (Oniguruma, Unicode tables) would split them off. ASCII text is split
/// exactly as tokenizers does.
enum class CharClass : std::uint8_t { letter, number, space, other };
inline CharClass gpt2_class(std::uint32_t cp) noexcept {
  if (cp >= 0x80 || (cp >= 'A' && cp <= 'Z') || (cp >= 'a' && cp <= 'z'))
    return CharClass::letter;
  if (cp >= '0' && cp <= '9')
    return CharClass::number;
  if (cp == ' ' || (cp >= '\t' && cp <= '\r'))
    return CharClass::space;
  return CharClass::other;
}

/// Splits valid UTF-8 `s` as tokenizers' ByteLevel pre-tokenizer does with the GPT-2 pattern
///   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
/// (alternatives tried in order at each position, leftmost-first; classes as gpt2_class()). The pattern matches at
/// every position, so the pieces cover `s` in order. Returns the pieces' byte lengths.
inline std::vector<std::size_t> gpt2_split(std::string_view s) {
  CodePoints const cp = code_points(s);
  std::size_t const n = cp.cps.size();
  auto const cls = [&](std::size_t k) { return gpt2_class(cp.cps[k]); };
  auto const run = [&](std::size_t k, CharClass c) {  // the end of the run of class c starting at k
    while (k < n && cls(k) == c)
      ++k;
    return k;
  };
  std::vector<std::size_t> lengths;
  for (std::size_t i = 0; i < n;) {
    std::size_t end = i;
    if (cp.cps[i] == '\'' && i + 1 < n) {
      std::uint32_t const a = cp.cps[i + 1], b = i + 2 < n ? cp.cps[i + 2] : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd')
        end = i + 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
        end = i + 3;
    }
    if (end == i) {
      std::size_t const body = cp.cps[i] == ' ' && i + 1 < n && cls(i + 1) != CharClass::space ? i + 1 : i;
      CharClass const c = cls(body);
      if (c != CharClass::space) {
        end = run(body, c);  // ' ?\p{L}+', ' ?\p{N}+' or ' ?[^\s\p{L}\p{N}]+'
      } else {
        end = run(i, CharClass::space);
        if (end < n && end - i >= 2)
          --end;  // '\s+(?!\S)': leave the last space to the word after it
      }
    }
    lengths.push_back(cp.offsets[end] - cp.offsets[i]);
    i = end;
  }
  return lengths;
}

/// Every non-overlapping occurrence of `from` (non-empty) in `s`, left to right, replaced by `to`.
inline std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  std::size_t i = 0;
  for (std::size_t at; (at = s.find(from, i)) != std::string_view::npos; i = at + from.size()) {
    out.append(s.substr(i, at - i));
    out.append(to);
  }
  out.append(s.substr(i));
  return out;
}

inline char const* kind_name(json::Kind k) noexcept {
  switch (k) {
    case json::Kind::null: return "null";
    case json::Kind::boolean: return "a boolean";
    case json::Kind::number: return "a number";
    case json::Kind::string: return "a string";
    case json::Kind::array: return "an array";
    case json::Kind::object: return "an object";
  }
  return "?";
}

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

/// A tokenizer read from tokenizer.json (Hugging Face BPE) or llama2.c's tokenizer.bin. Immutable once loaded;
/// encode() and decode() are const and may run concurrently.
class Tokenizer {
 public:
  /// Loads the file at `path`: "tokenizer.json" (Hugging Face) or llama2.c's "tokenizer.bin"/"tok512.bin" format
  /// (vocab_size comes from the model: llama2.c's file does not store it). At most 64 MiB are read. On failure
  /// returns false, leaves `out` as it was and sets `error` (starting with the path).
  static bool load_json(std::string const& path, Tokenizer& out, std::string& error) {
    std::string text;
    return read_file(path, text, error) && parse_json(text, out, error, path);
  }
  static bool load_llama2c(std::string const& path, std::int32_t vocab_size, Tokenizer& out, std::string& error) {
    std::string text;
    return read_file(path, text, error) &&
           parse_llama2c(std::as_bytes(std::span(text.data(), text.size())), vocab_size, out, error, path);
  }

  /// The same from bytes already in memory (the fuzzer's entry points); `name` prefixes errors.
  static bool parse_json(std::string_view text, Tokenizer& out, std::string& error,
                         std::string_view name = "tokenizer.json") {
    try {
      Tokenizer t;
      t.format_ = Format::hf_bpe;
      if (!t.read_json(text, error, name))
        return false;
      out = std::move(t);
      return true;
    } catch (std::bad_alloc const&) {
      error = std::string(name) + ": out of memory reading the tokenizer";
      return false;
    } catch (std::length_error const&) {
      error = std::string(name) + ": out of memory reading the tokenizer";
      return false;
    }
  }
  static bool parse_llama2c(std::span<std::byte const> bytes, std::int32_t vocab_size, Tokenizer& out,
                            std::string& error, std::string_view name = "tokenizer.bin") {
    try {
      Tokenizer t;
      t.format_ = Format::llama2c;
      if (!t.read_llama2c(bytes, vocab_size, error, name))
        return false;
      out = std::move(t);
      return true;
    } catch (std::bad_alloc const&) {
      error = std::string(name) + ": out of memory reading the tokenizer";
      return false;
    } catch (std::length_error const&) {
      error = std::string(name) + ": out of memory reading the tokenizer";
      return false;
    }
  }

  /// UTF-8 text -> ids, no BOS/EOS added (add_special_tokens=False).
  ///   tokenizer.json: as tokenizers' Tokenizer.encode; ill-formed UTF-8 is first replaced by U+FFFD as Python's
  ///     bytes.decode("utf-8", "replace") would (tokenizers takes str). APPROXIMATION: ByteLevel's GPT-2 split
  ///     treats every non-ASCII code point as a letter (see tokenizer_detail::gpt2_class); exact for ASCII text.
  ///   llama2.c: as run.c's encode(text, bos=0, eos=0): the text ends at its first NUL byte (a C string), a dummy
  ///     prefix " " is added when it is not empty, code points missing from the vocabulary become byte ids
  ///     (byte + 3), then the adjacent pair whose concatenation is in the vocabulary with the highest score (above
  ///     -1e10) is merged, the leftmost on ties, until none is.
  /// An empty tokenizer (default-constructed) gives no ids.
  std::vector<std::int32_t> encode(std::string_view text) const {
    if (format_ == Format::hf_bpe)
      return encode_hf(text);
    if (format_ == Format::llama2c)
      return encode_llama2c(text);
    return {};
  }

  /// ids -> text, as the reference decoders do for a whole sequence; every id renders (special tokens included);
  /// ids out of range render as U+FFFD.
  ///   tokenizer.json: as tokenizers' decode(ids, skip_special_tokens=False) (v0.22: an added token is its
  ///     content); the decoder chain, or the tokens joined with " " without a decoder. Always valid UTF-8.
  ///   llama2.c: the concatenation of run.c's decode(prev, id): after BOS (1) one leading ' ' of the piece is
  ///     dropped; a piece "<0x" + 1 or 2 hex digits (what run.c's sscanf "<0x%02hhX>" reads on real files; its
  ///     leniency for a sign, spaces or "0x" there is not reproduced) is that raw byte. BOS renders as its piece
  ///     ("\n<s>\n" in llama2.c's files). May be invalid UTF-8, as run.c prints it.
  std::string decode(std::span<std::int32_t const> ids) const {
    if (format_ == Format::hf_bpe)
      return decode_hf(ids);
    if (format_ == Format::llama2c)
      return decode_llama2c(ids);
    std::string out;  // an empty tokenizer: no id is in range
    for (std::size_t i = 0; i < ids.size(); ++i)
      out += tokenizer_detail::kReplacement;
    return out;
  }

  /// The number of ids: tokenizer.json: the model's vocabulary plus the added tokens outside it; llama2.c: the
  /// vocab_size given at load.
  std::int32_t vocab_size() const noexcept { return static_cast<std::int32_t>(pieces_.size()); }
  /// -1 if unknown. tokenizer.json: the special token leading post_processor's single template, else an added
  /// special token named <s>, <bos>, <|begin_of_text|>, <|startoftext|> or <|start_story|>. llama2.c: 1.
  std::int32_t bos_id() const noexcept { return bos_; }
  /// -1 if unknown. tokenizer.json: the special token ending post_processor's single template, else an added
  /// special token named </s>, <eos>, <|end_of_text|>, <|endoftext|> or <|end_story|>. llama2.c: 2.
  std::int32_t eos_id() const noexcept { return eos_; }

 private:
  enum class Format : std::uint8_t { none, hf_bpe, llama2c };
  /// A normalizer step (a Sequence is flattened): Prepend(a) or Replace(a -> b).
  struct Normalizer {
    bool prepend = false;
    std::string a, b;
  };
  /// A pre-tokenizer step (a Sequence is flattened).
  struct PreTokenizer {
    enum class Prepend : std::uint8_t { always, first, never };
    bool byte_level = false;        // ByteLevel, else Metaspace
    bool add_prefix_space = false;  // ByteLevel
    bool use_regex = true;          // ByteLevel
    std::string replacement;        // Metaspace: one character
    Prepend prepend = Prepend::always;
    bool split = true;  // Metaspace
  };
  /// A decoder step (a Sequence is flattened).
  struct Decoder {
    enum class Kind : std::uint8_t { replace, byte_fallback, fuse, strip, byte_level, metaspace };
    Kind kind = Kind::fuse;
    std::string a, b;                  // replace: pattern -> content; strip: the character; metaspace: the replacement
    std::int64_t start = 0, stop = 0;  // strip: characters at most, from each end
    bool prepend_never = false;        // metaspace: prepend_scheme "never" (keep the first token's replacements)
  };
  /// A node of the byte trie of the added tokens' patterns (node 0 is the root). An added token is matched in the
  /// raw text (normalized false) or in the normalized text against its content normalized (normalized true).
  struct TrieNode {
    std::vector<std::pair<unsigned char, std::uint32_t>> next;  // (byte, child node), sorted by byte
    std::array<std::int32_t, 2> id = {-1, -1};                  // the added token whose pattern ends here: [normalized]
  };
  /// A piece of the text on its way through encode: `id` >= 0 once it is an added token; `at_start` when it starts
  /// at offset 0 of the original text (Metaspace's prepend_scheme "first").
  struct Piece {
    std::string text;
    std::int32_t id = -1;
    bool at_start = false;
  };
  /// A BPE merge: its rank (position in model.merges) and the id of the merged token.
  struct Merge {
    std::int32_t rank = 0, id = 0;
  };

  Format format_ = Format::none;
  std::vector<std::string> pieces_;                    // id -> token text
  std::unordered_map<std::string, std::int32_t> ids_;  // token text -> id (tokenizer.json: the model's vocabulary)
  std::int32_t bos_ = -1, eos_ = -1;
  // llama2.c
  std::vector<float> scores_;   // id -> merge score
  std::int32_t space_id_ = -1;  // the id of " ", the dummy prefix
  // tokenizer.json
  std::unordered_map<std::uint64_t, Merge> merges_;  // (left id << 32 | right id) -> merge
  std::vector<TrieNode> trie_ = std::vector<TrieNode>(1);
  std::vector<Normalizer> normalizers_;
  std::vector<PreTokenizer> pre_tokenizers_;
  std::vector<Decoder> decoders_;
  bool has_decoder_ = false;  // false: decode joins the tokens with " "
  std::int32_t unk_id_ = -1;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  std::array<std::int32_t, 256> byte_ids_{};  // byte -> id of "<0xXX>", -1 if absent

  static bool read_file(std::string const& path, std::string& text, std::string& error) {
    std::vector<std::byte> bytes;
    std::string why;
    if (!read_regular_file(path, bytes, why, tokenizer_detail::kMaxFileBytes)) {
      error = path + ": " + why;
      return false;
    }
    try {
      text.assign(reinterpret_cast<char const*>(bytes.data()), bytes.size());
    } catch (std::bad_alloc const&) {
      error = path + ": out of memory reading " + std::to_string(bytes.size()) + " bytes";
      return false;
    }
    return true;
  }

  // ---- llama2.c -------------------------------------------------------------------------------------------------

  bool read_llama2c(std::span<std::byte const> bytes, std::int32_t vocab_size, std::string& error,
                    std::string_view name) {
    std::string const file(name);
    std::size_t pos = 0;
    auto const int32_at = [&](std::size_t at) {
      std::uint32_t u = 0;
      for (int k = 3; k >= 0; --k)
        u = (u << 8) | static_cast<std::uint32_t>(bytes[at + static_cast<std::size_t>(k)]);
      return u;
    };
    if (vocab_size < 259 || vocab_size > tokenizer_detail::kMaxVocab) {
      error = file + ": vocab_size " + std::to_string(vocab_size) + " is out of range (expected 259.." +
              std::to_string(tokenizer_detail::kMaxVocab) +
              ": llama2.c's byte fallback uses ids 3..258; vocab_size comes from the model)";
      return false;
    }
    if (bytes.size() < 4) {
      error = file + ": " + std::to_string(bytes.size()) + " bytes, too short for the int32 max_token_length";
      return false;
    }
    auto const max_len = static_cast<std::int32_t>(int32_at(0));
    pos = 4;
    if (max_len < 1 || max_len > tokenizer_detail::kMaxTokenLength) {
      error = file + ": max_token_length " + std::to_string(max_len) + " is out of range (expected 1.." +
              std::to_string(tokenizer_detail::kMaxTokenLength) + ")";
      return false;
    }
    // Each record has at least 8 bytes: check the count against the file before allocating for it.
    if (static_cast<std::uint64_t>(vocab_size) * 8 > bytes.size() - pos) {
      error = file + ": " + std::to_string(bytes.size()) + " bytes cannot hold " + std::to_string(vocab_size) +
              " token records of at least 8 bytes each (truncated file, or the model's vocab_size does not match "
              "this tokenizer)";
      return false;
    }
    pieces_.resize(static_cast<std::size_t>(vocab_size));
    scores_.resize(static_cast<std::size_t>(vocab_size));
    for (std::int32_t i = 0; i < vocab_size; ++i) {
      std::string const token = "token " + std::to_string(i);
      if (bytes.size() - pos < 8) {
        error = file + ": " + token + ": the file ends inside the record's score and length (truncated file)";
        return false;
      }
      scores_[static_cast<std::size_t>(i)] = std::bit_cast<float>(int32_at(pos));
      auto const len = static_cast<std::int32_t>(int32_at(pos + 4));
      pos += 8;
      if (len < 0 || len > max_len) {
        error = file + ": " + token + ": length " + std::to_string(len) + " is out of range (expected 0.." +
                std::to_string(max_len) + ", the file's max_token_length)";
        return false;
      }
      if (static_cast<std::size_t>(len) > bytes.size() - pos) {
        error = file + ": " + token + ": length " + std::to_string(len) + " runs past the end of the file (" +
                std::to_string(bytes.size() - pos) + " bytes left; truncated file)";
        return false;
      }
      std::string& piece = pieces_[static_cast<std::size_t>(i)];
      piece.assign(reinterpret_cast<char const*>(bytes.data() + pos), static_cast<std::size_t>(len));
      pos += static_cast<std::size_t>(len);
      // run.c handles pieces as C strings: a NUL would cut the piece short in lookups.
      if (piece.find('\0') != std::string::npos) {
        error = file + ": " + token + ": the piece \"" + json::printable(piece) +
                "\" contains a NUL byte (llama2.c pieces are C strings)";
        return false;
      }
      auto const [it, fresh] = ids_.emplace(piece, i);
      if (!fresh) {
        error = file + ": " + token + ": the piece \"" + json::printable(piece) + "\" is also token " +
                std::to_string(it->second) + " (llama2.c's lookup would be ambiguous)";
        return false;
      }
    }
    if (pos != bytes.size()) {
      error = file + ": " + std::to_string(bytes.size() - pos) + " bytes after the " + std::to_string(vocab_size) +
              " token records (the model's vocab_size does not match this tokenizer?)";
      return false;
    }
    auto const space = ids_.find(" ");
    if (space == ids_.end()) {
      error = file + ": no token is \" \", the dummy prefix llama2.c's encoder adds";
      return false;
    }
    space_id_ = space->second;
    bos_ = 1;
    eos_ = 2;
    return true;
  }

  std::vector<std::int32_t> encode_llama2c(std::string_view text) const {
    text = text.substr(0, text.find('\0'));  // a C string in run.c
    std::vector<std::int32_t> ids;
    if (!text.empty())
      ids.push_back(space_id_);
    for (std::size_t i = 0; i < text.size();) {
      // A "code point": one byte and up to 3 continuation bytes after it, as run.c groups them (unvalidated).
      std::size_t n = 1;
      while (n < 4 && i + n < text.size() && (static_cast<unsigned char>(text[i + n]) & 0xC0) == 0x80)
        ++n;
      auto const it = ids_.find(std::string(text.substr(i, n)));
      if (it != ids_.end()) {
        ids.push_back(it->second);
      } else {
        for (std::size_t k = 0; k < n; ++k)
          ids.push_back(static_cast<std::int32_t>(static_cast<unsigned char>(text[i + k])) + 3);
      }
      i += n;
    }
    // run.c rescans every pair after each merge (quadratic); a heap of candidate pairs gives the same merges:
    // the highest score first, then the leftmost (smallest original position), stale entries skipped.
    struct Candidate {
      float score;
      std::size_t pos;           // original index of the left token
      std::int32_t left, right;  // the pair when the candidate was made
      std::int32_t merged;
    };
    auto const worse = [](Candidate const& a, Candidate const& b) {
      return a.score != b.score ? a.score < b.score : a.pos > b.pos;
    };
    std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> heap(worse);
    std::vector<std::size_t> next(ids.size()), prev(ids.size());
    std::vector<char> alive(ids.size(), 1);
    std::size_t const none = ids.size();
    for (std::size_t i = 0; i < ids.size(); ++i) {
      next[i] = i + 1;
      prev[i] = i == 0 ? none : i - 1;
    }
    auto const consider = [&](std::size_t left) {
      if (left == none || next[left] == none)
        return;
      std::int32_t const a = ids[left], b = ids[next[left]];
      auto const it = ids_.find(pieces_[static_cast<std::size_t>(a)] + pieces_[static_cast<std::size_t>(b)]);
      if (it == ids_.end())
        return;
      float const score = scores_[static_cast<std::size_t>(it->second)];
      if (score > -1e10f)  // run.c's best_score starts at -1e10; NaN never wins
        heap.push({score, left, a, b, it->second});
    };
    for (std::size_t i = 0; i + 1 < ids.size(); ++i)
      consider(i);
    while (!heap.empty()) {
      Candidate const c = heap.top();
      heap.pop();
      if (!alive[c.pos] || next[c.pos] == none || ids[c.pos] != c.left || ids[next[c.pos]] != c.right)
        continue;  // stale: the pair changed since
      std::size_t const right = next[c.pos];
      ids[c.pos] = c.merged;
      alive[right] = 0;
      next[c.pos] = next[right];
      if (next[right] != none)
        prev[next[right]] = c.pos;
      consider(prev[c.pos]);
      consider(c.pos);
    }
    std::vector<std::int32_t> out;
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (alive[i])
        out.push_back(ids[i]);
    return out;
  }

  std::string decode_llama2c(std::span<std::int32_t const> ids) const {
    std::string out;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      std::int32_t const id = ids[i];
      if (id < 0 || id >= vocab_size()) {
        out += tokenizer_detail::kReplacement;
        continue;
      }
      std::string_view piece = pieces_[static_cast<std::size_t>(id)];
      if (i > 0 && ids[i - 1] == 1 && !piece.empty() && piece[0] == ' ')
        piece.remove_prefix(1);
      int const hi = piece.size() >= 4 && piece.substr(0, 3) == "<0x" ? json::detail::hex_value(piece[3]) : -1;
      if (hi >= 0) {
        int const lo = piece.size() >= 5 ? json::detail::hex_value(piece[4]) : -1;
        out += static_cast<char>(lo >= 0 ? hi * 16 + lo : hi);
      } else {
        out.append(piece);
      }
    }
    return out;
  }

  // ---- tokenizer.json: reading --------------------------------------------------------------------------------

  bool read_json(std::string_view text, std::string& error, std::string_view name) {
    using tokenizer_detail::JsonReader;
    std::size_t const values = 1 + static_cast<std::size_t>(std::count_if(text.begin(), text.end(), [](char c) {
                                 return c == ',' || c == '[' || c == '{';
                               }));
    if (values > tokenizer_detail::kMaxJsonValues) {
      error = std::string(name) + ": up to " + std::to_string(values) + " JSON values, more than the limit of " +
              std::to_string(tokenizer_detail::kMaxJsonValues) + " (the parsed document would not fit in 512 MiB)";
      return false;
    }
    json::Value root;
    std::string why;
    if (!json::parse(text, root, why)) {
      error = std::string(name) + ": malformed JSON: " + why;
      return false;
    }
    JsonReader r{name, error};
    if (!r.expect(root, json::Kind::object, "the top level") ||
        !r.only(root, "the top level",
                {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "model",
                 "post_processor", "decoder"}))
      return false;
    if (json::Value const* v = root.find("version"); v != nullptr && !(v->is_string() && v->as_string() == "1.0"))
      return r.fail("version", "expected \"1.0\", the only version tokenizers reads");
    if (json::Value const* v = root.find("truncation"); v != nullptr && !v->is_null())
      return r.fail("truncation", "unsupported (expected null: kvc-eval encodes whole texts)");
    if (!read_padding(r, root.find("padding")))
      return false;
    json::Value const* model = root.find("model");
    if (model == nullptr)
      return r.fail("model", "missing (expected the BPE model)");
    if (!read_model(r, *model) || !read_normalizer(r, root.find("normalizer"), "normalizer") ||
        !read_pre_tokenizer(r, root.find("pre_tokenizer"), "pre_tokenizer") ||
        !read_decoder(r, root.find("decoder"), "decoder") || !check_growth(r) ||
        !read_added_tokens(r, root.find("added_tokens")))
      return false;
    has_decoder_ = root.find("decoder") != nullptr && !root.find("decoder")->is_null();
    return read_special_ids(r, root.find("post_processor"));
  }

  /// Refuses chains of steps that can make a text more than kMaxGrowth times longer (upper bounds per step:
  /// Replace |content| / |pattern| rounded up, Prepend 1 + |prepend|, ByteLevel 4 before (prefix space, 2-byte
  /// characters) and 2 after (U+FFFD for a lone byte), Metaspace 2 |replacement|).
  bool check_growth(tokenizer_detail::JsonReader& r) const {
    auto const ratio = [](std::string const& from, std::string const& to) {
      return std::max(1.0, std::ceil(static_cast<double>(to.size()) / static_cast<double>(from.size())));
    };
    double in = 1, out = 1;
    for (Normalizer const& n : normalizers_)
      in *= n.prepend ? 1.0 + static_cast<double>(n.a.size()) : ratio(n.a, n.b);
    for (PreTokenizer const& p : pre_tokenizers_)
      in *= p.byte_level ? 4.0 : 2.0 * static_cast<double>(p.replacement.size());
    for (Decoder const& d : decoders_)
      out *= d.kind == Decoder::Kind::replace ? ratio(d.a, d.b) : d.kind == Decoder::Kind::byte_level ? 2.0 : 1.0;
    std::string const too_long = "these steps can make a text more than " +
                                 std::to_string(static_cast<int>(tokenizer_detail::kMaxGrowth)) +
                                 " times longer (a damaged file?)";
    if (in > tokenizer_detail::kMaxGrowth)
      return r.fail("normalizer, pre_tokenizer", too_long);
    if (out > tokenizer_detail::kMaxGrowth)
      return r.fail("decoder", too_long);
    return true;
  }

  /// Padding changes nothing for one sequence with strategy BatchLongest and no pad_to_multiple_of.
  static bool read_padding(tokenizer_detail::JsonReader& r, json::Value const* v) {
    if (v == nullptr || v->is_null())
      return true;
    json::Value const* strategy = v->find("strategy");
    json::Value const* multiple = v->find("pad_to_multiple_of");
    if (strategy == nullptr || !strategy->is_string() || strategy->as_string() != "BatchLongest" ||
        (multiple != nullptr && !multiple->is_null()))
      return r.fail("padding", "unsupported (expected null, or strategy \"BatchLongest\" without pad_to_multiple_of)");
    return true;
  }

  bool read_model(tokenizer_detail::JsonReader& r, json::Value const& model) {
    std::string type;
    if (!r.type(model, "model", type))
      return false;
    if (type != "BPE")
      return r.fail("model.type", "unsupported model type '" + json::printable(type) + "' (supported: BPE)");
    if (!r.only(model, "model",
                {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                 "byte_fallback", "ignore_merges", "vocab", "merges"}))
      return false;
    if (json::Value const* d = model.find("dropout"); d != nullptr && !d->is_null() && d->as_double() != 0.0)
      return r.fail("model.dropout", "unsupported (expected null or 0: dropout makes the tokenization random)");
    for (char const* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (json::Value const* v = model.find(key); v != nullptr && !v->is_null())
        return r.fail(std::string("model.") + key, "unsupported (expected null)");
    bool const no = false;
    if (!r.boolean(model, "model", "fuse_unk", fuse_unk_, &no) ||
        !r.boolean(model, "model", "byte_fallback", byte_fallback_, &no) ||
        !r.boolean(model, "model", "ignore_merges", ignore_merges_, &no))
      return false;
    json::Value const* vocab = model.find("vocab");
    if (vocab == nullptr)
      return r.fail("model.vocab", "missing (expected an object of token: id)");
    if (!r.expect(*vocab, json::Kind::object, "model.vocab"))
      return false;
    // The ids must be 0..n-1, each once: tokenizers numbers added tokens from n on.
    std::int64_t const n = static_cast<std::int64_t>(vocab->members().size());
    if (n > tokenizer_detail::kMaxVocab)
      return r.fail("model.vocab", std::to_string(n) + " tokens, more than the limit of " +
                                       std::to_string(tokenizer_detail::kMaxVocab));
    pieces_.assign(static_cast<std::size_t>(n), std::string());
    std::vector<char> seen(static_cast<std::size_t>(n), 0);
    ids_.reserve(static_cast<std::size_t>(n));
    for (json::Value::Member const& m : vocab->members()) {
      std::int64_t id = -1;
      if (!json::to_int64(m.second, id) || id < 0 || id >= n)
        return r.fail("model.vocab[\"" + json::printable(m.first) + "\"]",
                      "expected an integer id in 0.." + std::to_string(n - 1) + " (the vocabulary has " +
                          std::to_string(n) + " tokens), found " +
                          (m.second.is_number() ? json::printable(m.second.number_text()) : kind_name(m.second)));
      if (seen[static_cast<std::size_t>(id)])
        return r.fail("model.vocab[\"" + json::printable(m.first) + "\"]",
                      "id " + std::to_string(id) + " is also the id of \"" +
                          json::printable(pieces_[static_cast<std::size_t>(id)]) + "\" (expected unique ids)");
      seen[static_cast<std::size_t>(id)] = 1;
      pieces_[static_cast<std::size_t>(id)] = m.first;
      ids_.emplace(m.first, static_cast<std::int32_t>(id));
    }
    for (int b = 0; b < 256; ++b) {
      char name[7] = {'<', '0', 'x', "0123456789ABCDEF"[b >> 4], "0123456789ABCDEF"[b & 15], '>', '\0'};
      auto const it = ids_.find(name);
      byte_ids_[static_cast<std::size_t>(b)] = it == ids_.end() ? -1 : it->second;
    }
    if (json::Value const* unk = model.find("unk_token"); unk != nullptr && !unk->is_null()) {
      if (!r.expect(*unk, json::Kind::string, "model.unk_token"))
        return false;
      auto const it = ids_.find(unk->as_string());
      if (it == ids_.end())
        return r.fail("model.unk_token", "\"" + json::printable(unk->as_string()) + "\" is not in model.vocab");
      unk_id_ = it->second;
    }
    return read_merges(r, model.find("merges"));
  }

  static char const* kind_name(json::Value const& v) { return tokenizer_detail::kind_name(v.kind()); }

  /// merges: "a b" strings (exactly one space; lines starting with "#version" skipped) or [a, b] arrays. The rank
  /// is the position; a pair listed twice keeps its last rank, as tokenizers' map does.
  bool read_merges(tokenizer_detail::JsonReader& r, json::Value const* merges) {
    if (merges == nullptr)
      return r.fail("model.merges", "missing (expected an array)");
    if (!r.expect(*merges, json::Kind::array, "model.merges"))
      return false;
    std::int32_t rank = 0;
    std::size_t index = 0;
    for (json::Value const& m : merges->items()) {
      std::string const where = "model.merges[" + std::to_string(index++) + "]";
      std::string a, b;
      if (m.is_string()) {
        std::string const& line = m.as_string();
        if (line.starts_with("#version"))
          continue;
        std::size_t const space = line.find(' ');
        if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
          return r.fail(where,
                        "expected \"left right\" with exactly one space, found \"" + json::printable(line) + "\"");
        a = line.substr(0, space);
        b = line.substr(space + 1);
      } else if (m.is_array() && m.items().size() == 2 && m.items()[0].is_string() && m.items()[1].is_string()) {
        a = m.items()[0].as_string();
        b = m.items()[1].as_string();
      } else {
        return r.fail(where,
                      std::string("expected a string \"left right\" or an array [left, right], found ") + kind_name(m));
      }
      std::int32_t ids[3] = {};
      std::string const parts[3] = {a, b, a + b};
      for (int k = 0; k < 3; ++k) {
        auto const it = ids_.find(parts[k]);
        if (it == ids_.end())
          return r.fail(where, std::string(k == 2 ? "the merged token" : "the token") + " \"" +
                                   json::printable(parts[k]) + "\" is not in model.vocab");
        ids[k] = it->second;
      }
      merges_[static_cast<std::uint64_t>(static_cast<std::uint32_t>(ids[0])) << 32 |
              static_cast<std::uint32_t>(ids[1])] = Merge{rank++, ids[2]};
    }
    return true;
  }

  /// A {"type": "Sequence", KEY: [...]} component: every element read by `read_one(element, its path)`, in order.
  template <class ReadOne>
  static bool read_sequence(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
                            char const* key, ReadOne&& read_one) {
    json::Value const* list = v.find(key);
    std::string const at = path + "." + key;
    if (!r.only(v, path, {"type", key}))
      return false;
    if (list == nullptr)
      return r.fail(at, "missing (expected an array)");
    if (!r.expect(*list, json::Kind::array, at))
      return false;
    for (std::size_t i = 0; i < list->items().size(); ++i)
      if (!read_one(list->items()[i], at + "[" + std::to_string(i) + "]"))
        return false;
    return true;
  }

  bool read_normalizer(tokenizer_detail::JsonReader& r, json::Value const* v, std::string const& path) {
    if (v == nullptr || v->is_null())
      return true;
    std::string type;
    if (!r.type(*v, path, type))
      return false;
    if (type == "Sequence")
      return read_sequence(r, *v, path, "normalizers", [&](json::Value const& item, std::string const& at) {
        return read_normalizer(r, &item, at);
      });
    Normalizer n;
    if (type == "Prepend") {
      n.prepend = true;
      if (!r.only(*v, path, {"type", "prepend"}) || !r.string(*v, path, "prepend", n.a))
        return false;
    } else if (type == "Replace") {
      if (!read_replace(r, *v, path, n.a, n.b))
        return false;
    } else {
      return r.fail(
          path, "unsupported normalizer type '" + json::printable(type) + "' (supported: Prepend, Replace, Sequence)");
    }
    normalizers_.push_back(std::move(n));
    return true;
  }

  /// Replace (a normalizer or a decoder): {"pattern": {"String": non-empty}, "content": string}.
  static bool read_replace(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
                           std::string& pattern, std::string& content) {
    if (!r.only(v, path, {"type", "pattern", "content"}) || !r.string(v, path, "content", content))
      return false;
    json::Value const* p = v.find("pattern");
    if (p == nullptr)
      return r.fail(path + ".pattern", "missing (expected {\"String\": \"...\"})");
    if (p->is_object() && p->find("Regex") != nullptr)
      return r.fail(path + ".pattern", "unsupported Regex pattern (supported: String)");
    json::Value const* s = p->find("String");
    if (!p->is_object() || p->members().size() != 1 || s == nullptr || !s->is_string() || s->as_string().empty())
      return r.fail(path + ".pattern", "expected {\"String\": \"...\"} with a non-empty string");
    pattern = s->as_string();
    if (pattern.size() > tokenizer_detail::kMaxPattern)
      return r.fail(path + ".pattern", std::to_string(pattern.size()) + " bytes, more than the limit of " +
                                           std::to_string(tokenizer_detail::kMaxPattern));
    return true;
  }

  std::string normalize(std::string s) const {
    for (Normalizer const& n : normalizers_) {
      if (n.prepend)
        s = s.empty() ? s : n.a + s;
      else
        s = tokenizer_detail::replace_all(s, n.a, n.b);
    }
    return s;
  }

  /// added_tokens: [{id, content, single_word, lstrip, rstrip, normalized, special}], all fields required (as
  /// tokenizers reads them). A content in model.vocab keeps its id there; the others take the ids after it in
  /// order, which the file's ids must state. Needs the model and the normalizer.
  bool read_added_tokens(tokenizer_detail::JsonReader& r, json::Value const* list) {
    if (list == nullptr || list->is_null())
      return true;
    if (!r.expect(*list, json::Kind::array, "added_tokens"))
      return false;
    std::vector<std::pair<std::string, std::int32_t>> specials;
    std::size_t pattern_bytes = 0;
    for (std::size_t i = 0; i < list->items().size(); ++i) {
      json::Value const& t = list->items()[i];
      std::string const path = "added_tokens[" + std::to_string(i) + "]";
      std::string content;
      bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
      std::int64_t id = 0;
      if (!r.expect(t, json::Kind::object, path) ||
          !r.only(t, path, {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"}) ||
          !r.count(t, path, "id", tokenizer_detail::kMaxVocab, id) || !r.string(t, path, "content", content) ||
          !r.boolean(t, path, "single_word", single_word) || !r.boolean(t, path, "lstrip", lstrip) ||
          !r.boolean(t, path, "rstrip", rstrip) || !r.boolean(t, path, "normalized", normalized) ||
          !r.boolean(t, path, "special", special))
        return false;
      if (single_word || lstrip || rstrip)
        return r.fail(path, "unsupported single_word/lstrip/rstrip true (expected false)");
      if (content.empty())
        return r.fail(path + ".content", "expected a non-empty string");
      auto const in_vocab = ids_.find(content);
      std::int64_t const expected =
          in_vocab != ids_.end() ? in_vocab->second : static_cast<std::int64_t>(pieces_.size());
      if (id != expected)
        return r.fail(path + ".id", "expected " + std::to_string(expected) + " for \"" + json::printable(content) +
                                        "\" (" +
                                        (in_vocab != ids_.end() ? "its id in model.vocab"
                                                                : "the next id after the vocabulary and the added "
                                                                  "tokens before it") +
                                        "), found " + std::to_string(id));
      if (in_vocab == ids_.end()) {
        if (static_cast<std::int64_t>(pieces_.size()) >= tokenizer_detail::kMaxVocab)
          return r.fail(path, "more tokens than the limit of " + std::to_string(tokenizer_detail::kMaxVocab));
        pieces_.push_back(content);
      }
      std::string const pattern = normalized ? normalize(content) : content;
      if (pattern.empty() || pattern.size() > tokenizer_detail::kMaxPattern)
        return r.fail(path + ".content", "\"" + json::printable(content) + "\" is matched as " +
                                             std::to_string(pattern.size()) + " bytes (expected 1.." +
                                             std::to_string(tokenizer_detail::kMaxPattern) + ")");
      if ((pattern_bytes += pattern.size()) > tokenizer_detail::kMaxAddedBytes)
        return r.fail(path, "the added tokens have more than " + std::to_string(tokenizer_detail::kMaxAddedBytes) +
                                " bytes in all");
      if (std::int32_t const other = trie_insert(pattern, normalized, static_cast<std::int32_t>(id)); other >= 0)
        return r.fail(path + ".content", "\"" + json::printable(content) + "\" is matched as \"" +
                                             json::printable(pattern) + "\", as is the added token " +
                                             std::to_string(other) + " (expected unique added tokens)");
      if (special)
        specials.emplace_back(content, static_cast<std::int32_t>(id));
    }
    for (auto const& [content, id] : specials) {  // name-based guesses; the post_processor's template wins
      for (char const* bos : {"<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "<|start_story|>"})
        if (content == bos && bos_ < 0)
          bos_ = id;
      for (char const* eos : {"</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "<|end_story|>"})
        if (content == eos && eos_ < 0)
          eos_ = id;
    }
    return true;
  }

  bool read_pre_tokenizer(tokenizer_detail::JsonReader& r, json::Value const* v, std::string const& path) {
    if (v == nullptr || v->is_null())
      return true;
    std::string type;
    if (!r.type(*v, path, type))
      return false;
    if (type == "Sequence")
      return read_sequence(r, *v, path, "pretokenizers", [&](json::Value const& item, std::string const& at) {
        return read_pre_tokenizer(r, &item, at);
      });
    PreTokenizer p;
    if (type == "ByteLevel") {
      p.byte_level = true;
      if (!read_byte_level(r, *v, path, p.add_prefix_space, p.use_regex))
        return false;
    } else if (type == "Metaspace") {
      if (!read_metaspace(r, *v, path, p))
        return false;
    } else {
      return r.fail(path, "unsupported pre_tokenizer type '" + json::printable(type) +
                              "' (supported: null, ByteLevel, Metaspace, Sequence of those)");
    }
    pre_tokenizers_.push_back(std::move(p));
    return true;
  }

  /// ByteLevel (pre-tokenizer or decoder): add_prefix_space and trim_offsets required, use_regex defaults to true.
  static bool read_byte_level(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
                              bool& add_prefix_space, bool& use_regex) {
    bool trim_offsets = false;
    bool const yes = true;
    return r.only(v, path, {"type", "add_prefix_space", "trim_offsets", "use_regex"}) &&
           r.boolean(v, path, "add_prefix_space", add_prefix_space) &&
           r.boolean(v, path, "trim_offsets", trim_offsets) && r.boolean(v, path, "use_regex", use_regex, &yes);
  }

  /// Metaspace (pre-tokenizer or decoder): replacement (one character), prepend_scheme "always" (default),
  /// "first" or "never", split (default true); the legacy add_prefix_space false must come with "never".
  static bool read_metaspace(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
                             PreTokenizer& p) {
    bool const yes = true;
    bool add_prefix_space = true;
    if (!r.only(v, path, {"type", "replacement", "add_prefix_space", "prepend_scheme", "split", "str_rep"}) ||
        !r.character(v, path, "replacement", p.replacement) || !r.boolean(v, path, "split", p.split, &yes) ||
        !r.boolean(v, path, "add_prefix_space", add_prefix_space, &yes))
      return false;
    if (json::Value const* s = v.find("prepend_scheme"); s != nullptr) {
      std::string const scheme = s->as_string();
      if (scheme == "always")
        p.prepend = PreTokenizer::Prepend::always;
      else if (scheme == "first")
        p.prepend = PreTokenizer::Prepend::first;
      else if (scheme == "never")
        p.prepend = PreTokenizer::Prepend::never;
      else
        return r.fail(path + ".prepend_scheme", "expected \"always\", \"first\" or \"never\"");
    }
    if (!add_prefix_space && p.prepend != PreTokenizer::Prepend::never)
      return r.fail(path + ".add_prefix_space", "false does not match prepend_scheme (expected \"never\")");
    return true;
  }

  bool read_decoder(tokenizer_detail::JsonReader& r, json::Value const* v, std::string const& path) {
    if (v == nullptr || v->is_null())
      return true;
    std::string type;
    if (!r.type(*v, path, type))
      return false;
    Decoder d;
    if (type == "Sequence") {
      return read_sequence(r, *v, path, "decoders",
                           [&](json::Value const& item, std::string const& at) { return read_decoder(r, &item, at); });
    } else if (type == "Replace") {
      d.kind = Decoder::Kind::replace;
      if (!read_replace(r, *v, path, d.a, d.b))
        return false;
    } else if (type == "ByteFallback" || type == "Fuse") {
      d.kind = type == "Fuse" ? Decoder::Kind::fuse : Decoder::Kind::byte_fallback;
      if (!r.only(*v, path, {"type"}))
        return false;
    } else if (type == "Strip") {
      d.kind = Decoder::Kind::strip;
      if (!r.only(*v, path, {"type", "content", "start", "stop"}) || !r.character(*v, path, "content", d.a) ||
          !r.count(*v, path, "start", tokenizer_detail::kMaxVocab, d.start) ||
          !r.count(*v, path, "stop", tokenizer_detail::kMaxVocab, d.stop))
        return false;
    } else if (type == "ByteLevel") {
      d.kind = Decoder::Kind::byte_level;
      bool add_prefix_space = false, use_regex = true;
      if (!read_byte_level(r, *v, path, add_prefix_space, use_regex))
        return false;
    } else if (type == "Metaspace") {
      d.kind = Decoder::Kind::metaspace;
      PreTokenizer p;
      if (!read_metaspace(r, *v, path, p))
        return false;
      d.a = p.replacement;
      d.prepend_never = p.prepend == PreTokenizer::Prepend::never;
    } else {
      return r.fail(path, "unsupported decoder type '" + json::printable(type) +
                              "' (supported: ByteFallback, ByteLevel, Fuse, Metaspace, Replace, Strip, Sequence)");
    }
    decoders_.push_back(std::move(d));
    return true;
  }

  /// BOS/EOS from post_processor (TemplateProcessing, alone or in a Sequence): the special tokens that start and
  /// end the single-sequence template. Other processors are ignored (encode never adds special tokens).
  bool read_special_ids(tokenizer_detail::JsonReader& r, json::Value const* pp) {
    if (pp == nullptr || !pp->is_object())
      return true;
    json::Value const* type = pp->find("type");
    if (type != nullptr && type->as_string() == "Sequence") {
      if (json::Value const* list = pp->find("processors"); list != nullptr)
        for (json::Value const& p : list->items())
          if (!read_special_ids(r, &p))
            return false;
      return true;
    }
    if (type == nullptr || type->as_string() != "TemplateProcessing")
      return true;
    json::Value const* single = pp->find("single");
    json::Value const* specials = pp->find("special_tokens");
    if (single == nullptr || single->items().empty() || specials == nullptr)
      return true;
    auto const id_of = [&](json::Value const& item, std::int32_t& out) {
      json::Value const* st = item.find("SpecialToken");
      json::Value const* name = st != nullptr ? st->find("id") : nullptr;
      json::Value const* entry = name != nullptr ? specials->find(name->as_string()) : nullptr;
      json::Value const* ids = entry != nullptr ? entry->find("ids") : nullptr;
      std::int64_t id = -1;
      if (ids == nullptr || ids->items().size() != 1 || !json::to_int64(ids->items()[0], id))
        return true;  // not a single special token
      if (id < 0 || id >= vocab_size())
        return r.fail(
            "post_processor.special_tokens[\"" + json::printable(name->as_string()) + "\"].ids",
            "id " + std::to_string(id) + " is out of range (expected 0.." + std::to_string(vocab_size() - 1) + ")");
      out = static_cast<std::int32_t>(id);
      return true;
    };
    return id_of(single->items().front(), bos_) && (single->items().size() < 2 || id_of(single->items().back(), eos_));
  }

  // ---- tokenizer.json: encoding and decoding -------------------------------------------------------------------

  /// The child of trie node `node` by byte `c`, or 0 (the root is nobody's child).
  std::uint32_t trie_child(std::uint32_t node, unsigned char c) const {
    auto const& next = trie_[node].next;
    auto const it =
        std::lower_bound(next.begin(), next.end(), c, [](auto const& e, unsigned char b) { return e.first < b; });
    return it != next.end() && it->first == c ? it->second : 0;
  }

  /// Adds an added token's pattern to the trie; returns the id of another added token with the same pattern and
  /// kind, or -1.
  std::int32_t trie_insert(std::string const& pattern, bool normalized, std::int32_t id) {
    std::uint32_t node = 0;
    for (char ch : pattern) {
      auto const c = static_cast<unsigned char>(ch);
      std::uint32_t child = trie_child(node, c);
      if (child == 0) {
        child = static_cast<std::uint32_t>(trie_.size());
        auto& next = trie_[node].next;
        next.insert(std::lower_bound(next.begin(), next.end(), std::pair{c, std::uint32_t{0}}), {c, child});
        trie_.emplace_back();  // (invalidates `next`, not used after)
      }
      node = child;
    }
    std::int32_t& slot = trie_[node].id[normalized];
    if (slot >= 0)
      return slot;
    slot = id;
    return -1;
  }

  /// Splits `s` at the added tokens of the given kind (LeftmostLongest: the match that starts first, the longest
  /// one there), appending the non-empty pieces to `out`.
  void split_added(std::string s, bool normalized, bool at_start, std::vector<Piece>& out) const {
    if (s.empty())
      return;
    std::size_t last = 0;
    for (std::size_t i = 0; i < s.size();) {
      std::int32_t id = -1;
      std::size_t length = 0;  // the longest pattern matching at i (at most kMaxPattern bytes: the trie's depth)
      for (std::uint32_t node = 0, j = 0; i + j < s.size(); ++j) {
        if ((node = trie_child(node, static_cast<unsigned char>(s[i + j]))) == 0)
          break;
        if (trie_[node].id[normalized] >= 0) {
          id = trie_[node].id[normalized];
          length = j + 1;
        }
      }
      if (id < 0) {
        ++i;
        continue;
      }
      if (i > last)
        out.push_back({s.substr(last, i - last), -1, at_start && last == 0});
      out.push_back({s.substr(i, length), id, false});
      i += length;
      last = i;
    }
    if (last == 0)
      out.push_back({std::move(s), -1, at_start});
    else if (last < s.size())
      out.push_back({s.substr(last), -1, false});
  }

  /// Applies one pre-tokenizer to a piece, appending the non-empty pieces it gives.
  static void pre_tokenize(PreTokenizer const& p, Piece const& piece, std::vector<Piece>& out) {
    std::string s = piece.text;
    std::vector<std::size_t> lengths;
    if (p.byte_level) {
      if (p.add_prefix_space && !s.starts_with(' '))
        s.insert(0, 1, ' ');
      lengths = p.use_regex ? tokenizer_detail::gpt2_split(s) : std::vector<std::size_t>{s.size()};
    } else {
      s = tokenizer_detail::replace_all(s, " ", p.replacement);
      bool const prepend =
          p.prepend == PreTokenizer::Prepend::always || (p.prepend == PreTokenizer::Prepend::first && piece.at_start);
      if (prepend && !s.starts_with(p.replacement))
        s.insert(0, p.replacement);
      std::size_t start = 0;  // split: each replacement starts a new piece (MergedWithNext)
      for (std::size_t at = 1; p.split && (at = s.find(p.replacement, at)) != std::string::npos;
           at += p.replacement.size()) {
        lengths.push_back(at - start);
        start = at;
      }
      lengths.push_back(s.size() - start);
    }
    std::size_t offset = 0;
    for (std::size_t len : lengths) {
      if (len == 0)
        continue;
      Piece q{s.substr(offset, len), -1, piece.at_start && offset == 0};
      if (p.byte_level) {  // every byte becomes its GPT-2 character
        std::string mapped;
        for (char c : q.text)
          json::detail::append_utf8(mapped, tokenizer_detail::byte_to_code_point()[static_cast<unsigned char>(c)]);
        q.text = std::move(mapped);
      }
      out.push_back(std::move(q));
      offset += len;
    }
  }

  std::vector<std::int32_t> encode_hf(std::string_view raw) const {
    std::vector<Piece> pieces, next;
    split_added(tokenizer_detail::utf8_lossy(raw), false, true, pieces);
    for (Piece& p : pieces) {
      if (p.id >= 0)
        next.push_back(std::move(p));
      else
        split_added(normalize(std::move(p.text)), true, p.at_start, next);
    }
    pieces.swap(next);
    for (PreTokenizer const& pt : pre_tokenizers_) {
      next.clear();
      for (Piece& p : pieces) {
        if (p.id >= 0)
          next.push_back(std::move(p));
        else
          pre_tokenize(pt, p, next);
      }
      pieces.swap(next);
    }
    std::vector<std::int32_t> ids;
    for (Piece const& p : pieces) {
      if (p.id >= 0)
        ids.push_back(p.id);
      else
        bpe(p.text, ids);
    }
    return ids;
  }

  /// tokenizers' BPE::merge_word + Word::merge_all on one word (non-empty valid UTF-8): characters to ids (byte
  /// fallback, then unk, fused when fuse_unk; a character with neither is dropped), then the lowest-rank merge
  /// present is applied, the leftmost on equal rank, until none is. Appends the ids to `out`.
  void bpe(std::string const& word, std::vector<std::int32_t>& out) const {
    if (ignore_merges_) {
      if (auto const it = ids_.find(word); it != ids_.end()) {
        out.push_back(it->second);
        return;
      }
    }
    std::vector<std::int32_t> sym;  // the symbols' ids; merged-away symbols become -1
    std::int32_t unk = -1;          // an unk not yet added (it may fuse with the next unknown character)
    for (std::size_t i = 0; i < word.size();) {
      std::size_t const n = tokenizer_detail::utf8_step(word, i).length;
      std::string const ch = word.substr(i, n);
      i += n;
      if (auto const it = ids_.find(ch); it != ids_.end()) {
        if (unk >= 0)
          sym.push_back(std::exchange(unk, -1));
        sym.push_back(it->second);
        continue;
      }
      if (byte_fallback_ &&
          std::all_of(ch.begin(), ch.end(), [&](char c) { return byte_ids_[static_cast<unsigned char>(c)] >= 0; })) {
        for (char c : ch)  // (a pending unk stays pending, as in tokenizers)
          sym.push_back(byte_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
      if (unk_id_ >= 0) {
        if (unk >= 0 && !fuse_unk_)
          sym.push_back(unk);
        unk = unk_id_;
      }
    }
    if (unk >= 0)
      sym.push_back(unk);
    merge_all(sym);
    for (std::int32_t id : sym)
      if (id >= 0)
        out.push_back(id);
  }

  Merge const* find_merge(std::int32_t a, std::int32_t b) const {
    auto const it =
        merges_.find(static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32 | static_cast<std::uint32_t>(b));
    return it == merges_.end() ? nullptr : &it->second;
  }

  /// Word::merge_all without dropout: a heap of (rank, position) candidates, stale ones skipped.
  void merge_all(std::vector<std::int32_t>& sym) const {
    struct Candidate {
      std::int32_t rank;
      std::size_t pos;
      std::int32_t merged;
    };
    auto const worse = [](Candidate const& a, Candidate const& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> heap(worse);
    std::size_t const none = sym.size();
    std::vector<std::size_t> next(sym.size()), prev(sym.size());
    for (std::size_t i = 0; i < sym.size(); ++i) {
      next[i] = i + 1;
      prev[i] = i == 0 ? none : i - 1;
    }
    auto const consider = [&](std::size_t left) {
      if (left == none || next[left] == none)
        return;
      if (Merge const* m = find_merge(sym[left], sym[next[left]]))
        heap.push({m->rank, left, m->id});
    };
    for (std::size_t i = 0; i + 1 < sym.size(); ++i)
      consider(i);
    while (!heap.empty()) {
      Candidate const c = heap.top();
      heap.pop();
      if (sym[c.pos] < 0 || next[c.pos] == none)
        continue;
      std::size_t const right = next[c.pos];
      Merge const* m = find_merge(sym[c.pos], sym[right]);
      if (m == nullptr || m->id != c.merged)
        continue;  // stale: the pair changed since
      sym[c.pos] = c.merged;
      sym[right] = -1;
      next[c.pos] = next[right];
      if (next[right] != none)
        prev[next[right]] = c.pos;
      consider(prev[c.pos]);
      consider(c.pos);
    }
  }

  /// ByteFallback's flush: bytes that form valid UTF-8 become one token, else one U+FFFD per byte.
  static void flush_bytes(std::string& bytes, std::vector<std::string>& out) {
    if (bytes.empty())
      return;
    if (tokenizer_detail::is_utf8(bytes))
      out.push_back(bytes);
    else
      for (std::size_t i = 0; i < bytes.size(); ++i)
        out.emplace_back(tokenizer_detail::kReplacement);
    bytes.clear();
  }

  /// One decoder's decode_chain.
  static std::vector<std::string> apply(Decoder const& d, std::vector<std::string> tokens) {
    using K = Decoder::Kind;
    std::vector<std::string> out;
    switch (d.kind) {
      case K::replace:
        for (std::string& t : tokens)
          t = tokenizer_detail::replace_all(t, d.a, d.b);
        return tokens;
      case K::byte_fallback: {
        std::string bytes;  // consecutive "<0xXX>" tokens
        for (std::string& t : tokens) {
          // u8::from_str_radix(token[3..5], 16): two hex digits, or '+' and one.
          int const h = t.size() == 6 && t.starts_with("<0x") && t[5] == '>' ? json::detail::hex_value(t[3]) : -1;
          int const l = t.size() == 6 ? json::detail::hex_value(t[4]) : -1;
          if (l >= 0 && (h >= 0 || (t.starts_with("<0x+") && t[5] == '>'))) {
            bytes += static_cast<char>(h >= 0 ? h * 16 + l : l);
          } else {
            flush_bytes(bytes, out);
            out.push_back(std::move(t));
          }
        }
        flush_bytes(bytes, out);
        return out;
      }
      case K::fuse: {
        std::string all;
        for (std::string const& t : tokens)
          all += t;
        return {all};
      }
      case K::strip:
        for (std::string& t : tokens) {
          tokenizer_detail::CodePoints const cp = tokenizer_detail::code_points(t);
          std::size_t const n = cp.cps.size();
          std::uint32_t const c = tokenizer_detail::utf8_step(d.a, 0).code_point;
          std::size_t begin = 0, end = n;
          while (begin < n && begin < static_cast<std::size_t>(d.start) && cp.cps[begin] == c)
            ++begin;
          while (end > 0 && n - end < static_cast<std::size_t>(d.stop) && cp.cps[end - 1] == c)
            --end;  // (tokenizers panics where the two cuts cross; here the token becomes empty)
          t = begin < end ? t.substr(cp.offsets[begin], cp.offsets[end] - cp.offsets[begin]) : std::string();
        }
        return tokens;
      case K::byte_level: {
        std::string bytes;
        for (std::string const& t : tokens) {
          tokenizer_detail::CodePoints const cp = tokenizer_detail::code_points(t);
          std::string mapped;
          bool all = true;
          for (std::uint32_t c : cp.cps) {
            int const b = tokenizer_detail::code_point_to_byte(c);
            all = all && b >= 0;
            mapped += static_cast<char>(b);
          }
          bytes += all ? mapped : t;  // a token with a character outside the map passes as its UTF-8
        }
        return {tokenizer_detail::utf8_lossy(bytes)};
      }
      case K::metaspace:
        for (std::size_t i = 0; i < tokens.size(); ++i)
          tokens[i] = tokenizer_detail::replace_all(tokens[i], d.a, i == 0 && !d.prepend_never ? "" : " ");
        return tokens;
    }
    return tokens;
  }

  std::string decode_hf(std::span<std::int32_t const> ids) const {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (std::int32_t id : ids)
      tokens.push_back(id >= 0 && id < vocab_size() ? pieces_[static_cast<std::size_t>(id)]
                                                    : std::string(tokenizer_detail::kReplacement));
    for (Decoder const& d : decoders_)
      tokens = apply(d, std::move(tokens));
    std::string out;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0 && !has_decoder_)
        out += ' ';
      out += tokens[i];
    }
    return out;
  }
};

}  // namespace kvc::eval
