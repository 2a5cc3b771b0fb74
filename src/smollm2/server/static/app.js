// The page: a chat over POST /v1/chat/completions (streamed, with log-probabilities), and a view inside the model
// over POST /inspect, and with dictionaries served (smollm2 serve --sae), their features (/inspect/features,
// /inspect/feature) and attribution graphs (/inspect/graph). It uses nothing but the server's documented HTTP API.
"use strict";

const $ = (id) => document.getElementById(id);
const KINDS = {  // the kinds of operation of a profile, and their colors
  product: "#4f46e5", attention: "#0ea5e9", norm: "#f59e0b", activation: "#10b981",
  residual: "#a1a1aa", embedding: "#ec4899", sampling: "#ef4444",
};
const SETTINGS = ["system", "temperature", "top-p", "max-tokens", "seed", "stop", "show-probs",
  "steer-on", "steer-toward", "steer-away", "steer-layer", "steer-scale"];

const state = {
  key: localStorage.getItem("smollm2.key") || "",
  models: [],     // /v1/models' data
  messages: [],   // {role, content, tokens: [{text, logprob, top}], element}
  controller: null,  // aborts the answer streaming now
  inspection: null,  // {request, label, data, attention: {layer: heads}, profile, features: {sae: data}, graph}
  dictionaries: {data: [], graphs: false},  // /inspect/dictionaries
};

// The HTTP API.

async function api(path, body, signal) {
  const headers = {"Content-Type": "application/json"};
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  const response = await fetch(path, {
    method: body === undefined ? "GET" : "POST", headers, signal,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 401) {
    $("key-dialog").showModal();
    throw new Error("The server asks for an API key.");
  }
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

async function* serverSentEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") return;
        yield JSON.parse(line.slice(6));
      }
    }
  }
}

function model() { return $("model").value; }
function meta() { return (state.models.find((m) => m.id === model()) || {}).meta || {}; }

async function loadModels() {
  const models = await (await api("/v1/models")).json();
  state.models = models.data;
  $("model").replaceChildren(...state.models.map((m) => new Option(m.id, m.id)));
  showModel();
  state.dictionaries = await (await api("/inspect/dictionaries")).json();
  $("features-sae").replaceChildren(...state.dictionaries.data.map((d) => new Option(d.name, d.name)));
  document.querySelector("#tabs [data-tab=features]").hidden = !state.dictionaries.data.length;
  document.querySelector("#tabs [data-tab=graph]").hidden = !state.dictionaries.graphs;
}

function showModel() {
  const {n_layer, n_embd, n_ctx_train} = meta();
  $("status").textContent = n_layer ? `${n_layer} layers · width ${n_embd} · context ${n_ctx_train}` : "";
  $("steer-layer").max = n_layer - 1;
}

// A token's text as the page shows it: line breaks and tabs marked, a token of spaces alone as ␣.
function shown(text) {
  if (/^ +$/.test(text)) return "␣".repeat(text.length);
  return text.replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";
}
function percent(p) {
  return p >= 0.995 ? "100%" : p >= 0.01 ? `${(100 * p).toFixed(1)}%` : `${(100 * p).toPrecision(2)}%`;
}
function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "style" || name === "dataset") Object.assign(node[name], value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node[name] = value;
  }
  node.append(...children);
  return node;
}

// A tooltip that follows the pointer.
function tip(event, content) {
  const box = $("tooltip");
  box.replaceChildren(content);
  box.hidden = false;
  const x = Math.min(event.clientX + 14, innerWidth - box.offsetWidth - 8);
  const below = event.clientY + 18 + box.offsetHeight <= innerHeight;
  const y = below ? event.clientY + 18 : event.clientY - box.offsetHeight - 10;
  box.style.left = `${x}px`;
  box.style.top = `${y}px`;
}
function untip() { $("tooltip").hidden = true; }

function alternatives(title, rows) {  // rows: [text, probability, chosen]
  return el("div", {}, el("div", {className: "title"}, title),
    el("table", {}, ...rows.map(([text, p, chosen]) => el("tr", {},
      el("td", {style: {fontWeight: chosen ? "700" : "400"}}, shown(text)), el("td", {className: "p"}, percent(p))))));
}

// Surprise: the less likely a token was, the warmer its shade.
function surpriseShade(p) { return `rgba(245, 158, 11, ${(0.6 * (1 - p)).toFixed(3)})`; }
function heatShade(p) { return `rgba(var(--heat), ${Math.min(1, p).toFixed(3)})`; }

// The chat.

