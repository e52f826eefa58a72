// The agent panel: MCP servers (status, tools, add by JSON, auto-approve), a task for the model, each proposed
// tool call with Approve / Edit / Reject, its result, the final answer, and Teach (learn the corrected calls).
// Model text goes through renderMarkdown (DOM nodes only); tool arguments and results only ever become
// textContent. Protocol: docs/protocol.md ("Agent").
import { renderMarkdown } from "./markdown.js";

const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,59}$/;
const FINISHED = new Set(["done", "max_steps", "cancelled", "failed"]);
const $ = (id) => document.getElementById(id);

let ctx = null;            // {socket(), toast, el, button, JobCard, selectSkill}
const state = {
  servers: {},             // name -> {config, status, tools}
  selected: null,          // Set of server names the next task may use (null: every ready one)
  runs: [],                // RunView
  refreshTimer: null,
};

function el(tag, className, text) { return ctx.el(tag, className, text); }
function button(text, onClick, className, title) { return ctx.button(text, onClick, className, title); }

function json(value) {
  try { return JSON.stringify(value, null, 2); } catch { return String(value); }
}

// ---------- servers ----------

function setServers(servers) {
  state.servers = servers || {};
  if (state.selected) {
    for (const name of [...state.selected]) if (!(name in state.servers)) state.selected.delete(name);
  }
  renderServers();
}

async function refreshServers() {
  const socket = ctx.socket();
  if (!socket?.online) return;
  try {
    setServers((await socket.call({ type: "mcp_servers" })).servers);
  } catch (e) { ctx.toast(e.message); }
}

function scheduleRefresh() {
  clearTimeout(state.refreshTimer);
  state.refreshTimer = setTimeout(refreshServers, 250);
}

function isSelected(name) {
  const s = state.servers[name];
  return state.selected ? state.selected.has(name) : s?.status.state === "ready";
}

function renderServers() {
  const names = Object.keys(state.servers).sort();
  const list = $("mcp-list");
  const ready = names.filter((n) => state.servers[n].status.state === "ready").length;
  $("mcp-summary").textContent = names.length ? `${ready}/${names.length} ready` : "none yet";
  if (!names.length) {
    list.replaceChildren(el("p", "muted", "No MCP servers yet: add one below (a stdio command or an HTTP URL)."));
    return;
  }
  list.replaceChildren(...names.map((name) => {
    const { status, tools, config } = state.servers[name];
    const card = el("div", "mcp-server");
    card.dataset.name = name;
    card.dataset.state = status.state;
    const head = el("div", "row wrap mcp-head");
    const use = el("input", "use-server");
    use.type = "checkbox";
    use.checked = isSelected(name);
    use.disabled = status.state !== "ready";
    use.setAttribute("aria-label", `Use ${name}`);
    use.addEventListener("change", () => {
      if (!state.selected) state.selected = new Set(names.filter((n) => isSelected(n)));
      if (use.checked) state.selected.add(name); else state.selected.delete(name);
    });
    const label = el("label", "mcp-name");
    label.append(use, ` ${name}`);
    const badge = el("span", `badge state-${status.state}`, status.state);
    const count = el("span", "muted", `${tools.length} tool${tools.length === 1 ? "" : "s"} · skill ${status.adapter}`);
    const auto = el("input", "auto-approve");
    auto.type = "checkbox";
    auto.checked = status.auto_approve === true;
    auto.indeterminate = Array.isArray(status.auto_approve) && status.auto_approve.length > 0;
    auto.addEventListener("change", () => serverAction({ type: "mcp_auto_approve", name, value: auto.checked }));
    const autoLabel = el("label", "muted small-label");
    autoLabel.title = "Run this server's tools without asking";
    autoLabel.append(auto, " auto-approve");
    head.append(label, badge, count, autoLabel,
      button("Restart", () => serverAction({ type: "mcp_restart_server", name }), "button subtle small restart"),
      button("Remove", () => {
        if (confirm(`Remove MCP server ${name}?`)) serverAction({ type: "mcp_remove_server", name });
      }, "button danger small remove"));
    card.append(head);
    if (status.error) card.append(el("p", "error-text", status.error));
    if (tools.length) {
      const details = el("details", "mcp-tools");
      details.append(el("summary", "muted", tools.map((t) => t.name).join(", ")));
      for (const t of tools) {
        const row = el("div", "mcp-tool");
        row.append(el("code", null, t.name), el("span", "muted", ` ${t.description || ""}`));
        const schema = el("pre", "schema", json(t.input_schema));
        row.append(schema);
        details.append(row);
      }
      card.append(details);
    }
    const where = config.command ? [config.command, ...(config.args || [])].join(" ") : config.url || "";
    card.append(el("div", "muted mcp-where", where));
    return card;
  }));
}

