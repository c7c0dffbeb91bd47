// SPDX-License-Identifier: Apache-2.0
// tools/eval/tokenizer.cpp: loading, llama2.c's tokenizer.bin, and encode/decode of both formats (tokenizer.hpp).
#include "eval/tokenizer.hpp"

#include "eval/tokenizer_detail.hpp"
#include "io/file.hpp"
#include "io/json.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <queue>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvc::eval {

using namespace tokenizer_detail;

bool Tokenizer::load_json(std::string const& path, Tokenizer& out, std::string& error) {
  std::string text;
  return read_file(path, text, error) && parse_json(text, out, error, path);
}

bool Tokenizer::load_llama2c(std::string const& path, std::int32_t vocab_size, Tokenizer& out, std::string& error) {
  std::string text;
  return read_file(path, text, error) &&
         parse_llama2c(std::as_bytes(std::span(text.data(), text.size())), vocab_size, out, error, path);
}

namespace {

/// Reads a tokenizer with `read(t)` into a fresh one of `format` and moves it into `out` once whole; running out of
/// memory (a hostile file's sizes) is an error naming the file, not an exception.
template <class Read>
bool parse_whole(Tokenizer& out, std::string& error, std::string_view name, Read&& read) {
  try {
    Tokenizer t;
    if (!read(t))
      return false;
    out = std::move(t);
    return true;
  } catch (std::bad_alloc const&) {
  } catch (std::length_error const&) {
  }
  error = std::string(name) + ": out of memory reading the tokenizer";
  return false;
}

}  // namespace

bool Tokenizer::parse_json(std::string_view text, Tokenizer& out, std::string& error, std::string_view name) {
  return parse_whole(out, error, name, [&](Tokenizer& t) {
    t.format_ = Format::hf_bpe;
    return t.read_json(text, error, name);
  });
}

bool Tokenizer::parse_llama2c(std::span<std::byte const> bytes, std::int32_t vocab_size, Tokenizer& out,
                              std::string& error, std::string_view name) {
  return parse_whole(out, error, name, [&](Tokenizer& t) {
    t.format_ = Format::llama2c;
    return t.read_llama2c(bytes, vocab_size, error, name);
  });
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text) const {
  if (format_ == Format::hf_bpe)
    return encode_hf(text);
  if (format_ == Format::llama2c)
    return encode_llama2c(text);
  return {};
}

std::string Tokenizer::decode(std::span<std::int32_t const> ids) const {
  if (format_ == Format::hf_bpe)
    return decode_hf(ids);
  if (format_ == Format::llama2c)
    return decode_llama2c(ids);
  std::string out;  // an empty tokenizer: no id is in range
  for (std::size_t i = 0; i < ids.size(); ++i)
    out += tokenizer_detail::kReplacement;
  return out;
}

bool Tokenizer::read_file(std::string const& path, std::string& text, std::string& error) {
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

bool Tokenizer::read_llama2c(std::span<std::byte const> bytes, std::int32_t vocab_size, std::string& error,
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

std::vector<std::int32_t> Tokenizer::encode_llama2c(std::string_view text) const {
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

std::string Tokenizer::decode_llama2c(std::span<std::int32_t const> ids) const {
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

std::uint32_t Tokenizer::trie_child(std::uint32_t node, unsigned char c) const {
  auto const& next = trie_[node].next;
  auto const it =
      std::lower_bound(next.begin(), next.end(), c, [](auto const& e, unsigned char b) { return e.first < b; });
  return it != next.end() && it->first == c ? it->second : 0;
}

std::int32_t Tokenizer::trie_insert(std::string const& pattern, bool normalized, std::int32_t id) {
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

void Tokenizer::split_added(std::string s, bool normalized, bool at_start, std::vector<Piece>& out) const {
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

void Tokenizer::pre_tokenize(PreTokenizer const& p, Piece const& piece, std::vector<Piece>& out) {
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

std::vector<std::int32_t> Tokenizer::encode_hf(std::string_view raw) const {
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

void Tokenizer::bpe(std::string const& word, std::vector<std::int32_t>& out) const {
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

Tokenizer::Merge const* Tokenizer::find_merge(std::int32_t a, std::int32_t b) const {
  auto const it =
      merges_.find(static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32 | static_cast<std::uint32_t>(b));
  return it == merges_.end() ? nullptr : &it->second;
}

void Tokenizer::merge_all(std::vector<std::int32_t>& sym) const {
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

void Tokenizer::flush_bytes(std::string& bytes, std::vector<std::string>& out) {
  if (bytes.empty())
    return;
  if (tokenizer_detail::is_utf8(bytes))
    out.push_back(bytes);
  else
    for (std::size_t i = 0; i < bytes.size(); ++i)
      out.emplace_back(tokenizer_detail::kReplacement);
  bytes.clear();
}

std::vector<std::string> Tokenizer::apply(Decoder const& d, std::vector<std::string> tokens) {
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

std::string Tokenizer::decode_hf(std::span<std::int32_t const> ids) const {
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

}  // namespace kvc::eval
