// SPDX-License-Identifier: Apache-2.0
// tests/tools/tokenizer_test.cpp mirrors tools/eval/tokenizer.hpp: the two real tokenizers against the independent
// Python oracle (tools/reference/tokenizer.py), hand-computed cases on tiny hand-written files (merge order, ties,
// byte fallback, unk, added tokens, pre-tokenizers, decoders), every rejection with its message, and a
// deterministic mutation loop over the real files (run under ASan/UBSan in CI; tools/fuzz has the libFuzzer
// harness).
#include "eval/tokenizer.hpp"

#include "eval/tokenizer_detail.hpp"
#include "support/catch.hpp"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <sys/stat.h>
#include <vector>

using kvc::eval::Tokenizer;
using Ids = std::vector<std::int32_t>;

#define CHECK_HAS(text, part)                      \
  do {                                             \
    INFO("message: " << (text));                   \
    CHECK((text).find(part) != std::string::npos); \
  } while (0)

namespace {

bool exists(std::string const& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string const tinystories_json = std::string(KVC_SHARED_DIR) + "/models/tinystories-656k/tokenizer.json";
std::string const tok512_bin = std::string(KVC_SHARED_DIR) + "/models/stories260k/tok512.bin";

std::string slurp(std::string const& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string decode(Tokenizer const& t, Ids const& ids) {
  return t.decode(ids);
}

// ---- llama2.c files built in the test ---------------------------------------------------------------------------

struct BinToken {
  std::string piece;
  float score = 0.0f;
};

void put_i32(std::string& out, std::int32_t v) {
  auto const u = static_cast<std::uint32_t>(v);
  for (int k = 0; k < 4; ++k)
    out += static_cast<char>((u >> (8 * k)) & 0xFF);
}

/// tokenizer.bin bytes: int32 max_token_length, then {float32 score, int32 len, bytes} per token (little-endian).
std::string bin_file(std::int32_t max_len, std::vector<BinToken> const& tokens) {
  std::string out;
  put_i32(out, max_len);
  for (BinToken const& t : tokens) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &t.score, 4);
    put_i32(out, static_cast<std::int32_t>(bits));
    put_i32(out, static_cast<std::int32_t>(t.piece.size()));
    out += t.piece;
  }
  return out;
}

/// llama2.c's first 259 tokens: <unk>, "\n<s>\n", "\n</s>\n", then <0x00>..<0xFF> (ids 3..258), score 0.
std::vector<BinToken> base_vocab() {
  std::vector<BinToken> v = {{"<unk>"}, {"\n<s>\n"}, {"\n</s>\n"}};
  for (int b = 0; b < 256; ++b) {
    char name[7];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    v.push_back({name});
  }
  return v;
}

std::string bin_error(std::string const& bytes, std::int32_t vocab_size) {
  Tokenizer t;
  std::string error;
  return Tokenizer::parse_llama2c(std::as_bytes(std::span(bytes.data(), bytes.size())), vocab_size, t, error)
             ? std::string("ok")
             : error;
}

Tokenizer bin_tokenizer(std::vector<BinToken> const& tokens) {
  Tokenizer t;
  std::string const bytes = bin_file(16, tokens);
  std::string error;
  INFO(error);
  REQUIRE(Tokenizer::parse_llama2c(std::as_bytes(std::span(bytes.data(), bytes.size())),
                                   static_cast<std::int32_t>(tokens.size()), t, error));
  return t;
}

// ---- tokenizer.json files written in the test --------------------------------------------------------------------

/// A tokenizer.json with a BPE model: `vocab` and `merges` are the JSON texts inside {} and [], `model` more model
/// members, `top` more top-level members (each a JSON text starting with a member, or empty).
std::string bpe_json(std::string_view vocab, std::string_view merges, std::string_view model = "",
                     std::string_view top = "") {
  std::string s = "{";
  if (!top.empty())
    s += std::string(top) + ", ";
  s += "\"model\": {\"type\": \"BPE\", \"vocab\": {" + std::string(vocab) + "}, \"merges\": [" + std::string(merges) +
       "]";
  if (!model.empty())
    s += ", " + std::string(model);
  return s + "}}";
}

std::string json_error(std::string const& text) {
  Tokenizer t;
  std::string error;
  return Tokenizer::parse_json(text, t, error) ? std::string("ok") : error;
}

Tokenizer json_tokenizer(std::string const& text) {
  Tokenizer t;
  std::string error;
  bool const ok = Tokenizer::parse_json(text, t, error);
  INFO(error);
  REQUIRE(ok);
  return t;
}

/// An added token entry (all fields, as tokenizers writes them).
std::string added(int id, std::string_view content, bool normalized, bool special = true) {
  return "{\"id\": " + std::to_string(id) + ", \"content\": \"" + std::string(content) +
         "\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": " +
         (normalized ? "true" : "false") + ", \"special\": " + (special ? "true" : "false") + "}";
}

// ---- expected values from the oracle -----------------------------------------------------------------------------

struct Case {
  std::string_view text;
  Ids ids;
  std::string_view decoded;  // decode(ids)
};

// Generated by the independent oracle: `python3 tools/reference/tokenizer.py cases --shared ../shared` (from the
// repository root); it prints both tables below. The texts are tokenizer.py's TEXTS.
std::vector<Case> const tinystories_cases = {
    // tinystories-656k/tokenizer.json: {text, ids, decode(ids)}
    {std::string_view("Once upon a time, there was a little girl named Lily.", 53),
     {80, 147, 201, 282, 215, 286, 598, 629, 10},
     std::string_view("Once upon a time, there was a little girl named Lily.", 53)},
    {std::string_view("She said: \"I have 3 cats & 12 dogs!\"\012They're 100% happy.\012\012The end.", 66),
     {80, 892, 174, 1608, 5,  276,  357, 14, 80, 476, 89, 0,   80,  12,   13,  80, 604,
      71, 572, 45,  109,  77, 1758, 12,  11, 11, 0,   80, 405, 122, 1767, 183, 10},
     std::string_view("She said: \"I have 3 cats <unk> 12 dogs!\"\012They're 100<unk> happy.\012\012The end.", 74)},
    {std::string_view("Caf\303\251 na\303\257ve \360\237\230\200 \342\200\224 \346\227\245\346\234\254", 28),
     {80, 28, 53, 58, 0, 80, 557, 0, 218, 0, 80, 0, 80, 0},
     std::string_view("Caf<unk> na<unk>ve <unk> <unk> <unk>", 36)},
    {std::string_view("", 0), {}, std::string_view("", 0)},
    {std::string_view("<|start_story|>Once upon a time", 31),
     {1, 147, 201, 282, 57},
     std::string_view("<|start_story|>Once upon a time", 31)},
    {std::string_view("Hello <|start_story|> world <|end_story|>", 41),
     {80, 1288, 67, 1, 80, 410, 555, 2},
     std::string_view("Hello<|start_story|> world<|end_story|>", 39)},
    {std::string_view("  two  spaces\011and\011tabs  ", 24),
     {80, 80, 80, 1209, 80, 415, 53, 1499, 0, 1059, 0, 292, 54, 89, 80},
     std::string_view("  two  spaces<unk>and<unk>tabs  ", 32)},
    {std::string_view("bad \377\376 bytes \303", 14),
     {80, 1162, 0, 80, 1048, 72, 368, 0},
     std::string_view("bad <unk> bytes <unk>", 21)},
};

std::vector<Case> const tok512_cases = {
    // stories260k/tok512.bin: {text, ids, decode(ids)}
    {std::string_view("Once upon a time, there was a little girl named Lily.", 53),
     {403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426},
     std::string_view(" Once upon a time, there was a little girl named Lily.", 54)},
    {std::string_view("She said: \"I have 3 cats & 12 dogs!\"\012They're 100% happy.\012\012The end.", 66),
     {338, 336, 467, 313, 442, 300, 360, 410, 472, 280, 294, 419, 410, 499, 410, 475, 479, 400, 428, 419, 443,
      436, 13,  434, 260, 422, 439, 276, 410, 475, 477, 477, 501, 393, 426, 13,  13,  434, 260, 344, 264, 426},
     std::string_view(" She said: \"I have 3 cats & 12 dogs!\"\012They're 100% happy.\012\012The end.", 67)},
    {std::string_view("Caf\303\251 na\303\257ve \360\237\230\200 \342\200\224 \346\227\245\346\234\254", 28),
     {410, 457, 412, 431, 485, 297, 412, 198, 178, 360, 410, 243,
      162, 155, 131, 410, 481, 410, 233, 154, 168, 233, 159, 175},
     std::string_view(" Caf\303\251 na\303\257ve \360\237\230\200 \342\200\224 \346\227\245\346\234\254", 29)},
    {std::string_view("", 0), {}, std::string_view("", 0)},
    {std::string_view("<|start_story|>Once upon a time", 31),
     {410, 504, 506, 356, 295, 413, 98, 356, 304, 422, 506, 505, 441, 416, 331, 407, 261, 378},
     std::string_view(" <|start_story|>Once upon a time", 32)},
    {std::string_view("Hello <|start_story|> world <|end_story|>", 41),
     {346, 306, 414, 410, 504, 506, 356, 295, 413, 98,  356, 304, 422, 506,
      505, 263, 304, 341, 410, 504, 506, 367, 98,  356, 304, 422, 506, 505},
     std::string_view(" Hello <|start_story|> world <|end_story|>", 42)},
    {std::string_view("  two  spaces\011and\011tabs  ", 24),
     {410, 410, 259, 424, 414, 410, 262, 427, 412, 331, 419, 12, 412, 264, 12, 413, 412, 430, 419, 410, 410},
     std::string_view("   two  spaces\011and\011tabs  ", 25)},
    {std::string_view("bad \377\376 bytes \303", 14),
     {268, 380, 410, 258, 257, 268, 422, 413, 406, 410, 198},
     std::string_view(" bad \377\376 bytes \303", 15)},
};

}  // namespace

