// SPDX-License-Identifier: Apache-2.0
// tools/eval/tokenizer_json.cpp: reading tokenizer.json's model, normalizers, pre-tokenizers, decoders, added and
// special tokens (tokenizer.hpp), every field checked.
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

namespace {
char const* kind_name(json::Value const& v) {
  return tokenizer_detail::kind_name(v.kind());
}
}  // namespace

bool Tokenizer::read_json(std::string_view text, std::string& error, std::string_view name) {
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

bool Tokenizer::check_growth(tokenizer_detail::JsonReader& r) const {
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

bool Tokenizer::read_padding(tokenizer_detail::JsonReader& r, json::Value const* v) {
  if (v == nullptr || v->is_null())
    return true;
  json::Value const* strategy = v->find("strategy");
  json::Value const* multiple = v->find("pad_to_multiple_of");
  if (strategy == nullptr || !strategy->is_string() || strategy->as_string() != "BatchLongest" ||
      (multiple != nullptr && !multiple->is_null()))
    return r.fail("padding", "unsupported (expected null, or strategy \"BatchLongest\" without pad_to_multiple_of)");
  return true;
}

bool Tokenizer::read_model(tokenizer_detail::JsonReader& r, json::Value const& model) {
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
    return r.fail("model.vocab",
                  std::to_string(n) + " tokens, more than the limit of " + std::to_string(tokenizer_detail::kMaxVocab));
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

bool Tokenizer::read_merges(tokenizer_detail::JsonReader& r, json::Value const* merges) {
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
        return r.fail(where, "expected \"left right\" with exactly one space, found \"" + json::printable(line) + "\"");
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
    merges_[static_cast<std::uint64_t>(static_cast<std::uint32_t>(ids[0])) << 32 | static_cast<std::uint32_t>(ids[1])] =
        Merge{rank++, ids[2]};
  }
  return true;
}

template <class ReadOne>
bool Tokenizer::read_sequence(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
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

bool Tokenizer::read_normalizer(tokenizer_detail::JsonReader& r, json::Value const* v, std::string const& path) {
  if (v == nullptr || v->is_null())
    return true;
  std::string type;
  if (!r.type(*v, path, type))
    return false;
  if (type == "Sequence")
    return read_sequence(r, *v, path, "normalizers",
                         [&](json::Value const& item, std::string const& at) { return read_normalizer(r, &item, at); });
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

bool Tokenizer::read_replace(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
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

std::string Tokenizer::normalize(std::string s) const {
  for (Normalizer const& n : normalizers_) {
    if (n.prepend)
      s = s.empty() ? s : n.a + s;
    else
      s = tokenizer_detail::replace_all(s, n.a, n.b);
  }
  return s;
}

bool Tokenizer::read_added_tokens(tokenizer_detail::JsonReader& r, json::Value const* list) {
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
    std::int64_t const expected = in_vocab != ids_.end() ? in_vocab->second : static_cast<std::int64_t>(pieces_.size());
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

bool Tokenizer::read_pre_tokenizer(tokenizer_detail::JsonReader& r, json::Value const* v, std::string const& path) {
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

bool Tokenizer::read_byte_level(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
                                bool& add_prefix_space, bool& use_regex) {
  bool trim_offsets = false;
  bool const yes = true;
  return r.only(v, path, {"type", "add_prefix_space", "trim_offsets", "use_regex"}) &&
         r.boolean(v, path, "add_prefix_space", add_prefix_space) && r.boolean(v, path, "trim_offsets", trim_offsets) &&
         r.boolean(v, path, "use_regex", use_regex, &yes);
}

bool Tokenizer::read_metaspace(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
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

bool Tokenizer::read_decoder(tokenizer_detail::JsonReader& r, json::Value const* v, std::string const& path) {
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

bool Tokenizer::read_special_ids(tokenizer_detail::JsonReader& r, json::Value const* pp) {
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

}  // namespace kvc::eval
