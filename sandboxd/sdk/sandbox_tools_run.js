// Runs the code of an execution with tools (sandboxd writes this file; see sandbox_tools.js).
//
// The code runs as the body of an async function with every tool in scope, so it may `await` tool calls and end
// with `return value`; a returned value other than undefined is sent to the daemon, which reports it as
// `result.return_value` (as JSON).
"use strict";

const fs = require("fs");
const sdk = require("./sandbox_tools.js");

const file = process.argv[2];
const source = fs.readFileSync(file, "utf8");
const AsyncFunction = Object.getPrototypeOf(async () => {}).constructor;
const names = Object.keys(sdk._tools);
const params = ["require", "module", "exports", "__filename", "__dirname", "call", "ToolError", ...names];
const values = [require, module, exports, file, "/sandbox", sdk.call, sdk.ToolError, ...names.map((n) => sdk._tools[n])];

(async () => {
  let body;
  try {
    body = new AsyncFunction(...params, source);
  } catch (e) {
    console.error(`${file}: ${e.stack || e}`);
    process.exitCode = 1;
    return;
  }
  try {
    const value = await body(...values);
    if (value !== undefined) await sdk._return(value);
  } catch (e) {
    console.error(e && e.stack ? e.stack : e);
    process.exitCode = 1;
  } finally {
    sdk._close();
  }
})();
