// The official openwhisk npm client against dilu-invoker standalone: create (or update) a GPU action,
// invoke it blocking, invoke it non-blocking and read that activation's logs.
//
//   cd examples/npm && npm ci && node hello.js
//
// __OW_API_HOST and __OW_API_KEY override the standalone defaults (127.0.0.1:3233, the guest key).
'use strict'

const fs = require('fs')
const path = require('path')
const openwhisk = require('openwhisk')

const ow = openwhisk({
  apihost: process.env.__OW_API_HOST || 'http://127.0.0.1:3233',
  api_key: process.env.__OW_API_KEY ||
    '23bc46b1-71f6-4ed5-8c54-816aa4f8c502:123zO3xZCLrMN6v2BKK1dXYFpXlPkccOFqm12CdAsMgRU4VrNZ9lyGVCGuMDGIwP'
})
const name = 'hello-npm'
const sleep = ms => new Promise(resolve => setTimeout(resolve, ms))

async function main () {
  const code = fs.readFileSync(path.join(__dirname, 'hello.py'), 'utf8')
  // update = create with overwrite, so running this twice works
  await ow.actions.update({
    name,
    action: {
      exec: { kind: 'python:3-gpu', code },
      annotations: [{ key: 'gpu-class', value: 'inference' }, { key: 'gpu-sm-request', value: 0.2 }]
    }
  })
  const result = await ow.actions.invoke({ name, blocking: true, result: true, params: { name: 'npm' } })
  console.log('blocking invoke:', JSON.stringify(result))

  const { activationId } = await ow.actions.invoke({ name, params: { name: 'later' } })
  console.log('non-blocking invoke:', activationId)
  for (let tries = 0; ; tries++) {
    try {
      const { logs } = await ow.activations.logs({ activationId })
      console.log('its logs:', JSON.stringify(logs))
      return
    } catch (err) {
      // 404 until the activation has finished and been stored
      if (err.statusCode !== 404 || tries >= 120) throw err
      await sleep(250)
    }
  }
}

main().catch(err => {
  console.error('failed:', err.message || err)
  process.exit(1)
})
