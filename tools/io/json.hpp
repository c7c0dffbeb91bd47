// SPDX-License-Identifier: Apache-2.0
// tools/io/json.hpp: a small, strict JSON (RFC 8259) parser into a DOM, for untrusted files (safetensors headers,
// tokenizer.json, model configs).
//
// Strict: one value with optional whitespace (space, tab, LF, CR) around it; no comments, trailing commas, NaN,
// Infinity, leading zeros, single quotes, byte order mark or control characters in strings. Strings must be valid
// UTF-8 (RFC 3629: no overlong forms, no UTF-8-encoded surrogates, nothing above U+10FFFF); \u escapes are decoded,
// surrogate pairs joined, lone surrogates refused. Duplicate object keys are refused (sorted check, O(n log n) per
// object). Nesting is bounded (ParseLimits::max_depth), so the recursive parser and the recursive destructor use
// bounded stack. Numbers are kept as written and converted with std::from_chars (locale independent). Errors name
// the byte offset (from 0) and what was expected. Tool code, not a hot path: it allocates.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace kvc::json {

/// The six JSON value kinds (RFC 8259 section 3).
enum class Kind : std::uint8_t { null, boolean, number, string, array, object };

namespace detail {
class Parser;
}

/// One parsed JSON value. Read-only once parsed; the accessors of the wrong kind return an empty/zero value instead
/// of failing, so callers check kind() (or is_*()) where the kind matters. Copyable and movable (a moved-from value
/// is valid, of the same kind, with unspecified contents). 48 bytes: the string, the elements or the members share
/// storage, since a 10 MB document holds millions of values.
class Value {
 public:
  /// An object member: the decoded key (UTF-8) and its value.
  using Member = std::pair<std::string, Value>;

  Value() noexcept {}  // null
  Value(Value const& o) : kind_(o.kind_), boolean_(o.boolean_), number_(o.number_) { construct_from(o); }
  Value(Value&& o) noexcept : kind_(o.kind_), boolean_(o.boolean_), number_(o.number_) { construct_from(std::move(o)); }
  Value& operator=(Value const& o) {
    if (this != &o)
      *this = Value(o);
    return *this;
  }
  Value& operator=(Value&& o) noexcept {
    if (this != &o) {
      Value taken(std::move(o));  // first: `o` may be a part of *this
      destroy();
      kind_ = taken.kind_;
      boolean_ = taken.boolean_;
      number_ = taken.number_;
      construct_from(std::move(taken));
    }
    return *this;
  }
  ~Value() { destroy(); }

  Kind kind() const noexcept { return kind_; }
  bool is_null() const noexcept { return kind_ == Kind::null; }
  bool is_bool() const noexcept { return kind_ == Kind::boolean; }
  bool is_number() const noexcept { return kind_ == Kind::number; }
  bool is_string() const noexcept { return kind_ == Kind::string; }
  bool is_array() const noexcept { return kind_ == Kind::array; }
  bool is_object() const noexcept { return kind_ == Kind::object; }

  /// False unless a boolean true.
  bool as_bool() const noexcept { return kind_ == Kind::boolean && boolean_; }
  /// The number (std::from_chars of its text, the nearest double; locale independent); 0 if not a number. A literal
  /// beyond the double range gives +-inf, one below the smallest subnormal gives +-0.
  double as_double() const noexcept { return kind_ == Kind::number ? number_ : 0.0; }
  /// The number exactly as written in the file; empty if not a number.
  std::string_view number_text() const noexcept { return kind_ == Kind::number ? std::string_view(u_.text) : ""; }
  /// The decoded string (UTF-8, may contain U+0000 from a \u0000 escape); empty if not a string.
  std::string const& as_string() const noexcept { return kind_ == Kind::string ? u_.text : empty<std::string>(); }
  /// The array elements in file order; empty if not an array.
  std::vector<Value> const& items() const noexcept {
    return kind_ == Kind::array ? u_.items : empty<std::vector<Value>>();
  }
  /// The object members in file order (keys unique); empty if not an object.
  std::vector<Member> const& members() const noexcept {
    return kind_ == Kind::object ? u_.members : empty<std::vector<Member>>();
  }
  /// The member named `key` (linear search), nullptr if absent or not an object.
  Value const* find(std::string_view key) const noexcept {
    for (Member const& m : members())
      if (m.first == key)
        return &m.second;
    return nullptr;
  }

