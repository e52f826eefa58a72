// The websocket client: requests correlated by id, automatic reconnect with backoff, the API key sent
// as a subprotocol (browsers cannot set headers on a websocket). Protocol: docs/protocol.md.

export const PROTOCOL = 1;
const FINAL = new Set(["done", "error", "adapters", "conversations", "history", "ack", "pong"]);
const FINAL_JOB = new Set(["done", "failed", "cancelled"]);

export function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let bin = "";
  for (const b of bytes) bin += String.fromCharCode(b);
  return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

export function authHeaders(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

export class DarkSocket {
  constructor({ url, key = null, onHello, onUnsolicited, onStatus }) {
    this.url = url;
    this.key = key;
    this.onHello = onHello || (() => {});
    this.onUnsolicited = onUnsolicited || (() => {});
    this.onStatus = onStatus || (() => {});
    this.handlers = new Map();
    this.seq = 0;
    this.retry = 0;
    this.ws = null;
    this.closed = false;
    this.hello = null;
  }

  connect() {
    this.closed = false;
    this.onStatus("connecting");
    const protocols = ["dark.v1"];
    if (this.key) protocols.push(`bearer.${base64url(this.key)}`);
    const ws = new WebSocket(this.url, protocols);
    this.ws = ws;
    ws.addEventListener("message", (event) => this._frame(event.data));
    ws.addEventListener("close", (event) => this._closed(ws, event));
  }

  close() {
    this.closed = true;
    this.ws?.close();
  }

  get online() {
    return this.ws?.readyState === WebSocket.OPEN && this.hello !== null;
  }

  // Send a message; onFrame gets every frame with its id until the last one. Returns the id.
  request(message, onFrame = () => {}) {
    const id = message.id ?? `r${++this.seq}`;
    const msg = { ...message, id };
    if (!this.online) {
      queueMicrotask(() => onFrame({ type: "error", id, code: "offline", message: "not connected to the server; it will retry" }));
      return id;
    }
    this.handlers.set(id, onFrame);
    this.ws.send(JSON.stringify(msg));
    return id;
  }

  // A request answered by one frame, as a promise (rejects on an error frame).
  call(message) {
    return new Promise((resolve, reject) => {
      this.request(message, (frame) => (frame.type === "error" ? reject(new Error(frame.message)) : resolve(frame)));
    });
  }

  send(message) {
    if (this.online) this.ws.send(JSON.stringify(message));
  }

  _frame(data) {
    let frame;
    try { frame = JSON.parse(data); } catch { return; }
    if (frame.type === "hello") {
      this.hello = frame;
      this.retry = 0;
      this.onStatus("online");
      this.onHello(frame);
      return;
    }
    const handler = frame.id !== null && frame.id !== undefined ? this.handlers.get(frame.id) : undefined;
    if (!handler) { this.onUnsolicited(frame); return; }
    const last = frame.type === "job" ? FINAL_JOB.has(frame.state) : FINAL.has(frame.type);
    if (last) this.handlers.delete(frame.id);
    handler(frame);
  }

  _closed(ws, event) {
    if (ws !== this.ws) return;
    this.hello = null;
    for (const [id, handler] of this.handlers) {
      handler({ type: "error", id, code: "disconnected", message: "the connection to the server was lost" });
    }
    this.handlers.clear();
    if (this.closed) { this.onStatus("closed"); return; }
    const delay = Math.min(8000, 500 * 2 ** this.retry++) * (0.75 + Math.random() / 2);
    this.onStatus("offline", { delay, code: event.code });
    setTimeout(() => { if (!this.closed) this.connect(); }, delay);
  }
}
