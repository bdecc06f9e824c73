// Run by tests/e2e/test_trigger_sdk_e2e.py with TRIGGER_API_URL and TRIGGER_SECRET_KEY set.
// Each management call of @trigger.dev/sdk against a run-engine server; prints one JSON object:
// {call: {ok, value?, error?}}. The Python test reads it and checks the values.
import { configure, tasks, runs, wait, queues, schedules, batch, auth, idempotencyKeys } from "@trigger.dev/sdk";
import { apiClientManager } from "@trigger.dev/core/v3";
import { ShapeStream } from "@electric-sql/client";

configure({ baseURL: process.env.TRIGGER_API_URL, accessToken: process.env.TRIGGER_SECRET_KEY });
const out = {};
async function step(name, fn) {
  try { out[name] = { ok: true, value: await fn() }; }
  catch (e) { out[name] = { ok: false, error: String(e && e.message || e).slice(0, 800), status: e && e.status }; }
  return out[name].value;
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function until(id, pred, ms = 30000) {
  const end = Date.now() + ms;
  for (;;) { const r = await runs.retrieve(id); if (pred(r) || Date.now() > end) return r; await sleep(100); }
}

const h = await step("tasks.trigger", () => tasks.trigger("echo", { hello: "sdk", when: new Date(0) },
  { tags: ["sdk", "compat"], idempotencyKey: "sdk-key-1", ttl: "10m", priority: 5, concurrencyKey: "ck", maxAttempts: 2,
    machine: "small-2x" }));
await step("tasks.trigger.again", () => tasks.trigger("echo", { hello: "other" }, { idempotencyKey: "sdk-key-1" }));
if (h) {
  await step("runs.retrieve", async () => { const r = await until(h.id, (r) => r.isCompleted);
    return { id: r.id, status: r.status, output: r.output, tags: r.tags, ttl: r.ttl, isSuccess: r.isSuccess,
             payload: r.payload, createdAt: String(r.createdAt), attemptCount: r.attemptCount }; });
  await step("runs.retrieve.raw", async () => { const c = apiClientManager.clientOrThrow();
    const r = await fetch(`${c.baseUrl}/api/v3/runs/${h.id}`, { headers: { Authorization: `Bearer ${process.env.TRIGGER_SECRET_KEY}` } });
    const j = await r.json(); return { machine: j.machine, idempotencyKey: j.idempotencyKey }; });
  await step("runs.poll", async () => { const r = await runs.poll(h.id, { pollIntervalMs: 200 }); return r.status; });
  await step("runs.replay", async () => (await runs.replay(h.id)).id);
}
await step("runs.subscribeToRun", async () => {
  const r = await tasks.trigger("long", { seconds: 1 });
  const seen = [];
  const watch = (async () => {
    for await (const run of runs.subscribeToRun(r.id)) {
      seen.push(run.status);
      if (run.finishedAt) return { seen, output: run.output, isSuccess: run.isSuccess };
    }
    return { seen };
  })();
  return await Promise.race([watch, sleep(60000).then(() => ({ seen, timedOut: true }))]);
});
const delayed = await step("tasks.trigger.delayed", () => tasks.trigger("echo", { d: 1 }, { delay: "1h" }));
if (delayed) {
  await step("runs.reschedule", async () => { const r = await runs.reschedule(delayed.id, { delay: "2h" });
    return { status: r.status, delayedUntil: String(r.delayedUntil) }; });
  await step("runs.cancel", async () => { await runs.cancel(delayed.id); return (await runs.retrieve(delayed.id)).status; });
}
await step("runs.list", async () => { const page = await runs.list({ limit: 5, tag: "sdk" });
  return page.data.map((r) => ({ id: r.id, status: r.status, tags: r.tags, env: r.env })); });
await step("runs.list.status", async () => { const ids = [];
  for await (const r of runs.list({ status: ["COMPLETED"], limit: 2 })) { ids.push(r.id); if (ids.length >= 3) break; }
  return ids; });
// metadata and tags of a run from outside it: the SDK's API client (its task-side helpers call these)
await step("apiClient.updateRunMetadata", async () => { const c = apiClientManager.clientOrThrow();
  const r = await c.updateRunMetadata(h.id, { metadata: { step: 2 } }); return { reply: r.metadata, run: (await runs.retrieve(h.id)).metadata }; });
await step("apiClient.addTags", async () => { const c = apiClientManager.clientOrThrow();
  await c.addTags(h.id, { tags: ["added"] }); return (await runs.retrieve(h.id)).tags; });

const token = await step("wait.createToken", async () => { const t = await wait.createToken({ timeout: "1h", tags: ["sdk"] });
  return { id: t.id, isCached: t.isCached, url: t.url }; });
if (token) {
  await step("wait.completeToken", () => wait.completeToken(token.id, { approved: true }));
  await step("wait.retrieveToken", async () => { const t = await wait.retrieveToken(token.id);
    return { status: t.status, output: t.output }; });
  await step("wait.listTokens", async () => { const page = await wait.listTokens({ status: ["COMPLETED"], limit: 5 });
    return page.data.map((t) => t.id); });
}

await step("tasks.batchTrigger", async () => { const b = await tasks.batchTrigger("echo", [{ payload: { i: 1 } }, { payload: { i: 2 }, options: { tags: ["b"], delay: "1s", maxAttempts: 1 } }]);
  return { batchId: b.batchId, runCount: b.runCount }; });
await step("apiClient.batchTriggerV3.sequential", async () => { const c = apiClientManager.clientOrThrow();
  const b = await c.batchTriggerV3({ items: [{ task: "echo", payload: { i: 0 }, options: { tags: ["seq-0"] } },
    { task: "sync-echo", payload: 1, options: { tags: ["seq-1"], maxAttempts: 1 } }] }, { processingStrategy: "sequential" });
  return { id: b.id, runCount: b.runCount, publicAccessToken: Boolean(b.publicAccessToken) }; });
await step("batch.trigger", async () => { const b = await batch.trigger([{ id: "echo", payload: { i: 3 } }, { id: "sync-echo", payload: 4 }]);
  return { batchId: b.batchId, runCount: b.runCount }; });

await step("queues.list", async () => { const page = await queues.list();
  return page.data.map((q) => ({ name: q.name, type: q.type, paused: q.paused })); });
await step("queues.retrieve.task", async () => { const q = await queues.retrieve({ type: "task", name: "echo" });
  return { name: q.name, type: q.type }; });
await step("queues.pause.task", async () => (await queues.pause({ type: "task", name: "echo" })).paused);
await step("queues.resume.task", async () => (await queues.resume({ type: "task", name: "echo" })).paused);
await step("queues.pause.custom", async () => (await queues.pause({ type: "custom", name: "e2e-limited" })).paused);
await step("queues.resume.custom", async () => (await queues.resume({ type: "custom", name: "e2e-limited" })).paused);
await step("queues.overrideConcurrencyLimit", async () => (await queues.overrideConcurrencyLimit({ type: "task", name: "echo" }, 3)).concurrencyLimit);
await step("queues.resetConcurrencyLimit", async () => (await queues.resetConcurrencyLimit({ type: "task", name: "echo" })).concurrencyLimit);

const sched = await step("schedules.create", async () => { const s = await schedules.create({ task: "echo", cron: "0 3 * * *", deduplicationKey: "sdk-nightly", externalId: "x1" });
  return { id: s.id, task: s.task, active: s.active, cron: s.generator && s.generator.expression, nextRun: String(s.nextRun) }; });
if (sched) {
  await step("schedules.retrieve", async () => (await schedules.retrieve(sched.id)).id);
  await step("schedules.list", async () => (await schedules.list()).data.map((s) => s.id));
  await step("schedules.update", async () => { const s = await schedules.update(sched.id, { task: "echo", cron: "0 4 * * *" });
    return s.generator && s.generator.expression; });
  await step("schedules.deactivate", async () => (await schedules.deactivate(sched.id)).active);
  await step("schedules.activate", async () => (await schedules.activate(sched.id)).active);
  await step("schedules.del", async () => { await schedules.del(sched.id); return true; });
}
// public access tokens: the one a trigger answers with, tokens made with auth.*, and the realtime
// subscriptions a browser holding only such a token makes
async function denied(fn) {
  const tried = (async () => { try { await fn(); return "allowed"; } catch (e) { return (e && e.status) || String(e && e.message || e).slice(0, 200); } })();
  return await Promise.race([tried, sleep(15000).then(() => "no answer")]);
}
async function follow(iterable, done, ms = 60000) {
  const seen = [];
  const watch = (async () => { for await (const run of iterable) { seen.push(run); if (done(seen)) return; } })();
  await Promise.race([watch, sleep(ms)]);
  return seen;
}
if (h) {
  await step("publicAccessToken.retrieve", () => auth.withAuth({ accessToken: h.publicAccessToken }, async () => {
    const r = await runs.retrieve(h.id);
    return { id: r.id, status: r.status, other: await denied(() => runs.retrieve(delayed.id)),
             list: await denied(() => runs.list({ limit: 1 })) }; }));
}
await step("auth.createPublicToken.readTags", async () => {
  const tag = `pt-${Date.now()}`;
  const token = await auth.createPublicToken({ scopes: { read: { tags: [tag] } }, expirationTime: "1h" });
  const a = await tasks.trigger("echo", { n: 1 }, { tags: [tag] });
  const untagged = await tasks.trigger("echo", { n: 2 });
  return await auth.withAuth({ accessToken: token }, async () => {
    const seen = await follow(runs.subscribeToRunsWithTag(tag),
      (s) => s.some((r) => r.id === a.id && r.status === "COMPLETED"));
    return { tagged: a.id, statuses: seen.filter((r) => r.id === a.id).map((r) => r.status),
             others: seen.filter((r) => r.id !== a.id).length, retrieve: (await runs.retrieve(a.id)).id,
             untagged: await denied(() => runs.retrieve(untagged.id)) };
  });
});
await step("subscribeToBatch", async () => {
  const b = await tasks.batchTrigger("echo", [{ payload: { i: 1 } }, { payload: { i: 2 } }]);
  return await auth.withAuth({ accessToken: b.publicAccessToken }, async () => {
    const seen = await follow(runs.subscribeToBatch(b.batchId), (s) => {
      const done = new Set(s.filter((r) => r.status === "COMPLETED").map((r) => r.id)); return done.size === 2; });
    return { batchId: b.batchId, ids: [...new Set(seen.map((r) => r.id))].sort(),
             completed: [...new Set(seen.filter((r) => r.status === "COMPLETED").map((r) => r.id))].length };
  });
});
await step("batch.retrieve", async () => {
  const b = await tasks.batchTrigger("echo", [{ payload: { r: 1 } }, { payload: { r: 2 } }]);
  const got = await batch.retrieve(b.batchId);
  return { id: got.id === b.batchId, status: got.status, runCount: got.runCount, runs: got.runs.length,
           createdAt: got.createdAt instanceof Date, errors: got.processing.errors };
});
await step("idempotencyKeys.reset", async () => {
  const key = await idempotencyKeys.create(`reset-${Date.now()}`);
  const a = await tasks.trigger("echo", { k: 1 }, { idempotencyKey: key });
  const b = await tasks.trigger("echo", { k: 2 }, { idempotencyKey: key });
  const reset = await idempotencyKeys.reset("echo", key);
  const c = await tasks.trigger("echo", { k: 3 }, { idempotencyKey: key });
  return { same: a.id === b.id, fresh: c.id !== a.id, reset: typeof reset.id === "string" };
});
// runs.bulk.*: a cancel by the SDK's filter, followed to its end; the list; a replay by id, aborted
await step("runs.bulk", async () => {
  const tag = `bulk-${Date.now()}`;
  const a = await tasks.trigger("echo", { b: 1 }, { tags: [tag], delay: "1h" });
  const b = await tasks.trigger("echo", { b: 2 }, { tags: [tag], delay: "1h" });
  const made = await runs.bulk.cancel({ filter: { tag, period: "1h" }, name: "sdk bulk" });
  const done = await runs.bulk.poll(made.id, { pollIntervalMs: 100 });
  const statuses = [(await runs.retrieve(a.id)).status, (await runs.retrieve(b.id)).status];
  const replay = await runs.bulk.replay({ runIds: [a.id] });
  const listed = [];
  for await (const x of runs.bulk.list({ limit: 1 })) { listed.push(x.id); if (listed.length >= 3) break; }
  const abort = await runs.bulk.abort(replay.id).then((r) => r.id, (e) => e.status);
  const after = await runs.bulk.retrieve(replay.id);
  return { status: done.status, counts: done.counts, name: done.name, statuses,
           listed: listed.includes(made.id) && listed.includes(replay.id), pages: listed.length, abort: abort === replay.id ? "aborted" : abort, afterAbort: after.status,
           refused: await denied(() => runs.bulk.cancel({ filter: { version: "20250101.1" } })) };
});
// a payload of 128 KiB or more: the SDK uploads it first (PUT /api/v2/packets, then the URL) and
// triggers with its storage path ("application/store"); a batch item likewise
await step("tasks.trigger.largePayload", async () => {
  const r = await tasks.trigger("echo", { text: "y".repeat(150 * 1024), when: new Date(0) });
  const b = await tasks.batchTrigger("echo", [{ payload: { text: "z".repeat(140 * 1024) } }, { payload: { small: 1 } }]);
  const done = await until(r.id, (x) => x.isCompleted);
  return { status: done.status, length: done.output && done.output.payload.text.length,
           when: done.output && String(done.output.payload.when), batchRuns: b.runCount, batchId: b.batchId };
});
// a run whose payload and output are larger than a realtime answer carries inline: the shape sends
// them as "application/store" references, which the SDK fetches (getRunPacketUrl, then the URL)
await step("subscribeToRunsWithTag.largePackets", async () => {
  const tag = `big-${Date.now()}`;
  const big = { text: "x".repeat(200 * 1024) };
  const c = apiClientManager.clientOrThrow();
  const made = await fetch(`${c.baseUrl}/api/v1/tasks/echo/trigger`, { method: "POST",
    headers: { Authorization: `Bearer ${process.env.TRIGGER_SECRET_KEY}`, "Content-Type": "application/json" },
    body: JSON.stringify({ payload: big, options: { tags: [tag] } }) });
  const id = (await made.json()).id;
  const seen = await follow(runs.subscribeToRunsWithTag(tag), (s) => s.some((r) => r.id === id && r.status === "COMPLETED"));
  const last = seen.filter((r) => r.id === id).pop();
  const raw = await (await fetch(`${c.baseUrl}/realtime/v1/runs?tags=${tag}&offset=-1`,
    { headers: { Authorization: `Bearer ${process.env.TRIGGER_SECRET_KEY}` } })).json();
  const row = raw.find((m) => m.value && m.value.id === id).value;
  return { id, status: last && last.status, payloadLength: last && last.payload && last.payload.text.length,
           outputLength: last && last.output && last.output.payload.text.length,
           sentAs: [row.payloadType, row.outputType] };
});
// metadata has no reference the SDK could fetch: forty runs of 250 KiB each are more than one
// realtime answer holds (8 MiB), so the shape sends them in two answers, the first without
// up-to-date; the SDK asks for the rest at once and yields every run whole
await step("subscribeToRunsWithTag.largeMetadata", async () => {
  const tag = `meta-${Date.now()}`;
  const c = apiClientManager.clientOrThrow();
  const made = await tasks.batchTrigger("echo", Array.from({ length: 40 }, (_, i) => ({ payload: { i }, options: { tags: [tag] } })));
  const ids = (await batch.retrieve(made.batchId)).runs;
  for (const id of ids) await c.updateRunMetadata(id, { metadata: { text: "m".repeat(250 * 1024) } });
  const full = (s) => new Set(s.filter((r) => r.metadata && r.metadata.text && r.metadata.text.length === 250 * 1024).map((r) => r.id));
  const seen = await follow(runs.subscribeToRunsWithTag(tag), (s) => full(s).size === ids.length);
  const first = await fetch(`${c.baseUrl}/realtime/v1/runs?tags=${tag}&offset=-1`,
    { headers: { Authorization: `Bearer ${process.env.TRIGGER_SECRET_KEY}` } });
  const body = await first.json();
  return { runs: ids.length, whole: full(seen).size, firstAnswer: body.filter((m) => m.value).length,
           firstUpToDate: body.some((m) => m.headers && m.headers.control === "up-to-date") };
});
// an offset of another version of the server (a rolling upgrade): 409 must-refetch, and the
// SDK's shape client starts over at -1 by itself
await step("electric.mustRefetch", async () => {
  const tag = `refetch-${Date.now()}`;
  const r = await tasks.trigger("echo", { z: 1 }, { tags: [tag] });
  const c = apiClientManager.clientOrThrow();
  const stream = new ShapeStream({ url: `${c.baseUrl}/realtime/v1/runs?tags=${tag}`, offset: "1_2_3",
    handle: "tags-older", subscribe: false, headers: { Authorization: `Bearer ${process.env.TRIGGER_SECRET_KEY}` } });
  const seen = [];
  let refetched = false;
  await new Promise((resolve) => {
    const timer = setTimeout(resolve, 15000);
    const stop = stream.subscribe((messages) => {
      for (const m of messages) {
        if (m.value) seen.push(m.value.id);
        if (m.headers && m.headers.control === "must-refetch") refetched = true;
        if (m.headers && m.headers.control === "up-to-date") { clearTimeout(timer); stop(); resolve(); }
      }
    }, () => { clearTimeout(timer); resolve(); });
  });
  return { refetched, seen: seen.includes(r.id) };
});
await step("auth.createTriggerPublicToken", async () => {
  const token = await auth.createTriggerPublicToken("echo");
  return await auth.withAuth({ accessToken: token }, async () => {
    const r = await tasks.trigger("echo", { once: true });
    return { id: r.id, again: await denied(() => tasks.trigger("echo", { twice: true })) };
  });
});
await step("auth.createTriggerPublicToken.multipleUse", async () => {
  const token = await auth.createTriggerPublicToken("echo", { multipleUse: true });
  return await auth.withAuth({ accessToken: token }, async () => {
    const ids = [(await tasks.trigger("echo", { n: 1 })).id, (await tasks.trigger("echo", { n: 2 })).id];
    return { ids, otherTask: await denied(() => tasks.trigger("sync-echo", 1)) };
  });
});
await step("wait.publicAccessToken", async () => {
  const t = await wait.createToken({ timeout: "1h" });
  const other = await wait.createToken({ timeout: "1h" });
  return await auth.withAuth({ accessToken: t.publicAccessToken }, async () => ({
    id: t.id, completed: await wait.completeToken(t.id, { from: "browser" }),
    other: await denied(() => wait.completeToken(other.id, { from: "browser" })) }));
});
console.log(JSON.stringify(out));
process.exit(0);  // a subscription or keep-alive socket must not hold the process open