// ---- the real tokenizers -----------------------------------------------------------------------------------------

TEST_CASE("tokenizer: tinystories-656k tokenizer.json matches the oracle", "[tools][tokenizer]") {
  if (!exists(tinystories_json)) {
    WARN("SKIPPED: " << tinystories_json << " is absent (the shared models folder)");
    return;
  }
  Tokenizer t;
  std::string error;
  REQUIRE(Tokenizer::load_json(tinystories_json, t, error));
  CHECK(t.vocab_size() == 2048);
  CHECK(t.bos_id() == 1);  // <|start_story|>, post_processor's template
  CHECK(t.eos_id() == 2);  // <|end_story|>, by name
  for (Case const& c : tinystories_cases) {
    INFO("text: " << c.text);
    CHECK(t.encode(c.text) == c.ids);
    CHECK(decode(t, c.ids) == c.decoded);
  }
  // Lossless where every character is in the vocabulary and no space precedes a special token.
  for (std::string_view text : {"Once upon a time, there was a little girl named Lily.", "",
                                "<|start_story|>Once upon a time", " leading space", "Tom's ball\n\nis red!"})
    CHECK(decode(t, t.encode(text)) == text);
  CHECK(decode(t, {0, 5, -1, 2048}) == "<unk>\"\xEF\xBF\xBD\xEF\xBF\xBD");  // out of range: U+FFFD
}

