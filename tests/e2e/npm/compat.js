// Drives an OpenWhisk-compatible REST API with the official `openwhisk` npm client, as a user would.
//
//   __OW_API_HOST=http://127.0.0.1:3233 __OW_API_KEY=<uuid:key> node compat.js
//
// Creates a python:3-gpu action, invokes it blocking (result only and full activation) and non-blocking,
// reads the activation, its result and its logs, lists activations and actions, checks two refusals
// (unknown kind, missing action), and deletes the action. Prints one JSON summary line and exits non-zero
// on the first mismatch. Nothing here knows what runs the actions: it needs a real Python runtime behind
// the API (or anything that runs `main` and keeps its prints as logs).
'use strict'

const openwhisk = require('openwhisk')

const apihost = process.env.__OW_API_HOST
const apiKey = process.env.__OW_API_KEY
if (!apihost || !apiKey) {
  console.error('set __OW_API_HOST and __OW_API_KEY')
  process.exit(2)
}
const ow = openwhisk({ apihost, api_key: apiKey, namespace: process.env.__OW_NAMESPACE || '_' })
const actionName = process.env.DILU_COMPAT_ACTION || `dilu-compat-${process.pid}-${Date.now()}`
const pollTimeoutMs = Number(process.env.DILU_COMPAT_POLL_MS || 60000)

const CODE = [
  'import os',
  '',
  'def main(args):',
  '    name = args.get("name", "stranger")',
  '    print("compat log line for " + name)',
  '    return {"greeting": "Hello " + name, "activation": os.environ.get("__OW_ACTIVATION_ID", "")}',
  ''
].join('\n')

const checks = []

function check (what, ok, detail) {
  checks.push(what)
  if (!ok) {
    const err = new Error(`mismatch: ${what}${detail === undefined ? '' : ' -- ' + JSON.stringify(detail)}`)
    err.mismatch = true
    throw err
  }
}

const sleep = ms => new Promise(resolve => setTimeout(resolve, ms))

async function poll (what, fn) {
  const deadline = Date.now() + pollTimeoutMs
  let lastError
  while (Date.now() < deadline) {
    try {
      return await fn()
    } catch (err) {
      if (err.statusCode !== 404) throw err
      lastError = err
    }
    await sleep(250)
  }
  throw new Error(`gave up waiting for ${what}: ${lastError && lastError.message}`)
}

async function expectStatus (what, promise, status) {
  try {
    await promise
  } catch (err) {
    check(`${what} answers ${status}`, err.statusCode === status, { statusCode: err.statusCode, error: err.error })
    check(`${what} error body has OpenWhisk's shape`,
      err.error && typeof err.error.error === 'string' && typeof err.error.code === 'string', err.error)
    return err
  }
  check(`${what} answers ${status}`, false, 'the call succeeded')
}

async function run () {
  const created = await ow.actions.create({
    name: actionName,
    action: CODE,
    kind: 'python:3-gpu',
    annotations: { 'gpu-class': 'inference', 'gpu-sm-request': 0.2, 'gpu-memory-mb': 1024 },
    params: { name: 'default' }
  })
  check('create returns the action', created.name === actionName && created.exec.kind === 'python:3-gpu', created)

  const fetched = await ow.actions.get({ name: actionName })
  check('get returns the code', fetched.exec.code === CODE, fetched.exec)
  const annotations = Object.fromEntries(fetched.annotations.map(a => [a.key, a.value]))
  check('annotations are kept', annotations['gpu-class'] === 'inference' && annotations.exec === 'python:3-gpu',
    fetched.annotations)

  const listed = await ow.actions.list()
  check('the action is listed', listed.some(a => a.name === actionName), listed.map(a => a.name))

  const result = await ow.actions.invoke({ name: actionName, params: { name: 'dilu' }, blocking: true, result: true })
  check('blocking result', result.greeting === 'Hello dilu', result)

  const full = await ow.actions.invoke({ name: actionName, blocking: true })
  check('blocking activation succeeded', full.response && full.response.success === true, full.response)
  check('default parameter used', full.response.result.greeting === 'Hello default', full.response.result)
  check('blocking activation has an id', /^[0-9a-f]{32}$/.test(full.activationId), full.activationId)
  check('the action saw its activation id', full.response.result.activation === full.activationId,
    full.response.result)

  const queued = await ow.actions.invoke({ name: actionName, params: { name: 'async' } })
  check('non-blocking returns only an id', Object.keys(queued).length === 1 && /^[0-9a-f]{32}$/.test(queued.activationId),
    queued)
  const id = queued.activationId

  const activation = await poll('the non-blocking activation', () => ow.activations.get({ activationId: id }))
  check('activation record', activation.activationId === id && activation.name === actionName, activation)
  check('activation succeeded', activation.response.success === true, activation.response)

  const res = await ow.activations.result({ activationId: id })
  check('activation result', res.result && res.result.greeting === 'Hello async', res)

  const logs = await ow.activations.logs({ activationId: id })
  check('activation logs', Array.isArray(logs.logs) && logs.logs.some(l => l.includes('compat log line for async')),
    logs)

  const activations = await ow.activations.list({ name: actionName, limit: 10 })
  const ids = activations.map(a => a.activationId)
  check('activations are listed by name', ids.includes(id) && ids.includes(full.activationId), ids)
  check('list is newest first', ids.indexOf(id) < ids.indexOf(full.activationId), ids)

  const namespaces = await ow.namespaces.list()
  check('namespaces list', Array.isArray(namespaces) && namespaces.length >= 1, namespaces)

  await expectStatus('an unknown kind', ow.actions.create({ name: `${actionName}-bad`, action: CODE, kind: 'cobol:85' }),
    400)
  await expectStatus('a missing action', ow.actions.invoke({ name: `${actionName}-missing`, blocking: true }), 404)
  await expectStatus('creating the action again', ow.actions.create({ name: actionName, action: CODE, kind: 'python:3-gpu' }),
    409)

  const updated = await ow.actions.update({ name: actionName, action: CODE, kind: 'python:3-gpu' })
  check('update bumps the version', updated.version === '0.0.2', updated.version)

  const deleted = await ow.actions.delete({ name: actionName })
  check('delete returns the action', deleted.name === actionName, deleted)
  await expectStatus('the deleted action', ow.actions.get({ name: actionName }), 404)
}

run().then(() => {
  console.log(JSON.stringify({ ok: true, action: actionName, checks }))
}).catch(async err => {
  console.log(JSON.stringify({ ok: false, action: actionName, checks, error: err.message }))
  try { await ow.actions.delete({ name: actionName }) } catch (_) {}
  process.exit(1)
})
