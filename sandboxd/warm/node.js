// sandboxd's warm node stub: started ahead of time as `node -e <this> SKIP [MODULE...] FD`, it requires the preload
// modules and waits on descriptor FD, a pipe, for the launch (`{args, env}` as JSON), which the init writes when the
// execution arrives. Node cannot take descriptors over a socket, so the init copies the request's stdin into this
// process's own and relays its stdout and stderr. The stub then runs the program as `node <args[SKIP]>
// <args[SKIP+1:]...>` would: the environment replaced, process.argv and process.execArgv the plain start's, the
// globals `-e` defines removed, and the script run as the main module by node's own entry point (CommonJS or ES
// module, as node decides for a plain start).
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
    sink.end();
  }
  load("util").format("%s %o", 1, { a: [1] });
  fs.realpathSync("/");
  fs.readFileSync("/proc/self/comm");
  {
    const warm = new Module("/proc/sandboxd-warm.js", null);
    warm.filename = "/proc/sandboxd-warm.js";
    warm.paths = [];
    warm._compile("", warm.filename);
  }
  const chunks = [];
  const buf = Buffer.allocUnsafe(65536);
  for (;;) {
    const n = fs.readSync(fd, buf, 0, buf.length, null);
    if (n === 0) break;
    chunks.push(Buffer.from(buf.subarray(0, n)));
  }
  fs.closeSync(fd);
  if (chunks.length === 0) process.reallyExit(125);
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