async function serverAction(message) {
  const err = $("mcp-error");
  err.hidden = true;
  try {
    setServers((await ctx.socket().call(message)).servers);
    return true;
  } catch (e) {
    err.textContent = e.message;
    err.hidden = false;
    scheduleRefresh();
    return false;
  }
}

async function addServer(event) {
  event.preventDefault();
  const err = $("mcp-error");
  err.hidden = true;
  let parsed;
  try { parsed = JSON.parse($("mcp-config").value); } catch (e) {
    err.textContent = `The config is not valid JSON: ${e.message}`;
    err.hidden = false;
    return;
  }
  const name = $("mcp-name").value.trim();
  let entries;
  if (name) entries = [[name, parsed]];
  else if (parsed && typeof parsed === "object" && !Array.isArray(parsed)) {
    entries = Object.entries(parsed.mcpServers && typeof parsed.mcpServers === "object" ? parsed.mcpServers : parsed);
  }
  if (!entries?.length || entries.some(([n, c]) => !NAME_RE.test(n) || !c || typeof c !== "object" || Array.isArray(c))) {
    err.textContent = "Give a name and one server's config, or JSON of {\"name\": {config}, …} (or {\"mcpServers\": …}).";
    err.hidden = false;
    return;
  }
  let ok = true;
  for (const [n, config] of entries) {
    ok = (await serverAction({ type: "mcp_add_server", name: n, config })) && ok;
  }
  if (ok) { $("mcp-name").value = ""; $("mcp-config").value = ""; }
}

// ---------- runs ----------

class RunView {
  constructor(task) {
    this.task = task;
    this.runId = null;
    this.state = "sending";
    this.calls = new Map();        // call id -> CallView
    this.turns = new Map();        // step -> turn node
    this.stream = null;            // the text being generated
    this.corrected = false;        // some call was edited or written by the user: there is something to teach
    this.tools = [];
    this.node = el("article", "agent-run");
    this.node.dataset.state = this.state;
    const head = el("div", "message-head");
    this.meta = el("span", "meta");
    this.status = el("span", "agent-status");
    head.append(el("span", "role", "Task"), this.meta, this.status);
    this.body = el("div", "agent-body");
    this.body.append(el("p", "plain task", task));
    this.footer = el("div", "actions agent-actions");
    this.jobBox = el("div", "job");
    this.jobBox.hidden = true;
    this.node.append(head, this.body, this.footer, this.jobBox);
  }

  get finished() { return FINISHED.has(this.state); }

  onFrame(frame) {
    switch (frame.type) {
      case "agent_started":
        this.runId = frame.run_id;
        this.tools = frame.tools || [];
        this.meta.textContent = `${frame.servers.join(", ") || "no servers"} · ${frame.adapter ? `skill ${frame.adapter}` : "base model"}`;
        break;
      case "agent_state":
        this.setState(frame.state);
        break;
      case "agent_delta":
        if (!this.stream) {
          this.stream = el("pre", "agent-stream");
          this.body.append(this.stream);
        }
        this.stream.textContent += frame.text;
        break;
      case "agent_turn":
        this.stream?.remove();
        this.stream = null;
        this.addTurn(frame.step, frame.content, frame.calls, frame.calls.length === 0);
        break;
      case "agent_turn_corrected":
        this.corrected = true;
        this.addTurn(frame.step, "", frame.calls, false, true);
        break;
      case "tool_call_edited":
        this.corrected = true;
        this.calls.get(frame.call.id)?.update(frame.call);
        break;
      case "tool_running": case "tool_result": case "tool_rejected": case "tool_replaced":
        this.calls.get(frame.call.id)?.update(frame.call);
        break;
      case "agent_final":
        this.body.querySelector(".agent-turn:last-child")?.classList.add("final");
        break;
      case "agent_error":
        this.body.append(el("p", "error-text", frame.error));
        break;
      case "error":
        this.body.append(el("p", "error-text", frame.message));
        if (frame.code !== "disconnected") ctx.toast(frame.message);
        this.setState("failed");
        break;
      default:
        break;
    }
    this.renderFooter();
    scrollRuns();
  }

