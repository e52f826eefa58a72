// The dark UI: conversations, streaming replies, corrections that teach a skill, and the skills panel.
// Model text only ever reaches the page through renderMarkdown (DOM nodes, never HTML strings).
import { authHeaders, DarkSocket } from "./client.js";
import { lossChart } from "./chart.js";
import { renderMarkdown } from "./markdown.js";
import { agentOnHello, agentUnsolicited, initAgent, showAgent } from "./agent.js";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "dark.apiKey";
const SKILL_STORE = "dark.skill";
const NEW_SKILL = "__new__";
const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

const ui = {
  key: localStorage.getItem(KEY_STORE),
  authRequired: false,
  socket: null,
  adapters: [],
  skill: localStorage.getItem(SKILL_STORE) || "",
  learning: true,            // whether the server can learn (hello.learning)
  conversationId: null,
  views: [],                 // MessageView, in page order
  generating: new Map(),     // request id -> MessageView
  jobs: new Map(),           // job id -> JobCard
};

// ---------- small helpers ----------

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(text, onClick, className = "button subtle small", title) {
  const b = el("button", className, text);
  b.type = "button";
  if (title) { b.title = title; b.setAttribute("aria-label", title); }
  b.addEventListener("click", onClick);
  return b;
}

const SVG_NS = "http://www.w3.org/2000/svg";
const THUMB = "M14 9V5a3 3 0 0 0-3-3l-4 9v11h11.28a2 2 0 0 0 2-1.7l1.38-9a2 2 0 0 0-2-2.3zM7 22H4a2 2 0 0 1-2-2v-7a2 2 0 0 1 2-2h3";

// a thumb icon drawn as SVG, so it shows without an emoji font
function thumb(down) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("width", "15");
  svg.setAttribute("height", "15");
  svg.setAttribute("aria-hidden", "true");
  const path = document.createElementNS(SVG_NS, "path");
  path.setAttribute("d", THUMB);
  path.setAttribute("fill", "none");
  path.setAttribute("stroke", "currentColor");
  path.setAttribute("stroke-width", "2");
  path.setAttribute("stroke-linejoin", "round");
  if (down) path.setAttribute("transform", "rotate(180 12 12)");
  svg.append(path);
  return svg;
}

let toastTimer = null;
function toast(message, kind = "error") {
  const t = $("toast");
  t.textContent = message;
  t.dataset.kind = kind;
  t.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { t.hidden = true; }, 6000);
}

function adapterLabel(adapter) {
  if (!adapter) return "base";
  return adapter.version ? `${adapter.name} v${adapter.version}` : `${adapter.name} (untrained)`;
}

function scrollToEnd() {
  const box = $("messages");
  if (box.scrollHeight - box.scrollTop - box.clientHeight < 160) box.scrollTop = box.scrollHeight;
}

// ---------- messages ----------

class MessageView {
  constructor(data) {
    this.data = { content: "", ...data };
    this.node = $("message-template").content.firstElementChild.cloneNode(true);
    this.body = this.node.querySelector(".body");
    this.actions = this.node.querySelector(".actions");
    this.jobBox = this.node.querySelector(".job");
    this.pending = Boolean(data.pending);
    this.renderQueued = false;
    this.render();
  }

  get id() { return this.data.id; }

  render() {
    const d = this.data;
    this.node.dataset.role = d.role;
    this.node.classList.toggle("pending", this.pending);
    if (d.id) this.node.dataset.messageId = d.id;
    this.node.querySelector(".role").textContent = d.role === "user" ? "You" : d.role === "assistant" ? "Assistant" : d.role;
    this.renderMeta();
    this.renderBody();
    this.renderActions();
  }

  renderMeta() {
    const d = this.data;
    const parts = [];
    if (d.role === "assistant") {
      parts.push(adapterLabel(d.adapter ?? (d.adapter_name ? { name: d.adapter_name, version: d.adapter_version } : null)));
      const usage = d.usage || d.meta?.usage;
      if (usage && !this.pending) parts.push(`${usage.completion_tokens} tok`, `${usage.tokens_per_second} tok/s`);
      if (d.finish_reason === "abort") parts.push("stopped");
      if (d.finish_reason === "length") parts.push("cut at max tokens");
      const dropped = d.context_dropped ?? d.meta?.context_dropped;
      if (dropped) parts.push(`answered from the latest turns (${dropped} earlier message${dropped === 1 ? "" : "s"} beyond the context window)`);
      if (d.meta?.corrected) parts.push("corrected");
    }
    this.node.querySelector(".meta").textContent = parts.join(" · ");
  }

