// The endpoint page's playground, as the signed-in user: a chat that streams from /v1/chat/completions,
// or for an embedding endpoint (data-task="embed") one /v1/embeddings call per text.
(() => {
  const root = document.getElementById("playground");
  if (!root) return;
  const log = root.querySelector("[data-chat-log]");
  const status = root.querySelector("[data-chat-status]");
  const form = root.querySelector("[data-chat-form]");
  const input = form.querySelector("textarea");
  const send = form.querySelector("[data-chat-send]");
  const prices = {
    input: Number(root.dataset.priceInput), cached: Number(root.dataset.priceCached), output: Number(root.dataset.priceOutput),
  };
  // The organisation this page was shown for: the gateway refuses the call once the session has switched to another
  // (in another tab), rather than run it there.
  const headers = () => ({
    "Content-Type": "application/json", "X-CSRFToken": window.inferplaneCsrfToken(),
    "X-Inferplane-Organization": root.dataset.organization,
  });
  let messages = [];
  let controller = null;

  function bubble(role, text) {
    log.querySelector(".chat-empty")?.remove();
    const item = document.createElement("div");
    item.className = `chat-message chat-${role}`;
    const who = document.createElement("div");
    who.className = "chat-role";
    who.textContent = role === "user" ? "You" : (root.dataset.task === "embed" ? "Embedding" : "Assistant");
    const body = document.createElement("div");
    body.className = "chat-text";
    body.textContent = text;
    item.append(who, body);
    log.append(item);
    log.scrollTop = log.scrollHeight;
    return item;
  }

  function cost(usage) {
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    const dollars = ((usage.prompt_tokens - cached) * prices.input + cached * prices.cached + usage.completion_tokens * prices.output) / 1e6;
    return dollars < 0.01 ? `$${dollars.toFixed(6)}` : `$${dollars.toFixed(4)}`;
  }

  function footer(item, text, isError = false) {
    const meta = document.createElement("div");
    meta.className = isError ? "chat-meta error" : "chat-meta";
    meta.textContent = text;
    item.append(meta);
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      return (body.error && body.error.message) || body.detail || `HTTP ${response.status}`;
    } catch { return `HTTP ${response.status}`; }
  }

  async function ask(content) {
    messages.push({ role: "user", content });
    bubble("user", content);
    const item = bubble("assistant", "");
    item.classList.add("streaming");
    const text = item.querySelector(".chat-text");
    const started = performance.now();
    let firstTokenMs = null;
    let usage = null;
    let reply = "";
    controller = new AbortController();
    send.disabled = true;
    status.textContent = "Waiting for the endpoint…";
    try {
      const response = await fetch(root.dataset.url, {
        method: "POST", credentials: "same-origin", signal: controller.signal,
        headers: headers(),
        body: JSON.stringify({
          model: root.dataset.model, messages, stream: true, stream_options: { include_usage: true },
          max_tokens: Number(form.max_tokens.value) || 128,
        }),
      });
      if (!response.ok) throw new Error(await errorText(response));
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      let done = false;
      while (!done) {
        const chunk = await reader.read();
        if (chunk.done) break;
        buffer += decoder.decode(chunk.value, { stream: true });
        let newline;
        while ((newline = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, newline).replace(/\r$/, "");
          buffer = buffer.slice(newline + 1);
          if (line.startsWith(":")) {  // a progress comment while the endpoint cold-starts
            const note = line.slice(1).trim();
            if (note) status.textContent = note.charAt(0).toUpperCase() + note.slice(1);
            continue;
          }
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") { done = true; break; }
          const event = JSON.parse(data);
          if (event.error) throw new Error(event.error.message || "the stream ended with an error");
          const delta = event.choices && event.choices[0] && event.choices[0].delta;
          if (delta && delta.content) {
            if (firstTokenMs === null) { firstTokenMs = performance.now() - started; status.textContent = "Streaming…"; }
            reply += delta.content;
            text.textContent = reply;
            log.scrollTop = log.scrollHeight;
          }
          if (event.usage) usage = event.usage;
        }
      }
      messages.push({ role: "assistant", content: reply });
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      if (usage) {
        footer(item, `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens · ${cost(usage)} · ${seconds} s` +
          (firstTokenMs !== null ? ` · first token ${Math.round(firstTokenMs)} ms` : ""));
      } else {
        footer(item, `${seconds} s`);
      }
      status.textContent = "";
    } catch (error) {
      messages.pop();  // the failed turn is not part of the conversation
      if (error.name === "AbortError") { footer(item, "Stopped."); status.textContent = ""; }
      else { footer(item, `Error: ${error.message}`, true); status.textContent = ""; }
    } finally {
      item.classList.remove("streaming");
      send.disabled = false;
      controller = null;
    }
  }

  async function embed(content) {
    bubble("user", content);
    const item = bubble("assistant", "");
    const text = item.querySelector(".chat-text");
    const started = performance.now();
    controller = new AbortController();
    send.disabled = true;
    status.textContent = "Waiting for the endpoint…";
    try {
      const response = await fetch(root.dataset.url, {
        method: "POST", credentials: "same-origin", signal: controller.signal,
        headers: headers(),
        body: JSON.stringify({ model: root.dataset.model, input: content, encoding_format: "float" }),
      });
      if (!response.ok) throw new Error(await errorText(response));
      const body = await response.json();
      const vector = body.data[0].embedding;
      const head = vector.slice(0, 8).map((value) => value.toFixed(4)).join(", ");
      text.textContent = `${vector.length} dimensions: [${head}${vector.length > 8 ? ", …" : ""}]`;
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      const usage = { prompt_tokens: body.usage.prompt_tokens, completion_tokens: 0 };
      footer(item, `${usage.prompt_tokens} input tokens · ${cost(usage)} · ${seconds} s`);
    } catch (error) {
      footer(item, error.name === "AbortError" ? "Stopped." : `Error: ${error.message}`, error.name !== "AbortError");
    } finally {
      status.textContent = "";
      send.disabled = false;
      controller = null;
    }
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const content = input.value.trim();
    if (!content || controller) return;
    input.value = "";
    (root.dataset.task === "embed" ? embed : ask)(content);
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); form.requestSubmit(); }
  });
  root.querySelector("[data-playground-clear]").addEventListener("click", () => {
    if (controller) controller.abort();
    messages = [];
    log.innerHTML = '<p class="chat-empty muted">Send a message to start.</p>';
    status.textContent = "";
  });
})();