TEST_CASE("tokenizer: stories260k tok512.bin matches the oracle", "[tools][tokenizer]") {
  if (!exists(tok512_bin)) {
    WARN("SKIPPED: " << tok512_bin << " is absent (the shared models folder)");
    return;
  }
  Tokenizer t;
  std::string error;
  REQUIRE(Tokenizer::load_llama2c(tok512_bin, 512, t, error));
  CHECK(t.vocab_size() == 512);
  CHECK(t.bos_id() == 1);
  CHECK(t.eos_id() == 2);
  for (Case const& c : tok512_cases) {
    INFO("text: " << c.text);
    Ids const ids = t.encode(c.text);
    CHECK(ids == c.ids);
    CHECK(decode(t, c.ids) == c.decoded);
    // run.c's decoder is lossless but for the dummy prefix, which BOS strips.
    if (!c.text.empty()) {
      CHECK(decode(t, ids) == " " + std::string(c.text));
      Ids with_bos = {1};
      with_bos.insert(with_bos.end(), ids.begin(), ids.end());
      CHECK(decode(t, with_bos) == "\n<s>\n" + std::string(c.text));
    }
  }
  CHECK(t.encode(std::string_view("ab\0cd", 5)) == t.encode("ab"));  // a C string: the text ends at NUL
  CHECK(decode(t, {-5, 512}) == "\xEF\xBF\xBD\xEF\xBF\xBD");
  // run.c's decoder would need the file as loaded with another vocab_size: the count must match the file.
  CHECK_HAS(bin_error(slurp(tok512_bin), 511), "bytes after the 511 token records");
  CHECK_HAS(bin_error(slurp(tok512_bin), 513), "truncated");
}

TEST_CASE("tokenizer: long texts encode in near-linear time and round-trip", "[tools][tokenizer]") {
  std::string text;
  for (int i = 0; i < 4000; ++i)
    text += "Once upon a time, there was a little girl named Lily. ";  // 216 000 bytes, one BPE word in 656k
  if (!exists(tinystories_json) && !exists(tok512_bin)) {
    WARN("SKIPPED: " << tinystories_json << " and " << tok512_bin << " are absent (the shared models folder)");
    return;
  }
  if (exists(tinystories_json)) {
    Tokenizer t;
    std::string error;
    REQUIRE(Tokenizer::load_json(tinystories_json, t, error));
    CHECK(decode(t, t.encode(text)) == text);
  }
  if (exists(tok512_bin)) {
    Tokenizer t;
    std::string error;
    REQUIRE(Tokenizer::load_llama2c(tok512_bin, 512, t, error));
    CHECK(decode(t, t.encode(text)) == " " + text);
  }
}

// ---- llama2.c: hand-computed ------------------------------------------------------------------------------------

TEST_CASE("tokenizer: llama2.c merges the highest score first, the leftmost on ties", "[tools][tokenizer]") {
  std::vector<BinToken> v = base_vocab();  // ids 0..258
  v.push_back({" ", 0.0f});                // 259
  v.push_back({"a", 0.0f});                // 260
  v.push_back({"b", 0.0f});                // 261
  v.push_back({" a", 1.0f});               // 262
  v.push_back({"ab", 2.0f});               // 263
  v.push_back({" ab", 3.0f});              // 264
  v.push_back({"ba", 1.0f});               // 265
  // " ab": [' ', a, b]; " a" (1) < "ab" (2): merge ab -> [' ', ab] -> " ab" (3) -> [264].
  CHECK(bin_tokenizer(v).encode("ab") == Ids{264});
  // " aba": [' ', a, b, a]; "ab" (2) beats " a" and "ba" (1) -> [' ', ab, a] -> " ab" -> [" ab", a].
  CHECK(bin_tokenizer(v).encode("aba") == Ids{264, 260});
  // Ties: "bab" -> [' ', b, a, b]: "ba" (1) and "ab" (2): ab wins -> [' ', b, ab]; nothing more.
  CHECK(bin_tokenizer(v).encode("bab") == Ids{259, 261, 263});
  v[263].score = 1.0f;  // "ab" now ties with "ba" and " a"
  // " bab": pairs " b" (absent), "ba" (1), "ab" (1): the leftmost, "ba" -> [' ', ba, b].
  CHECK(bin_tokenizer(v).encode("bab") == Ids{259, 265, 261});
  // " ab": " a" (1) and "ab" (1) tie: the leftmost, " a" -> [" a", b] -> " ab" (3) -> [264].
  CHECK(bin_tokenizer(v).encode("ab") == Ids{264});
  v[264].score = -1e10f;  // run.c's best_score starts at -1e10: a score not above it never merges
  CHECK(bin_tokenizer(v).encode("ab") == Ids{262, 261});
}

