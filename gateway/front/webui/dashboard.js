// The dashboard: the server's own numbers from its one event feed (/dashboard/feed), as tiles
// and as charts of the last two minutes, redrawn on every sample. A feed refused for want of a
// key (401) asks for one; the feed reads it from a cookie, since EventSource sends no headers.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const feedStatus = $("feed-status");
  const percent = (share) => (share === null ? null : 100 * share);
  const charts = {
    requests: new Charts.TimeChart($("chart-requests")),
    cache: new Charts.TimeChart($("chart-cache"), { max: 100, unit: "%" }),
    tokens: new Charts.TimeChart($("chart-tokens")),
    phases: new Charts.TimeChart($("chart-phases"), { stacked: true, unit: " ms" }),
    tiers: new Charts.TimeChart($("chart-tiers")),
    lora: new Charts.TimeChart($("chart-lora"), { stacked: true }),
  };
  let source = null;
  let samples = 0;

  const keyForm = Folio.keyForm(connect);

  function show(id, value, unit = "") {
    $(id).textContent = Charts.format(value, unit);
  }

  // One chart series per key of a feed's map (a tier, an adapter).
  function seriesOf(values, label) {
    const series = {};
    for (const [key, value] of Object.entries(values)) {
      series[key] = { label: label(key), value };
    }
    return series;
  }

  function update(sample) {
    samples += 1;
    document.body.dataset.samples = String(samples);
    const stepMs = Object.values(sample.step_phase_ms).reduce((a, b) => a + b, 0);
    show("running", sample.running);
    show("waiting", sample.waiting);
    show("kv-cache", percent(sample.kv_cache_usage), "%");
    show("prefix-hits", percent(sample.prefix_cache_hit_rate), "%");
    show("draft-acceptance", percent(sample.draft_acceptance_rate), "%");
    show("generation-tps", sample.generation_tokens_per_second);
    show("prompt-tps", sample.prompt_tokens_per_second);
    show("steps", sample.steps_per_second);
    show("step-ms", sample.steps_per_second ? stepMs : null, " ms");
    const tierUsage = Object.entries(sample.kv_tier_usage);
    $("tier-usage").textContent = tierUsage.length
      ? tierUsage.map(([tier, share]) => `${tier} ${Charts.format(percent(share), "%")}`).join(" · ")
      : "–";
    $("resident-adapters").textContent = sample.resident_lora_adapters.join(", ") || "–";
    const time = sample.time;
    charts.requests.add(time, {
      running: { label: "running", value: sample.running },
      waiting: { label: "waiting", value: sample.waiting },
    });
    charts.cache.add(time, {
      kv: { label: "KV cache usage", value: percent(sample.kv_cache_usage) },
      prefix: { label: "prefix-cache hits", value: percent(sample.prefix_cache_hit_rate) },
      drafts: { label: "drafts accepted", value: percent(sample.draft_acceptance_rate) },
      ...seriesOf(sample.kv_tier_usage, (tier) => `${tier} tier usage`),
    });
    charts.tokens.add(time, {
      generation: { label: "generated", value: sample.generation_tokens_per_second },
      prompt: { label: "prompt", value: sample.prompt_tokens_per_second },
    });
    const phases = {};
    for (const [phase, ms] of Object.entries(sample.step_phase_ms)) {
      phases[phase] = { label: phase, value: ms };
    }
    charts.phases.add(time, phases);
    charts.tiers.add(time, seriesOf(sample.kv_tier_hits, (tier) => `from ${tier}`));
    charts.lora.add(time, seriesOf(sample.lora_requests, (name) => name));
    const clock = new Date(time * 1000).toLocaleTimeString();
    feedStatus.textContent = sample.engine_up
      ? `Live · ${clock}`
      : `The engine is not answering · ${clock}`;
  }

  // Why the feed failed: EventSource does not tell, so ask once with a plain request.
  async function diagnose() {
    try {
      const response = await fetch("/dashboard/feed", { headers: Folio.headers() });
      if (response.ok) {
        await response.body.cancel();
        return null;
      }
      return { status: response.status, reason: await Folio.errorMessage(response) };
    } catch (error) {
      return { status: 0, reason: error.message };
    }
  }

  function connect() {
    if (source) {
      source.close();
    }
    feedStatus.textContent = "Connecting…";
    source = new EventSource("/dashboard/feed");
    source.onmessage = (event) => update(JSON.parse(event.data));
    source.onerror = async () => {
      if (source.readyState !== EventSource.CLOSED) {
        feedStatus.textContent = "The feed was interrupted; reconnecting…";
        return; // EventSource reconnects by itself
      }
      const failure = await diagnose();
      if (failure && failure.status === 401) {
        feedStatus.textContent = "The feed needs an API key";
        keyForm.ask(failure.reason);
        return;
      }
      feedStatus.textContent = `The feed is unavailable${failure ? `: ${failure.reason}` : ""}; retrying…`;
      setTimeout(connect, 2000);
    };
  }

  window.addEventListener("resize", () => Object.values(charts).forEach((chart) => chart.draw()));
  connect();
})();
