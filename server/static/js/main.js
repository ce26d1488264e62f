// The chat page's controller: state, events, and which part of the page to redraw.

import { listModels } from "./api.js";
import { copyCode, renderMarkdown } from "./markdown.js";
import { loadChats, loadSettings, newConversation, saveChats, saveSettings } from "./store.js";
import { chatRequest, describe, streamAnswer } from "./turn.js";
import { conversationItem, editorElement, messageElement, renameInput } from "./view.js";

const $ = (id) => document.getElementById(id);
const settings = loadSettings();
const chats = loadChats();
let streaming = null; // { conversation, reply, controller } while an answer streams; one at a time
let modelsRetry = null;
let frame = null;

const SETTINGS_FIELDS = ["apiKey", "system", "temperature", "top_p", "top_k", "max_tokens", "seed"];

function current() {
  let conversation = chats.conversations.find((c) => c.id === chats.currentId);
  if (!conversation) {
    conversation = chats.conversations[0] ?? newConversation();
    if (!chats.conversations.includes(conversation)) chats.conversations.unshift(conversation);
    chats.currentId = conversation.id;
  }
  return conversation;
}

function persist() {
  if (!saveChats(chats)) showBanner("This browser did not store the conversations (storage full or off): a reload loses them.");
}

/** A page-wide notice; one that `needsKey` opens the settings when clicked. */
function showBanner(text, needsKey = false) {
  $("banner").textContent = text;
  $("banner").classList.toggle("needs-key", needsKey);
  $("banner").hidden = false;
}

// ---- drawing

function render() {
  $("title").textContent = current().title; // current() first: on a first visit it creates the conversation
  renderSidebar();
  renderMessages();
  $("send").hidden = Boolean(streaming);
  $("stop").hidden = !streaming;
}

function renderSidebar() {
  const list = $("conversations");
  const sorted = [...chats.conversations].sort((a, b) => b.updated - a.updated);
  list.replaceChildren(...sorted.map((c) => conversationItem(c, c.id === chats.currentId)));
}

function renderMessages() {
  const messages = current().messages;
  const lastUser = messages.findLastIndex((m) => m.role === "user");
  const lastAnswer = messages.findLastIndex((m) => m.role === "assistant");
  const items = messages.map((message, index) => {
    const actions = [];
    if (!streaming && index === lastUser) actions.push("edit");
    if (!streaming && index === lastAnswer && index === messages.length - 1) actions.push("regenerate");
    return messageElement(message, index, actions);
  });
  const list = $("messages");
  list.replaceChildren(...items);
  list.scrollTop = list.scrollHeight;
}

/** Redraw the streaming answer, at most once a frame, and follow it down unless the user scrolled up. */
function drawStreaming() {
  if (frame !== null) return;
  frame = requestAnimationFrame(() => {
    frame = null;
    if (!streaming || streaming.conversation !== current()) return;
    const list = $("messages");
    const following = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
    const body = list.querySelector(`article[data-index="${current().messages.indexOf(streaming.reply)}"] .body`);
    if (body) renderMarkdown(body, streaming.reply.content, false);
    if (following) list.scrollTop = list.scrollHeight;
  });
}

// ---- turns

function titleFrom(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 40 ? `${line.slice(0, 40)}…` : line;
}

async function answer(conversation) {
  const body = chatRequest(settings, conversation.messages);
  const reply = { role: "assistant", content: "", state: "streaming" };
  conversation.messages.push(reply);
  conversation.updated = Date.now();
  streaming = { conversation, reply, controller: new AbortController() };
  render();
  await streamAnswer(body, settings.apiKey, reply, streaming.controller.signal, drawStreaming, conversation.id);
  streaming = null;
  persist();
  render();
}

function send(text) {
  if (streaming || !text.trim()) return;
  const conversation = current();
  conversation.messages.push({ role: "user", content: text });
  if (conversation.messages.length === 1) conversation.title = titleFrom(text);
  answer(conversation);
}

function regenerate() {
  const messages = current().messages;
  if (streaming || messages.at(-1)?.role !== "assistant") return;
  messages.pop();
  answer(current());
}

function startEdit(article) {
  const index = Number(article.dataset.index);
  const editor = editorElement(current().messages[index].content);
  article.replaceChildren(editor);
  editor.elements.text.focus();
  editor.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = editor.elements.text.value;
    if (streaming || !text.trim()) return;
    current().messages.splice(index); // the question and the answer to it; the edited question replaces them
    send(text);
  });
}

// ---- conversations

function select(id) {
  chats.currentId = id;
  document.body.classList.remove("sidebar-open");
  persist();
  render();
}

function newChat() {
  let conversation = chats.conversations.find((c) => c.messages.length === 0); // reuse, rather than pile up, empties
  if (!conversation) {
    conversation = newConversation();
    chats.conversations.unshift(conversation);
  }
  select(conversation.id);
  $("prompt").focus();
}

