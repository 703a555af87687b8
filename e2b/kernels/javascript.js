// sandboxd's javascript context for e2b-code-interpreter's run_code: one node whose global scope (variables,
// functions, `let`/`const` of earlier cells) persists between cells. Cells arrive as JSON lines on stdin; output,
// the last expression's value and errors go out as JSON lines on stdout, then the cell's end. A cell using
// `await` at its top level runs as an async function (its value is then not reported). Started as `node -e <this>`.
const fs = require('fs');
const vm = require('vm');
const util = require('util');
const readline = require('readline');

const emit = (o) => fs.writeSync(1, JSON.stringify(o) + '\n');
const stamp = () => Date.now() * 1000;
const { Writable } = require('stream');
const writer = (kind) => new Writable({
  write(chunk, enc, cb) {
    emit({ type: kind, text: Buffer.from(chunk).toString('utf8'), timestamp: stamp() });
    cb();
  },
});
const cellConsole = new console.Console({ stdout: writer('stdout'), stderr: writer('stderr') });
const sandbox = { console: cellConsole, require, process, Buffer, setTimeout, clearTimeout, setInterval,
  clearInterval, setImmediate, clearImmediate, URL, TextEncoder, TextDecoder, fetch: globalThis.fetch };
sandbox.globalThis = sandbox;
const context = vm.createContext(sandbox);
let count = 0;

async function run(code) {
  let value;
  try {
    value = new vm.Script(code, { filename: '<cell>' }).runInContext(context);
  } catch (e) {
    if (e instanceof SyntaxError && /await/.test(e.message)) {
      await new vm.Script(`(async () => {\n${code}\n})()`, { filename: '<cell>' }).runInContext(context);
      return;
    }
    throw e;
  }
  if (value && typeof value.then === 'function') value = await value;
  if (value !== undefined) {
    emit({ type: 'result', is_main_result: true, text: util.inspect(value) });
  }
}

const rl = readline.createInterface({ input: process.stdin });
const queue = [];
let busy = false;
async function next() {
  if (busy || queue.length === 0) return;
  busy = true;
  const cell = queue.shift();
  count += 1;
  const saved = { ...process.env };
  try {
    Object.assign(process.env, cell.env || {});
    await run(cell.code || '');
  } catch (e) {
    const name = (e && e.name) || 'Error';
    emit({ type: 'error', name, value: e && e.message !== undefined ? String(e.message) : String(e),
      traceback: (e && e.stack) || String(e) });
  } finally {
    for (const k of Object.keys(process.env)) if (!(k in saved)) delete process.env[k];
    Object.assign(process.env, saved);
    emit({ type: 'number_of_executions', execution_count: count });
    emit({ type: '__done__' });
    busy = false;
    next();
  }
}
rl.on('line', (line) => {
  try { queue.push(JSON.parse(line)); } catch (e) { return; }
  next();
});
process.on('SIGINT', () => {});
