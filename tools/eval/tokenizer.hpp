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

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvc::json {
class Value;
}

namespace kvc::eval {

namespace tokenizer_detail {
struct JsonReader;
}

/// A tokenizer read from tokenizer.json (Hugging Face BPE) or llama2.c's tokenizer.bin. Immutable once loaded;
/// encode() and decode() are const and may run concurrently.
class Tokenizer {
 public:
  /// Loads the file at `path`: "tokenizer.json" (Hugging Face) or llama2.c's "tokenizer.bin"/"tok512.bin" format
  /// (vocab_size comes from the model: llama2.c's file does not store it). At most 64 MiB are read. On failure
  /// returns false, leaves `out` as it was and sets `error` (starting with the path).
  static bool load_json(std::string const& path, Tokenizer& out, std::string& error);
  static bool load_llama2c(std::string const& path, std::int32_t vocab_size, Tokenizer& out, std::string& error);

  /// The same from bytes already in memory (the fuzzer's entry points); `name` prefixes errors.
  static bool parse_json(std::string_view text, Tokenizer& out, std::string& error,
                         std::string_view name = "tokenizer.json");
  static bool parse_llama2c(std::span<std::byte const> bytes, std::int32_t vocab_size, Tokenizer& out,
                            std::string& error, std::string_view name = "tokenizer.bin");

  /// UTF-8 text -> ids, no BOS/EOS added (add_special_tokens=False).
  ///   tokenizer.json: as tokenizers' Tokenizer.encode; ill-formed UTF-8 is first replaced by U+FFFD as Python's
  ///     bytes.decode("utf-8", "replace") would (tokenizers takes str). APPROXIMATION: ByteLevel's GPT-2 split
  ///     treats every non-ASCII code point as a letter (see tokenizer_detail::gpt2_class); exact for ASCII text.
  ///   llama2.c: as run.c's encode(text, bos=0, eos=0): the text ends at its first NUL byte (a C string), a dummy
  ///     prefix " " is added when it is not empty, code points missing from the vocabulary become byte ids
  ///     (byte + 3), then the adjacent pair whose concatenation is in the vocabulary with the highest score (above
  ///     -1e10) is merged, the leftmost on ties, until none is.
  /// An empty tokenizer (default-constructed) gives no ids.
  std::vector<std::int32_t> encode(std::string_view text) const;

  /// ids -> text, as the reference decoders do for a whole sequence; every id renders (special tokens included);
  /// ids out of range render as U+FFFD.
  ///   tokenizer.json: as tokenizers' decode(ids, skip_special_tokens=False) (v0.22: an added token is its
  ///     content); the decoder chain, or the tokens joined with " " without a decoder. Always valid UTF-8.
  ///   llama2.c: the concatenation of run.c's decode(prev, id): after BOS (1) one leading ' ' of the piece is
  ///     dropped; a piece "<0x" + 1 or 2 hex digits (what run.c's sscanf "<0x%02hhX>" reads on real files; its
  ///     leniency for a sign, spaces or "0x" there is not reproduced) is that raw byte. BOS renders as its piece
  ///     ("\n<s>\n" in llama2.c's files). May be invalid UTF-8, as run.c prints it.
  std::string decode(std::span<std::int32_t const> ids) const;

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

  static bool read_file(std::string const& path, std::string& text, std::string& error);

  // ---- llama2.c -------------------------------------------------------------------------------------------------

  bool read_llama2c(std::span<std::byte const> bytes, std::int32_t vocab_size, std::string& error,
                    std::string_view name);

  std::vector<std::int32_t> encode_llama2c(std::string_view text) const;

  std::string decode_llama2c(std::span<std::int32_t const> ids) const;

  // ---- tokenizer.json: reading --------------------------------------------------------------------------------

  bool read_json(std::string_view text, std::string& error, std::string_view name);

  /// Refuses chains of steps that can make a text more than kMaxGrowth times longer (upper bounds per step:
  /// Replace |content| / |pattern| rounded up, Prepend 1 + |prepend|, ByteLevel 4 before (prefix space, 2-byte
  /// characters) and 2 after (U+FFFD for a lone byte), Metaspace 2 |replacement|).
  bool check_growth(tokenizer_detail::JsonReader& r) const;

  /// Padding changes nothing for one sequence with strategy BatchLongest and no pad_to_multiple_of.
  static bool read_padding(tokenizer_detail::JsonReader& r, json::Value const* v);

