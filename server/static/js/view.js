// DOM for the message list and the conversation list. Text the model or the user wrote goes in as text, or as
// sanitized markdown (markdown.js), never as raw HTML.

import { renderMarkdown } from "./markdown.js";

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, action, title) {
  const node = element("button", `action ${action}`, label);
  node.type = "button";
  node.dataset.action = action;
  if (title) node.title = title;
  return node;
}

function statsText(stats, finish) {
  const parts = [];
  if (stats.prompt_tokens !== undefined) {
    parts.push(`${stats.prompt_tokens} prompt + ${stats.completion_tokens} completion tokens`);
  }
  if (stats.ttft_ms !== null) parts.push(`first token ${stats.ttft_ms} ms`);
  if (stats.tokens_per_s !== undefined) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  if (finish === "length") parts.push("cut off at max_tokens");
  return parts.join(" · ");
}

/** One message; `actions` names the buttons it offers ("edit" on the last question, "regenerate" on the last answer). */
export function messageElement(message, index, actions) {
  const article = element("article", `msg ${message.role}`);
  article.dataset.index = index;
  article.dataset.state = message.state ?? "done";
  const body = element("div", "body");
  if (message.role === "user") body.textContent = message.content;
  else renderMarkdown(body, message.content, message.state !== "streaming");
  article.append(body);
  if (message.error) article.append(element("p", "error", message.error));
  const footer = element("footer", "meta");
  if (message.state === "stopped") footer.append(element("span", "stopped", "stopped"));
  const stats = message.stats ? statsText(message.stats, message.finish) : "";
  if (stats) footer.append(element("span", "stats", stats));
  if (actions.includes("edit")) footer.append(button("Edit", "edit", "Edit this message and send it again"));
  if (actions.includes("regenerate")) footer.append(button("Regenerate", "regenerate", "Answer the last message again"));
  if (footer.childElementCount) article.append(footer);
  return article;
}

/** The editor that replaces the last question's text while it is edited. */
export function editorElement(text) {
  const form = element("form", "editor");
  const area = element("textarea");
  area.name = "text";
  area.value = text;
  area.rows = Math.min(10, text.split("\n").length + 1);
  const row = element("div", "editor-row");
  const send = element("button", "primary", "Send");
  send.type = "submit";
  row.append(button("Cancel", "cancel-edit"), send);
  form.append(area, row);
  return form;
}

export function conversationItem(conversation, isCurrent) {
  const item = element("li", isCurrent ? "current" : "");
  item.dataset.id = conversation.id;
  const open = button(conversation.title, "open");
  if (isCurrent) open.setAttribute("aria-current", "true");
  const rename = button("\u270E", "rename", "Rename");
  const remove = button("\u2715", "delete", "Delete");
  rename.setAttribute("aria-label", "Rename"); // icons alone say nothing to a screen reader
  remove.setAttribute("aria-label", "Delete");
  item.append(open, rename, remove);
  return item;
}

export function renameInput(title) {
  const input = element("input", "rename-input");
  input.value = title;
  input.setAttribute("aria-label", "Conversation name");
  return input;
}
