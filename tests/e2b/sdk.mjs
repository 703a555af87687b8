// The unchanged JavaScript SDK (npm e2b, pinned by tests/e2b/setup.sh) against sandboxd's E2B facade: create with
// envs and metadata, commands.run with onStdout (streamed before the end), a non-zero exit, files.write/read of
// text and of 1 MiB of random bytes (byte-exact), kill. Configured by E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL
// alone, as a user's program is. The SDK is loaded from SANDBOXD_TEST_E2B_NODE (its node_modules directory), else
// the first NODE_PATH entry, else the ordinary resolution. Prints one line per check; any failure exits 1 with a
// message. sandboxd/tests/suite/e2b_sdk.rs runs it.
import { createHash, randomBytes } from 'node:crypto'
import { createRequire } from 'node:module'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { pathToFileURL } from 'node:url'

async function loadSdk() {
  const dir = process.env.SANDBOXD_TEST_E2B_NODE || (process.env.NODE_PATH || '').split(':')[0]
  if (!dir) return import('e2b')
  // NODE_PATH does not apply to `import`: resolve from the directory, as a file inside it would.
  const require = createRequire(join(dir, 'sdk.mjs'))
  return import(pathToFileURL(require.resolve('e2b')).href)
}

function check(cond, what, detail) {
  if (!cond) throw new Error(`${what}${detail === undefined ? '' : `: ${detail}`}`)
  console.log(`ok  ${what}`)
}

const sha256 = (bytes) => createHash('sha256').update(bytes).digest('hex')

async function scenarios({ Sandbox, CommandExitError }, created) {
  const tag = `sdk-mjs-${process.pid}-${Date.now()}`
  const sbx = await Sandbox.create({ envs: { JS_VAR: 'js-value' }, metadata: { suite: tag } })
  created.push(sbx.sandboxId)
  check(typeof sbx.sandboxId === 'string' && sbx.sandboxId.length > 0, 'create', sbx.sandboxId)

  const info = await sbx.getInfo()
  check(info.metadata?.suite === tag, 'getInfo shows the metadata', JSON.stringify(info.metadata))

  const ticks = []
  const run = await sbx.commands.run('echo a; sleep 1; echo b; echo "$JS_VAR"', {
    onStdout: (data) => ticks.push({ at: performance.now(), data }),
  })
  const end = performance.now()
  check(run.exitCode === 0 && run.stdout === 'a\nb\njs-value\n', 'run: stdout and the sandbox env',
    JSON.stringify(run))
  check(ticks.length > 0 && ticks[0].data.startsWith('a'), 'onStdout fired', JSON.stringify(ticks))
  check(end - ticks[0].at >= 500, 'onStdout fired before the command ended',
    `first chunk ${Math.round(end - ticks[0].at)} ms before the end (want >= 500)`)

  let exit
  try {
    await sbx.commands.run('echo oops >&2; exit 3')
  } catch (e) {
    exit = e
  }
  check(exit instanceof CommandExitError && exit.exitCode === 3 && exit.stderr.includes('oops'),
    'a non-zero exit throws CommandExitError with the code and stderr', String(exit))

  const dir = `/home/user/${tag}`
  await sbx.files.write(`${dir}/hello.txt`, 'hello from js')
  check((await sbx.files.read(`${dir}/hello.txt`)) === 'hello from js', 'files.write/read text')
  const cat = await sbx.commands.run(`cat ${dir}/hello.txt`)
  check(cat.stdout === 'hello from js', 'a command sees the written file', JSON.stringify(cat.stdout))

  const data = randomBytes(1 << 20)
  const buf = data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength)
  await sbx.files.write(`${dir}/blob.bin`, buf)
  const back = await sbx.files.read(`${dir}/blob.bin`, { format: 'bytes' })
  check(back.length === data.length && sha256(back) === sha256(data), 'files.write/read 1 MiB binary byte-exact',
    `${back.length} bytes, sha256 ${sha256(back)} (want ${sha256(data)})`)

  await sbx.kill()
  check(!(await sbx.isRunning()), 'kill: the sandbox is no longer running')
  check((await Sandbox.kill(sbx.sandboxId)) === false, 'kill again by id returns false')
  created.splice(created.indexOf(sbx.sandboxId), 1)
}

async function main() {
  for (const name of ['E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL']) {
    if (!process.env[name]) throw new Error(`${name} is not set`)
  }
  const sdk = await loadSdk()
  const created = []
  try {
    await scenarios(sdk, created)
  } finally {
    for (const id of created) {
      await sdk.Sandbox.kill(id).catch((e) => console.error(`cleanup: kill ${id}: ${e}`))
    }
  }
  console.log('sdk.mjs: all checks passed')
}

main().catch((e) => {
  console.error(`sdk.mjs FAILED: ${e?.stack ?? e}`)
  process.exit(1)
})