  renderBody() {
    if (this.editing) return;
    if (this.data.role === "user") {
      this.body.replaceChildren(el("p", "plain", this.data.content));
    } else {
      renderMarkdown(this.data.content, this.body);
      if (this.pending && !this.data.content) this.body.replaceChildren(el("span", "typing", "…"));
    }
  }

  // streaming: coalesce renders to one per frame
  append(text) {
    this.data.content += text;
    if (this.renderQueued) return;
    this.renderQueued = true;
    requestAnimationFrame(() => {
      this.renderQueued = false;
      this.renderBody();
      scrollToEnd();
    });
  }

  finish(done) {
    this.pending = false;
    Object.assign(this.data, {
      id: done.message_id, content: done.text, finish_reason: done.finish_reason,
      adapter: done.adapter, usage: done.usage, parent_id: done.parent_id, context_dropped: done.context_dropped,
    });
    this.render();
  }

  fail(message) {
    this.pending = false;
    this.data.finish_reason = "error";
    this.render();
    this.body.append(el("p", "error-text", message));
  }

  renderActions() {
    this.actions.replaceChildren();
    if (this.data.role !== "assistant" || this.pending || !this.data.id) return;
    const rating = this.data.feedback;
    const up = button("", () => this.rate(1), `button subtle small thumb-up${rating === 1 ? " pressed" : ""}`, "Good reply");
    const down = button("", () => this.rate(-1), `button subtle small thumb-down${rating === -1 ? " pressed" : ""}`, "Bad reply");
    up.append(thumb(false));
    down.append(thumb(true));
    if (ui.learning) {
      this.actions.append(button("✎ Correct", () => this.edit(), "button subtle small correct",
        "Correct this reply and teach the skill"));
    }
    this.actions.append(button("↻ Regenerate", () => regenerate(this), "button subtle small regenerate", "Answer again"),
      up, down);
  }

  async rate(rating) {
    try {
      await ui.socket.call({ type: "feedback", message_id: this.data.id, rating });
      this.data.feedback = rating;
      this.renderActions();
    } catch (e) { toast(e.message); }
  }

  edit() {
    if (this.editing) return;
    this.editing = true;
    const form = el("form", "edit-form");
    const area = el("textarea", "edit-text");
    area.value = this.data.content;
    area.rows = Math.min(14, Math.max(3, this.data.content.split("\n").length + 1));
    area.setAttribute("aria-label", "Corrected reply");
    const select = el("select", "edit-skill");
    select.setAttribute("aria-label", "Skill to teach");
    const fromAdapter = this.data.adapter?.name || this.data.adapter_name || "";
    const preferred = ui.skill || fromAdapter;
    for (const a of ui.adapters) select.append(new Option(a.name, a.name, false, a.name === preferred));
    select.append(new Option("+ new skill…", NEW_SKILL, false, !preferred));
    const newName = el("input", "edit-new-skill");
    newName.placeholder = "new skill name";
    newName.value = "my-skill";
    newName.setAttribute("aria-label", "New skill name");
    const syncNew = () => { newName.hidden = select.value !== NEW_SKILL; };
    select.addEventListener("change", syncNew);
    syncNew();
    const teach = el("button", "button primary small teach", "Teach");
    teach.type = "submit";
    const cancel = button("Cancel", () => { this.editing = false; this.render(); }, "button subtle small");
    const row = el("div", "row wrap");
    row.append(el("span", "muted", "Teach skill"), select, newName, teach, cancel);
    form.append(area, row);
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const adapter = select.value === NEW_SKILL ? newName.value.trim() : select.value;
      if (!NAME_RE.test(adapter)) { toast("A skill name is 1-64 letters, digits, '.', '_' or '-'"); return; }
      if (!area.value.trim()) { toast("The corrected reply is empty"); return; }
      this.correct(area.value, adapter);
    });
    this.body.replaceChildren(form);
    this.actions.replaceChildren();
    area.focus();
  }

  correct(content, adapter) {
    const card = new JobCard(this, adapter);
    ui.socket.request({ type: "correct", message_id: this.data.id, content, adapter }, (frame) => {
      if (frame.type === "error" && frame.code === "disconnected" && card.jobId) {
        card.note("connection lost; the job goes on and this resumes on reconnect");
        return;
      }
      if (frame.type === "error") { card.fail(frame.message); this.editing = false; this.render(); return; }
      if (frame.type !== "job") return;
      if (!card.jobId) {
        card.jobId = frame.job_id;
        ui.jobs.set(frame.job_id, card);
        this.editing = false;
        this.data.content = content;
        this.data.meta = { ...(this.data.meta || {}), corrected: true };
        this.render();
        selectSkill(adapter);
      }
      card.update(frame);
    });
  }
}

