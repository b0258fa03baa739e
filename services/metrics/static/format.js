// vgpu dashboard: the texts the page shows, as pure functions (no DOM), so that they can be
// checked outside a browser (tests/metrics/test_dashboard_page.py runs them under Node.js).
"use strict";

// Every memory figure on the page goes through memory(), in the one unit the metrics service
// chose (ClusterView.memory_unit): never "512 MiB" beside "40 GiB".
function memory(valueMib, unit) {
  if (valueMib === null || valueMib === undefined) return "?";
  if (unit !== "GiB") return count(Math.round(valueMib)) + " MiB";
  const gib = valueMib / 1024;
  if (gib === 0) return "0 GiB";
  if (Math.abs(gib) < 0.01) return "<0.01 GiB";
  const digits = Math.abs(gib) >= 100 ? 0 : Math.abs(gib) >= 10 ? 1 : 2;
  return count(Number(gib.toFixed(digits))) + " GiB";
}

function count(value) {
  return value.toLocaleString("en-US", { maximumFractionDigits: 2 });
}

// Over the pending list: how many of how many it shows (the service sends the longest
// waiting `pending_shown`; totals.pending_pods counts them all).
function pendingNote(shown, total) {
  if (total <= shown) return "";
  return "showing " + count(shown) + " of " + count(total) + " pending, longest waiting first";
}

// What a slice says in its bar: whose it is, down to the container.
function sliceLabel(slice) {
  return slice.namespace + "/" + slice.pod + " · " + slice.container;
}

// The node agent's standing findings on a slice (or a container's device), as badges.
function violationFlags(piece) {
  const flags = [];
  if (piece.over_limit) flags.push({ kind: "over-limit", text: "over limit" });
  if (piece.tampering) flags.push({ kind: "tampering", text: "tampering" });
  if (piece.over_compute) flags.push({ kind: "over-compute", text: "over compute" });
  return flags;
}

function violationText(piece, unit) {
  const flags = violationFlags(piece);
  if (!flags.length) return "";
  const measured = piece.measured_mib === null || piece.measured_mib === undefined
    ? "" : " (NVML measures " + memory(piece.measured_mib, unit) + ")";
  const reasons = piece.violation_reasons && piece.violation_reasons.length
    ? ": " + piece.violation_reasons.join("; ") : "";
  return flags.map((f) => f.text.toUpperCase()).join(" + ") + measured + reasons;
}

if (typeof module !== "undefined") {
  module.exports = { memory, count, pendingNote, sliceLabel, violationFlags, violationText };
}
