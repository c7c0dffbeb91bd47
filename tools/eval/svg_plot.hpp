// SPDX-License-Identifier: Apache-2.0
// tools/eval/svg_plot.hpp: a tiny SVG line-chart writer, so that kvc-eval can draw its quality-against-memory plots
// without gnuplot or any other dependency. One function, render_svg, turns a PlotSpec into a standalone SVG
// document; nice_ticks and nice_log_ticks (the axis ticks) and xml_escape are exposed for the tests.
//
// Layout (pixels, fixed so that the tests can compute positions by hand): 640 x 420 canvas; plot area x in
// [64, 480], y in [40, 360] (y grows downwards); the legend to the right of the plot area, the title above it, the
// axis labels below and to the left. Each axis spans exactly from its first to its last tick.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kvc::eval {

struct PlotSeries {
  std::string name;
  std::vector<double> x, y;  // one line with markers; points drawn in the given order
};

struct PlotSpec {
  std::string title, x_label, y_label;
  bool log_y = false;
  std::vector<PlotSeries> series;
};

/// Ticks at multiples of a "nice" step (1, 2 or 5 times 10^k) chosen so that about `target` steps cover [lo, hi];
/// the first tick is <= lo and the last >= hi, e.g. [0, 0.93] -> 0, 0.2, 0.4, 0.6, 0.8, 1.0. lo > hi is swapped; a
/// single value is widened to an interval around it. Empty when lo or hi (or their distance) is not finite.
std::vector<double> nice_ticks(double lo, double hi, int target = 5);

/// Ticks for a log axis over positive [lo, hi]: powers of ten from 10^floor(log10 lo) to 10^ceil(log10 hi) (at least
/// two), every k-th decade when more than about `target` decades are spanned. Empty unless 0 < lo, hi < inf.
std::vector<double> nice_log_ticks(double lo, double hi, int target = 5);

/// Escapes text for XML content or attributes; control characters XML 1.0 forbids become '?'.
std::string xml_escape(std::string_view s);

/// A complete standalone SVG document (640 x 420 px): axes with nice ticks and labels, one colour per series from a
/// colour-blind-safe palette, markers at the points joined by lines in the given order, a legend, the title.
/// Points with a non-finite coordinate (or y <= 0 when log_y) are skipped and break the line there. A spec with no
/// drawable point gives a valid SVG with a "no data" note. Throws std::invalid_argument when a series' x and y
/// differ in length. The legend has room for about 17 series and 20-character names (longer ones are shortened).
std::string render_svg(PlotSpec const& spec);

}  // namespace kvc::eval
