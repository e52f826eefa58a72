// A small loss chart: one SVG polyline, scaled to the values so far.
const SVG = "http://www.w3.org/2000/svg";

export function lossChart(losses, width = 180, height = 44) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("class", "loss-chart");
  svg.setAttribute("role", "img");
  const values = losses.filter((v) => Number.isFinite(v));
  svg.setAttribute("aria-label", values.length ? `loss from ${values[0].toFixed(3)} to ${values.at(-1).toFixed(3)}` : "no loss yet");
  if (values.length === 0) return svg;
  const lo = Math.min(...values), hi = Math.max(...values);
  const pad = 3;
  const x = (i) => pad + (values.length === 1 ? 0 : (i * (width - 2 * pad)) / (values.length - 1));
  const y = (v) => pad + (hi === lo ? (height - 2 * pad) / 2 : ((hi - v) * (height - 2 * pad)) / (hi - lo));
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", values.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "currentColor");
  line.setAttribute("stroke-width", "1.6");
  svg.append(line);
  const dot = document.createElementNS(SVG, "circle");
  dot.setAttribute("cx", x(values.length - 1).toFixed(1));
  dot.setAttribute("cy", y(values.at(-1)).toFixed(1));
  dot.setAttribute("r", "2.4");
  dot.setAttribute("fill", "currentColor");
  svg.append(dot);
  return svg;
}
