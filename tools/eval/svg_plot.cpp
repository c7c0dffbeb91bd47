// SPDX-License-Identifier: Apache-2.0
// tools/eval/svg_plot.cpp: the SVG line-chart writer (svg_plot.hpp): ticks, escaping, the document.
#include "eval/svg_plot.hpp"

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

namespace svg_detail {

inline constexpr double kWidth = 640, kHeight = 420;
inline constexpr double kLeft = 64, kRight = 480, kTop = 40, kBottom = 360;  // the plot area

// Okabe & Ito's colour-blind-safe palette, yellow last (it is faint on white); series past 8 reuse colours.
inline constexpr char const* kPalette[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7",
                                           "#E69F00", "#56B4E9", "#000000", "#F0E442"};

/// 10^e computed so that decimal multiples come out as the nearest double (k * 0.2 would give 0.6000000000000001;
/// k * 2 / 10 is correctly rounded, so ticks compare equal to the literals 0.6 etc.).
double scale10(double integer, int e) {
  return e >= 0 ? integer * std::pow(10.0, e) : integer / std::pow(10.0, -e);
}

/// A pixel coordinate: two decimals at most, trailing zeros dropped ("272", "62.4"). Callers pass finite values
/// on the canvas (never negative, so never "-0").
std::string px(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  std::string s = buf;
  s.erase(s.find_last_not_of('0') + 1);
  if (s.back() == '.')
    s.pop_back();
  return s;
}

/// Tick labels: as many decimals as the tick step needs (0.2 -> "0.2", 20000 -> "20000"), %g for extreme scales.
std::string tick_label(double v, double step) {
  char buf[32];
  int const decimals = std::max(0, -static_cast<int>(std::floor(std::log10(step) + 1e-9)));
  if (std::abs(v) >= 1e7 || decimals > 6) {
    std::snprintf(buf, sizeof buf, "%g", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  }
  return buf;
}

/// A legend entry has about 125 px beside the plot: names past 20 characters (UTF-8 code points, never split) keep
/// their first 19 and an ellipsis, rather than run off the canvas.
std::string legend_name(std::string const& name) {
  std::size_t chars = 0, cut = name.size();
  for (std::size_t i = 0; i < name.size(); ++i) {
    if ((static_cast<unsigned char>(name[i]) & 0xC0) == 0x80)
      continue;  // a continuation byte
    if (++chars == 20)
      cut = i;
    if (chars > 20)
      return name.substr(0, cut) + "\xE2\x80\xA6";  // U+2026, the ellipsis
  }
  return name;
}

}  // namespace svg_detail

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi) || !std::isfinite(hi - lo))
    return {};
  if (lo > hi)
    std::swap(lo, hi);
  if (lo == hi) {  // one value: give it some room rather than divide by a zero span
    double const pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  double const raw = (hi - lo) / std::max(target, 1);
  int e = static_cast<int>(std::floor(std::log10(raw)));
  double m = 10;  // the smallest of 1, 2, 5, 10 (times 10^e) that is at least raw
  for (double const c : {1.0, 2.0, 5.0}) {
    if (svg_detail::scale10(c, e) >= raw * (1 - 1e-12)) {
      m = c;
      break;
    }
  }
  if (m == 10) {
    m = 1;
    ++e;
  }
  double const step = svg_detail::scale10(m, e);
  // The 1e-9 slack keeps a bound that is a multiple of the step up to rounding from gaining an extra tick:
  // 0.3 / 0.1 = 2.9999999999999996 would floor to 2, 5e-6 / 1e-6 = 5.000000000000001 would ceil to 6.
  auto const first = static_cast<long long>(std::floor(lo / step + 1e-9));
  auto const last = static_cast<long long>(std::ceil(hi / step - 1e-9));
  std::vector<double> ticks;
  for (long long k = first; k <= last; ++k)
    ticks.push_back(svg_detail::scale10(static_cast<double>(k) * m, e));
  return ticks;
}

std::vector<double> nice_log_ticks(double lo, double hi, int target) {
  if (!(lo > 0) || !(hi > 0) || !std::isfinite(lo) || !std::isfinite(hi))
    return {};
  if (lo > hi)
    std::swap(lo, hi);
  int const e0 = static_cast<int>(std::floor(std::log10(lo) + 1e-9));
  int e1 = std::max(static_cast<int>(std::ceil(std::log10(hi) - 1e-9)), e0 + 1);
  int const every = std::max(1, (e1 - e0 + target - 1) / std::max(target, 1));
  e1 = e0 + (e1 - e0 + every - 1) / every * every;  // end on a labelled decade
  std::vector<double> ticks;
  for (int e = e0; e <= e1; e += every)
    ticks.push_back(svg_detail::scale10(1, e));
  return ticks;
}

std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char const c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        bool const forbidden = static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r';
        out += forbidden ? '?' : c;
    }
  }
  return out;
}