 private:
  friend class detail::Parser;
  template <class T>
  static T const& empty() noexcept {
    static T const value;
    return value;
  }

  /// Turns a null value into an empty value of kind `k` (the parser's only way to build one).
  void become(Kind k) noexcept {
    kind_ = k;
    if (k == Kind::string || k == Kind::number)
      ::new (&u_.text) std::string();
    else if (k == Kind::array)
      ::new (&u_.items) std::vector<Value>();
    else if (k == Kind::object)
      ::new (&u_.members) std::vector<Member>();
  }
  /// Constructs the storage of kind_ (already set) from `o`'s, copied or moved.
  template <class V>
  void construct_from(V&& o) {
    switch (kind_) {
      case Kind::string:
      case Kind::number: ::new (&u_.text) std::string(std::forward<V>(o).u_.text); break;
      case Kind::array: ::new (&u_.items) std::vector<Value>(std::forward<V>(o).u_.items); break;
      case Kind::object: ::new (&u_.members) std::vector<Member>(std::forward<V>(o).u_.members); break;
      case Kind::null:
      case Kind::boolean: break;
    }
  }
  /// Destroys the storage and leaves a null value. Recursion depth: the nesting depth (bounded by the parser).
  void destroy() noexcept {
    switch (kind_) {
      case Kind::string:
      case Kind::number: u_.text.~basic_string(); break;
      case Kind::array: u_.items.~vector(); break;
      case Kind::object: u_.members.~vector(); break;
      case Kind::null:
      case Kind::boolean: break;
    }
    kind_ = Kind::null;
  }

  union Storage {
    Storage() noexcept {}
    ~Storage() {}
    std::string text;             // string: the decoded bytes; number: the text as written
    std::vector<Value> items;     // array
    std::vector<Member> members;  // object
  };

  Kind kind_ = Kind::null;
  bool boolean_ = false;
  double number_ = 0.0;
  Storage u_;
};