  setState(s) {
    this.state = s;
    this.node.dataset.state = s;
    this.status.textContent = {
      generating: "thinking…", awaiting_approval: "waiting for you", ready: "…", done: "done",
      max_steps: "stopped at the step cap", cancelled: "stopped", failed: "failed",
    }[s] || s;
    if (s === "cancelled") {   // calls that waited for a decision will not run now
      for (const view of this.calls.values()) {
        if (["pending", "invalid"].includes(view.call.status)) {
          view.editing = false;
          view.update({ ...view.call, status: "rejected", reason: "the run was stopped" });
        }
      }
    }
    updateComposer();
  }

  addTurn(step, content, calls, final, corrected = false) {
    let turn = this.turns.get(step);
    if (!turn) {
      turn = el("div", "agent-turn");
      turn.dataset.step = step;
      this.turns.set(step, turn);
      this.body.append(turn);
    }
    turn.classList.toggle("corrected", corrected);
    turn.replaceChildren();
    if (corrected) turn.append(el("div", "muted small-label", "your calls for this step"));
    if (content && content.trim()) {
      const text = el("div", final ? "body agent-final" : "body");
      renderMarkdown(content, text);
      turn.append(text);
    }
    if (final && !calls.length) {
      turn.classList.add("no-call");
      turn.append(button("✎ Write the call it should make", () => this.writeCall(turn), "button subtle small write-call",
        "The model answered without a tool: write the call it should have made; it runs, and Teach learns it"));
    }
    for (const call of calls) {
      const view = new CallView(this, call);
      this.calls.set(call.id, view);
      turn.append(view.node);
    }
  }

  writeCall(turn) {
    if (turn.querySelector(".call-edit")) return;
    const form = callForm(this.tools, { name: this.tools[0] || "", arguments: {} }, "Run this call", async (edited) => {
      await ctx.socket().call({ type: "agent_correct_turn", run_id: this.runId, calls: [edited] });
      form.remove();
    }, () => form.remove());
    turn.append(form);
    form.querySelector(".edit-args").focus();
  }

  renderFooter() {
    const parts = [];
    if (this.runId && !this.finished && this.state !== "sending") {
      parts.push(button("Stop", () => ctx.socket().call({ type: "agent_stop", run_id: this.runId }).catch((e) => ctx.toast(e.message)),
        "button danger small stop-run"));
    }
    if (this.corrected && this.runId && ["done", "max_steps", "ready", "awaiting_approval", "cancelled"].includes(this.state) && !this.teaching) {
      parts.push(button("Teach", () => this.teach(), "button primary small teach-agent",
        "Teach this server's skill the calls you corrected, so the model makes them itself"));
    }
    this.footer.replaceChildren(...parts);
  }

  teach() {
    this.teaching = true;
    this.renderFooter();
    const card = new ctx.JobCard({ jobBox: this.jobBox }, "the tool skill", { regenerate: false });
    ctx.socket().request({ type: "agent_learn", run_id: this.runId }, (frame) => {
      if (frame.type === "error") {
        card.fail(frame.message);
        this.teaching = false;
        this.renderFooter();
        return;
      }
      if (frame.type !== "job") return;
      if (!card.jobId) { card.jobId = frame.job_id; ctx.jobs.set(frame.job_id, card); }
      card.update(frame);
      if (frame.state === "done") {
        this.jobBox.append(button(`↻ Run the task again with ${frame.adapter}`, () => runTask(this.task),
          "button primary small run-again", "The same task: see whether the skill now makes the call itself"));
      }
    });
  }
}