std::string render_svg(PlotSpec const& spec) {
  using namespace svg_detail;
  for (auto const& s : spec.series) {
    if (s.x.size() != s.y.size()) {
      throw std::invalid_argument("render_svg: series '" + s.name + "' has " + std::to_string(s.x.size()) +
                                  " x values but " + std::to_string(s.y.size()) + " y values");
    }
  }
  auto const drawable = [&](double x, double y) {
    return std::isfinite(x) && std::isfinite(y) && (!spec.log_y || y > 0);
  };
  // The data range over the points that will be drawn.
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = -INFINITY;
  for (auto const& s : spec.series) {
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      if (!drawable(s.x[i], s.y[i]))
        continue;
      x_lo = std::min(x_lo, s.x[i]);
      x_hi = std::max(x_hi, s.x[i]);
      y_lo = std::min(y_lo, s.y[i]);
      y_hi = std::max(y_hi, s.y[i]);
    }
  }
  std::vector<double> const x_ticks = nice_ticks(x_lo, x_hi);
  std::vector<double> const y_ticks = spec.log_y ? nice_log_ticks(y_lo, y_hi) : nice_ticks(y_lo, y_hi);

  std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + px(kWidth) + "\" height=\"" + px(kHeight) +
         "\" viewBox=\"0 0 " + px(kWidth) + " " + px(kHeight) + "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  out += "<rect x=\"0\" y=\"0\" width=\"" + px(kWidth) + "\" height=\"" + px(kHeight) + "\" fill=\"white\"/>\n";
  auto const text = [&](double x, double y, std::string_view anchor, std::string_view s, std::string_view extra = "") {
    out += "<text x=\"" + px(x) + "\" y=\"" + px(y) + "\" text-anchor=\"" + std::string(anchor) + "\"" +
           std::string(extra) + ">" + xml_escape(s) + "</text>\n";
  };
  auto const line = [&](double x1, double y1, double x2, double y2) {
    out += "<line x1=\"" + px(x1) + "\" y1=\"" + px(y1) + "\" x2=\"" + px(x2) + "\" y2=\"" + px(y2) + "\"/>\n";
  };
  text((kLeft + kRight) / 2, 24, "middle", spec.title, " font-size=\"15\" font-weight=\"bold\"");
  text((kLeft + kRight) / 2, kHeight - 12, "middle", spec.x_label);
  double const y_mid = (kTop + kBottom) / 2;
  text(16, y_mid, "middle", spec.y_label, " transform=\"rotate(-90 16 " + px(y_mid) + ")\"");

  if (x_ticks.size() < 2 || y_ticks.size() < 2) {  // nothing drawable (or a range too wide to scale)
    out += "<rect x=\"" + px(kLeft) + "\" y=\"" + px(kTop) + "\" width=\"" + px(kRight - kLeft) + "\" height=\"" +
           px(kBottom - kTop) + "\" fill=\"none\" stroke=\"#888\"/>\n";
    text((kLeft + kRight) / 2, y_mid, "middle", "no data", " fill=\"#888\"");
    return out + "</svg>\n";
  }

  // Data to pixels. A log axis maps log10(y) linearly.
  auto const ty = [&](double y) { return spec.log_y ? std::log10(y) : y; };
  double const x0 = x_ticks.front(), x1 = x_ticks.back(), y0 = ty(y_ticks.front()), y1 = ty(y_ticks.back());
  auto const map_x = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * (kRight - kLeft); };
  auto const map_y = [&](double y) { return kBottom - (ty(y) - y0) / (y1 - y0) * (kBottom - kTop); };

  // Grid, axes, ticks and tick labels.
  out += "<g stroke=\"#e0e0e0\">\n";
  for (double const t : x_ticks)
    line(map_x(t), kTop, map_x(t), kBottom);
  for (double const t : y_ticks)
    line(kLeft, map_y(t), kRight, map_y(t));
  out += "</g>\n<g stroke=\"black\">\n";
  line(kLeft, kBottom, kRight, kBottom);
  line(kLeft, kTop, kLeft, kBottom);
  for (double const t : x_ticks)
    line(map_x(t), kBottom, map_x(t), kBottom + 5);
  for (double const t : y_ticks)
    line(kLeft - 5, map_y(t), kLeft, map_y(t));
  out += "</g>\n";
  double const x_step = x_ticks[1] - x_ticks[0];
  for (double const t : x_ticks)
    text(map_x(t), kBottom + 18, "middle", tick_label(t, x_step));
  for (std::size_t i = 0; i < y_ticks.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", y_ticks[i]);
    std::string const label = spec.log_y ? buf : tick_label(y_ticks[i], y_ticks[1] - y_ticks[0]);
    text(kLeft - 8, map_y(y_ticks[i]) + 4, "end", label);
  }

  // Series: a polyline per run of drawable points, a marker at each, then the legend entry.
  for (std::size_t k = 0; k < spec.series.size(); ++k) {
    auto const& s = spec.series[k];
    std::string const colour = kPalette[k % std::size(kPalette)];
    out += "<g stroke=\"" + colour + "\" fill=\"" + colour + "\">\n";
    std::string points, markers;
    std::size_t run = 0;  // points in the current polyline
    auto const flush = [&] {
      if (run >= 2)
        out += "<polyline fill=\"none\" stroke-width=\"1.5\" points=\"" + points + "\"/>\n";
      points.clear();
      run = 0;
    };
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      if (!drawable(s.x[i], s.y[i])) {
        flush();
        continue;
      }
      std::string const cx = px(map_x(s.x[i])), cy = px(map_y(s.y[i]));
      points += (run++ ? " " : "") + cx + "," + cy;
      markers += "<circle cx=\"" + cx + "\" cy=\"" + cy + "\" r=\"3\"/>\n";
    }
    flush();
    out += markers;
    double const ly = kTop + 8 + 18 * static_cast<double>(k);
    line(kRight + 10, ly, kRight + 28, ly);
    out += "<circle cx=\"" + px(kRight + 19) + "\" cy=\"" + px(ly) + "\" r=\"3\"/>\n</g>\n";
    text(kRight + 34, ly + 4, "start", legend_name(s.name), " font-size=\"11\"");
  }
  return out + "</svg>\n";
}

}  // namespace kvc::eval