/// A number written as an integer (optional '-', then digits: no fraction, no exponent) whose value fits int64
/// ("-0" is 0). On success sets `out`; otherwise returns false and leaves `out` as it was.
inline bool to_int64(Value const& v, std::int64_t& out) noexcept {
  std::string_view const t = v.number_text();
  if (t.empty() || t.find_first_of(".eE") != std::string_view::npos)
    return false;
  std::int64_t value = 0;
  auto const [end, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
  if (ec != std::errc() || end != t.data() + t.size())
    return false;
  out = value;
  return true;
}

/// Bounds on what parse() accepts.
struct ParseLimits {
  /// The most arrays/objects nested inside one another ("[[1]]" is 2 levels; scalars are 0). Values above
  /// kMaxDepth are treated as kMaxDepth, since both the parser and Value's destructor recurse once per level.
  int max_depth = 128;
  static constexpr int kMaxDepth = 1024;
};

/// Appends `s` to `out` as a JSON string literal (quotes included; '"', '\\' and control characters escaped, other
/// bytes as they are). Returns false, appending nothing, when `s` is not valid UTF-8 (it could not be read back).
inline bool append_string(std::string& out, std::string_view s);

/// `s` made safe to quote in an error message: printable ASCII as is, every other byte as \xNN, cut to about
/// `max_chars` characters with "..." (names in untrusted files can hold terminal escapes).
inline std::string printable(std::string_view s, std::size_t max_chars = 64);

namespace detail {

/// The length of the valid UTF-8 sequence (RFC 3629 table 3-7) starting at s[i], or 0 if the bytes there are not
/// one: a stray continuation byte, an overlong form, a surrogate, a code point above U+10FFFF, a truncated tail.
inline std::size_t utf8_sequence(std::string_view s, std::size_t i) noexcept {
  auto const at = [&](std::size_t k) { return k < s.size() ? static_cast<unsigned char>(s[k]) : 0u; };
  unsigned const b0 = at(i);
  auto const cont = [](unsigned b) { return b >= 0x80 && b <= 0xBF; };
  if (b0 < 0x80)
    return i < s.size() ? 1 : 0;
  if (b0 >= 0xC2 && b0 <= 0xDF)
    return cont(at(i + 1)) ? 2 : 0;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    unsigned const lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;  // no overlong, no surrogates
    return at(i + 1) >= lo && at(i + 1) <= hi && cont(at(i + 2)) ? 3 : 0;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    unsigned const lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;  // no overlong, <= U+10FFFF
    return at(i + 1) >= lo && at(i + 1) <= hi && cont(at(i + 2)) && cont(at(i + 3)) ? 4 : 0;
  }
  return 0;  // 0x80-0xC1 (continuation or overlong lead), 0xF5-0xFF
}

/// The value of one hexadecimal digit (either case), or -1.
inline int hex_value(char c) noexcept {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

inline char hex_digit(unsigned v) noexcept {
  return "0123456789abcdef"[v & 0xF];
}

}  // namespace detail

inline bool append_string(std::string& out, std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    std::size_t const n = detail::utf8_sequence(s, i);
    if (n == 0)
      return false;
    i += n;
  }
  out += '"';
  for (char c : s) {
    unsigned const u = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (u < 0x20) {
          out += "\\u00";
          out += detail::hex_digit(u >> 4);
          out += detail::hex_digit(u);
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return true;
}

inline std::string printable(std::string_view s, std::size_t max_chars) {
  std::string out;
  for (char c : s) {
    if (out.size() >= max_chars) {
      out += "...";
      break;
    }
    unsigned const u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7F && c != '\\') {
      out += c;
    } else {
      out += "\\x";
      out += detail::hex_digit(u >> 4);
      out += detail::hex_digit(u);
    }
  }
  return out;
}

namespace detail {

/// The recursive-descent parser behind parse(): depth-first, one call level per nesting level (bounded by the
/// clamped max_depth). A class only so that Value can befriend it.
class Parser {
 public:
  Parser(std::string_view text, int max_depth) noexcept : text_(text), max_depth_(max_depth) {}

  bool run(Value& out, std::string& error) {
    try {
      skip_space();
      if (!value(out, 0))
        return finish(error);
      skip_space();
      if (pos_ != text_.size()) {
        fail(pos_, "unexpected " + describe(pos_) + " after the JSON value (expected the end of the text)");
        return finish(error);
      }
      return true;
    } catch (std::bad_alloc const&) {
      error = "out of memory parsing " + std::to_string(text_.size()) + " bytes of JSON";
      return false;
    } catch (std::length_error const&) {
      error = "out of memory parsing " + std::to_string(text_.size()) + " bytes of JSON";
      return false;
    }
  }

 private:
  std::string_view text_;
  std::size_t pos_ = 0;
  int max_depth_;
  std::size_t error_pos_ = 0;
  std::string error_;
  // Scratch stacks shared by every nesting level (each container uses the part above where it started and pops it
  // when it closes), so that a container's elements are moved once into a vector of the exact size, with no growth
  // reallocations and no allocation per object for the duplicate check.
  std::vector<Value> items_;            // elements of the open arrays
  std::vector<Value::Member> members_;  // members of the open objects
  std::vector<std::size_t> key_at_;     // the byte offset of each of those members' keys, for messages
  std::vector<std::uint32_t> order_;    // unique_keys' sort

  bool finish(std::string& error) {
    error = "byte " + std::to_string(error_pos_) + ": " + error_;
    return false;
  }
  bool fail(std::size_t at, std::string message) {
    error_pos_ = at;
    error_ = std::move(message);
    return false;
  }
  /// The byte at `at`, for messages: "'x'" when printable ASCII, "byte 0xNN" otherwise, "the end of the text".
  std::string describe(std::size_t at) const {
    if (at >= text_.size())
      return "the end of the text";
    unsigned const u = static_cast<unsigned char>(text_[at]);
    if (u >= 0x20 && u < 0x7F)
      return std::string("'") + text_[at] + "'";
    std::string s = "byte 0x";
    s += detail::hex_digit(u >> 4);
    s += detail::hex_digit(u);
    return s;
  }

  void skip_space() noexcept {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\r' || text_[pos_] == '\t'))
      ++pos_;
  }
  bool at(char c) const noexcept { return pos_ < text_.size() && text_[pos_] == c; }

  bool value(Value& v, int depth) {
    if (pos_ >= text_.size())
      return fail(pos_, "expected a value, found the end of the text");
    char const c = text_[pos_];
    switch (c) {
      case '{': return object(v, depth + 1);
      case '[': return array(v, depth + 1);
      case '"': v.become(Kind::string); return string(v.u_.text);
      case 't': return literal(v, "true", Kind::boolean, true);
      case 'f': return literal(v, "false", Kind::boolean, false);
      case 'n': return literal(v, "null", Kind::null, false);
      default:
        if (c == '-' || (c >= '0' && c <= '9'))
          return number(v);
        if (static_cast<unsigned char>(c) == 0xEF && text_.substr(pos_, 3) == "\xEF\xBB\xBF")
          return fail(pos_, "unexpected UTF-8 byte order mark (expected a value)");
        return fail(pos_, "unexpected " + describe(pos_) + " (expected a value: object, array, string, number, " +
                              "true, false or null)");
    }
  }

  bool literal(Value& v, std::string_view word, Kind kind, bool b) {
    if (text_.substr(pos_, word.size()) != word)
      return fail(pos_, "unexpected " + describe(pos_) + " (expected a value; literals are true, false, null)");
    pos_ += word.size();
    v.become(kind);
    v.boolean_ = b;
    return true;
  }

  bool digits(std::size_t& count) noexcept {
    std::size_t const start = pos_;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9')
      ++pos_;
    count = pos_ - start;
    return count > 0;
  }

  bool number(Value& v) {
    std::size_t const start = pos_;
    bool const negative = at('-');
    if (negative)
      ++pos_;
    std::size_t int_digits = 0, frac_digits = 0;
    std::size_t const int_start = pos_;
    if (!digits(int_digits))
      return fail(pos_, "expected a digit after '-', found " + describe(pos_));
    if (int_digits > 1 && text_[int_start] == '0')
      return fail(int_start, "a number with a leading zero (JSON numbers are written 0, 0.5 or 12, never 012)");
    std::size_t const frac_start = pos_ + 1;
    if (at('.')) {
      ++pos_;
      if (!digits(frac_digits))
        return fail(pos_, "expected a digit after the decimal point, found " + describe(pos_));
    }
    std::int64_t exponent = 0;
    if (at('e') || at('E')) {
      ++pos_;
      bool const exp_negative = at('-');
      if (at('+') || at('-'))
        ++pos_;
      std::size_t const exp_start = pos_;
      std::size_t exp_digits = 0;
      if (!digits(exp_digits))
        return fail(pos_, "expected a digit in the exponent, found " + describe(pos_));
      for (std::size_t i = exp_start; i < pos_; ++i)  // saturates: only the sign of a huge exponent matters below
        exponent = std::min<std::int64_t>(exponent * 10 + (text_[i] - '0'), std::int64_t{1} << 40);
      if (exp_negative)
        exponent = -exponent;
    }
    v.become(Kind::number);
    v.u_.text.assign(text_.data() + start, pos_ - start);
    double d = 0.0;
    auto const [end, ec] = std::from_chars(text_.data() + start, text_.data() + pos_, d);
    if (ec == std::errc::result_out_of_range) {
      // Out of range: too large (+-inf) or too small (+-0). The decimal exponent of the first non-zero digit
      // tells which; the digit counts are bounded by the text size, the exponent saturated above.
      std::int64_t magnitude = exponent;
      std::size_t first = int_start;
      while (first < int_start + int_digits && text_[first] == '0')
        ++first;
      if (first < int_start + int_digits) {
        magnitude += static_cast<std::int64_t>(int_start + int_digits - first) - 1;
      } else {
        std::size_t k = 0;
        while (k < frac_digits && text_[frac_start + k] == '0')
          ++k;
        magnitude -= static_cast<std::int64_t>(k) + 1;
      }
      d = magnitude > 0 ? std::numeric_limits<double>::infinity() : 0.0;
      if (negative)
        d = -d;
    } else if (ec != std::errc() || end != text_.data() + pos_) {
      return fail(start, "the number " + printable(v.u_.text) + " cannot be converted");  // not reached: grammar above
    }
    v.number_ = d;
    return true;
  }

  /// Reads the 4 hex digits of a \u escape at pos_ (after "\u").
  bool hex4(std::uint32_t& out) {
    out = 0;
    for (int i = 0; i < 4; ++i) {
      int const h = pos_ < text_.size() ? hex_value(text_[pos_]) : -1;
      if (h < 0)
        return fail(pos_, "expected 4 hex digits after \\u, found " + describe(pos_));
      out = out * 16 + static_cast<std::uint32_t>(h);
      ++pos_;
    }
    return true;
  }

  /// A string at pos_ (the opening quote), decoded into `out`.
  bool string(std::string& out) {
    std::size_t const open = pos_++;
    out.clear();
    while (true) {
      std::size_t const run = pos_;  // copy runs of plain ASCII in one go
      while (pos_ < text_.size()) {
        auto const u = static_cast<unsigned char>(text_[pos_]);
        if (u < 0x20 || u >= 0x80 || u == '"' || u == '\\')
          break;
        ++pos_;
      }
      out.append(text_.data() + run, pos_ - run);
      if (pos_ >= text_.size())
        return fail(open, "unterminated string (no closing '\"')");
      auto const u = static_cast<unsigned char>(text_[pos_]);
      if (u == '"') {
        ++pos_;
        return true;
      }
      if (u < 0x20)
        return fail(pos_, "unescaped control character " + describe(pos_) + " in a string (write it as \\u00XX)");
      if (u >= 0x80) {
        std::size_t const n = detail::utf8_sequence(text_, pos_);
        if (n == 0)
          return fail(pos_, "invalid UTF-8 in a string at " + describe(pos_) +
                                " (overlong form, surrogate, code point above U+10FFFF, or a broken sequence)");
        out.append(text_.data() + pos_, n);
        pos_ += n;
        continue;
      }
      std::size_t const escape = pos_++;  // a backslash
      if (pos_ >= text_.size())
        return fail(escape, "unterminated escape sequence at the end of the text");
      char const e = text_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = 0;
          if (!hex4(cp))
            return false;
          if (cp >= 0xDC00 && cp <= 0xDFFF)
            return fail(escape, "lone low surrogate \\u" + std::string(text_.substr(escape + 2, 4)) +
                                    " (expected it after a high surrogate \\uD800-\\uDBFF)");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (text_.substr(pos_, 2) != "\\u")
              return fail(escape, "lone high surrogate \\u" + std::string(text_.substr(escape + 2, 4)) +
                                      " (expected a low surrogate \\uDC00-\\uDFFF after it)");
            pos_ += 2;
            std::uint32_t low = 0;
            if (!hex4(low))
              return false;
            if (low < 0xDC00 || low > 0xDFFF)
              return fail(escape, "lone high surrogate \\u" + std::string(text_.substr(escape + 2, 4)) +
                                      " (expected a low surrogate \\uDC00-\\uDFFF after it)");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          detail::append_utf8(out, cp);
          break;
        }
        default:
          return fail(escape, "invalid escape sequence \\" + printable(std::string_view(&e, 1)) +
                                  " (expected one of \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)");
      }
    }
  }

  bool too_deep(int depth) {
    if (depth <= max_depth_)
      return false;
    fail(pos_, "nesting deeper than the limit of " + std::to_string(max_depth_) + " arrays/objects");
    return true;
  }

  bool array(Value& v, int depth) {
    if (too_deep(depth))
      return false;
    v.become(Kind::array);
    ++pos_;  // '['
    skip_space();
    if (at(']')) {
      ++pos_;
      return true;
    }
    std::size_t const base = items_.size();
    while (true) {
      Value item;  // not parsed in place: the nested containers may reallocate items_
      if (!value(item, depth))
        return false;
      items_.push_back(std::move(item));
      skip_space();
      if (at(',')) {
        ++pos_;
        skip_space();
        if (at(']'))
          return fail(pos_, "trailing comma before ']' (expected another value)");
        continue;
      }
      if (at(']')) {
        ++pos_;
        v.u_.items.reserve(items_.size() - base);
        std::move(items_.begin() + static_cast<std::ptrdiff_t>(base), items_.end(), std::back_inserter(v.u_.items));
        items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(base), items_.end());
        return true;
      }
      return fail(pos_, "expected ',' or ']' after an array element, found " + describe(pos_));
    }
  }

  bool object(Value& v, int depth) {
    if (too_deep(depth))
      return false;
    v.become(Kind::object);
    ++pos_;  // '{'
    skip_space();
    if (at('}')) {
      ++pos_;
      return true;
    }
    std::size_t const base = members_.size(), key_base = key_at_.size();
    while (true) {
      if (!at('"'))
        return fail(pos_, at('}') ? "trailing comma before '}' (expected another key)"
                                  : "expected a string key, found " + describe(pos_));
      key_at_.push_back(pos_);
      Value::Member m;  // not parsed in place: the nested containers may reallocate members_
      if (!string(m.first))
        return false;
      skip_space();
      if (!at(':'))
        return fail(pos_, "expected ':' after an object key, found " + describe(pos_));
      ++pos_;
      skip_space();
      if (!value(m.second, depth))
        return false;
      members_.push_back(std::move(m));
      skip_space();
      if (at(',')) {
        ++pos_;
        skip_space();
        continue;
      }
      if (at('}')) {
        ++pos_;
        v.u_.members.reserve(members_.size() - base);
        std::move(members_.begin() + static_cast<std::ptrdiff_t>(base), members_.end(),
                  std::back_inserter(v.u_.members));
        members_.erase(members_.begin() + static_cast<std::ptrdiff_t>(base), members_.end());
        bool const unique = unique_keys(v, std::span(key_at_).subspan(key_base));
        key_at_.resize(key_base);
        return unique;
      }
      return fail(pos_, "expected ',' or '}' after an object member, found " + describe(pos_));
    }
  }

  /// Refuses an object with two members of the same key: sorts the member indices by key, compares neighbours.
  bool unique_keys(Value const& v, std::span<std::size_t const> key_at) {
    auto const& ms = v.u_.members;
    if (ms.size() < 2)
      return true;
    std::vector<std::uint32_t>& order = order_;
    order.resize(ms.size());
    for (std::size_t i = 0; i < order.size(); ++i)
      order[i] = static_cast<std::uint32_t>(i);
    std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      int const c = ms[a].first.compare(ms[b].first);
      return c < 0 || (c == 0 && a < b);
    });
    std::size_t dup = ms.size();  // the earliest second occurrence of any key
    for (std::size_t i = 1; i < order.size(); ++i)
      if (ms[order[i]].first == ms[order[i - 1]].first)
        dup = std::min<std::size_t>(dup, order[i]);
    if (dup == ms.size())
      return true;
    return fail(key_at[dup], "duplicate object key \"" + printable(ms[dup].first) + "\"");
  }
};

}  // namespace detail

/// Parses all of `text` as one JSON value (whitespace allowed around it). On failure returns false, leaves `out`
/// unspecified and sets `error` to e.g. "byte 17: expected ':' after an object key, found ','" (never empty; the
/// byte offset counts from 0). Out of memory is reported as an error, not thrown.
inline bool parse(std::string_view text, Value& out, std::string& error, ParseLimits limits = {}) {
  out = Value();
  int const depth = std::clamp(limits.max_depth, 0, ParseLimits::kMaxDepth);
  if (text.size() > static_cast<std::size_t>(std::numeric_limits<std::uint32_t>::max())) {
    error = "the JSON text has " + std::to_string(text.size()) + " bytes, more than the parser's limit of 4 GiB";
    return false;
  }
  return detail::Parser(text, depth).run(out, error);
}

}  // namespace kvc::json