class CallView {
  constructor(run, call) {
    this.run = run;
    this.node = el("div", "tool-call");
    this.update(call);
  }

  update(call) {
    this.call = call;
    const n = this.node;
    n.dataset.callId = call.id;
    n.dataset.status = call.status;
    if (this.editing) return;
    const head = el("div", "row wrap call-head");
    head.append(el("span", "call-icon", "⚙"), el("code", "call-name", call.name ?? "(unreadable call)"),
      el("span", `badge call-status status-${call.status}`, call.status + (call.auto_approved ? " (auto)" : "") + (call.edited ? " · edited" : "")));
    const parts = [head];
    if (call.arguments != null) parts.push(el("div", "muted small-label", "arguments"), el("pre", "args", json(call.arguments)));
    else if (call.raw) parts.push(el("div", "muted small-label", "as the model wrote it"), el("pre", "args raw", call.raw));
    if (call.edited && call.proposed) {
      parts.push(el("div", "muted small-label proposed", `the model proposed: ${call.proposed.name} ${JSON.stringify(call.proposed.arguments)}`));
    }
    if (call.error) parts.push(el("p", "error-text call-error", call.error));
    if (call.reason) parts.push(el("p", "muted small-label", `rejected: ${call.reason}`));
    if (call.result != null && ["done", "error"].includes(call.status)) {
      const result = el("pre", `result${call.status === "error" ? " error" : ""}`, call.result);
      parts.push(el("div", "muted small-label", call.status === "error" ? "error" : "result"), result);
      if (call.result_cut) parts.push(el("div", "muted small-label", "(cut to the token budget for the model)"));
    }
    if (["pending", "invalid"].includes(call.status) && !this.run.finished) {
      const actions = el("div", "actions call-actions");
      const approve = button("✓ Approve", () => this.decide({ type: "agent_approve", call_id: call.id }), "button primary small approve");
      approve.disabled = call.status === "invalid";
      if (approve.disabled) approve.title = "This call cannot run as written: edit it or reject it";
      actions.append(approve,
        button("✎ Edit", () => this.edit(), "button subtle small edit"),
        button("✕ Reject", () => {
          const reason = prompt("Why? (the model reads this)", "") ?? null;
          if (reason !== null) this.decide({ type: "agent_reject", call_id: call.id, reason });
        }, "button danger small reject"));
      parts.push(actions);
    }
    n.replaceChildren(...parts);
  }

  async decide(message) {
    for (const b of this.node.querySelectorAll(".call-actions button")) b.disabled = true;
    try {
      const ack = await ctx.socket().call(message);
      this.editing = false;
      this.update(ack.data.call);
    } catch (e) {
      ctx.toast(e.message);
      this.update(this.call);
    }
  }

  edit() {
    this.editing = true;
    const current = { name: this.call.name || this.run.tools[0] || "", arguments: this.call.arguments ?? {} };
    const form = callForm(this.run.tools, current, "Approve edited", async (edited) => {
      const ack = await ctx.socket().call({ type: "agent_approve", call_id: this.call.id, edited });
      this.editing = false;
      this.update(ack.data.call);
    }, () => { this.editing = false; this.update(this.call); });
    this.node.querySelector(".call-actions")?.remove();
    this.node.append(form);
    form.querySelector(".edit-args").focus();
  }
}

