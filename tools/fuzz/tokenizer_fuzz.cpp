// SPDX-License-Identifier: Apache-2.0
// tools/fuzz/tokenizer_fuzz.cpp: libFuzzer harness for kvc-eval's tokenizer parsers (tools/eval/tokenizer.hpp,
// defined in tokenizer.cpp, tokenizer_json.cpp and tokenizer_detail.cpp, compiled with the fuzzer's instrumentation
// as kvc_eval_readers_fuzz): tokenizer.json and llama2.c's tokenizer.bin are untrusted input, and a file that loads
// must then encode and decode any text without a crash, a hang or an id out of range.
//   cmake -DCMAKE_CXX_COMPILER=clang++ -DKVC_BUILD_FUZZERS=ON ... && ninja kvc_tokenizer_fuzz &&
//   ./tools/kvc_tokenizer_fuzz -max_total_time=60 -max_len=131072 CORPUS_DIR
// Input layout: byte 0: the format (even: tokenizer.json, odd: tokenizer.bin); bytes 1-2: tokenizer.bin's
// vocab_size (uint16, little-endian); byte 3: n, the length of the text to encode; the next n bytes: the text; the
// rest: the file. (A seed from a real file: "\x00\x00\x00\x00" + tokenizer.json, "\x01\x00\x02\x00" + tok512.bin.)
#include "eval/tokenizer.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  if (size < 4)
    return 0;
  bool const json = data[0] % 2 == 0;
  auto const vocab_size = static_cast<std::int32_t>(data[1] | data[2] << 8);
  std::size_t const text_size = std::min<std::size_t>(data[3], size - 4);
  std::string_view const text(reinterpret_cast<char const*>(data + 4), text_size);
  std::span<std::byte const> const file(reinterpret_cast<std::byte const*>(data + 4 + text_size), size - 4 - text_size);

  kvc::eval::Tokenizer t;
  std::string error;
  bool const ok = json ? kvc::eval::Tokenizer::parse_json(
                             std::string_view(reinterpret_cast<char const*>(file.data()), file.size()), t, error)
                       : kvc::eval::Tokenizer::parse_llama2c(file, vocab_size, t, error);
  if (!ok) {
    if (error.empty())
      std::abort();  // every rejection says why
    return 0;
  }
  if (t.vocab_size() <= 0)
    std::abort();
  for (std::string_view s : {text, std::string_view("Once upon a time, <|start_story|> \xC3\xA9\xF0\x9F\x98\x80!")}) {
    std::vector<std::int32_t> ids = t.encode(s);
    for (std::int32_t id : ids)
      if (id < 0 || id >= t.vocab_size())
        std::abort();  // encode gives ids in range
    (void)t.decode(ids);
  }
  // Decoding arbitrary ids, in range or not, never fails: the text's bytes read as ids.
  std::vector<std::int32_t> ids;
  for (std::size_t i = 0; i + 1 < text.size(); i += 2)
    ids.push_back(
        static_cast<std::int32_t>(static_cast<std::uint8_t>(text[i]) | static_cast<std::uint8_t>(text[i + 1]) << 8) -
        256);
  (void)t.decode(ids);
  return 0;
}