TEST_CASE("tokenizer: llama2.c byte fallback, dummy prefix and decode", "[tools][tokenizer]") {
  std::vector<BinToken> v = base_vocab();
  v.push_back({" "});                 // 259
  v.push_back({"\xC3\xA9"});          // 260: "é" is in the vocabulary, "è" is not
  v.push_back({" x"});                // 261
  v.push_back({"x"});                 // 262
  v.push_back({"\xF0\x9F\x98\x80"});  // 263: a 4-byte code point (U+1F600)
  v.push_back({"\x80\x80\x80\x80"});  // 264: four stray continuation bytes, one "code point" for run.c
  Tokenizer const t = bin_tokenizer(v);
  CHECK(t.encode("") == Ids{});                                 // no dummy prefix for the empty text
  CHECK(t.encode("\xC3\xA9") == Ids{259, 260});                 // a code point in the vocabulary
  CHECK(t.encode("\xC3\xA8") == Ids{259, 0xC3 + 3, 0xA8 + 3});  // byte fallback: byte + 3
  CHECK(t.encode("\xF0\x9F\x98\x80") == Ids{259, 263});
  // run.c groups a byte with at most 3 continuation bytes after it, unvalidated: 4 + 1 here.
  CHECK(t.encode("\x80\x80\x80\x80\x80") == Ids{259, 264, 131});
  CHECK(t.encode("\x80\x80\x80") == Ids{259, 131, 131, 131});
  CHECK(t.encode("x") == Ids{261});           // [" ", "x"] merged (score 0 > -1e10)
  CHECK(t.encode("y") == Ids{259, 'y' + 3});  // " <0x79>" is no token: no merge
  // decode: byte pieces give raw bytes; after BOS one leading space is dropped; U+FFFD out of range.
  CHECK(decode(t, {0xC3 + 3, 0xA8 + 3}) == "\xC3\xA8");
  CHECK(decode(t, {1, 261, 261}) == "\n<s>\nx x");
  CHECK(decode(t, {261, 1}) == " x\n<s>\n");
  CHECK(decode(t, {265}) == "\xEF\xBF\xBD");
  CHECK(t.bos_id() == 1);
  CHECK(t.eos_id() == 2);
}

TEST_CASE("tokenizer: llama2.c files are validated", "[tools][tokenizer]") {
  std::vector<BinToken> v = base_vocab();
  v.push_back({" "});
  std::string const good = bin_file(8, v);
  REQUIRE(bin_error(good, 260) == "ok");
  CHECK_HAS(bin_error(good, 258), "vocab_size 258 is out of range (expected 259..");
  CHECK_HAS(bin_error(good, -1), "vocab_size -1 is out of range");
  CHECK_HAS(bin_error(good, 1 << 30), "vocab_size 1073741824 is out of range");
  CHECK_HAS(bin_error(good.substr(0, 3), 260), "too short for the int32 max_token_length");
  CHECK_HAS(bin_error(good.substr(0, good.size() - 1), 260), "token 259: length 1 runs past the end of the file");
  CHECK_HAS(bin_error(good.substr(0, good.size() - 6), 260),
            "token 259: the file ends inside the record's score and length (truncated file)");
  CHECK_HAS(bin_error(good.substr(0, 100), 260), "cannot hold 260 token records");
  CHECK_HAS(bin_error(good + "x", 260), "1 bytes after the 260 token records");
  CHECK_HAS(bin_error(bin_file(0, v), 260), "max_token_length 0 is out of range");
  CHECK_HAS(bin_error(bin_file(1025, v), 260), "max_token_length 1025 is out of range (expected 1..1024)");
  CHECK_HAS(bin_error(bin_file(4, v), 260),
            "token 0: length 5 is out of range (expected 0..4, the file's "
            "max_token_length)");  // "<unk>"
  std::string negative = good;
  std::size_t const last_len = good.size() - 1 - 4;  // the int32 len of the last record (" ")
  negative[last_len] = negative[last_len + 1] = negative[last_len + 2] = negative[last_len + 3] = '\xFF';
  CHECK_HAS(bin_error(negative, 260), "token 259: length -1 is out of range");
  std::vector<BinToken> dup = v;
  dup.push_back({"<0x41>"});
  CHECK_HAS(bin_error(bin_file(8, dup), 261), "token 260: the piece \"<0x41>\" is also token 68");
  std::vector<BinToken> nul = v;
  nul.push_back({std::string("a\0b", 3)});
  CHECK_HAS(bin_error(bin_file(8, nul), 261), "token 260: the piece \"a\\x00b\" contains a NUL byte");
  std::vector<BinToken> no_space = base_vocab();
  no_space.push_back({"x"});
  CHECK_HAS(bin_error(bin_file(8, no_space), 260), "no token is \" \"");
  std::string error;
  Tokenizer t;
  CHECK_FALSE(Tokenizer::load_llama2c("/nonexistent/tok.bin", 512, t, error));
  CHECK_HAS(error, "/nonexistent/tok.bin: cannot open the file for reading");
}

