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

// One connection; the daemon answers its requests one at a time and in order, so replies match a FIFO of waiters.
let conn = null;
let buffered = "";
const waiting = [];

function connection() {
  if (conn) return conn;
  conn = net.createConnection(SOCKET);
  conn.setEncoding("utf8");
  conn.on("data", (chunk) => {
    buffered += chunk;
    let nl;
    while ((nl = buffered.indexOf("\n")) >= 0) {
      const line = buffered.slice(0, nl);
      buffered = buffered.slice(nl + 1);
      const w = waiting.shift();
      if (w) w.resolve(JSON.parse(line));
    }
    if (waiting.length === 0) conn.unref();
  });
  const fail = (err) => {
    const e = new ToolError("closed", err ? `The tool socket failed: ${err.message}` : "The tool socket closed");
    conn = null;
    buffered = "";
    while (waiting.length) waiting.shift().reject(e);
  };
  conn.on("error", fail);
  conn.on("close", () => fail(null));
  return conn;
}

function request(message) {
  return new Promise((resolve, reject) => {
    const c = connection();
    c.ref();
    waiting.push({ resolve, reject });
    c.write(JSON.stringify(message) + "\n");
  });
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
  if (conn) conn.end();
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

const listed = JSON.parse(fs.readFileSync(path.join(__dirname, "sandbox_tools.json"), "utf8")).tools;
const tools = {};
for (const t of listed) tools[t.name] = make(t.name, t.params || [], t.description || "");

module.exports = { ...tools, call, ToolError, _tools: tools, _return, _close };
