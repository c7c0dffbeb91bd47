// SPDX-License-Identifier: Apache-2.0
// tests/io/json_test.cpp mirrors tools/io/json.hpp: the accepted grammar, every rejection class (with the
// byte offset of the error), UTF-8 and escape decoding against hand-written bytes, to_int64's edges, the depth
// limit, duplicate keys (also in a 200K-member object) and member order.

#include "io/json.hpp"

#include "io/file.hpp"
#include "support/catch.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace json = kvc::json;

namespace {

/// The error of parsing `text`, or "ok".
std::string error_of(std::string const& text, json::ParseLimits limits = {}) {
  json::Value v;
  std::string error;
  if (json::parse(text, v, error, limits))
    return "ok";
  CHECK(!error.empty());
  return error;
}

/// Parses `text`, which must be valid.
json::Value parsed(std::string const& text) {
  json::Value v;
  std::string error;
  INFO(text);
  INFO(error);
  bool const ok = json::parse(text, v, error);
  INFO(error);
  REQUIRE(ok);
  return v;
}

/// The decoded string of the JSON string literal `literal`.
std::string decoded(std::string const& literal) {
  json::Value const v = parsed(literal);
  REQUIRE(v.is_string());
  return v.as_string();
}

bool contains(std::string const& s, std::string const& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("json: scalars, arrays and objects parse to the right kinds and values", "[io][json]") {
  CHECK(parsed("null").is_null());
  CHECK(parsed(" \t\r\n true \n").as_bool());
  CHECK(parsed("false").is_bool());
  CHECK(!parsed("false").as_bool());
  CHECK(!parsed("1").as_bool());  // not a boolean
  json::Value const n = parsed("-12.5e1");
  REQUIRE(n.is_number());
  CHECK(n.number_text() == "-12.5e1");
  CHECK(n.as_double() == -125.0);
  CHECK(parsed("0").as_double() == 0.0);
  CHECK(parsed("0.25").as_double() == 0.25);
  CHECK(parsed("1E+2").as_double() == 100.0);
  CHECK(parsed("5e-1").as_double() == 0.5);
  CHECK(parsed("1e400").as_double() == HUGE_VAL);  // beyond the double range
  CHECK(parsed("-1e400").as_double() == -HUGE_VAL);
  CHECK(parsed("0.000001e-400").as_double() == 0.0);  // below the smallest subnormal
  CHECK(std::signbit(parsed("-1e-400").as_double()));
  CHECK(parsed("\"x\"").number_text().empty());
  CHECK(parsed("\"x\"").as_double() == 0.0);
  CHECK(parsed("1").as_string().empty());

  json::Value const a = parsed("[1, \"two\", [], {}, null]");
  REQUIRE(a.is_array());
  REQUIRE(a.items().size() == 5);
  CHECK(a.items()[0].as_double() == 1.0);
  CHECK(a.items()[1].as_string() == "two");
  CHECK(a.items()[2].is_array());
  CHECK(a.items()[2].items().empty());
  CHECK(a.items()[3].is_object());
  CHECK(a.items()[4].is_null());
  CHECK(a.members().empty());
  CHECK(a.find("x") == nullptr);

  json::Value const o = parsed("{\"b\": 1, \"a\": {\"c\": [true]}}");
  REQUIRE(o.is_object());
  REQUIRE(o.find("a") != nullptr);
  REQUIRE(o.find("a")->find("c") != nullptr);
  CHECK(o.find("a")->find("c")->items().at(0).as_bool());
  CHECK(o.find("c") == nullptr);
  CHECK(o.items().empty());
}

TEST_CASE("json: object members keep file order", "[io][json]") {
  json::Value const o = parsed("{\"z\": 0, \"a\": 1, \"m\": 2, \"b\": 3}");
  REQUIRE(o.members().size() == 4);
  CHECK(o.members()[0].first == "z");
  CHECK(o.members()[1].first == "a");
  CHECK(o.members()[2].first == "m");
  CHECK(o.members()[3].first == "b");
  CHECK(o.members()[2].second.as_double() == 2.0);
}

TEST_CASE("json: to_int64 accepts exactly the integers that fit int64", "[io][json]") {
  std::int64_t out = 42;
  CHECK(json::to_int64(parsed("9223372036854775807"), out));
  CHECK(out == INT64_MAX);
  CHECK(json::to_int64(parsed("-9223372036854775808"), out));
  CHECK(out == INT64_MIN);
  out = 42;
  CHECK(!json::to_int64(parsed("9223372036854775808"), out));
  CHECK(!json::to_int64(parsed("-9223372036854775809"), out));
  CHECK(out == 42);  // untouched on refusal
  CHECK(json::to_int64(parsed("-0"), out));
  CHECK(out == 0);
  CHECK(!json::to_int64(parsed("1.0"), out));
  CHECK(!json::to_int64(parsed("1e3"), out));
  CHECK(!json::to_int64(parsed("1E3"), out));
  CHECK(!json::to_int64(parsed("\"7\""), out));
  CHECK(!json::to_int64(parsed("true"), out));
  CHECK(!json::to_int64(json::Value(), out));
  CHECK(json::to_int64(parsed("123"), out));
  CHECK(out == 123);
}

TEST_CASE("json: escapes and UTF-8 decode to the hand-written bytes", "[io][json]") {
  CHECK(decoded(R"("a\"b\\c\/d\be\ff\ng\rh\ti")") == "a\"b\\c/d\be\ff\ng\rh\ti");
  CHECK(decoded(R"("\u0041\u00e9\u20AC")") == "A\xC3\xA9\xE2\x82\xAC");  // A, e-acute (U+00E9), euro (U+20AC)
  CHECK(decoded(R"("\u0000")") == std::string(1, '\0'));
  CHECK(decoded(R"("\u07FF\u0800\uFFFF")") == "\xDF\xBF\xE0\xA0\x80\xEF\xBF\xBF");
  // U+1F600 = D83D DE00: 0xF0 0x9F 0x98 0x80. U+10FFFF = DBFF DFFF: 0xF4 0x8F 0xBF 0xBF. U+10000 = D800 DC00.
  CHECK(decoded(R"("\uD83D\uDE00")") == "\xF0\x9F\x98\x80");
  CHECK(decoded(R"("\udbff\udfff")") == "\xF4\x8F\xBF\xBF");
  CHECK(decoded(R"("\uD800\uDC00")") == "\xF0\x90\x80\x80");
  // Raw UTF-8 passes through unchanged: 2, 3 and 4 byte forms at their edges, and DEL (0x7F) is not a control.
  std::string const raw = "\xC2\x80\xDF\xBF\xE0\xA0\x80\xED\x9F\xBF\xEE\x80\x80\xF0\x90\x80\x80\xF4\x8F\xBF\xBF\x7F";
  CHECK(decoded("\"" + raw + "\"") == raw);
  CHECK(decoded("\"\"").empty());
}

TEST_CASE("json: invalid UTF-8 in strings is refused", "[io][json]") {
  for (std::string const bad : {
           "\x80",              // a stray continuation byte
           "\xC0\xAF",          // overlong '/'
           "\xC1\xBF",          // overlong
           "\xE0\x80\xAF",      // overlong 3-byte
           "\xF0\x80\x80\xAF",  // overlong 4-byte
           "\xED\xA0\x80",      // U+D800 encoded in UTF-8
           "\xED\xBF\xBF",      // U+DFFF encoded in UTF-8
           "\xF4\x90\x80\x80",  // U+110000
           "\xF5\x80\x80\x80",  // lead byte beyond U+10FFFF
           "\xFF",              // never valid
           "\xC3",              // truncated 2-byte form (the quote follows)
           "\xE2\x82",          // truncated 3-byte form
       }) {
    INFO(json::printable(bad));
    std::string const e = error_of("\"" + bad + "\"");
    CHECK(contains(e, "byte 1: invalid UTF-8"));
  }
}

TEST_CASE("json: escape errors: lone surrogates, bad hex, unknown escapes", "[io][json]") {
  CHECK(contains(error_of(R"("\uD800")"), "byte 1: lone high surrogate"));
  CHECK(contains(error_of(R"("\uD800x")"), "lone high surrogate"));
  CHECK(contains(error_of(R"("\uD800\u0041")"), "lone high surrogate"));
  CHECK(contains(error_of(R"("\uD800\uD800")"), "lone high surrogate"));
  CHECK(contains(error_of(R"("ab\uDC00")"), "byte 3: lone low surrogate"));
  CHECK(contains(error_of(R"("\u12G4")"), "byte 5: expected 4 hex digits"));
  CHECK(contains(error_of(R"("\u12")"), "expected 4 hex digits"));
  CHECK(contains(error_of(R"("\x41")"), "byte 1: invalid escape sequence"));
  CHECK(contains(error_of(R"("\')"), "invalid escape sequence"));
  CHECK(contains(error_of("\"\\"), "unterminated escape"));
}

TEST_CASE("json: grammar violations are refused with the byte offset", "[io][json]") {
  CHECK(contains(error_of(""), "byte 0: expected a value, found the end of the text"));
  CHECK(contains(error_of("   "), "byte 3: expected a value"));
  CHECK(contains(error_of("{\"a\" 1}"), "byte 5: expected ':' after an object key"));
  CHECK(contains(error_of("[1,]"), "byte 3: trailing comma before ']'"));
  CHECK(contains(error_of("{\"a\":1,}"), "byte 7: trailing comma before '}'"));
  CHECK(contains(error_of("[1 2]"), "byte 3: expected ',' or ']'"));
  CHECK(contains(error_of("{\"a\":1 \"b\":2}"), "byte 7: expected ',' or '}'"));
  CHECK(contains(error_of("{a:1}"), "byte 1: expected a string key"));
  CHECK(contains(error_of("{1:1}"), "expected a string key"));
  CHECK(contains(error_of("['a']"), "byte 1: unexpected '''"));
  CHECK(contains(error_of("[1] x"), "byte 4: unexpected 'x' after the JSON value"));
  CHECK(contains(error_of("1 2"), "after the JSON value"));
  CHECK(contains(error_of("[1"), "byte 2: expected ',' or ']' after an array element, found the end of the text"));
  CHECK(contains(error_of("{\"a\":1"), "expected ',' or '}'"));
  CHECK(contains(error_of("\"abc"), "byte 0: unterminated string"));
  // Comments, NaN and Infinity, capitalised or shortened literals.
  CHECK(contains(error_of("// c\n1"), "byte 0: unexpected '/'"));
  CHECK(contains(error_of("[1 /* c */]"), "expected ',' or ']'"));
  CHECK(error_of("NaN") != "ok");
  CHECK(error_of("Infinity") != "ok");
  CHECK(error_of("-Infinity") != "ok");
  CHECK(error_of("True") != "ok");
  CHECK(error_of("nul") != "ok");
  CHECK(error_of("truex") != "ok");
  // Whitespace other than space, tab, LF, CR; a byte order mark.
  CHECK(contains(error_of("\f1"), "byte 0: unexpected byte 0x0c"));
  CHECK(contains(error_of("\xEF\xBB\xBF{}"), "byte 0: unexpected UTF-8 byte order mark"));
  CHECK(contains(error_of("[\xC3\xA9]"), "byte 1: unexpected byte 0xc3"));
  // A NUL inside the text is a byte like any other: it ends nothing.
  CHECK(contains(error_of(std::string("1\0", 2)), "byte 1: unexpected byte 0x00"));
}

TEST_CASE("json: numbers follow the RFC grammar exactly", "[io][json]") {
  CHECK(contains(error_of("01"), "byte 0: a number with a leading zero"));
  CHECK(contains(error_of("-01"), "byte 1: a number with a leading zero"));
  CHECK(contains(error_of("00.5"), "leading zero"));
  CHECK(contains(error_of("-"), "byte 1: expected a digit after '-'"));
  CHECK(contains(error_of("-a"), "expected a digit after '-'"));
  CHECK(contains(error_of("1."), "byte 2: expected a digit after the decimal point"));
  CHECK(contains(error_of("1.e5"), "expected a digit after the decimal point"));
  CHECK(contains(error_of("1e"), "byte 2: expected a digit in the exponent"));
  CHECK(contains(error_of("1e+"), "byte 3: expected a digit in the exponent"));
  CHECK(error_of(".5") != "ok");
  CHECK(error_of("+1") != "ok");
  CHECK(error_of("0x10") != "ok");
  CHECK(error_of("1_000") != "ok");
  CHECK(error_of("-0") == "ok");
  CHECK(error_of("-0.0e-0") == "ok");
  CHECK(error_of("0e0") == "ok");
}

TEST_CASE("json: control characters in strings are refused, escaped ones accepted", "[io][json]") {
  CHECK(contains(error_of("\"a\nb\""), "byte 2: unescaped control character byte 0x0a"));
  CHECK(contains(error_of("\"\t\""), "unescaped control character"));
  CHECK(contains(error_of(std::string("\"\0\"", 3)), "byte 1: unescaped control character byte 0x00"));
  CHECK(contains(error_of("\"\x1f\""), "unescaped control character"));
  CHECK(decoded("\"\\u001f\"") == "\x1f");
}

TEST_CASE("json: duplicate keys are refused, in small and 200K-member objects", "[io][json]") {
  CHECK(contains(error_of("{\"a\":1,\"b\":2,\"a\":3}"), "byte 13: duplicate object key \"a\""));
  CHECK(contains(error_of("{\"x\":{\"k\":1,\"k\":1}}"), "byte 12: duplicate object key \"k\""));
  // Keys equal after decoding are duplicates: "\u0061" is "a".
  CHECK(contains(error_of("{\"a\":1,\"\\u0061\":2}"), "duplicate object key \"a\""));
  // Same key in different objects is fine; "a" and "a\u0000" differ.
  CHECK(error_of("[{\"a\":1},{\"a\":2}]") == "ok");
  CHECK(error_of("{\"a\":1,\"a\\u0000\":2}") == "ok");
  // A key with control bytes is quoted printably in the message.
  CHECK(contains(error_of("{\"\\u001b[31m\":1,\"\\u001b[31m\":2}"), "duplicate object key \"\\x1b[31m\""));

  // A tokenizer-vocabulary-sized object: 200000 distinct keys parse quickly; one repeat at the end is found.
  std::string big = "{";
  for (int i = 0; i < 200000; ++i)
    big += (i ? ",\"tok" : "\"tok") + std::to_string(i) + "\":" + std::to_string(i);
  auto const start = std::chrono::steady_clock::now();
  json::Value const v = parsed(big + "}");
  double const seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  REQUIRE(v.members().size() == 200000);
  CHECK(v.members()[199999].first == "tok199999");
  CHECK(v.find("tok123456")->as_double() == 123456.0);
  CHECK(seconds < 10.0);  // linearithmic; a quadratic check would take minutes even in Release
  CHECK(contains(error_of(big + ",\"tok77\":0}"), "duplicate object key \"tok77\""));
}

TEST_CASE("json: nesting is refused beyond max_depth, and a deep refusal does not overflow the stack", "[io][json]") {
  auto nested = [](int n) {
    return std::string(static_cast<std::size_t>(n), '[') + std::string(static_cast<std::size_t>(n), ']');
  };
  CHECK(error_of(nested(128)) == "ok");
  CHECK(contains(error_of(nested(129)), "byte 128: nesting deeper than the limit of 128"));
  CHECK(contains(error_of(nested(5), json::ParseLimits{4}), "byte 4: nesting deeper than the limit of 4"));
  CHECK(error_of(nested(4), json::ParseLimits{4}) == "ok");
  std::string objects;
  for (int i = 0; i < 3; ++i)
    objects += "{\"k\":";
  CHECK(contains(error_of(objects + "1}}}", json::ParseLimits{2}), "nesting deeper than the limit of 2"));
  CHECK(error_of(objects + "1}}}", json::ParseLimits{3}) == "ok");
  CHECK(contains(error_of("[]", json::ParseLimits{0}), "nesting deeper than the limit of 0"));
  CHECK(error_of("7", json::ParseLimits{0}) == "ok");
  // A million open brackets: refused at the limit, not a stack overflow; the limit is clamped to kMaxDepth.
  std::string const deep(1000000, '[');
  CHECK(contains(error_of(deep), "nesting deeper than the limit of 128"));
  CHECK(contains(error_of(deep, json::ParseLimits{1 << 30}), "nesting deeper than the limit of 1024"));
  CHECK(error_of(nested(1024), json::ParseLimits{1 << 30}) == "ok");
}

TEST_CASE("json: a 10 MB document parses in linear time", "[io][json]") {
  std::string text = "[";
  while (text.size() < 10'000'000)
    text += "{\"id\":12345,\"name\":\"caf\\u00e9 \xE2\x82\xAC\",\"v\":[1.5e-3,-2,true,null]},";
  text.back() = ']';
  auto const start = std::chrono::steady_clock::now();
  json::Value const v = parsed(text);
  double const seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  REQUIRE(v.items().size() > 100000);
  CHECK(v.items().back().find("name")->as_string() == "caf\xC3\xA9 \xE2\x82\xAC");
  CHECK(v.items().back().find("v")->items()[0].as_double() == 1.5e-3);
  CHECK(seconds < 20.0);  // a few hundred ms in Release; generous for Debug + sanitizers
}

TEST_CASE("json: append_string escapes and refuses invalid UTF-8, printable quotes bytes", "[io][json]") {
  std::string out;
  REQUIRE(json::append_string(out, std::string("a\"b\\c\n\x01\xC3\xA9", 9)));
  CHECK(out == "\"a\\\"b\\\\c\\n\\u0001\xC3\xA9\"");
  CHECK(decoded(out) == std::string("a\"b\\c\n\x01\xC3\xA9", 9));  // it reads back
  std::string bad = "keep";
  CHECK(!json::append_string(bad, "\xC0\xAF"));
  CHECK(bad == "keep");
  CHECK(json::printable("a\x1b[0m\\") == "a\\x1b[0m\\x5c");
  CHECK(json::printable(std::string(100, 'x'), 10) == std::string(10, 'x') + "...");
}

TEST_CASE("json: the real tinystories-656k tokenizer.json and config.json parse", "[io][json]") {
  std::string const dir = std::string(KVC_SHARED_DIR) + "/models/tinystories-656k/";
  std::vector<std::byte> tok, cfg;
  std::string error;
  if (!kvc::read_regular_file(dir + "tokenizer.json", tok, error) ||
      !kvc::read_regular_file(dir + "config.json", cfg, error)) {
    WARN("SKIPPED: " + dir + " lacks tokenizer.json or config.json");
    return;
  }
  // Expected values from python3's json module: a BPE model with 2048 vocabulary entries and 1967 merges.
  json::Value t;
  REQUIRE(json::parse(std::string_view(reinterpret_cast<char const*>(tok.data()), tok.size()), t, error));
  json::Value const* model = t.find("model");
  REQUIRE(model != nullptr);
  CHECK(model->find("type")->as_string() == "BPE");
  json::Value const* vocab = model->find("vocab");
  REQUIRE(vocab != nullptr);
  REQUIRE(vocab->members().size() == 2048);
  CHECK(vocab->members()[0].first == "<unk>");
  CHECK(vocab->members()[3].first == "\n");
  std::int64_t id = -1;
  REQUIRE(vocab->find("dog\xE2\x96\x81named\xE2\x96\x81Max") != nullptr);  // U+2581 LOWER ONE EIGHTH BLOCK
  CHECK(json::to_int64(*vocab->find("dog\xE2\x96\x81named\xE2\x96\x81Max"), id));
  CHECK(id == 2047);
  CHECK(model->find("merges")->items().size() == 1967);

  json::Value c;
  REQUIRE(json::parse(std::string_view(reinterpret_cast<char const*>(cfg.data()), cfg.size()), c, error));
  CHECK(c.find("rms_norm_eps")->as_double() == 1e-6);
  CHECK(c.find("rope_scaling")->is_null());
  CHECK(c.find("tie_word_embeddings")->as_bool());
  REQUIRE(json::to_int64(*c.find("vocab_size"), id));
  CHECK(id == 2048);
  CHECK(c.find("architectures")->items().at(0).as_string() == "LlamaForCausalLM");
}

TEST_CASE("json: values copy and move whole, including onto themselves and from their own parts", "[io][json]") {
  json::Value const original = parsed("{\"a\": [1, \"two\", {\"b\": null}], \"s\": \"text that is not short at all\"}");
  json::Value copy = original;  // deep copy
  REQUIRE(copy.members().size() == 2);
  CHECK(copy.find("a")->items().at(1).as_string() == "two");
  CHECK(copy.find("s")->as_string() == "text that is not short at all");
  CHECK(&copy.find("a")->items() != &original.find("a")->items());  // not shared
  json::Value moved = std::move(copy);
  CHECK(moved.find("a")->items().at(2).find("b")->is_null());
  CHECK(moved.find("s")->as_string() == "text that is not short at all");
  json::Value assigned;
  assigned = moved;
  CHECK(assigned.find("a")->items().size() == 3);
  json::Value& self = assigned;
  assigned = self;  // self copy-assignment keeps the value
  CHECK(assigned.find("a")->items().size() == 3);
  assigned = *assigned.find("a");  // from a part of itself: the part is copied before the whole is replaced
  REQUIRE(assigned.is_array());
  CHECK(assigned.items().at(0).number_text() == "1");
  assigned = json::Value();
  CHECK(assigned.is_null());
  CHECK(assigned.items().empty());
  CHECK(original.find("s")->as_string() == "text that is not short at all");  // the source is untouched
}
