// One turn of a conversation: the request it sends and the streamed answer it collects.

import { ApiError, streamChat } from "./api.js";

const NUMERIC = ["temperature", "top_p", "top_k", "max_tokens", "seed"];

/** The request for the conversation so far: the whole history goes with every turn. */
export function chatRequest(settings, messages) {
  const history = messages.filter((m) => m.content).map(({ role, content }) => ({ role, content }));
  if (settings.system.trim()) history.unshift({ role: "system", content: settings.system });
  // include_usage: the last chunk carries the token counts that the answer's stats line shows
  const body = { messages: history, stream: true, stream_options: { include_usage: true } };
  if (settings.model) body.model = settings.model;
  for (const name of NUMERIC) {
    if (settings[name] !== "") body[name] = Number(settings[name]);
  }
  if (settings.json) body.response_format = { type: "json_object" };
  return body;
}

/** What the page says about a failed turn. */
export function describe(error) {
  if (!(error instanceof ApiError)) return `Something went wrong in the page: ${error.message}`;
  if (error.status === 401) return `401: ${error.message} Enter the server's API key in Settings.`;
  if (error.status === 429) {
    const wait = error.retryAfter ? ` Try again in ${error.retryAfter} s.` : "";
    return `429: ${error.message}${wait}`;
  }
  if (error.status === 0 || error.status === 200) return error.message; // no HTTP error to quote
  return `${error.status}: ${error.message}`;
}

/**
 * Stream the answer into `reply` (a message object, saved with the conversation), calling `onText` after each piece
 * of text. Ends with reply.state "done", "stopped" (signal aborted) or "error" (reply.error says why). `sessionId`:
 * the conversation's id, sent as X-Session-Id.
 */
export async function streamAnswer(body, apiKey, reply, signal, onText, sessionId = "") {
  const started = performance.now();
  let first = null;
  let usage = null;
  reply.state = "streaming";
  try {
    for await (const chunk of streamChat(body, apiKey, signal, sessionId)) {
      const choice = chunk.choices?.[0];
      if (choice?.delta?.content) {
        first ??= performance.now();
        reply.content += choice.delta.content;
        onText();
      }
      if (choice?.finish_reason) reply.finish = choice.finish_reason;
      if (chunk.usage) usage = chunk.usage;
    }
    reply.state = "done";
  } catch (error) {
    reply.state = signal.aborted ? "stopped" : "error";
    if (!signal.aborted) reply.error = describe(error);
  }
  reply.stats = stats(started, first, performance.now(), usage);
}

function stats(started, first, ended, usage) {
  const result = { ttft_ms: first === null ? null : Math.round(first - started) };
  if (usage) {
    result.prompt_tokens = usage.prompt_tokens;
    result.completion_tokens = usage.completion_tokens;
    // decode speed: the tokens after the first, over the time after it
    if (first !== null && usage.completion_tokens > 1 && ended > first) {
      result.tokens_per_s = (usage.completion_tokens - 1) / ((ended - first) / 1000);
    }
  }
  return result;
}