class JobCard {
  // view: anything with a jobBox (a MessageView, or an agent run); regenerate: offer "Regenerate with" when done
  constructor(view, adapter, { regenerate = true } = {}) {
    this.view = view;
    this.adapter = adapter;
    this.offerRegenerate = regenerate;
    this.jobId = null;
    this.losses = new Map();   // step -> loss (a replay after a reconnect repeats steps)
    this.state = "sending";
    this.box = view.jobBox;
    this.box.hidden = false;
    this.box.dataset.state = "sending";
    this.draw({});
  }

  update(frame) {
    this.state = frame.state;
    if (frame.adapter) this.adapter = frame.adapter;
    if (frame.state === "running" && Number.isFinite(frame.loss)) this.losses.set(frame.step ?? this.losses.size, frame.loss);
    this.draw(frame);
  }

  note(text) {
    const status = this.box.querySelector(".job-state");
    if (status) status.textContent = text;
  }

  fail(message) {
    this.state = "failed";
    this.draw({ error: message });
  }

  draw(frame) {
    const box = this.box;
    box.dataset.state = this.state;
    const head = el("div", "job-head");
    const title = el("span", "job-title");
    const status = el("span", "job-state");
    if (this.state === "sending") { title.textContent = `Teaching ${this.adapter}…`; }
    else if (this.state === "queued") { title.textContent = `Learning into ${this.adapter}`; status.textContent = "queued"; }
    else if (this.state === "running") {
      title.textContent = `Learning into ${this.adapter}`;
      const step = frame.step != null ? `step ${frame.step}${frame.total_steps ? `/${frame.total_steps}` : ""}` : "running";
      status.textContent = frame.loss != null ? `${step} · loss ${frame.loss.toFixed(3)}` : step;
    } else if (this.state === "done") {
      title.textContent = `Learned: ${this.adapter} v${frame.version ?? "?"}`;
      const badge = el("span", `badge ${frame.verified ? "ok" : "warn"}`, frame.verified ? "verified ✓" : "not verified");
      badge.title = frame.verified ? "the skill now gives the corrected answer" : "training ended but the answer did not match exactly";
      status.append(badge);
      const r = frame.report;
      if (r && Number.isFinite(r.steps)) {
        status.append(` ${r.steps} step${r.steps === 1 ? "" : "s"}${Number.isFinite(r.seconds) ? ` in ${r.seconds.toFixed(1)} s` : ""}`);
      }
    } else if (this.state === "failed" || this.state === "cancelled") {
      title.textContent = `Could not learn into ${this.adapter}`;
      status.textContent = frame.error || this.state;
      box.dataset.state = "failed";
    }
    head.append(title, status);
    const parts = [head];
    if (this.losses.size) parts.push(lossChart([...this.losses].sort((a, b) => a[0] - b[0]).map(([, loss]) => loss)));
    if (this.state === "done" && this.offerRegenerate) {
      parts.push(button(`↻ Regenerate with ${this.adapter}`, () => { selectSkill(this.adapter); regenerate(this.view); },
        "button primary small regenerate-learned"));
    }
    box.replaceChildren(...parts);
    scrollToEnd();
  }
}

function addView(data, before = null) {
  const view = new MessageView(data);
  $("empty").hidden = true;
  const box = $("messages");
  if (before) {
    box.insertBefore(view.node, before.node);
    ui.views.splice(ui.views.indexOf(before), 0, view);
  } else {
    box.append(view.node);
    ui.views.push(view);
  }
  return view;
}

function removeView(view) {
  view.node.remove();
  ui.views = ui.views.filter((v) => v !== view);
}

function clearViews() {
  for (const v of ui.views) v.node.remove();
  ui.views = [];
  $("empty").hidden = false;
}

// ---------- chat ----------