  bool read_model(tokenizer_detail::JsonReader& r, json::Value const& model);

  /// merges: "a b" strings (exactly one space; lines starting with "#version" skipped) or [a, b] arrays. The rank
  /// is the position; a pair listed twice keeps its last rank, as tokenizers' map does.
  bool read_merges(tokenizer_detail::JsonReader& r, json::Value const* merges);

  /// A {"type": "Sequence", KEY: [...]} component: every element read by `read_one(element, its path)`, in order.
  template <class ReadOne>
  static bool read_sequence(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
                            char const* key, ReadOne&& read_one);

  bool read_normalizer(tokenizer_detail::JsonReader& r, json::Value const* v, std::string const& path);

  /// Replace (a normalizer or a decoder): {"pattern": {"String": non-empty}, "content": string}.
  static bool read_replace(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
                           std::string& pattern, std::string& content);

  std::string normalize(std::string s) const;

  /// added_tokens: [{id, content, single_word, lstrip, rstrip, normalized, special}], all fields required (as
  /// tokenizers reads them). A content in model.vocab keeps its id there; the others take the ids after it in
  /// order, which the file's ids must state. Needs the model and the normalizer.
  bool read_added_tokens(tokenizer_detail::JsonReader& r, json::Value const* list);

  bool read_pre_tokenizer(tokenizer_detail::JsonReader& r, json::Value const* v, std::string const& path);

  /// ByteLevel (pre-tokenizer or decoder): add_prefix_space and trim_offsets required, use_regex defaults to true.
  static bool read_byte_level(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
                              bool& add_prefix_space, bool& use_regex);

  /// Metaspace (pre-tokenizer or decoder): replacement (one character), prepend_scheme "always" (default),
  /// "first" or "never", split (default true); the legacy add_prefix_space false must come with "never".
  static bool read_metaspace(tokenizer_detail::JsonReader& r, json::Value const& v, std::string const& path,
                             PreTokenizer& p);

  bool read_decoder(tokenizer_detail::JsonReader& r, json::Value const* v, std::string const& path);

  /// BOS/EOS from post_processor (TemplateProcessing, alone or in a Sequence): the special tokens that start and
  /// end the single-sequence template. Other processors are ignored (encode never adds special tokens).
  bool read_special_ids(tokenizer_detail::JsonReader& r, json::Value const* pp);

  // ---- tokenizer.json: encoding and decoding -------------------------------------------------------------------

  /// The child of trie node `node` by byte `c`, or 0 (the root is nobody's child).
  std::uint32_t trie_child(std::uint32_t node, unsigned char c) const;

  /// Adds an added token's pattern to the trie; returns the id of another added token with the same pattern and
  /// kind, or -1.
  std::int32_t trie_insert(std::string const& pattern, bool normalized, std::int32_t id);

  /// Splits `s` at the added tokens of the given kind (LeftmostLongest: the match that starts first, the longest
  /// one there), appending the non-empty pieces to `out`.
  void split_added(std::string s, bool normalized, bool at_start, std::vector<Piece>& out) const;

  /// Applies one pre-tokenizer to a piece, appending the non-empty pieces it gives.
  static void pre_tokenize(PreTokenizer const& p, Piece const& piece, std::vector<Piece>& out);

  std::vector<std::int32_t> encode_hf(std::string_view raw) const;

  /// tokenizers' BPE::merge_word + Word::merge_all on one word (non-empty valid UTF-8): characters to ids (byte
  /// fallback, then unk, fused when fuse_unk; a character with neither is dropped), then the lowest-rank merge
  /// present is applied, the leftmost on equal rank, until none is. Appends the ids to `out`.
  void bpe(std::string const& word, std::vector<std::int32_t>& out) const;

  Merge const* find_merge(std::int32_t a, std::int32_t b) const;

  /// Word::merge_all without dropout: a heap of (rank, position) candidates, stale ones skipped.
  void merge_all(std::vector<std::int32_t>& sym) const;

  /// ByteFallback's flush: bytes that form valid UTF-8 become one token, else one U+FFFD per byte.
  static void flush_bytes(std::string& bytes, std::vector<std::string>& out);

  /// One decoder's decode_chain.
  static std::vector<std::string> apply(Decoder const& d, std::vector<std::string> tokens);

  std::string decode_hf(std::span<std::int32_t const> ids) const;
};

}  // namespace kvc::eval