function settings() {
  const body = {
    model: model(), stream: true, logprobs: true, top_logprobs: 5,
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value) || undefined,
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const stop = $("stop").value.split("\n").filter((s) => s);
  if (stop.length) body.stop = stop;
  if ($("steer-on").checked) {
    body.steering = {layer: Number($("steer-layer").value), toward: $("steer-toward").value,
      away: $("steer-away").value, scale: Number($("steer-scale").value)};
  }
  return body;
}

function conversation(upTo = state.messages.length) {
  const chat = state.messages.slice(0, upTo).map(({role, content}) => ({role, content}));
  const system = $("system").value.trim();
  return system ? [{role: "system", content: system}, ...chat] : chat;
}

function addMessage(role, content) {
  const message = {role, content, tokens: []};
  const index = state.messages.length;
  message.element = el("div", {className: `message ${role}`},
    el("div", {className: "who"}, role === "user" ? "You" : "Model"), el("div", {className: "body"}));
  if (role === "assistant") {
    message.actions = el("div", {className: "actions"},
      el("button", {className: "ghost", textContent: "Inspect",
        onclick: () => inspect({messages: conversation(index + 1)}, "this answer, in its chat")}));
    message.element.append(message.actions);
  }
  $("empty").hidden = true;
  $("messages").append(message.element);
  state.messages.push(message);
  renderMessage(message);
  return message;
}

function renderMessage(message) {
  const body = message.element.querySelector(".body");
  if (!$("show-probs").checked || !message.tokens.length) {
    body.textContent = message.content;
  } else {  // each token a span, as far as the tokens spell the text (a stop string or EOS ends it)
    let rest = message.content;
    const spans = [];
    for (const token of message.tokens) {
      if (!token.text || !rest.startsWith(token.text)) break;
      rest = rest.slice(token.text.length);
      const p = Math.exp(token.logprob);
      spans.push(el("span", {
        className: "tok", textContent: token.text, style: {background: surpriseShade(p)},
        onmousemove: (event) => tip(event, alternatives(`${shown(token.text)}  ${percent(p)}`,
          token.top.map((t) => [t.token, Math.exp(t.logprob), t.token === token.text]))),
        onmouseleave: untip,
      }));
    }
    body.replaceChildren(...spans, rest);
  }
  const scroller = $("messages");
  const atBottom = scroller.scrollHeight - scroller.scrollTop - scroller.clientHeight < 120;
  if (atBottom) scroller.scrollTop = scroller.scrollHeight;
}