function updateComposer() {
  const busy = [...ui.generating.values()].some((v) => ui.views.includes(v));
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function generationHandler(reply, onStarted) {
  return (frame) => {
    if (frame.type === "started") onStarted?.(frame);
    else if (frame.type === "token") reply.append(frame.text);
    else if (frame.type === "done") {
      reply.finish(frame);
      ui.generating.delete(frame.id);
      updateComposer();
      refreshConversations();
    } else if (frame.type === "error") {
      reply.fail(frame.message);
      ui.generating.delete(frame.id);
      updateComposer();
      if (frame.code !== "disconnected") toast(frame.message);
    }
  };
}

function sendMessage() {
  const input = $("input");
  const content = input.value.trim();
  if (!content) return;
  if (!ui.socket?.online) { toast("Not connected yet; the message was kept"); return; }
  input.value = "";
  autosize();
  const last = ui.views.at(-1);
  const message = { type: "chat", content };
  if (ui.skill) message.adapter = ui.skill;
  if (ui.conversationId) {
    message.conversation_id = ui.conversationId;
    if (last?.id) message.parent_id = last.id;
  }
  const user = addView({ role: "user", content, pending: true });
  const reply = addView({ role: "assistant", content: "", pending: true,
    adapter: ui.skill ? { name: ui.skill, version: currentVersion(ui.skill) } : null });
  scrollToEnd();
  const id = ui.socket.request(message, generationHandler(reply, (started) => {
    ui.conversationId = started.conversation_id;
    user.data.id = started.user_message_id;
    user.pending = false;
    user.render();
    markActiveConversation();
  }));
  ui.generating.set(id, reply);
  updateComposer();
}

function regenerate(old) {
  if (!ui.socket?.online) { toast("Not connected"); return; }
  const reply = addView({ role: "assistant", content: "", pending: true,
    adapter: ui.skill ? { name: ui.skill, version: currentVersion(ui.skill) } : null }, old);
  // the old reply stays in the conversation's history as a sibling; this view shows the newest branch
  const next = ui.views.slice(ui.views.indexOf(old) + 1);
  removeView(old);
  for (const v of next) removeView(v);
  const id = ui.socket.request({ type: "regenerate", message_id: old.id, adapter: ui.skill || null },
    generationHandler(reply));
  ui.generating.set(id, reply);
  updateComposer();
}

function stopAll() {
  for (const [id, view] of ui.generating) {
    if (ui.views.includes(view)) ui.socket.send({ type: "stop", id });
  }
}

// ---------- conversations ----------

async function refreshConversations() {
  if (!ui.socket?.online) return;
  try {
    const { conversations } = await ui.socket.call({ type: "conversations", limit: 100 });
    const list = $("conversation-list");
    list.replaceChildren(...conversations.map((c) => {
      const li = el("li");
      const b = button(c.title || "untitled", () => openConversation(c.id), "conversation");
      b.dataset.id = c.id;
      b.title = new Date(c.updated_at * 1000).toLocaleString();
      li.append(b);
      return li;
    }));
    markActiveConversation();
  } catch (e) { toast(e.message); }
}

function markActiveConversation() {
  for (const b of document.querySelectorAll("#conversation-list .conversation")) {
    b.classList.toggle("active", b.dataset.id === ui.conversationId);
  }
}

async function openConversation(id) {
  closeSidebarOnPhone();
  showAgent(false);
  try {
    const { conversation, messages } = await ui.socket.call({ type: "history", conversation_id: id });
    clearViews();
    ui.conversationId = conversation.id;
    for (const m of messages) {
      if (m.role === "system") continue;
      addView({ ...m, adapter: m.adapter ? { name: m.adapter, version: m.adapter_version } : null });
    }
    markActiveConversation();
    $("messages").scrollTop = $("messages").scrollHeight;
  } catch (e) { toast(e.message); }
}

function newChat() {
  showAgent(false);
  clearViews();
  ui.conversationId = null;
  markActiveConversation();
  closeSidebarOnPhone();
  $("input").focus();
}

// ---------- skills ----------

function currentVersion(name) {
  return ui.adapters.find((a) => a.name === name)?.version ?? 0;
}

function selectSkill(name) {
  ui.skill = name || "";
  localStorage.setItem(SKILL_STORE, ui.skill);
  renderSkillSelect();
}

function renderSkillSelect() {
  const select = $("skill-select");
  const known = ui.adapters.some((a) => a.name === ui.skill);
  const options = [new Option("Base model", "", false, !ui.skill)];
  for (const a of ui.adapters) {
    options.push(new Option(`${a.name} · v${a.version}`, a.name, false, a.name === ui.skill));
  }
  if (ui.skill && !known) options.push(new Option(`${ui.skill} (new)`, ui.skill, false, true));
  options.push(new Option("+ New skill…", NEW_SKILL));
  select.replaceChildren(...options);
}

function setAdapters(adapters) {
  ui.adapters = adapters;
  renderSkillSelect();
  renderAdapterPanel();
}

async function refreshAdapters() {
  try {
    const { adapters } = await ui.socket.call({ type: "adapters" });
    setAdapters(adapters);
  } catch (e) { toast(e.message); }
}

async function adapterAction(message) {
  const err = $("skills-error");
  err.hidden = true;
  try {
    const { adapters } = await ui.socket.call(message);
    setAdapters(adapters);
    return true;
  } catch (e) {
    err.textContent = e.message;
    err.hidden = false;
    return false;
  }
}

async function download(name, version) {
  const query = version ? `?version=${version}` : "";
  try {
    const res = await fetch(`api/adapters/${encodeURIComponent(name)}/download${query}`, { headers: authHeaders(ui.key) });
    if (!res.ok) throw new Error((await res.json().catch(() => ({}))).detail || `download failed (${res.status})`);
    const url = URL.createObjectURL(await res.blob());
    const a = el("a");
    a.href = url;
    a.download = `${name}${version ? `-v${version}` : ""}.zip`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
  } catch (e) { toast(e.message); }
}

function renderAdapterPanel() {
  const box = $("adapter-list");
  if (!ui.adapters.length) {
    box.replaceChildren(el("p", "muted", "No skills yet. Create one, or correct a reply to start one."));
    return;
  }
  box.replaceChildren(...ui.adapters.map((a) => {
    const card = el("section", "adapter");
    card.dataset.name = a.name;
    const head = el("div", "adapter-head");
    const state = a.version ? `current v${a.version}`
      : a.versions.length > 1 ? "current v0 (answers like the base model)" : "untrained (answers like the base model)";
    head.append(el("h3", null, a.name), el("span", "muted", state));
    const actions = el("div", "row wrap");
    actions.append(
      button(ui.skill === a.name ? "In use" : "Use", () => { selectSkill(a.name); $("skills-dialog").close(); },
        "button primary small"),
      button("Undo last", () => adapterAction({ type: "rollback", adapter: a.name }), "button subtle small"),
      button("Download", () => download(a.name), "button subtle small"),
      button("Delete", () => {
        if (confirm(`Delete skill ${a.name} with all its versions and examples?`)) {
          adapterAction({ type: "delete_adapter", adapter: a.name }).then((ok) => {
            if (ok && ui.skill === a.name) selectSkill("");
          });
        }
      }, "button danger small"),
    );
    const table = el("table", "versions");
    const rows = [...a.versions].sort((x, y) => y.version - x.version);
    for (const v of rows) {
      const tr = el("tr");
      if (v.version === a.version) tr.className = "current";
      const when = v.created_at ? new Date(v.created_at * 1000).toLocaleString() : "";
      const verified = v.verified == null ? "" : v.verified ? "verified ✓" : "not verified";
      const td = (text, cls) => el("td", cls, text);
      const acts = el("td", "version-actions");
      if (v.version !== a.version) {
        acts.append(button("Roll back", () => adapterAction({ type: "rollback", adapter: a.name, version: v.version })));
      } else acts.append(el("span", "muted", "current"));
      if (v.version > 0) acts.append(button("⇩", () => download(a.name, v.version), "button subtle small", `Download v${v.version}`));
      tr.append(td(`v${v.version}`), td(when, "muted"), td(verified, v.verified ? "ok-text" : "muted"),
        td(v.loss != null ? `loss ${v.loss.toFixed(3)}` : "", "muted"), acts);
      table.append(tr);
    }
    card.append(head, actions, table);
    return card;
  }));
}

// ---------- connection and key ----------

function setStatus(state, info = {}) {
  const c = $("connection");
  c.dataset.state = state;
  const text = {
    connecting: "connecting…", online: "online", closed: "closed",
    offline: `offline, retrying in ${Math.round((info.delay || 0) / 1000)} s`,
  }[state] || state;
  c.querySelector(".connection-text").textContent = text;
  if (state === "offline") {
    for (const [id, view] of ui.generating) { view.fail("connection lost"); ui.generating.delete(id); }
    updateComposer();
    checkKey().catch(() => {});  // a key that stopped working shows as a closed socket
  }
}

async function onHello(hello) {
  $("model-name").textContent = hello.model;
  ui.learning = hello.learning;
  await refreshAdapters();
  await refreshConversations();
  agentOnHello();
  for (const [jobId, card] of ui.jobs) {
    if (["queued", "running"].includes(card.state)) {
      ui.socket.request({ type: "watch", job_id: jobId }, (frame) => { if (frame.type === "job") card.update(frame); });
    }
  }
}

function onUnsolicited(frame) {
  if (agentUnsolicited(frame)) return;
  if (frame.type === "adapters") setAdapters(frame.adapters);
  else if (frame.type === "error") toast(frame.message);
}

function wsUrl() {
  const url = new URL("ws", window.location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  return url.href;
}

async function keyWorks(key) {
  const res = await fetch("api/info", { headers: authHeaders(key) });
  if (res.status === 401) return false;
  if (!res.ok) throw new Error(`the server answered ${res.status}`);
  return true;
}

async function checkKey() {
  if (!ui.authRequired) return;
  if (!(await keyWorks(ui.key))) askForKey("The API key was not accepted.");
}

function askForKey(problem) {
  ui.socket?.close();
  const dialog = $("key-dialog");
  const err = $("key-error");
  err.textContent = problem || "";
  err.hidden = !problem;
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

async function submitKey(event) {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  try {
    if (!(await keyWorks(key))) { askForKey("That key is wrong."); return; }
  } catch (e) { askForKey(e.message); return; }
  ui.key = key;
  localStorage.setItem(KEY_STORE, key);
  $("key-dialog").close();
  $("forget-key").hidden = false;
  connect();
}

function connect() {
  ui.socket?.close();
  ui.socket = new DarkSocket({ url: wsUrl(), key: ui.key, onHello, onUnsolicited, onStatus: setStatus });
  ui.socket.connect();
}

async function start() {
  let health;
  try {
    health = await (await fetch("health")).json();
  } catch {
    setStatus("offline", { delay: 3000 });
    setTimeout(start, 3000);
    return;
  }
  ui.authRequired = Boolean(health.auth_required);
  if (ui.authRequired) {
    $("forget-key").hidden = !ui.key;
    if (!ui.key) { askForKey(); return; }
    try {
      if (!(await keyWorks(ui.key))) { askForKey("The saved API key was not accepted."); return; }
    } catch (e) { toast(e.message); }
  }
  connect();
}

// ---------- layout ----------

function autosize() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = `${Math.min(input.scrollHeight, 200)}px`;
}

function closeSidebarOnPhone() {
  document.body.classList.remove("sidebar-open");
}

function wire() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); sendMessage(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); if (!$("send").hidden) sendMessage(); }
  });
  $("input").addEventListener("input", autosize);
  $("stop").addEventListener("click", stopAll);
  $("new-chat").addEventListener("click", newChat);
  $("menu-button").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
  $("skills-button").addEventListener("click", () => { renderAdapterPanel(); $("skills-dialog").showModal(); });
  $("skill-select").addEventListener("change", (e) => {
    if (e.target.value === NEW_SKILL) {
      renderSkillSelect();
      $("skills-dialog").showModal();
      $("new-skill-name").focus();
    } else selectSkill(e.target.value);
  });
  $("create-skill").addEventListener("submit", async (e) => {
    e.preventDefault();
    const name = $("new-skill-name").value.trim();
    if (await adapterAction({ type: "create_adapter", name })) {
      $("new-skill-name").value = "";
      selectSkill(name);
    }
  });
  for (const b of document.querySelectorAll("[data-close]")) b.addEventListener("click", () => b.closest("dialog").close());
  $("key-form").addEventListener("submit", submitKey);
  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(KEY_STORE);
    ui.key = null;
    $("forget-key").hidden = true;
    askForKey();
  });
  renderSkillSelect();
  initAgent({ socket: () => ui.socket, toast, el, button, JobCard, jobs: ui.jobs, selectSkill });
}

wire();
start();
