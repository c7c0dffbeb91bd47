// SPDX-License-Identifier: Apache-2.0
// tests/tools/svg_plot_test.cpp mirrors tools/eval/svg_plot.hpp: nice ticks for hand-picked ranges, the data ->
// pixel mapping of known points (plot area x in [64, 480], y in [40, 360], each axis from its first to its last
// tick), well-formedness without an XML library (a tag-stack check), no NaN/Inf in the output, XML escaping, log_y.
#include "eval/svg_plot.hpp"

#include "support/catch.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

using kvc::eval::nice_log_ticks;
using kvc::eval::nice_ticks;
using kvc::eval::PlotSeries;
using kvc::eval::PlotSpec;
using kvc::eval::render_svg;

namespace {

/// Empty when `svg` is well formed as far as this writer goes: every element opened is closed in order (or is
/// self-closing), attribute values are quoted, '&' only starts the five predefined entities. Else what is wrong.
std::string xml_problem(std::string const& svg) {
  std::vector<std::string> open;
  std::size_t i = 0;
  if (svg.rfind("<?xml", 0) == 0)
    i = svg.find("?>") + 2;
  while ((i = svg.find_first_of("<&", i)) != std::string::npos) {
    if (svg[i] == '&') {
      bool known = false;
      for (char const* e : {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"})
        known = known || svg.compare(i, std::strlen(e), e) == 0;
      if (!known)
        return "bare '&' at " + std::to_string(i);
      ++i;
      continue;
    }
    // The tag ends at the first '>' outside quotes.
    std::size_t j = i + 1;
    bool quoted = false;
    for (; j < svg.size() && (quoted || svg[j] != '>'); ++j) {
      if (svg[j] == '"')
        quoted = !quoted;
      if (!quoted && svg[j] == '<')
        return "'<' inside a tag at " + std::to_string(j);
    }
    if (j == svg.size())
      return "unterminated tag at " + std::to_string(i);
    std::string const tag = svg.substr(i + 1, j - i - 1);
    bool const closing = tag[0] == '/', self_closing = tag.back() == '/';
    std::size_t const name_begin = closing ? 1 : 0;
    std::string const name = tag.substr(name_begin, tag.find_first_of(" /", name_begin) - name_begin);
    if (name.empty() || !std::isalpha(static_cast<unsigned char>(name[0])))
      return "bad tag <" + tag + ">";
    if (closing) {
      if (open.empty() || open.back() != name)
        return "</" + name + "> closes " + (open.empty() ? "nothing" : open.back());
      open.pop_back();
    } else if (!self_closing) {
      open.push_back(name);
    }
    i = j + 1;
  }
  if (!open.empty())
    return "<" + open.back() + "> never closed";
  return "";
}

std::size_t count(std::string const& haystack, std::string const& needle) {
  std::size_t n = 0;
  for (std::size_t i = haystack.find(needle); i != std::string::npos; i = haystack.find(needle, i + 1))
    ++n;
  return n;
}

bool has_nan_or_inf(std::string svg) {
  std::transform(svg.begin(), svg.end(), svg.begin(), [](unsigned char c) { return std::tolower(c); });
  return svg.find("nan") != std::string::npos || svg.find("inf") != std::string::npos;
}

}  // namespace

TEST_CASE("svg_plot: nice ticks for hand-picked ranges") {
  // Step: the smallest of 1, 2, 5 x 10^k at least (hi - lo) / 5; ticks from floor(lo / step) to ceil(hi / step).
  CHECK(nice_ticks(0, 0.93) == std::vector<double>{0, 0.2, 0.4, 0.6, 0.8, 1.0});               // 0.186 -> 0.2
  CHECK(nice_ticks(0, 10) == std::vector<double>{0, 2, 4, 6, 8, 10});                          // 2 -> 2
  CHECK(nice_ticks(3, 97) == std::vector<double>{0, 20, 40, 60, 80, 100});                     // 18.8 -> 20
  CHECK(nice_ticks(-0.35, 0.12) == std::vector<double>{-0.4, -0.3, -0.2, -0.1, 0, 0.1, 0.2});  // 0.094 -> 0.1
  CHECK(nice_ticks(1024, 65536) == std::vector<double>{0, 20000, 40000, 60000, 80000});        // 12902 -> 20000
  CHECK(nice_ticks(0.93, 0) == nice_ticks(0, 0.93));                                           // swapped
  CHECK(nice_ticks(0, 1, 2) == std::vector<double>{0, 0.5, 1});                                // target 2: 0.5
  // A bound that is a multiple of the step up to rounding gains no tick: 0.3 / 0.1 = 2.9999999999999996 (floor 2
  // would start at 0.2) and 5e-6 / 1e-6 = 5.000000000000001 (ceil 6 would end at 6e-6).
  CHECK(nice_ticks(0.3, 0.7, 4) == std::vector<double>{0.3, 0.4, 0.5, 0.6, 0.7});
  CHECK(nice_ticks(0, 5e-6) == std::vector<double>{0, 1e-6, 2e-6, 3e-6, 4e-6, 5e-6});
  // One value: widened by 10% each way, [4.5, 5.5] -> step 0.2 -> 4.4 .. 5.6.
  CHECK(nice_ticks(5, 5) == std::vector<double>{4.4, 4.6, 4.8, 5.0, 5.2, 5.4, 5.6});
  CHECK(nice_ticks(0, 0) == std::vector<double>{-1, -0.5, 0, 0.5, 1});  // widened to [-1, 1]: 0.4 -> 0.5
  CHECK(nice_ticks(std::nan(""), 1).empty());
  CHECK(nice_ticks(0, std::numeric_limits<double>::infinity()).empty());
  CHECK(nice_ticks(-1e308, 1e308).empty());  // the span overflows

  CHECK(nice_log_ticks(0.01, 100) == std::vector<double>{0.01, 0.1, 1, 10, 100});
  CHECK(nice_log_ticks(2, 8) == std::vector<double>{1, 10});                      // within one decade: its two ends
  CHECK(nice_log_ticks(1, 1e12) == std::vector<double>{1, 1e3, 1e6, 1e9, 1e12});  // 12 decades: every 3rd
  CHECK(nice_log_ticks(1, 1e11) == std::vector<double>{1, 1e3, 1e6, 1e9, 1e12});  // 11: every 3rd, past 1e11
  CHECK(nice_log_ticks(0, 1).empty());
  CHECK(nice_log_ticks(-1, 1).empty());
}

TEST_CASE("svg_plot: a known point lands on its hand-computed pixel") {
  // x in [0, 1] -> ticks 0 .. 1 (step 0.2); y in [0, 0.93] -> ticks 0 .. 1.0. So (0.5, 0.5) is at
  // x = 64 + 0.5 * (480 - 64) = 272, y = 360 - 0.5 * (360 - 40) = 200, and (1, 0.93) at (480, 360 - 297.6 = 62.4).
  PlotSpec spec{
      "quality vs memory", "kept fraction", "top-1 agreement", false, {{"snapkv", {0, 0.5, 1}, {0, 0.5, 0.93}}}};
  std::string const svg = render_svg(spec);
  INFO(svg);
  CHECK(xml_problem(svg).empty());
  CHECK(svg.find("width=\"640\" height=\"420\"") != std::string::npos);
  CHECK(count(svg, "<circle cx=\"64\" cy=\"360\" r=\"3\"/>") == 1);
  CHECK(count(svg, "<circle cx=\"272\" cy=\"200\" r=\"3\"/>") == 1);
  CHECK(count(svg, "<circle cx=\"480\" cy=\"62.4\" r=\"3\"/>") == 1);
  CHECK(svg.find("points=\"64,360 272,200 480,62.4\"") != std::string::npos);  // the line, in the given order
  // Tick labels with the step's decimals; the 0.6 y tick at 360 - 0.6 * 320 = 168 (label baseline 4 px lower).
  for (char const* label : {">0.0<", ">0.2<", ">0.4<", ">0.6<", ">0.8<", ">1.0<"})
    CHECK(count(svg, label) == 2);
  CHECK(svg.find("<text x=\"56\" y=\"172\" text-anchor=\"end\">0.6</text>") != std::string::npos);
  CHECK(svg.find(">quality vs memory</text>") != std::string::npos);
  CHECK(svg.find(">kept fraction</text>") != std::string::npos);
  CHECK(svg.find(">top-1 agreement</text>") != std::string::npos);
  CHECK(svg.find(">snapkv</text>") != std::string::npos);  // the legend
  CHECK(svg.find("no data") == std::string::npos);
}

TEST_CASE("svg_plot: series get distinct palette colours") {
  PlotSpec spec{"t", "x", "y", false, {}};
  for (int k = 0; k < 3; ++k)
    spec.series.push_back({std::string(1, static_cast<char>('a' + k)), {0, 1}, {k * 1.0, k + 1.0}});
  std::string const svg = render_svg(spec);
  CHECK(xml_problem(svg).empty());
  for (char const* colour : {"#0072B2", "#D55E00", "#009E73"})
    CHECK(count(svg, std::string("stroke=\"") + colour) == 1);
  CHECK(count(svg, "<polyline") == 3);
}

TEST_CASE("svg_plot: non-finite points are skipped and break the line") {
  double const nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
  PlotSpec spec{"t", "x", "y", false, {{"a", {0, 1, 2, nan, 4, 5}, {0, inf, 2, 3, -inf, 5}}}};
  std::string const svg = render_svg(spec);
  INFO(svg);
  CHECK(xml_problem(svg).empty());
  CHECK_FALSE(has_nan_or_inf(svg));
  // Drawable: (0, 0), (2, 2), (5, 5); axes 0 .. 5 both, so pixels (64, 360), (230.4, 232), (480, 40).
  CHECK(count(svg, "<circle cx=") == 3 + 1);  // + the legend marker
  CHECK(svg.find("cx=\"230.4\" cy=\"232\"") != std::string::npos);
  CHECK(count(svg, "<polyline") == 0);  // no two drawable points are adjacent
}

TEST_CASE("svg_plot: names, title and labels are XML-escaped") {
  PlotSpec spec{"a \"b\" & 'c'", "<x>", "y & z", false, {{"k<&>v", {1, 2}, {3, 4}}}};
  std::string const svg = render_svg(spec);
  CHECK(xml_problem(svg).empty());
  CHECK(svg.find(">k&lt;&amp;&gt;v</text>") != std::string::npos);
  CHECK(svg.find(">a &quot;b&quot; &amp; &apos;c&apos;</text>") != std::string::npos);
  CHECK(svg.find(">&lt;x&gt;</text>") != std::string::npos);
  CHECK(svg.find("k<&>v") == std::string::npos);
  CHECK(kvc::eval::xml_escape(std::string("a\x01"
                                          "b\tc")) == "a?b\tc");  // XML 1.0 forbids most control chars
}

TEST_CASE("svg_plot: long legend names are shortened at a character boundary") {
  // 21 characters -> the first 19 and U+2026; "\xC3\xA9" (e acute) is one character of two bytes, never split.
  PlotSpec spec{"t",
                "x",
                "y",
                false,
                {{"abcdefghijklmnopqrstu", {0, 1}, {0, 1}},
                 {"\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9"
                  "\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9<",
                  {0, 1},
                  {1, 0}},
                 {"exactly twenty chars", {0, 1}, {1, 1}}}};
  std::string const svg = render_svg(spec);
  CHECK(xml_problem(svg).empty());
  CHECK(svg.find(">abcdefghijklmnopqrs\xE2\x80\xA6</text>") != std::string::npos);
  std::string nineteen;
  for (int i = 0; i < 19; ++i)
    nineteen += "\xC3\xA9";
  CHECK(svg.find(">" + nineteen + "\xE2\x80\xA6</text>") != std::string::npos);
  CHECK(svg.find(">exactly twenty chars</text>") != std::string::npos);
}

TEST_CASE("svg_plot: log_y skips non-positive values and spaces decades evenly") {
  // Drawable: (3, 0.01), (4, 1), (5, 100); y ticks 0.01 .. 100 (4 decades), x ticks 3, 3.5, .., 5 (step 0.5).
  // (4, 1): x = 64 + 0.5 * 416 = 272; log10(1) is halfway up: y = 360 - 0.5 * 320 = 200.
  PlotSpec spec{"t", "x", "perplexity", true, {{"a", {1, 2, 3, 4, 5}, {0, -1, 0.01, 1, 100}}}};
  std::string const svg = render_svg(spec);
  INFO(svg);
  CHECK(xml_problem(svg).empty());
  CHECK_FALSE(has_nan_or_inf(svg));
  CHECK(count(svg, "<circle cx=") == 3 + 1);
  CHECK(svg.find("<circle cx=\"64\" cy=\"360\"") != std::string::npos);
  CHECK(svg.find("<circle cx=\"272\" cy=\"200\"") != std::string::npos);
  CHECK(svg.find("<circle cx=\"480\" cy=\"40\"") != std::string::npos);
  for (char const* label : {">0.01<", ">0.1<", ">1<", ">10<", ">100<"})
    CHECK(count(svg, label) == 1);
  CHECK(svg.find(">3.5<") != std::string::npos);
}

TEST_CASE("svg_plot: no drawable point gives a valid SVG saying so") {
  for (PlotSpec const& spec : {PlotSpec{}, PlotSpec{"t", "x", "y", false, {{"a", {std::nan("")}, {1}}}},
                               PlotSpec{"t", "x", "y", true, {{"a", {1, 2}, {0, -3}}}}}) {
    std::string const svg = render_svg(spec);
    INFO(svg);
    CHECK(xml_problem(svg).empty());
    CHECK_FALSE(has_nan_or_inf(svg));
    CHECK(svg.find(">no data</text>") != std::string::npos);
    CHECK(svg.rfind("</svg>\n") == svg.size() - 7);
  }
}

TEST_CASE("svg_plot: x and y of different lengths are an error naming the series") {
  PlotSpec spec{"t", "x", "y", false, {{"bad", {1, 2}, {1}}}};
  CHECK_THROWS_AS(render_svg(spec), std::invalid_argument);
  CHECK_THROWS_WITH(render_svg(spec), "render_svg: series 'bad' has 2 x values but 1 y values");
}

TEST_CASE("svg_plot: the tag checker itself rejects broken documents") {
  CHECK(xml_problem("<svg><g></svg>") == "</svg> closes g");
  CHECK(xml_problem("<svg><text>a & b</text></svg>").rfind("bare '&'", 0) == 0);
  CHECK(xml_problem("<svg>") == "<svg> never closed");
  CHECK(xml_problem("<svg><line x=\"1\"/></svg>").empty());
}