// ---- tokenizer.json: hand-computed -------------------------------------------------------------------------------

TEST_CASE("tokenizer: BPE applies the lowest-rank merge, the leftmost on equal rank", "[tools][tokenizer]") {
  std::string const vocab = R"("a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5, "aa": 6)";
  // "abc": (a b) rank 1, (b c) rank 0 -> a bc; (a bc) is no merge -> [a, bc].
  CHECK(json_tokenizer(bpe_json(vocab, R"("b c", "a b", "ab c")")).encode("abc") == Ids{0, 4});
  // The same merges in the other order: ab c -> abc.
  CHECK(json_tokenizer(bpe_json(vocab, R"("a b", "b c", "ab c")")).encode("abc") == Ids{5});
  // [a, b] arrays (newer files) are the same merges.
  CHECK(json_tokenizer(bpe_json(vocab, R"(["a", "b"], ["b", "c"], ["ab", "c"])")).encode("abc") == Ids{5});
  // "aaa": two (a a) candidates of the same rank: the leftmost -> [aa, a]; "aaaa" -> [aa, aa].
  Tokenizer const t = json_tokenizer(bpe_json(vocab, R"("#version: 0.2", "a a")"));
  CHECK(t.encode("aaa") == Ids{6, 0});
  CHECK(t.encode("aaaa") == Ids{6, 6});
  // A pair listed twice keeps its last rank (tokenizers' map): (a b) at rank 2 loses to (b c) at rank 1.
  CHECK(json_tokenizer(bpe_json(vocab, R"("a b", "b c", "a b")")).encode("abc") == Ids{0, 4});
  // ignore_merges: a word in the vocabulary is one token whatever the merges.
  CHECK(json_tokenizer(bpe_json(vocab, R"("b c")", R"("ignore_merges": true)")).encode("abc") == Ids{5});
  CHECK(json_tokenizer(bpe_json(vocab, R"("b c")", R"("ignore_merges": false)")).encode("abc") == Ids{0, 4});
  // No decoder: tokens joined with spaces (tokenizers' default).
  CHECK(decode(t, {6, 0, 9}) == "aa a \xEF\xBF\xBD");
}

TEST_CASE("tokenizer: BPE byte fallback and unk, as tokenizers' merge_word", "[tools][tokenizer]") {
  std::string const vocab = R"("<unk>": 0, "a": 1, "<0xC3>": 2, "<0xA9>": 3, "<0x61>": 4)";
  std::string const decoders =
      R"("decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]})";
  std::string const fused = R"("unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true)";
  Tokenizer const t = json_tokenizer(bpe_json(vocab, "", fused, decoders));
  CHECK(t.encode("a\xC3\xA9") == Ids{1, 2, 3});  // "é" is not in the vocabulary: its bytes are
  CHECK(t.encode("xya") == Ids{0, 1});           // 'x' and 'y' have no byte tokens: one fused unk
  // A pending unk is added after byte-fallback tokens (tokenizers adds it at the next known character or the end).
  CHECK(t.encode("x\xC3\xA9") == Ids{2, 3, 0});
  CHECK(decode(t, {1, 2, 3}) == "a\xC3\xA9");
  CHECK(decode(t, {2, 1}) ==
        "\xEF\xBF\xBD"
        "a");                        // an incomplete UTF-8 sequence: one U+FFFD per byte
  CHECK(decode(t, {4, 4}) == "aa");  // <0x61> is the byte 'a'
  std::string const unfused = R"("unk_token": "<unk>", "fuse_unk": false, "byte_fallback": false)";
  Tokenizer const u = json_tokenizer(bpe_json(vocab, "", unfused));
  CHECK(u.encode("xya\xC3\xA9") == Ids{0, 0, 1, 0});
  // Neither byte fallback nor unk: an unknown character is dropped.
  CHECK(json_tokenizer(bpe_json(vocab, "")).encode("xay") == Ids{1});
}

