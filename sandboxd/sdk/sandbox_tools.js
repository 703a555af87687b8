// Tools of this execution, called through sandboxd (the `tool_calls` extension of FSP/1).
//
// sandboxd writes this file next to the code of an execution whose request lists tools. Every tool is an async
// function of the same name (also `require("sandbox_tools")`); a call goes over the unix socket
// /sandbox/tools.sock to the daemon, which forwards it to the orchestrator and resolves with its answer.
//
//   const text = await read_file("notes.txt");         // positional arguments follow the tool's schema
//   const hits = await grep({content: text, pattern: "x"}); // or one object of arguments
//   await call("read_file", {path: "a"}, {timeoutMs: 500}); // the generic form, with a shorter timeout
//
// A failed call rejects with a ToolError whose `code` is not_allowed, timeout, tool_error, invalid, limit or closed.
"use strict";

const fs = require("fs");
const net = require("net");
const path = require("path");

const SOCKET = process.env.SANDBOX_TOOLS_SOCKET || "/sandbox/tools.sock";

class ToolError extends Error {
  constructor(code, message) {
    super(`${code}: ${message}`);
    this.name = "ToolError";
    this.code = code;
    this.toolMessage = message;
  }
}

const listed = JSON.parse(fs.readFileSync(path.join(__dirname, "sandbox_tools.json"), "utf8"));
// The socket's limits: connections served at once per execution, and the longest request line.
const _limits = {
  maxConnections: Math.max(1, listed.max_connections || 8),
  maxLine: listed.max_line_bytes || 1 << 20,
};

// The daemon serves one request at a time per connection and at most `maxConnections` connections per execution.
// Requests wait in `queue`; each open connection takes the next one after its reply, and closes when none is left,
// so an idle program (or worker) never keeps a connection from the others.
const queue = [];
let open = 0;
let connecting = 0;

function request(message) {
  return new Promise((resolve, reject) => {
    const line = JSON.stringify(message) + "\n";
    const size = Buffer.byteLength(line) - 1;
    if (size > _limits.maxLine) {
      reject(new ToolError("invalid", `The request is ${size} bytes, over the tool socket's limit of ${_limits.maxLine}`));
      return;
    }
    queue.push({ line, resolve, reject });
    pump();
  });
}

function pump() {
  // A connection being opened takes a request once connected: open more only for requests beyond those.
  while (queue.length > connecting && open < _limits.maxConnections) {
    open += 1;
    connecting += 1;
    connect();
  }
}

function connect() {
  const sock = net.createConnection(SOCKET);
  let current = null;
  let buffered = "";
  let done = false;
  let connected = false;
  const next = () => {
    current = queue.shift() || null;
    if (current) sock.write(current.line);
    else finish();
  };
  const finish = () => {
    if (done) return;
    done = true;
    if (!connected) connecting -= 1;
    open -= 1;
    sock.destroy();
    pump();
  };
  sock.setEncoding("utf8");
  sock.on("connect", () => {
    connected = true;
    connecting -= 1;
    next();
  });
  sock.on("data", (chunk) => {
    buffered += chunk;
    let nl;
    while ((nl = buffered.indexOf("\n")) >= 0) {
      const text = buffered.slice(0, nl);
      buffered = buffered.slice(nl + 1);
      const w = current;
      current = null;
      if (!w) continue;
      let reply;
      try {
        reply = JSON.parse(text);
      } catch (e) {
        w.reject(new ToolError("invalid", `Unreadable reply from the tool socket: ${text.slice(0, 200)}`));
        finish();
        return;
      }
      w.resolve(reply);
      // After `invalid` the daemon may have closed the connection: later requests use a fresh one.
      if (!reply.ok && reply.error && reply.error.code === "invalid") {
        finish();
        return;
      }
      next();
    }
  });
  const fail = (err) => {
    // The request in flight fails; so does the next one when no connection could be made.
    const w = current || (connected || done ? null : queue.shift());
    current = null;
    if (w) w.reject(new ToolError("closed", err ? `The tool socket failed: ${err.message}` : "The tool socket closed"));
    finish();
  };
  sock.on("error", fail);
  sock.on("close", () => fail(null));
}

async function call(name, args = {}, options = {}) {
  const message = { op: "call", name, args: args || {} };
  if (options && options.timeoutMs) message.timeout_ms = Math.floor(options.timeoutMs);
  const reply = await request(message);
  if (reply.ok) return reply.result;
  const error = reply.error || {};
  throw new ToolError(error.code || "error", error.message || "");
}

async function _return(value) {
  const reply = await request({ op: "return", value });
  if (!reply.ok) {
    const error = reply.error || {};
    throw new ToolError(error.code || "error", error.message || "");
  }
}

function _close() {
  // Connections close by themselves once no request is left.
}

function isPlainObject(v) {
  return v !== null && typeof v === "object" && Object.getPrototypeOf(v) === Object.prototype;
}

function make(name, params, description) {
  const tool = async (...args) => {
    if (args.length === 1 && isPlainObject(args[0]) && (params.length === 0 || Object.keys(args[0]).every((k) => params.includes(k)))) {
      return call(name, args[0]);
    }
    if (args.length > params.length) {
      throw new TypeError(`${name}() takes ${params.length} positional arguments (${params.join(", ")}), got ${args.length}`);
    }
    const merged = {};
    args.forEach((a, i) => { merged[params[i]] = a; });
    return call(name, merged);
  };
  Object.defineProperty(tool, "name", { value: name });
  tool.description = description;
  return tool;
}

const tools = {};
for (const t of listed.tools) tools[t.name] = make(t.name, t.params || [], t.description || "");

module.exports = { ...tools, call, ToolError, _tools: tools, _return, _close, _limits };
