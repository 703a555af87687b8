// sandboxd's warm node stub: started ahead of time as `node -e <this> SKIP [MODULE...] FD`, it requires the preload
// modules and waits on descriptor FD, a stream socket, for the launch (`{args, env}` as JSON), which the init writes
// when the execution arrives. Node cannot take descriptors over a socket, so the init copies the request's stdin into this
// process's own and relays its stdout and stderr. The stub then runs the program as `node <args[SKIP]>
// <args[SKIP+1:]...>` would: the environment replaced, process.argv and process.execArgv the plain start's, the
// globals `-e` defines removed, and the script run as the main module by node's own entry point (CommonJS or ES
// module, as node decides for a plain start).
//
// When the program ends the ordinary way (its event loop ran out, or process.exit), once every 'exit' listener ran,
// the stub reports `exit N` on the same descriptor (a socket; the launch ended at its end of file): the init then
// need not wait for node's tear-down and the kernel's freeing of its memory to know the program's end. Node writes
// to pipes synchronously, so the output is in the init's pipes by then. An end through an uncaught exception or an
// unhandled rejection, whose error node prints after the 'exit' listeners, is not reported, nor is one where the
// descriptor is no longer the socket (the program closed it and opened something else under its number), nor one
// after a native addon was loaded or process.reallyExit was replaced (node runs addons' cleanup hooks, and
// process.exit the replacement, after the 'exit' listeners). The socket stays open for the report: the program finds
// one descriptor more than in a plain start (its children do not: libuv starts them with their stdio alone); the
// init takes only what this process writes.
{
  const load = require;
  const fs = require("fs");
  const path = require("path");
  const Module = require("module");
  // `-e` makes these globals, and every built-in module a lazy global (`fs`, `http`, `module`: an accessor whose
  // setter node names `setReal`); a plain start has none of them.
  for (const name of ["module", "exports", "require", "__filename", "__dirname"]) {
    delete globalThis[name];
  }
  for (const name of Module.builtinModules) {
    const d = Object.getOwnPropertyDescriptor(globalThis, name);
    if (d && d.set && d.set.name === "setReal") delete globalThis[name];
  }
  const [skipArg, ...rest] = process.argv.slice(1);
  const fd = Number(rest.pop());
  for (const name of rest) {
    // The image's preload list. One that fails here fails again in the program that requires it.
    try {
      load(name);
    } catch {}
  }
  // Code a program's start runs for the first time costs more (V8 compiles a function on its first call), so the
  // modules and functions of the stdio streams, of a write, of formatting and of the loader are run once ahead, on
  // objects of their own: nothing is written, no descriptor is opened (process.stdout would open one: it is left
  // to the program), and nothing is looked up under the program's directories, whose files arrive with the launch.
  {
    const net = load("net");
    new net.Socket({ readable: false, writable: true }).destroy();
    const sink = new (load("stream").Writable)({ write: (chunk, encoding, done) => done() });
    sink.write("x");
    // colorMode "auto" would look at the real stdio (and open a descriptor).
    new (load("console").Console)({ stdout: sink, stderr: sink, colorMode: false }).log("%s", 1, { a: [1] });
    sink.end();
  }
  load("util").format("%s %o", 1, { a: [1] });
  fs.realpathSync("/");
  fs.readFileSync("/proc/self/comm");
  {
    // The main module's resolution and load (path look-ups, realpath, the extension's loader), on /dev/null: no
    // package.json is read (it does not end in .js) and nothing enters require.cache.
    const probe = new Module("/dev/null", null);
    probe.filename = Module._resolveFilename("/dev/null", null, true);
    probe.paths = [];
    probe.load(probe.filename);
  }
  {
    const warm = new Module("/proc/sandboxd-warm.js", null);
    warm.filename = "/proc/sandboxd-warm.js";
    warm.paths = [];
    warm._compile("", warm.filename);
  }
  JSON.parse(Buffer.concat([Buffer.from('{"args": ["/"]}')]).toString("utf8"));
  // The tick queue runs once now (the warm-ups' own ticks with it, which would otherwise run after the program's
  // first line, before its own): process._tickCallback, which is node's tick processing itself unless
  // --pending-deprecation makes it a deprecated wrapper (then skipped: it would print a warning).
  const pendingDeprecation =
    process.execArgv.includes("--pending-deprecation") ||
    (process.env.NODE_OPTIONS ?? "").includes("pending-deprecation") ||
    process.env.NODE_PENDING_DEPRECATION === "1";
  if (!pendingDeprecation) {
    process.nextTick(() => {});
    process._tickCallback();
  }
  // The channel as it is now: the report is written only while the descriptor is still this socket.
  const channel = fs.fstatSync(fd);
  const chunks = [];
  const buf = Buffer.allocUnsafe(65536);
  for (;;) {
    const n = fs.readSync(fd, buf, 0, buf.length, null);
    if (n === 0) break;
    chunks.push(Buffer.from(buf.subarray(0, n)));
  }
  if (chunks.length === 0) process.reallyExit(125);
  // What the report uses, taken now: the program may replace any of them.
  const { fstatSync, writeSync } = fs;
  const { apply } = Reflect;
  const { isArray } = Array;
  const { isInteger } = Number;
  const { captureStackTrace } = Error;
  // A native addon may have cleanup hooks that node runs after the 'exit' event, and a program may have replaced
  // process.reallyExit, which process.exit calls after it: either keeps the report back (the end is then node's own).
  const { dlopen, reallyExit } = process;
  let addons = false;
  process.dlopen = function dlopen_() {
    addons = true;
    return apply(dlopen, this, arguments);
  };
  Object.defineProperty(process.dlopen, "name", { value: "dlopen" });
  const emit = process.emit;
  // process.emit of a plain start is EventEmitter's, inherited; this one is the process's own and calls it.
  process.emit = function emit_(event) {
    const result = apply(emit, this, arguments);
    if (event === "exit") report();
    return result;
  };
  Object.defineProperty(process.emit, "name", { value: "emit" });
  // Not a function declaration: in a block of the stub's sloppy code that would become a global.
  const report = () => {
    if (addons || process.reallyExit !== reallyExit) return;
    // Only from node's own end of the event loop (no caller) or from process.exit.
    const limit = Error.stackTraceLimit;
    const prepare = Error.prepareStackTrace;
    const holder = {};
    let frames;
    try {
      Error.stackTraceLimit = 3;
      Error.prepareStackTrace = (_, callSites) => callSites;
      apply(captureStackTrace, Error, [holder, report]);
      // Formatted when first read: read while prepareStackTrace is this one.
      frames = holder.stack;
    } finally {
      Error.stackTraceLimit = limit;
      Error.prepareStackTrace = prepare;
    }
    if (!isArray(frames) || frames.length === 0) return;
    const caller = frames[1];
    if (caller && !(caller.getFunctionName() === "exit" && caller.getFileName() === "node:internal/process/per_thread")) {
      return;
    }
    const code = process.exitCode ?? 0;
    if (!isInteger(code)) return;
    try {
      const now = fstatSync(fd);
      if (now.dev === channel.dev && now.ino === channel.ino) writeSync(fd, `exit ${code & 0xff}\n`);
    } catch {}
  };
  const launch = JSON.parse(Buffer.concat(chunks).toString("utf8"));
  for (const key of Object.keys(process.env)) delete process.env[key];
  for (const item of launch.env) {
    const i = item.indexOf("=");
    process.env[item.slice(0, i)] = item.slice(i + 1);
  }
  const skip = Number(skipArg);
  process.argv = [process.execPath, path.resolve(launch.args[skip]), ...launch.args.slice(skip + 1)];
  // The `-e <stub>` this process started with.
  process.execArgv = process.execArgv.slice(0, -2);
  delete process._eval;
  // Module search paths depend on the environment (HOME, NODE_PATH): computed again for the launch's.
  Module._initPaths();
  // `-e` puts the built-in `module` back on the global object once this script returns: taken off again before
  // any callback of the program runs (the first tick).
  process.nextTick(() => {
    delete globalThis.module;
  });
  Module.runMain();
}