TEST_CASE("tokenizer: added tokens are split out before and after normalization", "[tools][tokenizer]") {
  // Prepend "_" + Replace " " -> "_" (as Llama's files with "▁"). <s> is matched in the raw text; <n> is
  // normalized, so matched as "_<n>" in the normalized text (tokenizers normalizes the patterns too).
  std::string const vocab = R"("<s>": 0, "<n>": 1, "_": 2, "a": 3, "<": 4, "n": 5, ">": 6)";
  std::string const top = R"("normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "_"},)"
                          R"( {"type": "Replace", "pattern": {"String": " "}, "content": "_"}]}, "added_tokens": [)" +
                          added(0, "<s>", false) + ", " + added(1, "<n>", true) + "]";
  Tokenizer const t = json_tokenizer(bpe_json(vocab, "", "", top));
  CHECK(t.encode("a<s>a") == Ids{2, 3, 0, 2, 3});  // pieces "a", "<s>", "a": each normalized to "_a"
  CHECK(t.encode("a <n>a") == Ids{2, 3, 1, 3});    // "_a_<n>a": "_<n>" is the added token
  CHECK(t.encode("a<n>") == Ids{2, 3, 4, 5, 6});   // "_a<n>" has no "_<n>": plain characters
  CHECK(t.encode("<n>") == Ids{1});                // "_<n>"
  CHECK(t.encode("") == Ids{});
  CHECK(t.bos_id() == 0);  // <s>, by name
  CHECK(t.eos_id() == -1);
  CHECK(decode(t, {0, 2, 3, 1}) == "<s> _ a <n>");

  // LeftmostLongest: the match that starts first, the longest there; added ids follow the vocabulary's (4, 5, 6).
  Tokenizer const l = json_tokenizer(bpe_json(R"("a": 0, "b": 1, "c": 2, "d": 3)", "", "",
                                              "\"added_tokens\": [" + added(4, "ab", false, false) + ", " +
                                                  added(5, "abc", false, false) + ", " + added(6, "bcd", false) + "]"));
  CHECK(l.vocab_size() == 7);
  CHECK(l.encode("abcd") == Ids{5, 3});  // "abc" (not "ab", not "bcd"), "d"
  CHECK(l.encode("abd") == Ids{4, 3});
  CHECK(l.encode("cbcda") == Ids{2, 6, 0});
  CHECK(decode(l, {5, 6}) == "abc bcd");
}

TEST_CASE("tokenizer: pre-tokenizers split words as tokenizers does", "[tools][tokenizer]") {
  // The GPT-2 split, by hand: contractions, " ?letters", " ?digits", " ?others", spaces before a word kept apart.
  std::string const s = "I'm  here!! 123abc\n\n x";
  std::vector<std::size_t> const lengths = kvc::eval::tokenizer_detail::gpt2_split(s);
  std::vector<std::string> pieces;
  std::size_t at = 0;
  for (std::size_t n : lengths) {
    pieces.push_back(s.substr(at, n));
    at += n;
  }
  CHECK(pieces == std::vector<std::string>{"I", "'m", " ", " here", "!!", " 123", "abc", "\n\n", " x"});

  // ByteLevel: add_prefix_space, then the split, then bytes as GPT-2 characters (' ' is U+0120 "Ġ"); the ByteLevel
  // decoder maps them back.
  std::string const top = R"("pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true},)"
                          R"( "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true})";
  Tokenizer const b = json_tokenizer(bpe_json(R"("\u0120Hi": 0, "!": 1, "\u0120": 2, "\u00c3": 3, "\u00a9": 4,)"
                                              R"( "\u00c3\u00a9": 5)",
                                              R"("\u00c3 \u00a9")", R"("ignore_merges": true)", top));
  CHECK(b.encode("Hi!") == Ids{0, 1});  // " Hi" (a word of the vocabulary: ignore_merges), "!"
  // " é" is one word (non-ASCII counts as a letter): "Ġ", then é's bytes C3 A9 as "Ã" "©", merged.
  CHECK(b.encode(" \xC3\xA9") == Ids{2, 5});
  CHECK(decode(b, {0, 1, 2, 5}) == " Hi! \xC3\xA9");

  // Metaspace "first": " " -> "▁", "▁" prepended to the text's first piece only, a new word at each "▁".
  std::string const meta =
      R"("added_tokens": [)" + added(4, "<s>", false) +
      R"(], "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": true},)"
      R"( "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": true})";
  Tokenizer const m = json_tokenizer(
      bpe_json(R"("\u2581a": 0, "\u2581": 1, "a": 2, "b": 3, "<s>": 4)", "", R"("ignore_merges": true)", meta));
  CHECK(m.encode("a  b") == Ids{0, 1, 1, 3});  // "▁a", "▁", "▁b" -> "▁b" is no token: "▁", "b"
  CHECK(m.encode("<s>a") == Ids{4, 2});        // the piece after <s> does not start the text: no "▁"
  CHECK(decode(m, {0, 1, 0}) == "a  a");       // the first token's "▁" is dropped, the others become " "
}

TEST_CASE("tokenizer: decoders Replace, Strip and Fuse", "[tools][tokenizer]") {
  std::string const top =
      R"("decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "_"},)"
      R"( "content": " "}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 2}]})";
  Tokenizer const t = json_tokenizer(bpe_json(R"("_a": 0, "__": 1, "b_": 2)", "", "", top));
  CHECK(decode(t, {0, 2}) == "ab");        // " ab " -> one leading and the trailing space stripped
  CHECK(decode(t, {1, 1, 0}) == "    a");  // "     a": one leading space only (start 1)
  CHECK(decode(t, {1}) == "");             // "  ": stripping crosses itself: empty (tokenizers panics)
}

