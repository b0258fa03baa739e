// Renders the dashboard's real scripts (format.js, dashboard.js) outside a browser: a small
// document with the elements index.html names, an EventSource that hands over the snapshot
// read from stdin, then the page's own render(). Prints {id: outerHTML} of every element with
// an id as JSON. Used by tests/metrics/test_dashboard_page.py where no browser is installed;
// tests/browser runs the same page in Chromium where one is.
"use strict";

const fs = require("fs");
const path = require("path");
const vm = require("vm");

const STATIC = path.join(__dirname, "..", "..", "services", "metrics", "static");

class Node {}

class Text extends Node {
  constructor(data) {
    super();
    this.data = String(data);
  }
  get outerHTML() {
    return this.data.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }
  get textContent() {
    return this.data;
  }
}

class Element extends Node {
  constructor(tag) {
    super();
    this.tagName = tag;
    this.attributes = new Map();
    this.children = [];
    this.className = "";
    this.style = { cssText: "" };
    this.hidden = false;
    this.listeners = {};
  }
  setAttribute(key, value) {
    this.attributes.set(key, String(value));
  }
  getAttribute(key) {
    return this.attributes.has(key) ? this.attributes.get(key) : null;
  }
  addEventListener(kind, handler) {
    (this.listeners[kind] = this.listeners[kind] || []).push(handler);
  }
  append(...nodes) {
    for (const node of nodes) this.children.push(node instanceof Node ? node : new Text(node));
  }
  replaceChildren(...nodes) {
    this.children = [];
    this.append(...nodes);
  }
  set textContent(value) {
    this.children = [new Text(value)];
  }
  get textContent() {
    return this.children.map((c) => c.textContent).join("");
  }
  get outerHTML() {
    const attrs = [];
    if (this.className) attrs.push(`class="${this.className}"`);
    if (this.style.cssText) attrs.push(`style="${this.style.cssText}"`);
    if (this.hidden) attrs.push("hidden");
    for (const [key, value] of this.attributes) attrs.push(`${key}="${value.replace(/"/g, "&quot;")}"`);
    const open = [this.tagName, ...attrs].join(" ");
    return `<${open}>${this.children.map((c) => c.outerHTML).join("")}</${this.tagName}>`;
  }
}

// Every element index.html gives an id, so a script that needs one the page lacks fails here.
const page = fs.readFileSync(path.join(STATIC, "index.html"), "utf8");
const byId = {};
for (const match of page.matchAll(/<(\w+)[^>]*\sid="([^"]+)"/g)) byId[match[2]] = new Element(match[1]);

const sources = [];
class EventSource {
  constructor(url) {
    this.url = url;
    this.readyState = 1;
    this.listeners = {};
    sources.push(this);
  }
  addEventListener(kind, handler) {
    (this.listeners[kind] = this.listeners[kind] || []).push(handler);
  }
  close() {
    this.readyState = 2;
  }
  emit(kind, data) {
    for (const handler of this.listeners[kind] || []) handler({ data: JSON.stringify(data) });
  }
}
EventSource.CLOSED = 2;

const context = vm.createContext({
  document: {
    createElement: (tag) => new Element(tag),
    createTextNode: (text) => new Text(text),
    getElementById: (id) => byId[id] || null,
  },
  window: { addEventListener() {}, location: { assign() {} } },
  location: { hash: process.argv[2] || "" },
  performance: { now: () => 0 },
  requestAnimationFrame: (callback) => callback(),
  setInterval: () => 0,
  setTimeout: () => 0,
  fetch: () => Promise.reject(new Error("no network here")),
  EventSource,
  Node,
  console,
});
for (const name of ["format.js", "dashboard.js"]) {
  vm.runInContext(fs.readFileSync(path.join(STATIC, name), "utf8"), context, { filename: name });
}
const snapshot = JSON.parse(fs.readFileSync(0, "utf8"));
sources[0].emit("snapshot", snapshot);
sources[0].emit("bus", { connected: true, nats_down_since: null });
const rendered = {};
for (const [id, element] of Object.entries(byId)) rendered[id] = element.outerHTML;
process.stdout.write(JSON.stringify(rendered));
