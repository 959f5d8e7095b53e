// The Folio contracts from another language: a Node.js client (@grpc/grpc-js, @grpc/proto-loader)
// loads protos/ and streams generations from the Engine service (token ids in, tokens out) and
// from the Gateway service (text). The token path and the text path must agree: the gateway's
// greedy text equals the engine's greedy tokens detokenized by the tokenizer service.
//
// Run by tests/e2e/test_serve.py against a real `folio serve`, with NODE_PATH pointing at the
// project-local .tools/node_modules and the addresses in FOLIO_ENGINE_ADDRESS,
// FOLIO_TOKENIZER_ADDRESS and FOLIO_GATEWAY_GRPC_ADDRESS; FOLIO_INTERNAL_TOKEN is the token the
// internal services (engine, tokenizer) ask of their callers.
'use strict';

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTOS = path.resolve(__dirname, '..', '..', 'protos');
const definition = protoLoader.loadSync(
  ['folio/v1/engine.proto', 'folio/v1/tokenizer.proto', 'folio/v1/gateway.proto'],
  { includeDirs: [PROTOS], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true },
);
const folio = grpc.loadPackageDefinition(definition).folio.v1;

function address(name) {
  const value = process.env[name];
  assert.ok(value, `${name} is not set`);
  return value;
}

const credentials = grpc.credentials.createInsecure();
const engine = new folio.EngineService(address('FOLIO_ENGINE_ADDRESS'), credentials);
const tokenizer = new folio.TokenizerService(address('FOLIO_TOKENIZER_ADDRESS'), credentials);
const gateway = new folio.GatewayService(address('FOLIO_GATEWAY_GRPC_ADDRESS'), credentials);

const deadline = () => ({ deadline: Date.now() + 60_000 });
// The internal services admit callers that bring the run's token.
const internal = new grpc.Metadata();
internal.set('authorization', `Bearer ${address('FOLIO_INTERNAL_TOKEN')}`);
// Shorter than one KV block (16 tokens): no prefix-cache hit makes one run differ from another.
const PROMPT = 'The three primary colors are';
const MAX_TOKENS = 12;
const GREEDY = { temperature: 0, max_tokens: MAX_TOKENS, ignore_eos: true };

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, internal, deadline(), (error, response) => (error ? reject(error) : resolve(response)));
  });
}

// Sends `requests` on one Generate stream, half-closes, collects every output by request id.
function engineGenerate(requests) {
  return new Promise((resolve, reject) => {
    const byId = Object.fromEntries(requests.map((r) => [r.request_id, { tokens: [], outputs: [] }]));
    let messages = 0;
    const call = engine.Generate(internal, deadline());
    call.on('data', (response) => {
      messages += 1;
      for (const output of response.outputs) {
        const entry = byId[output.request_id];
        assert.ok(entry, `unknown request id ${output.request_id}`);
        entry.tokens.push(...output.token_ids);
        entry.outputs.push(output);
      }
    });
    call.on('error', reject);
    call.on('end', () => resolve({ messages, byId }));
    for (const request of requests) call.write({ add: request });
    call.end();
  });
}

// A server-streaming Gateway call: the concatenated text and the last message.
function gatewayStream(method, request) {
  return new Promise((resolve, reject) => {
    const parts = [];
    const call = gateway[method](request, deadline());
    call.on('data', (response) => parts.push(response));
    call.on('error', reject);
    call.on('end', () => resolve({ text: parts.map((p) => p.text).join(''), parts }));
  });
}

function assertFinishedByLength(outputs, promptTokens) {
  const last = outputs[outputs.length - 1];
  assert.equal(last.finished, true);
  assert.equal(last.finish_reason, 'FINISH_REASON_LENGTH');
  assert.equal(last.usage.prompt_tokens, promptTokens);
  assert.equal(last.usage.completion_tokens, MAX_TOKENS);
  assert.ok(outputs.slice(0, -1).every((o) => !o.finished), 'only the last output is finished');
}

test('engine streams token ids, then the gateway streams the same text', async () => {
  const { token_ids: promptIds } = await unary(tokenizer, 'Tokenize', { text: PROMPT });
  assert.ok(promptIds.length > 0 && promptIds.length < 16);

  const { messages, byId } = await engineGenerate([
    { request_id: 'node-engine-1', prompt_token_ids: promptIds, sampling_params: GREEDY },
  ]);
  const { tokens, outputs } = byId['node-engine-1'];
  assert.equal(tokens.length, MAX_TOKENS);
  assert.ok(messages >= MAX_TOKENS, `streamed in ${messages} messages, not one per step`);
  assertFinishedByLength(outputs, promptIds.length);

  const { text: expected } = await unary(tokenizer, 'Detokenize', { token_ids: tokens });
  assert.ok(expected.length > 0);
  const { text, parts } = await gatewayStream('Generate', { prompt: PROMPT, sampling_params: GREEDY });
  assert.ok(parts.length > 1, 'the gateway streams deltas');
  assert.equal(text, expected);
  const last = parts[parts.length - 1];
  assert.equal(last.finish_reason, 'FINISH_REASON_LENGTH');
  assert.equal(last.usage.prompt_tokens, promptIds.length);
  assert.equal(last.usage.completion_tokens, MAX_TOKENS);
});

test('one engine stream multiplexes two requests', async () => {
  const prompts = ['Once upon a time', 'def fibonacci(n):'];
  const ids = await Promise.all(prompts.map((text) => unary(tokenizer, 'Tokenize', { text })));
  const requests = ids.map((r, i) => ({
    request_id: `node-mux-${i}`, prompt_token_ids: r.token_ids, sampling_params: GREEDY,
  }));
  const { byId } = await engineGenerate(requests);
  requests.forEach((request, i) => {
    const entry = byId[request.request_id];
    assert.equal(entry.tokens.length, MAX_TOKENS);
    assertFinishedByLength(entry.outputs, ids[i].token_ids.length);
  });
});

test('gateway chat equals the chat template run through the engine', async () => {
  const messages = [{ role: 'user', content: 'Name a fruit.' }];
  const { token_ids: promptIds } = await unary(tokenizer, 'Tokenize', { chat: { messages } });
  // The template's prompt spans full KV blocks: warm the prefix cache first, so that the engine
  // run and the gateway run below both start from the same cached blocks (same arithmetic).
  await engineGenerate([{ request_id: 'node-chat-0', prompt_token_ids: promptIds, sampling_params: GREEDY }]);
  const { byId } = await engineGenerate([
    { request_id: 'node-chat-1', prompt_token_ids: promptIds, sampling_params: GREEDY },
  ]);
  const { text: expected } = await unary(tokenizer, 'Detokenize', { token_ids: byId['node-chat-1'].tokens });
  const { text, parts } = await gatewayStream('Chat', { messages, sampling_params: GREEDY });
  assert.equal(text, expected);
  assert.equal(parts[parts.length - 1].usage.prompt_tokens, promptIds.length);
});

test('a malformed engine request fails with INVALID_ARGUMENT in the stream', async () => {
  const { byId } = await engineGenerate([
    { request_id: 'node-bad-1', prompt_token_ids: [], sampling_params: GREEDY },
  ]);
  const [output] = byId['node-bad-1'].outputs;
  assert.equal(output.error.code, grpc.status.INVALID_ARGUMENT);
});

test.after(() => {
  for (const client of [engine, tokenizer, gateway]) client.close();
});