TEST_CASE("tokenizer: tokenizer.json files are validated", "[tools][tokenizer]") {
  std::string const vocab = R"("a": 0, "b": 1, "ab": 2)";
  REQUIRE(json_error(bpe_json(vocab, R"("a b")")) == "ok");
  CHECK_HAS(json_error("{\"model\": "), "tokenizer.json: malformed JSON: byte 10: expected a value");
  CHECK_HAS(json_error("[]"), "tokenizer.json: the top level: expected an object, found an array");
  CHECK_HAS(json_error("{}"), "tokenizer.json: model: missing");
  CHECK_HAS(json_error(bpe_json(R"("a": 0, "b": 3)", "")),
            "tokenizer.json: model.vocab[\"b\"]: expected an integer id in 0..1 (the vocabulary has 2 tokens), "
            "found 3");
  CHECK_HAS(json_error(bpe_json(R"("a": 0, "b": -1)", "")), "model.vocab[\"b\"]: expected an integer id");
  CHECK_HAS(json_error(bpe_json(R"("a": 0, "b": 0.5)", "")), "found 0.5");
  CHECK_HAS(json_error(bpe_json(R"("a": 0, "b": 0)", "")), "id 0 is also the id of \"a\" (expected unique ids)");
  CHECK_HAS(json_error(bpe_json(vocab, R"("a c")")), "model.merges[0]: the token \"c\" is not in model.vocab");
  CHECK_HAS(json_error(bpe_json(vocab, R"("b a")")), "model.merges[0]: the merged token \"ba\" is not in model.vocab");
  CHECK_HAS(json_error(bpe_json(vocab, R"("a b c")")), "model.merges[0]: expected \"left right\" with exactly one");
  CHECK_HAS(json_error(bpe_json(vocab, "3")), "model.merges[0]: expected a string \"left right\" or an array");
  CHECK_HAS(json_error(bpe_json(vocab, "", R"("unk_token": "<unk>")")),
            "model.unk_token: \"<unk>\" is not in model.vocab");
  CHECK_HAS(json_error(bpe_json(vocab, "", R"("continuing_subword_prefix": "##")")),
            "model.continuing_subword_prefix: unsupported (expected null)");
  CHECK_HAS(json_error(bpe_json(vocab, "", R"("dropout": 0.1)")), "model.dropout: unsupported");
  CHECK_HAS(json_error(bpe_json(vocab, "", R"("fuse_unk": 1)")), "model.fuse_unk: expected a boolean, found a number");
  CHECK_HAS(json_error(bpe_json(vocab, "", R"("frobnicate": 1)")), "model: unsupported field \"frobnicate\"");
  CHECK_HAS(json_error(R"({"model": {"type": "Unigram", "vocab": []}})"),
            "tokenizer.json: model.type: unsupported model type 'Unigram' (supported: BPE)");
  CHECK_HAS(json_error(bpe_json(vocab, "", "", R"("pre_tokenizer": {"type": "Split", "pattern": {"Regex": "x"}})")),
            "tokenizer.json: pre_tokenizer: unsupported pre_tokenizer type 'Split'");
  CHECK_HAS(json_error(bpe_json(vocab, "", "",
                                R"("pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Digits"}]})")),
            "pre_tokenizer.pretokenizers[0]: unsupported pre_tokenizer type 'Digits'");
  CHECK_HAS(json_error(bpe_json(vocab, "", "", R"("normalizer": {"type": "NFC"})")),
            "normalizer: unsupported normalizer type 'NFC'");
  CHECK_HAS(json_error(bpe_json(vocab, "", "",
                                R"("normalizer": {"type": "Replace", "pattern": {"Regex": " +"}, "content": " "})")),
            "normalizer.pattern: unsupported Regex pattern");
  CHECK_HAS(json_error(bpe_json(vocab, "", "", R"("decoder": {"type": "WordPiece", "prefix": "##"})")),
            "decoder: unsupported decoder type 'WordPiece'");
  CHECK_HAS(
      json_error(bpe_json(vocab, "", "", R"("decoder": {"type": "Strip", "content": "ab", "start": 1, "stop": 0})")),
      "decoder.content: expected one character");
  CHECK_HAS(json_error(bpe_json(vocab, "", "", R"("truncation": {"max_length": 8})")), "truncation: unsupported");
  CHECK_HAS(json_error(bpe_json(vocab, "", "", R"("version": "2.0")")), "version: expected \"1.0\"");
  CHECK_HAS(json_error(bpe_json(vocab, "", "",
                                "\"added_tokens\": [" + added(2, "ab", false) + ", " + added(4, "<x>", false) + "]")),
            "added_tokens[1].id: expected 3 for \"<x>\" (the next id after the vocabulary");
  CHECK_HAS(json_error(bpe_json(vocab, "", "", "\"added_tokens\": [" + added(1, "ab", false) + "]")),
            "added_tokens[0].id: expected 2 for \"ab\" (its id in model.vocab), found 1");
  CHECK_HAS(json_error(bpe_json(vocab, "", "",
                                R"("added_tokens": [{"id": 3, "content": "<x>", "single_word": false, "lstrip": true,)"
                                R"( "rstrip": false, "normalized": false, "special": true}])")),
            "added_tokens[0]: unsupported single_word/lstrip/rstrip true");
  CHECK_HAS(json_error(bpe_json(vocab, "", "", R"("added_tokens": [{"id": 3, "content": "<x>"}])")),
            "added_tokens[0].single_word: missing (expected true or false)");
  CHECK_HAS(json_error(bpe_json(vocab, "", "",
                                "\"added_tokens\": [" + added(3, "<x>", false) + ", " + added(4, "<x>", false) + "]")),
            "added_tokens[1].content: \"<x>\" is matched as \"<x>\", as is the added token 3");
  // Limits against damaged files: long strings, chains of steps that multiply a text's length, huge documents.
  std::string const long_content = "\"" + std::string(1025, 'x') + "\"";
  CHECK_HAS(
      json_error(bpe_json(vocab, "", "", "\"normalizer\": {\"type\": \"Prepend\", \"prepend\": " + long_content + "}")),
      "normalizer.prepend: 1025 bytes, more than the limit of 1024");
  std::string byte_levels;
  for (int i = 0; i < 6; ++i)  // 4^5 = 1024 is the most: the sixth is refused
    byte_levels +=
        std::string(i ? ", " : "") + R"({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true})";
  CHECK_HAS(json_error(bpe_json(vocab, "", "",
                                R"("pre_tokenizer": {"type": "Sequence", "pretokenizers": [)" + byte_levels + "]}")),
            "normalizer, pre_tokenizer: these steps can make a text more than 1024 times longer");
  CHECK(json_error(bpe_json(vocab, "", "",
                            R"("pre_tokenizer": {"type": "Sequence", "pretokenizers": [)" +
                                byte_levels.substr(0, byte_levels.rfind(", {")) + "]}")) == "ok");
  std::string const forty = std::string(40, 'x');  // two Replace steps of 40 times: 1600
  CHECK_HAS(json_error(bpe_json(vocab, "", "",
                                R"("decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": )"
                                R"({"String": "a"}, "content": ")" +
                                    forty + R"("}, {"type": "Replace", "pattern": {"String": "x"}, "content": ")" +
                                    forty + "\"}]}")),
            "decoder: these steps can make a text more than 1024 times longer");
  std::string many = "\"added_tokens\": [";
  for (int i = 0; i < 1025; ++i) {  // 1025 tokens of 1024 bytes: more than 1 MiB of patterns
    std::string content = std::to_string(i);
    content.resize(1024, 'x');
    many += (i ? ", " : "") + added(3 + i, content, false);
  }
  CHECK_HAS(json_error(bpe_json(vocab, "", "", many + "]")),
            "added_tokens[1024]: the added tokens have more than 1048576 bytes in all");
  CHECK_HAS(json_error("[" + std::string(std::size_t{1} << 22, ',') + "]"),
            "tokenizer.json: up to 4194306 JSON values, more than the limit of 4194304");
  std::string error;
  Tokenizer t;
  CHECK_FALSE(Tokenizer::load_json("/nonexistent/tokenizer.json", t, error));
  CHECK_HAS(error, "/nonexistent/tokenizer.json: cannot open the file for reading");
  CHECK(t.vocab_size() == 0);  // a failed load leaves the tokenizer as it was
  CHECK(t.encode("abc").empty());
}

// ---- robustness --------------------------------------------------------------------------------------------------

TEST_CASE("tokenizer: mutated real files are refused or tokenize within range", "[tools][tokenizer]") {
  struct File {
    std::string path;
    bool json;
  };
  int checked = 0, files = 0;
  for (File const& f : {File{tinystories_json, true}, File{tok512_bin, false}}) {
    if (!exists(f.path))
      continue;
    ++files;
    std::string const original = slurp(f.path);
    std::uint64_t state = 0x9E3779B97F4A7C15ull;  // xorshift64: a fixed sequence of mutations
    auto const next = [&] {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      return state;
    };
    for (int round = 0; round < 200; ++round) {
      std::string bytes = original;
      if (round % 4 == 0) {
        bytes.resize(static_cast<std::size_t>(next() % bytes.size()));  // truncated
      } else {
        for (int k = 0; k < 1 + round % 8; ++k)
          bytes[static_cast<std::size_t>(next() % bytes.size())] = static_cast<char>(next() & 0xFF);
      }
      Tokenizer t;
      std::string error;
      bool const ok =
          f.json ? Tokenizer::parse_json(bytes, t, error)
                 : Tokenizer::parse_llama2c(std::as_bytes(std::span(bytes.data(), bytes.size())), 512, t, error);
      if (!ok) {
        CHECK_FALSE(error.empty());
        continue;
      }
      Ids const ids = t.encode("Once upon a time, \xC3\xA9\xFF <|start_story|> 42!");
      for (std::int32_t id : ids)
        CHECK((id >= 0 && id < t.vocab_size()));
      (void)t.decode(ids);
      ++checked;
    }
  }
  if (files == 0)
    WARN("SKIPPED: " << tinystories_json << " and " << tok512_bin << " are absent (the shared models folder)");
  else
    CHECK(checked > 0);  // some mutated files load, so encode/decode ran on them
}
