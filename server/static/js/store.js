// Conversations and settings live in this browser's localStorage; the server keeps nothing between requests.

const CHATS_KEY = "llmserve.chats.v1";
const SETTINGS_KEY = "llmserve.settings.v1";

// Sampling fields are strings as typed; empty means "the server's default" and is not sent.
const DEFAULT_SETTINGS = {
  apiKey: "", model: "", system: "", temperature: "", top_p: "", top_k: "", max_tokens: "", seed: "", json: false,
};

function read(key) {
  try {
    return JSON.parse(localStorage.getItem(key));
  } catch {
    return null; // missing, or written by something else: start afresh rather than not at all
  }
}

/** False when the browser refused (storage full or disabled), so the page can say the chat is not kept. */
function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return true;
  } catch {
    return false;
  }
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS_KEY) };
}

export function saveSettings(settings) {
  return write(SETTINGS_KEY, settings);
}

/** { conversations: [{ id, title, messages: [{ role, content, ... }], updated }], currentId } */
export function loadChats() {
  const chats = read(CHATS_KEY);
  if (!chats || !Array.isArray(chats.conversations)) return { conversations: [], currentId: null };
  for (const conversation of chats.conversations) {
    for (const message of conversation.messages) {
      if (message.state === "streaming") message.state = "stopped"; // the page was closed mid-answer
    }
  }
  return chats;
}

export function saveChats(chats) {
  return write(CHATS_KEY, chats);
}

// Not crypto.randomUUID: that needs a secure context, and the page may be opened over plain http on a LAN address.
function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

export function newConversation() {
  return { id: newId(), title: "New chat", messages: [], updated: Date.now() };
}
