// vgpu dashboard: one page, no build step, no third-party code.
// State comes from /api/v1/events (server-sent events): a `snapshot` with the whole picture,
// then `change` batches carrying whole views of the nodes and pods that changed. Every text
// that came from the cluster is set with textContent, never parsed as HTML. The texts
// themselves come from format.js (loaded first).
"use strict";

const state = {
  nodes: new Map(), // name -> NodeView
  pods: new Map(), // uid -> PodView
  pending: [], // the longest waiting, as many as the service shows
  totals: null,
  memoryUnit: null, // ClusterView.memory_unit: the one unit of every memory figure
  receivedAt: 0, // performance.now() when the last batch arrived
};
let renderQueued = false;

// -- small helpers -------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function mib(value) {
  return memory(value, state.memoryUnit);
}

function pct(value) {
  return value === null || value === undefined ? "?" : Math.round(value) + "%";
}

function share(part, whole) {
  return whole > 0 ? Math.max(0, Math.min(100, (100 * part) / whole)) : 0;
}

function duration(seconds) {
  if (!isFinite(seconds)) return "ever";
  if (seconds < 90) return Math.round(seconds) + " s";
  if (seconds < 5400) return Math.round(seconds / 60) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function hue(text) {
  let hash = 0;
  for (const ch of text) hash = (hash * 31 + ch.codePointAt(0)) >>> 0;
  return hash % 360;
}

function sinceBatch() {
  return (performance.now() - state.receivedAt) / 1000;
}

function podKey(namespace, name) {
  return namespace + "/" + name;
}

function selectedPod() {
  const match = /^#pod\/([^/]+)\/(.+)$/.exec(location.hash);
  return match ? podKey(decodeURIComponent(match[1]), decodeURIComponent(match[2])) : null;
}

function showPod(namespace, name) {
  location.hash = "#pod/" + encodeURIComponent(namespace) + "/" + encodeURIComponent(name);
}

// -- rendering -----------------------------------------------------------------------

function renderTotals() {
  const t = state.totals;
  const box = document.getElementById("totals");
  if (!t) return;
  const figure = (value, label, alert) =>
    el("div", { class: "figure" + (alert ? " alert" : "") }, el("b", {}, value), el("span", {}, label));
  box.replaceChildren(
    figure(t.nodes_up + "/" + t.nodes, "nodes up", t.nodes_up < t.nodes),
    figure(t.gpus, "GPUs"),
    figure(mib(t.memory_allocated_mib) + " / " + mib(t.memory_mib), "memory allocated"),
    figure(mib(t.memory_used_mib), "memory used"),
    figure(pct(share(t.cores_allocated, t.cores)), "compute allocated"),
    figure(t.slices, "slices"),
    figure(t.pending_pods, "pending", t.pending_pods > 0),
    figure(mib(t.stranded_memory_mib), "stranded", t.stranded_memory_mib > 0),
  );
}

function sliceTitle(slice, gpu) {
  const used = slice.memory_used_mib === null ? "not reported" : mib(slice.memory_used_mib);
  return [
    podKey(slice.namespace, slice.pod) + " · container " + slice.container,
    "memory asked " + mib(slice.memory_mib) + ", limit " + mib(slice.memory_limit_mib) + ", used " + used,
    "compute asked " + (slice.cores ? slice.cores + "%" : "none (best effort)") +
      ", used " + (slice.sm_util_percent === null ? "not reported" : pct(slice.sm_util_percent)),
    "GPU " + gpu.index + " " + gpu.uuid,
    violationText(slice, state.memoryUnit),
  ].filter(Boolean).join("\n");
}

function sliceElement(slice, gpu, left, width, usedWidth, selected) {
  const key = podKey(slice.namespace, slice.pod);
  const color = hue(key);
  const flags = violationFlags(slice);
  return el(
    "div",
    {
      class: "slice" + (selected === key ? " selected" : "") + (flags.length ? " violation" : "") +
        flags.map((f) => " " + f.kind).join(""),
      "data-pod": key,
      "data-namespace": slice.namespace,
      "data-container": slice.container,
      style: `left:${left}%;width:${width}%;background:hsl(${color} 55% 78%)`,
      title: sliceTitle(slice, gpu),
      onclick: () => showPod(slice.namespace, slice.pod),
    },
    el("span", { class: "used", style: `width:${usedWidth}%;background:hsl(${color} 50% 45%)` }),
    el("span", { class: "label" }, flags.map((f) => el("b", { class: "flag " + f.kind }, f.text)),
      sliceLabel(slice)),
  );
}

function memoryBar(gpu, silent, selected) {
  const bar = el("div", { class: "bar memory", "data-kind": "memory" });
  let left = 0;
  for (const slice of gpu.slices) {
    const width = share(slice.memory_mib, gpu.memory_mib);
    const used = slice.memory_used_mib === null || silent ? 0 : share(slice.memory_used_mib, slice.memory_mib);
    bar.append(sliceElement(slice, gpu, left, width, used, selected));
    left += width;
  }
  if (gpu.stranded_memory_mib > 0) {
    const width = share(gpu.stranded_memory_mib, gpu.memory_mib);
    bar.append(el("div", { class: "stranded", style: `left:${100 - width}%;width:${width}%`,
      title: mib(gpu.stranded_memory_mib) + " free that no pending pod fits" }));
  }
  if (gpu.memory_used_mib !== null && !silent) {
    bar.append(el("div", { class: "gpu-used", style: `width:${share(gpu.memory_used_mib, gpu.memory_mib)}%`,
      title: "used on the GPU: " + mib(gpu.memory_used_mib) }));
  }
  return bar;
}

function computeBar(gpu, silent, selected) {
  const bar = el("div", { class: "bar compute", "data-kind": "compute" });
  let left = 0;
  for (const slice of gpu.slices) {
    if (!slice.cores) continue; // best effort: no share reserved, nothing to draw
    const width = Math.min(slice.cores, 100 - left);
    const used = slice.sm_util_percent === null || silent ? 0 : share(slice.sm_util_percent, slice.cores);
    bar.append(sliceElement(slice, gpu, left, width, used, selected));
    left += width;
  }
  if (gpu.sm_util_percent !== null && !silent) {
    bar.append(el("div", { class: "gpu-used", style: `width:${Math.min(100, gpu.sm_util_percent)}%`,
      title: "SM utilisation of the GPU: " + pct(gpu.sm_util_percent) }));
  }
  return bar;
}

function gpuElement(gpu, silent, selected) {
  const usedText = silent || gpu.memory_used_mib === null ? "used unknown" : "used " + mib(gpu.memory_used_mib);
  const smText = silent || gpu.sm_util_percent === null ? "" : " · SM " + pct(gpu.sm_util_percent);
  return el(
    "div",
    { class: "gpu", "data-uuid": gpu.uuid },
    el("div", { class: "gpu-head" },
      el("span", {}, "GPU " + gpu.index + " · " + gpu.model + " ",
        gpu.healthy ? null : el("span", { class: "badge unhealthy" }, "unhealthy")),
      el("span", { class: "figures" },
        mib(gpu.memory_allocated_mib) + " / " + mib(gpu.memory_mib) + " allocated · " + usedText +
        " · compute " + gpu.cores_allocated + "% allocated" + smText)),
    el("div", { class: "bar-row" }, el("span", { class: "what" }, "memory"), memoryBar(gpu, silent, selected)),
    el("div", { class: "bar-row" }, el("span", { class: "what" }, "compute"), computeBar(gpu, silent, selected)),
  );
}

function nodeElement(node, selected) {
  const silent = node.state !== "up";
  const badge = silent
    ? el("span", { class: "badge silent" }, "silent for " + duration(node.silent_s + sinceBatch()) + " — figures unknown")
    : el("span", { class: "badge" }, "up");
  return el(
    "section",
    { class: "node" + (silent ? " silent" : ""), "data-node": node.name, "data-state": node.state },
    el("div", { class: "node-head" }, el("h2", {}, node.name), badge,
      el("span", { class: "meta" }, node.gpus.length + " GPUs" + (node.agent_version ? " · agent " + node.agent_version : ""))),
    node.gpus.map((gpu) => gpuElement(gpu, silent, selected)),
  );
}

function renderNodes(selected) {
  const box = document.getElementById("nodes");
  const nodes = [...state.nodes.values()].sort((a, b) => a.name.localeCompare(b.name));
  if (!nodes.length) {
    box.replaceChildren(el("p", { class: "empty" }, "Waiting for the first node to report…"));
    return;
  }
  box.replaceChildren(...nodes.map((node) => nodeElement(node, selected)));
}

function asks(requests) {
  return requests
    .filter((r) => r.gpus > 0)
    .map((r) => {
      const memory = r.memory_mib ? mib(r.memory_mib) : r.memory_percent ? r.memory_percent + "% memory" : "whole GPU";
      return r.container + ": " + r.gpus + " × " + memory + (r.cores ? ", " + r.cores + "% compute" : "");
    })
    .join("; ");
}

function renderPending() {
  const list = document.getElementById("pending");
  const total = state.totals ? Math.max(state.totals.pending_pods, state.pending.length) : state.pending.length;
  document.getElementById("pending-count").textContent = count(total);
  document.getElementById("pending-note").textContent = pendingNote(state.pending.length, total);
  if (!state.pending.length) {
    list.replaceChildren(el("li", { class: "empty" }, "No pod is waiting for GPUs."));
    return;
  }
  list.replaceChildren(
    ...state.pending.map((p) =>
      el(
        "li",
        { class: p.unresolvable ? "unresolvable" : "", "data-pod": podKey(p.namespace, p.name) },
        el("span", { class: "who" }, podKey(p.namespace, p.name)),
        el("span", { class: "since" }, "waiting " + duration(p.waiting_s + sinceBatch())),
        el("div", { class: "asks" }, asks(p.requests)),
        el("div", { class: "reason" }, p.summary),
        p.reasons.length > 1 || (p.reasons[0] && p.reasons[0].nodes.length)
          ? el("details", {}, el("summary", {}, "all reasons"),
              el("ul", {}, p.reasons.map((r) => el("li", {},
                r.message + " — " + Math.max(r.node_count, r.nodes.length) + " node(s)" +
                (r.nodes.length ? ": " + r.nodes.join(", ") : "")))))
          : null,
      ),
    ),
  );
}

function renderPods(selected) {
  const body = document.getElementById("pods");
  const pods = [...state.pods.values()].sort((a, b) =>
    podKey(a.namespace, a.name).localeCompare(podKey(b.namespace, b.name)));
  document.getElementById("pods-count").textContent = pods.length;
  body.replaceChildren(
    ...pods.map((p) =>
      el("tr", { class: "pod-row" + (selected === podKey(p.namespace, p.name) ? " selected" : ""),
        "data-pod": podKey(p.namespace, p.name), onclick: () => showPod(p.namespace, p.name) },
        el("td", {}, podKey(p.namespace, p.name)),
        el("td", {}, p.node + (p.node_state === "up" ? "" : " (silent)")),
        el("td", { class: "num" }, mib(p.memory_mib)),
        el("td", { class: "num" }, p.cores + "%"))),
  );
}

function renderPodView(selected) {
  const panel = document.getElementById("pod");
  if (!selected) {
    panel.hidden = true;
    panel.replaceChildren();
    return;
  }
  const pod = [...state.pods.values()].find((p) => podKey(p.namespace, p.name) === selected);
  panel.hidden = false;
  const close = el("a", { class: "close", href: "#", title: "close" }, "×");
  if (!pod) {
    const waiting = state.pending.find((p) => podKey(p.namespace, p.name) === selected);
    panel.replaceChildren(close, el("h2", {}, selected),
      el("p", { class: "empty" }, waiting ? "Waiting for GPUs: " + waiting.summary : "No GPU pod of this name is known."));
    return;
  }
  const value = (v, render) => (v === null || v === undefined ? el("span", { class: "unknown" }, "?") : render(v));
  panel.replaceChildren(
    close,
    el("h2", { "data-pod-view": selected }, selected),
    el("div", { class: "meta" }, "on " + pod.node + (pod.node_state === "up" ? "" : " (node silent: figures unknown)") +
      " · bound " + new Date(pod.bound_at * 1000).toLocaleTimeString() + " · uid " + pod.uid),
    ...pod.containers.flatMap((c) => [
      el("h3", {}, (c.init ? "init container " : "container ") + c.name + " ",
        ...c.devices.flatMap((d) => violationFlags(d).map((f) =>
          el("span", { class: "badge violation " + f.kind,
            title: "GPU " + d.index + ": " + violationText(d, state.memoryUnit) }, f.text))),
        el("span", { class: "meta" }, c.reporting
          ? "· " + c.processes + " process(es) · throttled " + (c.throttled_ms / 1000).toFixed(1) + " s"
          : c.claimed ? "· no report from its hook yet" : "· not started on the node yet")),
      el("table", {},
        el("thead", {}, el("tr", {}, el("th", {}, "GPU"), el("th", { class: "num" }, "mem asked"),
          el("th", { class: "num" }, "limit"), el("th", { class: "num" }, "used"),
          el("th", { class: "num" }, "measured"),
          el("th", { class: "num" }, "compute asked"), el("th", { class: "num" }, "used"))),
        el("tbody", {}, c.devices.map((d) => el("tr", {},
          el("td", { title: d.uuid }, d.index + " · " + d.uuid.slice(0, 12) + "…"),
          el("td", { class: "num" }, mib(d.memory_mib)),
          el("td", { class: "num" }, mib(d.memory_limit_mib)),
          el("td", { class: "num" }, value(d.memory_used_mib, mib)),
          el("td", { class: violationFlags(d).length ? "num violation" : "num" }, value(d.measured_mib, mib)),
          el("td", { class: "num" }, d.cores ? d.cores + "%" : "none"),
          el("td", { class: "num" }, value(d.sm_util_percent, pct)))))),
    ]),
  );
}

function render() {
  renderQueued = false;
  const selected = selectedPod();
  renderTotals();
  renderNodes(selected);
  renderPending();
  renderPods(selected);
  renderPodView(selected);
}

function queueRender() {
  if (!renderQueued) {
    renderQueued = true;
    requestAnimationFrame(render);
  }
}

// -- live updates --------------------------------------------------------------------

function applySnapshot(view) {
  state.nodes = new Map(view.nodes.map((n) => [n.name, n]));
  state.pods = new Map(view.pods.map((p) => [p.uid, p]));
  state.pending = view.pending;
  state.totals = view.totals;
  state.memoryUnit = view.memory_unit || state.memoryUnit;
  state.receivedAt = performance.now();
  queueRender();
}

function applyChange(batch) {
  for (const node of batch.nodes) state.nodes.set(node.name, node);
  for (const name of batch.removed_nodes) state.nodes.delete(name);
  for (const pod of batch.pods) state.pods.set(pod.uid, pod);
  for (const uid of batch.removed_pods) state.pods.delete(uid);
  if (batch.pending !== null) state.pending = batch.pending;
  state.totals = batch.totals;
  state.receivedAt = performance.now();
  queueRender();
}

function setStatus(text, kind) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.className = "status " + kind;
}

