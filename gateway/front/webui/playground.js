// The playground: a conversation with the served model through /v1/chat/completions, streamed.
// Stop aborts the fetch: the gateway sees its client leave and aborts the engine request. Each
// answer shows its time to first token (from sending to the first text) and its tokens per
// second (the tokens after the first, over the time since the first).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const conversation = $("conversation");
  const message = $("message");
  const send = $("send");
  const stop = $("stop");
  const status = $("status");
  const history = []; // {role, content} of the turns so far
  let model = null;
  let running = null; // the AbortController of the answer being streamed

  const keyForm = Folio.keyForm(() => {
    loadModel();
    if (message.value.trim()) {
      $("composer").requestSubmit();
    }
  });

  function setRunning(controller) {
    running = controller;
    send.disabled = controller !== null;
    stop.disabled = controller === null;
  }

  function addTurn(role, text) {
    const turn = document.createElement("article");
    turn.className = `message ${role}`;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role === "user" ? "You" : "Assistant";
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    turn.append(who, content);
    conversation.append(turn);
    conversation.scrollTop = conversation.scrollHeight;
    return turn;
  }

  function showStats(turn, stats) {
    const line = document.createElement("div");
    line.className = "stats";
    const ttft = stats.firstAt === null ? null : stats.firstAt - stats.sentAt;
    const decodeSeconds = stats.firstAt === null ? 0 : (stats.endAt - stats.firstAt) / 1000;
    const tps = stats.tokens > 1 && decodeSeconds > 0 ? (stats.tokens - 1) / decodeSeconds : null;
    line.dataset.ttftMs = ttft === null ? "" : ttft.toFixed(0);
    line.dataset.tokensPerSecond = tps === null ? "" : tps.toFixed(2);
    line.dataset.tokens = String(stats.tokens);
    const parts = [
      `time to first token ${ttft === null ? "—" : `${ttft.toFixed(0)} ms`}`,
      `${tps === null ? "—" : tps.toFixed(1)} tokens/s`,
      `${stats.exact ? "" : "≈"}${stats.tokens} tokens`,
    ];
    if (stats.ending) {
      parts.push(stats.ending);
    }
    line.textContent = parts.join(" · ");
    turn.append(line);
  }

  function numberField(id) {
    const value = $(id).value.trim();
    return value === "" ? undefined : Number(value);
  }

  function requestBody() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) {
      messages.push({ role: "system", content: system });
    }
    messages.push(...history);
    const body = {
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: numberField("temperature"),
      max_tokens: numberField("max-tokens"),
      seed: numberField("seed"),
    };
    if (model) {
      body.model = model;
    }
    return body;
  }

  async function answer() {
    const controller = new AbortController();
    setRunning(controller);
    status.textContent = "";
    const turn = addTurn("assistant", "");
    turn.setAttribute("aria-busy", "true");
    const content = turn.querySelector(".content");
    const stats = { sentAt: performance.now(), firstAt: null, endAt: null, tokens: 0, exact: false };
    let text = "";
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: Folio.headers({ "Content-Type": "application/json" }),
        body: JSON.stringify(requestBody()),
        signal: controller.signal,
      });
      if (!response.ok) {
        const reason = await Folio.errorMessage(response);
        turn.remove();
        if (response.status === 401) {
          // Give the turn back: it is sent again once a key is entered.
          message.value = history.pop().content;
          conversation.lastElementChild.remove();
          keyForm.ask(reason);
        } else {
          status.textContent = `Error: ${reason}`;
          history.pop();
          conversation.lastElementChild.remove();
        }
        return;
      }
      for await (const data of Folio.events(response)) {
        if (data === "[DONE]") {
          break;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) {
          stats.ending = `error: ${chunk.error.message}`;
          break;
        }
        if (chunk.usage) {
          stats.tokens = chunk.usage.completion_tokens;
          stats.exact = true;
        }
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) {
          continue;
        }
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          if (stats.firstAt === null) {
            stats.firstAt = performance.now();
          }
          stats.tokens += 1; // until usage gives the exact count
          text += delta;
          content.textContent = text;
          conversation.scrollTop = conversation.scrollHeight;
        }
        if (choice.finish_reason === "length") {
          stats.ending = "stopped at max tokens";
        }
      }
    } catch (error) {
      if (error.name === "AbortError") {
        stats.ending = "stopped";
      } else {
        stats.ending = `error: ${error.message}`;
      }
    } finally {
      setRunning(null);
      turn.removeAttribute("aria-busy");
    }
    stats.endAt = performance.now();
    if (text) {
      history.push({ role: "assistant", content: text });
    }
    showStats(turn, stats);
  }

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = message.value.trim();
    if (!text || running) {
      return;
    }
    message.value = "";
    history.push({ role: "user", content: text });
    addTurn("user", text);
    answer();
  });

  message.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });

  stop.addEventListener("click", () => {
    if (running) {
      running.abort();
    }
  });

  $("clear").addEventListener("click", () => {
    if (running) {
      running.abort();
    }
    history.length = 0;
    conversation.replaceChildren();
    status.textContent = "";
  });

  async function loadModel() {
    const response = await fetch("/v1/models", { headers: Folio.headers() });
    if (response.status === 401) {
      keyForm.ask(await Folio.errorMessage(response));
      return;
    }
    if (!response.ok) {
      status.textContent = `The server is not ready: ${await Folio.errorMessage(response)}`;
      return;
    }
    model = (await response.json()).data[0].id;
    $("model").textContent = model;
  }

  loadModel().catch((error) => {
    status.textContent = `The server cannot be reached: ${error.message}`;
  });
})();