async function send(text) {
  addMessage("user", text);
  const request = {...settings(), messages: conversation()};
  const answer = addMessage("assistant", "");
  const bytes = new TextDecoder();  // tokens' bytes -> text, a character split across tokens shown once whole
  answer.element.classList.add("streaming");
  state.controller = new AbortController();
  setBusy(true);
  let note = "";
  try {
    const response = await api("/v1/chat/completions", request, state.controller.signal);
    for await (const chunk of serverSentEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      if (!choice) continue;
      for (const lp of (choice.logprobs && choice.logprobs.content) || []) {
        answer.tokens.push({text: bytes.decode(new Uint8Array(lp.bytes), {stream: true}), logprob: lp.logprob,
          top: lp.top_logprobs});
      }
      answer.content += choice.delta.content || "";
      if (choice.finish_reason) note = choice.finish_reason === "length" ? "cut at max tokens" : "";
      renderMessage(answer);
    }
  } catch (error) {
    note = error.name === "AbortError" ? "stopped" : "";
    if (error.name !== "AbortError") answer.element.append(el("div", {className: "error", textContent: error.message}));
  } finally {
    answer.element.classList.remove("streaming");
    const probability = answer.tokens.length
      ? Math.exp(answer.tokens.reduce((sum, t) => sum + t.logprob, 0) / answer.tokens.length) : null;
    answer.actions.append(`${answer.tokens.length} tokens`
      + (probability ? ` · mean probability ${percent(probability)}` : "")
      + (note ? ` · ${note}` : "") + (request.steering ? " · steered" : ""));
    state.controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-button").hidden = !busy;
}

// The view inside the model.

async function inspect(request, label) {
  state.inspection = {request, label, data: null, attention: {}, profile: null, features: {}, graph: null};
  $("inspector").hidden = false;
  $("inspect-what").textContent = label;
  $("inspect-error").hidden = true;
  for (const id of ["token-strip", "token-detail", "lens-grid", "attention-strip", "time-view", "features-view",
    "feature-detail", "graph-view"]) {
    $(id).replaceChildren();
  }
  $("token-strip").append(el("div", {className: "loading", textContent: "Running the model, layer by layer…"}));
  const inspection = state.inspection;
  try {
    const data = await (await api("/inspect", {model: model(), top_k: 5, ...request})).json();
    if (state.inspection !== inspection) return;
    inspection.data = data;
    renderTokens();
    renderLens();
    const layers = data.logit_lens.length - 1;
    $("attention-layer").replaceChildren(...Array.from({length: layers}, (_, l) => new Option(`${l}`, l)));
    showTab(document.querySelector("#tabs .active").dataset.tab);
  } catch (error) {
    showInspectError(error);
  }
}

function showInspectError(error) {
  $("inspect-error").textContent = error.message;
  $("inspect-error").hidden = false;
  for (const node of document.querySelectorAll("#inspector .loading")) node.remove();
}

function showTab(name) {
  for (const button of document.querySelectorAll("#tabs button")) {
    button.classList.toggle("active", button.dataset.tab === name);
  }
  for (const tab of ["tokens", "lens", "attention", "time", "features", "graph"]) $(`tab-${tab}`).hidden = tab !== name;
  const inspection = state.inspection;
  if (!inspection || !inspection.data) return;
  if (name === "attention") loadAttention();
  if (name === "time" && !inspection.profile) loadProfile();
  if (name === "features") loadFeatures();
  if (name === "graph" && !inspection.graph && !$("graph-view").children.length) {
    $("graph-view").replaceChildren(el("p", {className: "hint",
      textContent: "Trace the graph of this prompt: seconds to a minute, a backward pass per batch of features."}));
  }
}

function renderTokens() {
  const {tokens} = state.inspection.data;
  const strip = $("token-strip");
  strip.replaceChildren(...tokens.map((token, i) => {
    const p = token.logprob === null ? null : Math.exp(token.logprob);
    return el("span", {
      className: "tok", textContent: token.text, style: {background: p === null ? "transparent" : surpriseShade(p)},
      onclick: (event) => {
        for (const node of strip.children) node.classList.remove("selected");
        event.target.classList.add("selected");
        showToken(i);
      },
      onmousemove: (event) => tip(event, el("div", {},
        `${shown(token.text)}  ${p === null ? "(first: nothing predicts it)" : percent(p)}`)),
      onmouseleave: untip,
    });
  }));
}

function showToken(i) {
  const token = state.inspection.data.tokens[i];
  if (token.logprob === null) {
    $("token-detail").replaceChildren(el("p", {className: "hint",
      textContent: "The first token: nothing before it predicts it."}));
    return;
  }
  const rows = token.top.map((t) => el("tr", {className: t.id === token.id ? "chosen" : ""},
    el("td", {className: "text", textContent: shown(t.text)}),
    el("td", {style: {width: "60%"}}, el("div", {className: "bar", style: {width: `${100 * Math.exp(t.logprob)}%`}})),
    el("td", {textContent: percent(Math.exp(t.logprob))})));
  const inTop = token.top.some((t) => t.id === token.id);
  $("token-detail").replaceChildren(
    el("p", {}, `After the ${i} tokens before it, the model gave `, el("b", {textContent: shown(token.text)}),
      ` ${percent(Math.exp(token.logprob))}${inTop ? "" : " (not among its likeliest)"}. Its likeliest tokens there:`),
    el("table", {className: "alts"}, ...rows));
}

function renderLens() {
  const {tokens, logit_lens: lens} = state.inspection.data;
  const layers = lens.length - 1;
  const head = el("tr", {}, el("th", {className: "layer", textContent: "layer"}),
    ...tokens.map((t) => el("th", {textContent: shown(t.text), title: t.text})));
  const rows = [];
  for (let layer = layers; layer >= 0; layer--) {
    const cells = lens[layer].map((top, position) => {
      const [best] = top;
      const next = tokens[position + 1];
      return el("td", {
        className: next && next.id === best.id ? "next" : "", textContent: shown(best.text),
        style: {background: heatShade(best.prob), color: best.prob > 0.55 ? "#fff" : ""},
        onmousemove: (event) => tip(event, alternatives(
          `layer ${layer === layers ? `${layer} (output)` : layer}, after ${shown(tokens[position].text)}`,
          top.map((t) => [t.text, t.prob, next && t.id === next.id]))),
        onmouseleave: untip,
      });
    });
    rows.push(el("tr", {}, el("th", {className: "layer", textContent: layer === layers ? "out" : layer}), ...cells));
  }
  $("lens-grid").replaceChildren(el("table", {className: "lens"}, el("thead", {}, head), el("tbody", {}, ...rows)));
}

async function loadAttention() {
  const inspection = state.inspection;
  const layer = Number($("attention-layer").value);
  if (!inspection.attention[layer]) {
    $("attention-strip").replaceChildren(el("div", {className: "loading",
      textContent: `Reading layer ${layer}'s attention…`}));
    try {
      const data = await (await api("/inspect", {model: model(), ...inspection.request, top_k: 1, logit_lens: false,
        attention: [layer]})).json();
      inspection.attention[layer] = data.attention[0].heads;
    } catch (error) {
      showInspectError(error);
      return;
    }
    if (state.inspection !== inspection) return;
  }
  const heads = inspection.attention[layer];
  const chosen = $("attention-head").value;
  $("attention-head").replaceChildren(new Option("mean", "mean"), ...heads.map((_, h) => new Option(`${h}`, h)));
  $("attention-head").value = chosen && chosen < heads.length ? chosen : "mean";
  drawAttention();
}

function attentionRows() {  // the chosen head's pattern (or the heads' mean): rows of probabilities over keys
  const heads = state.inspection.attention[Number($("attention-layer").value)];
  const head = $("attention-head").value;
  if (head !== "mean") return heads[Number(head)];
  return heads[0].map((row, q) => row.map((_, k) => heads.reduce((sum, h) => sum + h[q][k], 0) / heads.length));
}

function drawAttention() {
  const rows = attentionRows();
  const {tokens} = state.inspection.data;
  const n = rows.length;
  const cell = Math.max(1, Math.floor(480 / n));
  const canvas = $("attention-map");
  canvas.width = canvas.height = cell * n;
  canvas.style.width = canvas.style.height = `${Math.max(cell * n, Math.min(480, 4 * n))}px`;
  const context = canvas.getContext("2d");
  const heat = getComputedStyle(document.body).getPropertyValue("--heat").trim();
  context.fillStyle = getComputedStyle(document.body).getPropertyValue("--panel");
  context.fillRect(0, 0, canvas.width, canvas.height);
  rows.forEach((row, q) => row.forEach((p, k) => {
    context.fillStyle = `rgba(${heat}, ${Math.sqrt(p).toFixed(3)})`;  // square root: faint attention stays visible
    context.fillRect(k * cell, q * cell, cell, cell);
  }));
  canvas.onmousemove = (event) => {
    const box = canvas.getBoundingClientRect();
    const q = Math.floor((event.clientY - box.top) / box.height * n);
    const k = Math.floor((event.clientX - box.left) / box.width * n);
    if (q < 0 || q >= n || k < 0 || k >= n) return;
    attentionStrip(rows, q);
    tip(event, el("div", {}, el("div", {className: "title"}, `${shown(tokens[q].text)} → ${shown(tokens[k].text)}`),
      k <= q ? `${percent(rows[q][k])} of its attention` : "later: not visible to it"));
  };
  canvas.onmouseleave = untip;
  attentionStrip(rows, n - 1);
}

function attentionStrip(rows, q) {  // the tokens, each shaded by the attention query q pays it
  const {tokens} = state.inspection.data;
  $("attention-hover").textContent = `where ${shown(tokens[q].text)} (position ${q}) looks`;
  $("attention-strip").replaceChildren(...tokens.map((token, k) => el("span", {
    className: `tok${k === q ? " selected" : ""}`, textContent: token.text,
    style: {background: k <= q ? heatShade(Math.sqrt(rows[q][k])) : "transparent", opacity: k <= q ? 1 : 0.35},
    onclick: () => attentionStrip(rows, k),
  })));
}

async function loadProfile() {
  const inspection = state.inspection;
  $("time-view").replaceChildren(el("div", {className: "loading",
    textContent: "Timing a prompt pass and a decoding step, operation by operation…"}));
  try {
    const data = await (await api("/inspect", {model: model(), ...inspection.request, top_k: 1, logit_lens: false,
      profile: true})).json();
    inspection.profile = data.profile;
  } catch (error) {
    showInspectError(error);
    return;
  }
  if (state.inspection === inspection) renderProfile(inspection.profile);
}

function ms(seconds) {
  return seconds >= 0.1 ? `${(1000 * seconds).toFixed(0)} ms` : `${(1000 * seconds).toPrecision(3)} ms`;
}

function stack(shares) {  // {kind: seconds} as one stacked bar
  const total = Object.values(shares).reduce((a, b) => a + b, 0);
  return el("div", {className: "stack"}, ...Object.entries(shares).map(([kind, s]) => el("div", {
    title: `${kind}: ${ms(s)} (${percent(s / total)})`, style: {width: `${100 * s / total}%`, background: KINDS[kind]},
  })));
}

function sumBy(ops, key) {
  const sums = new Map();
  for (const op of ops) {
    const name = key(op);
    const sum = sums.get(name) || {name, kind: op.kind, seconds: 0, bytes: 0, flops: 0};
    sum.seconds += op.seconds; sum.bytes += op.bytes; sum.flops += op.flops;
    sums.set(name, sum);
  }
  return [...sums.values()];
}

function renderProfile(profile) {
  const {machine} = profile;
  const card = (title, value, note) => el("div", {className: "card"},
    el("span", {className: "hint", textContent: title}), el("span", {className: "big", textContent: value}),
    el("span", {className: "hint", textContent: note}));
  const phases = [["prefill", `The prompt's pass, ${profile.tokens} tokens`], ["decode", "One decoding step after it"]];
  const view = [el("div", {className: "time-summary"},
    card("memory bandwidth, measured", `${(machine.bandwidth / 1e9).toFixed(1)} GB/s`,
      "a 256 MiB matrix times a vector"),
    card("matrix products, measured", `${(machine.flops / 1e9).toFixed(0)} GFLOP/s`, "a 2048² float32 product"),
    ...phases.map(([phase, title]) => card(title, ms(profile[phase].ops.reduce((s, op) => s + op.seconds, 0)),
      `op by op; as served (fused kernels): ${ms(profile[phase].served_seconds)}`)))];
  view.push(el("div", {className: "legend"}, ...Object.entries(KINDS).map(([kind, color]) =>
    el("span", {}, el("i", {style: {background: color}}), kind))));
  for (const [phase, title] of phases) {
    const ops = profile[phase].ops;
    const total = ops.reduce((s, op) => s + op.seconds, 0);
    const kinds = {};
    for (const op of ops) kinds[op.kind] = (kinds[op.kind] || 0) + op.seconds;
    view.push(el("h2", {textContent: title}), stack(kinds));
    const rows = sumBy(ops, (op) => op.name).sort((a, b) => b.seconds - a.seconds).map((op) => {
      const limit = Math.max(op.bytes / machine.bandwidth, op.flops / machine.flops);  // the roofline's time
      const meter = (share) => el("div", {className: "meter", title: percent(share)},
        el("div", {style: {width: `${Math.min(100, 100 * share)}%`}}));
      return el("tr", {},
        el("td", {}, el("i", {style: {display: "inline-block", width: "8px", height: "8px", borderRadius: "2px",
          marginRight: "6px", background: KINDS[op.kind]}}), op.name),
        el("td", {textContent: ms(op.seconds)}), el("td", {textContent: percent(op.seconds / total)}),
        el("td", {textContent: `${(op.bytes / 1e6).toFixed(op.bytes < 1e7 ? 2 : 0)} MB`}),
        el("td", {textContent: `${(op.bytes / op.seconds / 1e9).toFixed(1)} GB/s`}),
        el("td", {textContent: op.flops ? `${(op.flops / op.seconds / 1e9).toFixed(1)}` : "–"}),
        el("td", {}, meter(limit / op.seconds)));
    });
    view.push(el("table", {className: "ops"}, el("thead", {}, el("tr", {},
      ...["operation", "time", "share", "read", "read speed", "GFLOP/s", "of its limit"].map(
        (h) => el("th", {textContent: h})))),
      el("tbody", {}, ...rows)));
    const layers = sumBy(ops.filter((op) => op.layer !== null), (op) => `${op.layer}`);
    const byLayer = el("div", {className: "layers"});
    for (const {name} of layers) {
      const shares = {};
      for (const op of ops) if (`${op.layer}` === name) shares[op.kind] = (shares[op.kind] || 0) + op.seconds;
      byLayer.append(el("span", {textContent: `${name}`}), stack(shares));
    }
    view.push(el("p", {className: "hint", textContent: "By layer:"}), byLayer);
  }
  view.push(el("p", {className: "hint", textContent:
    "Each operation timed between the hook points around it, on the reference math (torch, op by op). " +
    "Its limit is the longer of its bytes at the measured bandwidth and its products at the measured speed: " +
    "the meter shows how close it comes. Bytes count what it reads: weights, activations, keys and values."}));
  $("time-view").replaceChildren(...view);
}

// Features: each token's strongest features in a dictionary, and one feature across the prompt.

function loading(text) { return el("div", {className: "loading", textContent: text}); }

async function loadFeatures() {
  const inspection = state.inspection;
  const sae = $("features-sae").value;
  if (!inspection.features[sae]) {
    $("features-view").replaceChildren(loading(`Encoding the activations with ${sae}…`));
    $("feature-detail").replaceChildren();
    try {
      inspection.features[sae] = await (await api("/inspect/features",
        {model: model(), ...inspection.request, sae, k: 5})).json();
    } catch (error) {
      showInspectError(error);
      return;
    }
    if (state.inspection !== inspection) return;
  }
  renderFeatures(inspection.features[sae]);
}

// The first position is the attention sink, its stream many times the others' norm: shades are scaled to the rest.
function sinkless(values) { return values.length > 1 ? values.slice(1) : values; }

function renderFeatures(data) {
  $("features-where").textContent = `read at ${data.hook_name}`;
  const strongest = Math.max(1e-9, ...sinkless(data.top).flat().map((f) => f.activation));
  const rows = data.tokens.map((token, position) => el("tr", {},
    el("th", {textContent: shown(token.text), title: `position ${position}`}),
    el("td", {}, ...(data.top[position].length ? data.top[position].map((f) => el("span", {
      className: "feature", dataset: {index: f.index},
      style: {background: heatShade(Math.min(1, f.activation / strongest)),
        color: f.activation / strongest > 0.55 ? "#fff" : ""},
      onclick: () => loadFeature(data.sae, f.index),
      onmousemove: (event) => tip(event, el("div", {}, el("div", {className: "title"}, `feature ${f.index}`),
        `${f.activation.toFixed(3)} at ${shown(token.text)}`)),
      onmouseleave: untip,
    }, el("b", {textContent: `#${f.index}`}), ` ${f.activation.toFixed(2)}`)) : [el("span", {className: "hint",
      textContent: "none active"})]))));
  $("features-view").replaceChildren(el("table", {className: "features"}, el("tbody", {}, ...rows)));
}

async function loadFeature(sae, index) {
  const inspection = state.inspection;
  untip();  // the view below grows: the pointer is no longer where the tip says
  for (const chip of document.querySelectorAll("#features-view .feature")) {
    chip.classList.toggle("selected", Number(chip.dataset.index) === index);
  }
  $("feature-detail").replaceChildren(loading(`Reading feature ${index}…`));
  let data;
  try {
    data = await (await api("/inspect/feature", {model: model(), ...inspection.request, sae, index, k: 8})).json();
  } catch (error) {
    showInspectError(error);
    return;
  }
  if (state.inspection !== inspection) return;
  const strongest = Math.max(1e-9, ...sinkless(data.activations));
  const peak = data.activations.indexOf(Math.max(...sinkless(data.activations)));
  const strip = el("div", {className: "strip"}, ...data.tokens.map((token, i) => el("span", {
    className: "tok", textContent: token.text,
    style: {background: heatShade(Math.min(1, data.activations[i] / strongest))},
    onmousemove: (event) => tip(event, el("div", {}, `${shown(token.text)}: ${data.activations[i].toFixed(3)}`)),
    onmouseleave: untip,
  })));
  const effect = (title, tokens) => {
    const largest = Math.max(1e-9, ...tokens.map((t) => Math.abs(t.logit)));
    return el("div", {}, el("h3", {textContent: title}), el("table", {className: "alts"}, ...tokens.map((t) =>
      el("tr", {}, el("td", {className: "text", textContent: shown(t.text)}),
        el("td", {style: {width: "55%"}}, el("div", {className: `bar${t.logit < 0 ? " down" : ""}`,
          style: {width: `${100 * Math.abs(t.logit) / largest}%`}})),
        el("td", {textContent: `${t.logit > 0 ? "+" : ""}${t.logit.toFixed(2)}`})))));
  };
  $("feature-detail").replaceChildren(
    el("h2", {textContent: `Feature ${index} of ${sae}`}),
    el("p", {className: "hint", textContent: Math.max(...sinkless(data.activations)) > 0
      ? `Its activation at each token: strongest at ${shown(data.tokens[peak].text)} (position ${peak}), `
        + `${data.activations[peak].toFixed(3)}` + (data.tokens.length > 1 ? `; at the first token, the attention `
        + `sink, ${data.activations[0].toFixed(3)}.` : ".") : "Not active past the first token."}),
    strip,
    data.promoted ? el("div", {className: "effects"}, effect("Promotes", data.promoted),
      effect("Suppresses", data.suppressed))
      : el("p", {className: "hint",
        textContent: "Its decoder direction is not in the residual stream: no logit effect."}));
}

// Graph: an attribution graph from the served transcoders, drawn by layer and position.

async function loadGraph() {
  const inspection = state.inspection;
  $("graph-view").replaceChildren(loading("Tracing: a backward pass per batch of features…"));
  $("graph-download").hidden = true;
  try {
    const body = {model: model(), ...inspection.request, max_features: Number($("graph-features").value) || 64};
    const target = $("graph-target").value;
    if (target) {
      const ids = (await (await api("/tokenize", {content: target})).json()).tokens;
      if (ids.length !== 1) throw new Error(`“${target}” is ${ids.length} tokens: a target is one token`);
      body.target = ids[0];
    }
    inspection.graph = await (await api("/inspect/graph", body)).json();
  } catch (error) {
    $("graph-view").replaceChildren();
    showInspectError(error);
    return;
  }
  if (state.inspection !== inspection) return;
  const link = $("graph-download");
  if (link.href) URL.revokeObjectURL(link.href);
  link.href = URL.createObjectURL(new Blob([JSON.stringify(inspection.graph)], {type: "application/json"}));
  link.hidden = false;
  drawGraph(inspection.graph);
}

// SVG's namespace, as the HTML parser gives an <svg>: the page's files name no address (tests/test_inspect.py)
const SVG = (() => {
  const box = document.createElement("div");
  box.innerHTML = "<svg></svg>";
  return box.firstChild.namespaceURI;
})();
function svg(tag, attributes = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

function nodeLabel(node) {
  const [layer, index] = node.node_id.split("_");
  const tokens = state.inspection.graph.metadata.prompt_tokens;
  if (node.feature_type === "embedding") return `token ${shown(tokens[node.ctx_idx])}`;
  if (node.feature_type === "logit") return node.clerp;
  if (node.feature_type === "mlp reconstruction error") return `error, block ${layer}`;
  return `feature ${index}, block ${layer}`;
}

function drawGraph(graph) {
  const tokens = graph.metadata.prompt_tokens;
  const layers = Math.max(...graph.nodes.filter((n) => n.feature_type === "logit").map((n) => Number(n.layer))) - 1;
  const rowOf = (node) => node.layer === "E" ? 0 : node.feature_type === "logit" ? layers + 1 : Number(node.layer) + 1;
  const column = Math.max(48, Math.floor(($("graph-view").clientWidth - 84) / tokens.length));  // to fit, or scroll
  const row = Math.max(10, Math.min(26, Math.floor(440 / (layers + 2))));
  const left = 44, top = 56, width = left + column * tokens.length + 40, height = top + row * (layers + 1) + 44;
  // where each node sits: its position's column, its block's row, side by side within the cell
  const cells = new Map();
  for (const node of graph.nodes) {
    const key = `${rowOf(node)},${node.ctx_idx}`;
    cells.set(key, [...(cells.get(key) || []), node]);
  }
  const at = new Map();
  // the target logits (all at the last position) side by side along the top, each with its token
  const logits = graph.nodes.filter((n) => n.feature_type === "logit");
  logits.forEach((node, j) => at.set(node.node_id, {x: left + (width - left - 40) * (j + 0.5) / logits.length,
    y: top, label: top - 10 - (j % 2) * 13}));  // labels staggered: neighbours' may be wider than their gap
  for (const [key, nodes] of cells) {
    if (nodes[0].feature_type === "logit") continue;
    const [r, position] = key.split(",").map(Number);
    const spacing = Math.min(13, (column - 8) / nodes.length);
    nodes.sort((a, b) => (b.influence || 0) - (a.influence || 0));
    nodes.forEach((node, j) => at.set(node.node_id, {
      x: left + column * (position + 0.5) + (j - (nodes.length - 1) / 2) * spacing,
      y: top + row * (layers + 1 - r)}));
  }
  const largest = Math.max(1e-9, ...graph.links.map((link) => Math.abs(link.weight)));
  const inputs = new Map();
  const edges = svg("g", {class: "edges"});
  for (const link of [...graph.links].sort((a, b) => Math.abs(a.weight) - Math.abs(b.weight))) {
    const a = at.get(link.source), b = at.get(link.target);
    const share = Math.abs(link.weight) / largest;
    const line = svg("line", {x1: a.x, y1: a.y, x2: b.x, y2: b.y, class: link.weight > 0 ? "up" : "down",
      "stroke-width": (0.4 + 3.2 * share).toFixed(2), "stroke-opacity": (0.15 + 0.7 * share).toFixed(2)});
    line.dataset.source = link.source;
    line.dataset.target = link.target;
    edges.append(line);
    inputs.set(link.target, [...(inputs.get(link.target) || []), link]);
  }
  const names = new Map(graph.nodes.map((node) => [node.node_id, node]));
  const grid = svg("g", {class: "grid"});
  for (let r = 0; r <= layers + 1; r++) {
    const y = top + row * (layers + 1 - r);
    if (r === 0 || r === layers + 1 || r % 5 === 1) {
      grid.append(svg("text", {x: left - 8, y: y + 4, "text-anchor": "end"},
        r === 0 ? "emb" : r === layers + 1 ? "out" : `${r - 1}`));
    }
    grid.append(svg("line", {x1: left, x2: width - 40, y1: y, y2: y}));
  }
  tokens.forEach((text, position) => grid.append(svg("text", {x: left + column * (position + 0.5), y: height - 16,
    "text-anchor": "middle", class: "token"}, shown(text).slice(0, 12))));
  const nodes = svg("g", {class: "nodes"});
  for (const node of graph.nodes) {
    const {x, y} = at.get(node.node_id);
    const kind = {"cross layer transcoder": "feature", "mlp reconstruction error": "error", embedding: "embedding",
      logit: "logit"}[node.feature_type];
    const shape = kind === "error" ? svg("rect", {x: x - 4, y: y - 4, width: 8, height: 8})
      : kind === "embedding" ? svg("rect", {x: x - 6, y: y - 3, width: 12, height: 6, rx: 2})
        : svg("circle", {cx: x, cy: y, r: kind === "logit" ? 6 : 4.5});
    shape.setAttribute("class", kind);
    shape.addEventListener("mousemove", (event) => {
      for (const line of edges.children) {
        line.classList.toggle("faded", line.dataset.source !== node.node_id && line.dataset.target !== node.node_id);
      }
      const strongest = [...(inputs.get(node.node_id) || [])].sort((a, b) => Math.abs(b.weight) - Math.abs(a.weight));
      tip(event, el("div", {}, el("div", {className: "title"}, nodeLabel(node)),
        el("div", {}, `position ${node.ctx_idx}`
          + (node.activation !== null ? ` · activation ${node.activation.toFixed(3)}` : "")
          + (node.influence !== null ? ` · influence ${percent(node.influence)}` : "")),
        ...(strongest.length ? [el("div", {className: "title"}, "strongest inputs"), el("table", {},
          ...strongest.slice(0, 6).map((link) => el("tr", {}, el("td", {}, nodeLabel(names.get(link.source))),
            el("td", {className: "p"}, `${link.weight > 0 ? "+" : ""}${link.weight.toFixed(3)}`))))] : [])));
    });
    shape.addEventListener("mouseleave", () => {
      untip();
      for (const line of edges.children) line.classList.remove("faded");
    });
    nodes.append(shape);
    if (kind === "logit") {
      nodes.append(svg("text", {x, y: at.get(node.node_id).label, "text-anchor": "middle", class: "logit-label"},
        node.clerp.replace(/^Output "(.*)" \(p=(.*)\)$/, (_, text, p) => `${shown(text)} ${percent(Number(p))}`)));
    }
  }
  const features = graph.nodes.filter((n) => n.feature_type === "cross layer transcoder").length;
  const errors = graph.nodes.filter((n) => n.feature_type === "mlp reconstruction error").length;
  $("graph-view").replaceChildren(
    el("p", {className: "hint", textContent: `${features} features, ${errors} error nodes and ${graph.links.length}`
      + ` edges kept (nodes until ${percent(graph.metadata.node_threshold)} of the influence).`}),
    svg("svg", {width, height, viewBox: `0 0 ${width} ${height}`, class: "graph"}, grid, edges, nodes));
}

// Wiring.

function saveSettings() {
  const saved = {};
  for (const id of SETTINGS) saved[id] = $(id).type === "checkbox" ? $(id).checked : $(id).value;
  localStorage.setItem("smollm2.settings", JSON.stringify(saved));
  $("temperature-value").textContent = $("temperature").value;
  $("top-p-value").textContent = $("top-p").value;
}

function restoreSettings() {
  const saved = JSON.parse(localStorage.getItem("smollm2.settings") || "{}");
  for (const id of SETTINGS) {
    if (!(id in saved)) continue;
    if ($(id).type === "checkbox") $(id).checked = saved[id]; else $(id).value = saved[id];
  }
  saveSettings();
}

function wire() {
  restoreSettings();
  for (const id of SETTINGS) $(id).addEventListener("input", saveSettings);
  $("show-probs").addEventListener("change", () => state.messages.forEach(renderMessage));
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop-button").addEventListener("click", () => state.controller && state.controller.abort());
  $("inspect-input").addEventListener("click", () => {
    const text = $("input").value;
    if (text.trim()) inspect({prompt: text}, `the prompt “${text.length > 40 ? text.slice(0, 40) + "…" : text}”`);
  });
  $("new-chat").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    for (const message of state.messages) message.element.remove();
    state.messages = [];
    $("empty").hidden = false;
  });
  $("close-inspector").addEventListener("click", () => { $("inspector").hidden = true; state.inspection = null; });
  for (const button of document.querySelectorAll("#tabs button")) {
    button.addEventListener("click", () => showTab(button.dataset.tab));
  }
  $("attention-layer").addEventListener("change", loadAttention);
  $("attention-head").addEventListener("change", drawAttention);
  $("features-sae").addEventListener("change", loadFeatures);
  $("graph-build").addEventListener("click", () => state.inspection && state.inspection.data && loadGraph());
  $("model").addEventListener("change", showModel);
  $("key-button").addEventListener("click", () => $("key-dialog").showModal());
  $("key-dialog").addEventListener("close", () => {
    state.key = $("key").value;
    localStorage.setItem("smollm2.key", state.key);
    loadModels().catch(() => {});
  });
  loadModels().catch((error) => { $("status").textContent = error.message; });
}

wire();
