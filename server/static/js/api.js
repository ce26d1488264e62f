// The server's HTTP API as the page uses it: the model list and a streamed chat completion.

/** An answer from the server that is not a success, or an error the server reported inside a stream. */
export class ApiError extends Error {
  constructor(status, message, retryAfter = null) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

function headers(apiKey, sessionId = "") {
  const result = { "Content-Type": "application/json" };
  if (apiKey) result.Authorization = `Bearer ${apiKey}`;
  // behind the compose `scale` profile's nginx, a conversation's turns go to the replica holding its prefix cache
  if (sessionId) result["X-Session-Id"] = sessionId;
  return result;
}

const LOST = "Lost the connection to the server.";

// fetch and its body reader fail with a bare TypeError when the network does; Stop's AbortError passes as it is.
function lost(error) {
  return error.name === "AbortError" ? error : new ApiError(0, LOST);
}

async function failure(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    message = body.error?.message || message;
  } catch {
    // not the server's JSON error (a proxy's page, say): the status line is all there is
  }
  return new ApiError(response.status, message, response.headers.get("Retry-After"));
}

export async function listModels(apiKey) {
  const response = await fetch("/v1/models", { headers: headers(apiKey) }).catch((error) => { throw lost(error); });
  if (!response.ok) throw await failure(response);
  return (await response.json()).data.map((model) => model.id);
}

/** The chunks of a streamed chat completion, one parsed JSON object each; ends at `data: [DONE]`. */
export async function* streamChat(body, apiKey, signal, sessionId = "") {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(apiKey, sessionId), body: JSON.stringify(body), signal,
  }).catch((error) => { throw lost(error); });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read().catch((error) => { throw lost(error); });
      if (done) throw new ApiError(0, "The connection closed before the answer was complete.");
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = frame.split("\n").filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart()).join("\n");
        if (!data) continue; // a `: ping` comment
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(200, chunk.error.message); // the 200 had gone out when it failed
        yield chunk;
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // whatever ended the loop, the connection is not needed any more
  }
}
