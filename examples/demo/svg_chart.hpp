#pragma once
/// A small SVG line-chart writer for the demo's results: panels side by side, one polyline per series, a log-scale
/// x axis (keep ratios 5 %, 10 %, 20 % are equally spaced) and a linear y axis. No dependency beyond the standard
/// library; the output is a plain SVG 1.1 file that browsers and GitHub render.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace demo {

struct Series {
  std::string name;
  std::vector<double> x, y;  // same length; x > 0 (log scale)
  bool dashed = false;
};

struct Panel {
  std::string title, x_label, y_label;
  std::vector<Series> series;
  std::vector<double> x_ticks;  // where to label the x axis
  std::string x_tick_suffix;    // e.g. "%"
};

namespace detail {

inline std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '&')
      out += "&amp;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

inline std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

inline std::string label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

/// A "nice" tick step (1, 2 or 5 x 10^k) giving about `target` intervals over `span`.
inline double nice_step(double span, int target) {
  const double raw = span / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * mag) return m * mag;
  return 10.0 * mag;
}

// Colour-blind-safe palette (Okabe-Ito), then greys.
inline const char* colour(std::size_t i) {
  static const char* palette[] = {"#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442",
                                  "#0072B2", "#D55E00", "#CC79A7", "#999999", "#555555"};
  return palette[i % (sizeof palette / sizeof palette[0])];
}

}  // namespace detail

/// Writes `panels` side by side as one SVG; series with the same name get the same colour in every panel and one
/// shared legend on the right.
inline void write_svg(std::ostream& out, const std::vector<Panel>& panels) {
  using detail::num;
  const double pw = 420, ph = 300, left = 60, right = 15, top = 35, bottom = 50, legend_w = 170;
  const double width = static_cast<double>(panels.size()) * pw + legend_w, height = ph;
  std::vector<std::string> names;
  std::vector<bool> dashed;
  for (const Panel& p : panels)
    for (const Series& s : p.series)
      if (std::find(names.begin(), names.end(), s.name) == names.end())
        names.push_back(s.name), dashed.push_back(s.dashed);
  const auto colour_of = [&](const std::string& name) {
    return detail::colour(static_cast<std::size_t>(std::find(names.begin(), names.end(), name) - names.begin()));
  };

  out << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(width) << "\" height=\"" << num(height)
      << "\" viewBox=\"0 0 " << num(width) << " " << num(height) << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  for (std::size_t pi = 0; pi < panels.size(); ++pi) {
    const Panel& p = panels[pi];
    double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
    for (const Series& s : p.series) {
      if (s.x.size() != s.y.size()) throw std::invalid_argument("write_svg: series '" + s.name + "' x/y sizes differ");
      for (std::size_t i = 0; i < s.x.size(); ++i) {
        if (!(s.x[i] > 0) || !std::isfinite(s.y[i]))
          throw std::invalid_argument("write_svg: series '" + s.name + "' has a non-positive x or non-finite y");
        x0 = std::min(x0, s.x[i]), x1 = std::max(x1, s.x[i]);
        y0 = std::min(y0, s.y[i]), y1 = std::max(y1, s.y[i]);
      }
    }
    for (double t : p.x_ticks) x0 = std::min(x0, t), x1 = std::max(x1, t);
    if (!std::isfinite(x0)) continue;  // an empty panel
    y0 = std::min(y0, 0.0);
    if (y1 <= y0) y1 = y0 + 1;
    const double step = detail::nice_step(y1 - y0, 6);
    y0 = std::floor(y0 / step) * step, y1 = std::ceil(y1 / step) * step;
    const double lx0 = std::log(x0), lx1 = std::log(x1) > lx0 ? std::log(x1) : lx0 + 1;
    const double ox = static_cast<double>(pi) * pw + left, ow = pw - left - right, oy = top, oh = ph - top - bottom;
    const auto X = [&](double x) { return ox + (std::log(x) - lx0) / (lx1 - lx0) * ow; };
    const auto Y = [&](double y) { return oy + oh - (y - y0) / (y1 - y0) * oh; };

    out << "<text x=\"" << num(ox + ow / 2) << "\" y=\"20\" text-anchor=\"middle\" font-size=\"13\">"
        << detail::escape(p.title) << "</text>\n";
    for (double y = y0; y <= y1 + step / 2; y += step) {
      out << "<line x1=\"" << num(ox) << "\" x2=\"" << num(ox + ow) << "\" y1=\"" << num(Y(y)) << "\" y2=\""
          << num(Y(y)) << "\" stroke=\"#ddd\"/>\n"
          << "<text x=\"" << num(ox - 6) << "\" y=\"" << num(Y(y) + 4) << "\" text-anchor=\"end\">"
          << detail::label(std::abs(y) < step * 1e-9 ? 0.0 : y) << "</text>\n";
    }
    for (double t : p.x_ticks)
      out << "<line x1=\"" << num(X(t)) << "\" x2=\"" << num(X(t)) << "\" y1=\"" << num(oy) << "\" y2=\""
          << num(oy + oh) << "\" stroke=\"#eee\"/>\n"
          << "<text x=\"" << num(X(t)) << "\" y=\"" << num(oy + oh + 16) << "\" text-anchor=\"middle\">"
          << detail::label(t) << detail::escape(p.x_tick_suffix) << "</text>\n";
    out << "<rect x=\"" << num(ox) << "\" y=\"" << num(oy) << "\" width=\"" << num(ow) << "\" height=\"" << num(oh)
        << "\" fill=\"none\" stroke=\"#333\"/>\n"
        << "<text x=\"" << num(ox + ow / 2) << "\" y=\"" << num(ph - 10) << "\" text-anchor=\"middle\">"
        << detail::escape(p.x_label) << "</text>\n"
        << "<text transform=\"translate(" << num(static_cast<double>(pi) * pw + 14) << " " << num(oy + oh / 2)
        << ") rotate(-90)\" text-anchor=\"middle\">" << detail::escape(p.y_label) << "</text>\n";
    for (const Series& s : p.series) {
      out << "<polyline fill=\"none\" stroke-width=\"2\" stroke=\"" << colour_of(s.name) << "\""
          << (s.dashed ? " stroke-dasharray=\"6 4\"" : "") << " points=\"";
      for (std::size_t i = 0; i < s.x.size(); ++i) out << (i ? " " : "") << num(X(s.x[i])) << "," << num(Y(s.y[i]));
      out << "\"/>\n";
      for (std::size_t i = 0; i < s.x.size(); ++i)
        out << "<circle cx=\"" << num(X(s.x[i])) << "\" cy=\"" << num(Y(s.y[i])) << "\" r=\"3\" fill=\""
            << colour_of(s.name) << "\"/>\n";
    }
  }
  const double lx = static_cast<double>(panels.size()) * pw + 10;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const double y = top + 10 + 18.0 * static_cast<double>(i);
    out << "<line x1=\"" << num(lx) << "\" x2=\"" << num(lx + 22) << "\" y1=\"" << num(y) << "\" y2=\"" << num(y)
        << "\" stroke-width=\"2\" stroke=\"" << colour_of(names[i]) << "\""
        << (dashed[i] ? " stroke-dasharray=\"6 4\"" : "") << "/>\n"
        << "<text x=\"" << num(lx + 28) << "\" y=\"" << num(y + 4) << "\">" << detail::escape(names[i]) << "</text>\n";
  }
  out << "</svg>\n";
}

}  // namespace demo