// A small form for a call: the tool (one of the run's) and its arguments as JSON, checked before sending.
function callForm(tools, call, submitText, onSubmit, onCancel) {
  const form = el("form", "call-edit");
  const name = el("select", "edit-name");
  name.setAttribute("aria-label", "Tool");
  const options = tools.includes(call.name) || !call.name ? tools : [call.name, ...tools];
  for (const t of options) name.append(new Option(t, t, false, t === call.name));
  const args = el("textarea", "edit-args");
  args.spellcheck = false;
  args.value = json(call.arguments);
  args.rows = Math.min(12, Math.max(3, args.value.split("\n").length + 1));
  args.setAttribute("aria-label", "Arguments (JSON)");
  const error = el("p", "error-text edit-error");
  error.hidden = true;
  const submit = el("button", "button primary small run-edited", submitText);
  submit.type = "submit";
  const row = el("div", "row wrap");
  row.append(submit, button("Cancel", onCancel, "button subtle small cancel-edit"));
  const label = el("div", "muted small-label", "Tool and arguments (JSON)");
  form.append(label, name, args, error, row);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.hidden = true;
    let parsed;
    try { parsed = JSON.parse(args.value || "{}"); } catch (e) {
      error.textContent = `Arguments are not valid JSON: ${e.message}`;
      error.hidden = false;
      return;
    }
    if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) {
      error.textContent = "Arguments must be a JSON object, e.g. {\"timezone\": \"Asia/Tokyo\"}";
      error.hidden = false;
      return;
    }
    submit.disabled = true;
    try {
      await onSubmit({ name: name.value, arguments: parsed });
    } catch (e) {
      error.textContent = e.message;   // the server checks it against the tool's schema
      error.hidden = false;
      submit.disabled = false;
    }
  });
  return form;
}

function scrollRuns() {
  const box = $("agent-runs");
  if (box.scrollHeight - box.scrollTop - box.clientHeight < 200) box.scrollTop = box.scrollHeight;
}

function activeRun() {
  return state.runs.find((r) => !r.finished && r.state !== "awaiting_approval" && r.runId);
}

function updateComposer() {
  const busy = state.runs.some((r) => r.state === "sending" || r.state === "generating" || r.state === "ready");
  $("agent-send").hidden = busy;
  $("agent-stop").hidden = !busy;
}

function runTask(task = null) {
  const input = $("agent-input");
  const content = (task ?? input.value).trim();
  if (!content) return;
  const socket = ctx.socket();
  if (!socket?.online) { ctx.toast("Not connected yet; the task was kept"); return; }
  const servers = Object.keys(state.servers).filter((n) => isSelected(n) && state.servers[n].status.state === "ready");
  if (!servers.length) { ctx.toast("Pick at least one ready MCP server for the agent"); return; }
  if (task === null) input.value = "";
  $("agent-servers").open = false;   // room for the run (the list opens again with a click)
  const run = new RunView(content);
  state.runs.push(run);
  $("agent-empty").hidden = true;
  $("agent-runs").append(run.node);
  run.setState("sending");
  socket.request({ type: "agent", content, servers }, (frame) => run.onFrame(frame));
  scrollRuns();
}

// ---------- wiring ----------

export function showAgent(on) {
  document.body.classList.toggle("agent-mode", on);
  $("agent-view").hidden = !on;
  $("agent-button").setAttribute("aria-pressed", String(on));
  $("agent-button").classList.toggle("pressed", on);
  if (on) { refreshServers(); $("agent-input").focus(); }
}

export function agentOnHello() {
  refreshServers();
}

export function agentUnsolicited(frame) {
  if (frame.type !== "mcp_status") return false;
  const entry = state.servers[frame.name];
  if (entry) {
    entry.status = { ...entry.status, ...frame };
    renderServers();
  }
  scheduleRefresh();   // tools change with the status: fetch the full view
  return true;
}

export function initAgent(context) {
  ctx = context;
  $("agent-button").addEventListener("click", () => showAgent(!document.body.classList.contains("agent-mode")));
  $("mcp-add").addEventListener("submit", addServer);
  $("agent-form").addEventListener("submit", (e) => { e.preventDefault(); runTask(); });
  $("agent-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); if (!$("agent-send").hidden) runTask(); }
  });
  $("agent-stop").addEventListener("click", () => {
    const run = activeRun();
    if (run) ctx.socket().call({ type: "agent_stop", run_id: run.runId }).catch((e) => ctx.toast(e.message));
  });
  renderServers();
}
