// SPDX-License-Identifier: Apache-2.0
// tools/eval/tokenizer_detail.cpp: the tokenizer's UTF-8 steps, byte tables and GPT-2 split (tokenizer_detail.hpp).
#include "eval/tokenizer_detail.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvc::eval::tokenizer_detail {

Utf8Step utf8_step(std::string_view s, std::size_t i) noexcept {
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

std::string utf8_lossy(std::string_view s) {
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

bool is_utf8(std::string_view s) noexcept {
  for (std::size_t i = 0; i < s.size();) {
    Utf8Step const step = utf8_step(s, i);
    if (!step.valid)
      return false;
    i += step.length;
  }
  return true;
}

CodePoints code_points(std::string_view s) {
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

std::array<std::uint32_t, 256> const& byte_to_code_point() {
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

int code_point_to_byte(std::uint32_t cp) {
  static std::array<std::int16_t, 324> const table = [] {
    std::array<std::int16_t, 324> t{};
    t.fill(-1);
    for (int b = 0; b < 256; ++b)
      t[byte_to_code_point()[static_cast<std::size_t>(b)]] = static_cast<std::int16_t>(b);
    return t;
  }();
  return cp < table.size() ? table[cp] : -1;
}

CharClass gpt2_class(std::uint32_t cp) noexcept {
  if (cp >= 0x80 || (cp >= 'A' && cp <= 'Z') || (cp >= 'a' && cp <= 'z'))
    return CharClass::letter;
  if (cp >= '0' && cp <= '9')
    return CharClass::number;
  if (cp == ' ' || (cp >= '\t' && cp <= '\r'))
    return CharClass::space;
  return CharClass::other;
}

std::vector<std::size_t> gpt2_split(std::string_view s) {
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

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  std::size_t i = 0;
  for (std::size_t at; (at = s.find(from, i)) != std::string_view::npos; i = at + from.size()) {
    out.append(s.substr(i, at - i));
    out.append(to);
  }
  out.append(s.substr(i));
  return out;
}

char const* kind_name(json::Kind k) noexcept {
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

}  // namespace kvc::eval::tokenizer_detail
