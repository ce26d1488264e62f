// Model output is untrusted: markdown becomes HTML, raw HTML in it stays text, and DOMPurify cleans the result
// before it touches the page. Code blocks are highlighted from their text and get a copy button.

import { Marked } from "../vendor/marked/marked.esm.js";
import DOMPurify from "../vendor/dompurify/purify.es.mjs";
import hljs from "../vendor/highlight/highlight.min.js";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (ch) => ESCAPES[ch]);
}

// A model that writes `<img src=x onerror=...>` is shown the tag as text, as it would be in a code editor.
const marked = new Marked({
  gfm: true,
  renderer: {
    html({ text, block }) {
      return block ? `<p>${escapeHtml(text)}</p>` : escapeHtml(text);
    },
  },
});

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") { // links open elsewhere and never hand this page to the target
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/**
 * Render `text` into `target`. While an answer streams this runs once per frame, so code blocks without a language
 * are auto-detected only when `final` (detection tries every language).
 */
export function renderMarkdown(target, text, final) {
  target.innerHTML = DOMPurify.sanitize(marked.parse(text));
  for (const code of target.querySelectorAll("pre > code")) {
    const language = /\blanguage-(\S+)/.exec(code.className)?.[1];
    if (language ? hljs.getLanguage(language) : final) hljs.highlightElement(code);
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    code.parentElement.append(copy);
  }
}

/** The click handler of the copy buttons, delegated from the message list. */
export async function copyCode(button) {
  const text = button.parentElement.querySelector("code").textContent.replace(/\n$/, ""); // marked ends blocks with one
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard API outside a secure context (http on a LAN address): copy through a selection
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}
