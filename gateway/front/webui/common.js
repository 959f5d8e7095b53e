// What both pages share: the API key (asked for only when the server answers 401, kept in this
// tab's sessionStorage), the headers the API calls carry, and reading a server-sent-event body.
"use strict";

const Folio = (() => {
  const STORAGE_KEY = "folio.apiKey";
  // The dashboard's feed reads it from this cookie: a browser's EventSource sends no headers.
  const COOKIE = "folio_api_key";

  function apiKey() {
    return sessionStorage.getItem(STORAGE_KEY) || "";
  }

  function setCookie(key) {
    // A session cookie for the feed only; never sent to the API routes.
    const expiry = key ? "" : "; max-age=0";
    document.cookie = `${COOKIE}=${encodeURIComponent(key)}; path=/dashboard; SameSite=Strict${expiry}`;
  }

  function setApiKey(key) {
    if (key) {
      sessionStorage.setItem(STORAGE_KEY, key);
    } else {
      sessionStorage.removeItem(STORAGE_KEY);
    }
    setCookie(key);
  }

  function headers(extra = {}) {
    const key = apiKey();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
  }

  // The error message of a failed API answer (the OpenAI error body when there is one).
  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) {
        return body.error.message;
      }
    } catch (_) {
      // not JSON: the status says it
    }
    return `${response.status} ${response.statusText}`;
  }

  // The data of each event of a text/event-stream body, as they arrive.
  async function* events(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        return;
      }
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) {
          yield data;
        }
      }
    }
  }

  // The key form of a page: shown with `reason`, it calls `onKey` once a key is entered.
  function keyForm(onKey) {
    const form = document.getElementById("key-form");
    const input = document.getElementById("api-key");
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) {
        input.focus();
        return;
      }
      setApiKey(key);
      input.value = "";
      form.hidden = true;
      onKey();
    });
    return {
      ask(reason) {
        document.getElementById("key-reason").textContent = reason;
        form.hidden = false;
        input.focus();
      },
    };
  }

  // A key kept from another page of this tab reaches the feed's cookie too.
  setCookie(apiKey());

  return { apiKey, setApiKey, headers, errorMessage, events, keyForm };
})();