// The page is live only while the metrics service hears the bus: without NATS its picture
// stops changing, so the badge says since when it has been cut off instead.
let busDownSince = null;

function showLive() {
  if (busDownSince === null) setStatus("live", "live");
  else setStatus("bus down since " + new Date(busDownSince * 1000).toLocaleTimeString(), "bus-down");
}

function applyBus(bus) {
  busDownSince = bus.connected ? null : (bus.nats_down_since ?? Date.now() / 1000);
  showLive();
}

function connect() {
  const source = new EventSource("/api/v1/events");
  source.addEventListener("open", showLive);
  source.addEventListener("bus", (event) => applyBus(JSON.parse(event.data)));
  source.addEventListener("error", () => {
    if (source.readyState === EventSource.CLOSED) explainRefusal();
    else setStatus("reconnecting…", "reconnecting");
  });
  source.addEventListener("denied", (event) => {
    source.close();
    setStatus(JSON.parse(event.data).error, "reconnecting");
  });
  source.addEventListener("snapshot", (event) => applySnapshot(JSON.parse(event.data)));
  source.addEventListener("change", (event) => applyChange(JSON.parse(event.data)));
}

// The stream was refused (401, 403, 503): say why, sign in again on 401, retry later.
async function explainRefusal() {
  let reason = "disconnected";
  try {
    const response = await fetch("/api/v1/pending", {credentials: "same-origin"});
    if (response.status === 401) {
      window.location.assign("/login");
      return;
    }
    if (!response.ok) reason = (await response.json()).error || response.statusText;
  } catch (error) {
    reason = "the metrics service is unreachable";
  }
  setStatus(reason, "reconnecting");
  setTimeout(connect, 10000);
}

window.addEventListener("hashchange", queueRender);
setInterval(queueRender, 5000); // keeps "silent for" and "waiting" ages moving
connect();