function startRename(item) {
  const conversation = chats.conversations.find((c) => c.id === item.dataset.id);
  const input = renameInput(conversation.title);
  item.replaceChildren(input);
  input.focus();
  input.select();
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep && input.value.trim()) conversation.title = input.value.trim();
    persist();
    render();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
}

// Deleting takes two clicks on the same button, so a slip of the finger loses nothing.
function remove(item, deleteButton) {
  if (!deleteButton.classList.contains("armed")) {
    deleteButton.classList.add("armed");
    deleteButton.textContent = "Delete?";
    setTimeout(() => {
      deleteButton.classList.remove("armed");
      deleteButton.textContent = "\u2715";
    }, 3000);
    return;
  }
  const id = item.dataset.id;
  if (streaming?.conversation.id === id) streaming.controller.abort();
  chats.conversations = chats.conversations.filter((c) => c.id !== id);
  if (chats.currentId === id) chats.currentId = null; // current() picks another, or starts a new one
  persist();
  render();
}

// ---- settings and models

function bindSettings() {
  const form = $("settings-form");
  for (const name of SETTINGS_FIELDS) {
    const field = form.elements[name];
    field.value = settings[name];
    field.addEventListener("input", () => {
      settings[name] = field.value.trim();
      saveSettings(settings);
    });
  }
  form.elements.apiKey.addEventListener("change", refreshModels); // once the key is typed, not per keystroke
  form.elements.model.addEventListener("change", () => {
    settings.model = form.elements.model.value;
    saveSettings(settings);
    $("model-name").textContent = settings.model;
  });
  form.addEventListener("submit", (event) => event.preventDefault());
  $("json-mode").checked = settings.json;
  $("json-mode").addEventListener("change", () => {
    settings.json = $("json-mode").checked;
    saveSettings(settings);
  });
}

/** `forKey`: opened because the server wants a key, so the cursor goes to that field (not otherwise: on a phone it
 * would pop up the keyboard). */
function toggleSettings(open, forKey = false) {
  $("settings").hidden = !open;
  $("toggle-settings").setAttribute("aria-expanded", String(open));
  if (open && forKey) $("settings-form").elements.apiKey.focus();
}

async function refreshModels() {
  clearTimeout(modelsRetry);
  const select = $("settings-form").elements.model;
  try {
    const ids = await listModels(settings.apiKey);
    select.replaceChildren(...ids.map((id) => new Option(id, id)));
    if (!ids.includes(settings.model)) settings.model = ids[0] ?? "";
    select.value = settings.model;
    saveSettings(settings);
    $("model-name").textContent = settings.model;
    $("banner").hidden = true;
  } catch (error) {
    if (error.status === 401) {
      showBanner("This server needs an API key: enter it in Settings (\u2699).", true);
    } else {
      // 503 while the model loads, or no server at all: say so and look again
      const seconds = Number(error.retryAfter) || 5;
      showBanner(`${describe(error)} Trying again in ${seconds} s.`);
      modelsRetry = setTimeout(refreshModels, seconds * 1000);
    }
  }
}

// ---- events

function bindEvents() {
  const prompt = $("prompt");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (streaming) return;
    const text = prompt.value;
    prompt.value = "";
    prompt.style.height = "";
    send(text);
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  prompt.addEventListener("input", () => { // grow with the text, up to the CSS max-height
    prompt.style.height = "";
    prompt.style.height = `${prompt.scrollHeight}px`;
  });
  $("stop").addEventListener("click", () => streaming?.controller.abort());
  $("messages").addEventListener("click", (event) => {
    const target = event.target.closest("button");
    if (!target) return;
    if (target.classList.contains("copy")) copyCode(target);
    else if (target.dataset.action === "regenerate") regenerate();
    else if (target.dataset.action === "edit") startEdit(target.closest("article"));
    else if (target.dataset.action === "cancel-edit") render();
  });
  $("conversations").addEventListener("click", (event) => {
    const target = event.target.closest("button");
    const item = target?.closest("li");
    if (!item) return;
    if (target.dataset.action === "open") select(item.dataset.id);
    else if (target.dataset.action === "rename") startRename(item);
    else if (target.dataset.action === "delete") remove(item, target);
  });
  $("new-chat").addEventListener("click", newChat);
  $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
  $("scrim").addEventListener("click", () => document.body.classList.remove("sidebar-open"));
  $("toggle-settings").addEventListener("click", () => toggleSettings($("settings").hidden));
  $("close-settings").addEventListener("click", () => toggleSettings(false));
  $("banner").addEventListener("click", () => {
    if ($("banner").classList.contains("needs-key")) toggleSettings(true, true);
  });
}

bindSettings();
bindEvents();
render();
refreshModels();
