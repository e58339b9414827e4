// The ticks of a chart's axis, for the console's server page (detail.js) and the trajectory viewer's metrics page
// (viewer.js): round values, evenly spaced, and a span that rounding noise cannot blow up.
"use strict";

// An axis's ticks: about ``count`` round values (1, 2 or 5 times a power of ten apart) that cover [lo, hi]. A span
// under MIN_SPAN of the values' size (or absolute, around zero) is widened to it, so that rounding noise (±2e-17
// around 0) draws as the flat line it is, not as swings across the chart.
const MIN_SPAN = 1e-6, MIN_ABS_SPAN = 1e-9;

function ticks(lo, hi, count, whole) {
  const least = Math.max(MIN_ABS_SPAN, MIN_SPAN * Math.max(Math.abs(lo), Math.abs(hi)), whole ? 1 : 0);
  if (hi - lo < least) { const mid = (lo + hi) / 2; lo = mid - least / 2; hi = mid + least / 2; }
  const rough = (hi - lo) / count;
  const power = 10 ** Math.floor(Math.log10(rough));
  const f = rough / power;
  let step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * power;
  if (whole) step = Math.max(1, Math.round(step));
  const first = Math.floor(lo / step + 1e-9) * step, last = Math.ceil(hi / step - 1e-9) * step;
  const values = [];
  for (let i = 0; first + i * step <= last + step * 1e-9; i++) values.push(first + i * step);
  return { lo: first, hi: last, step, values };
}

function tickText(v, step) {
  if (Math.abs(v) < step * 1e-6) return "0";
  if (Math.abs(v) >= 1e5 || step < 1e-4) return v.toExponential(Math.max(0, Math.floor(Math.log10(Math.abs(v)))
    - Math.floor(Math.log10(step))));
  return v.toFixed(Math.max(0, -Math.floor(Math.log10(step))));
}
