// Safe markdown: model text becomes DOM nodes made with createElement and textContent only.
// Nothing the model writes is ever parsed as HTML; links only for http(s) and mailto URLs.

const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+?)\*\*|__([^_\n]+?)__|\*([^*\s\n][^*\n]*?)\*|(?<![\w])_([^_\s\n][^_\n]*?)_(?![\w])|\[([^\]\n]+)\]\(([^)\s]+)\)|(https?:\/\/[^\s<>()]+[^\s<>().,;:!?'"])/g;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function safeUrl(raw) {
  try {
    const url = new URL(raw, window.location.href);
    return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

function link(text, href) {
  const url = safeUrl(href);
  if (!url) return document.createTextNode(text === href ? text : `${text} (${href})`);
  const a = el("a", null, text);
  a.href = url;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  return a;
}

export function inline(text) {
  const out = [];
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) out.push(document.createTextNode(text.slice(last, m.index)));
    if (m[1]) out.push(el("code", null, m[2].replace(/^ (.*) $/, "$1")));
    else if (m[3] || m[4]) { const b = el("strong"); b.append(...inline(m[3] || m[4])); out.push(b); }
    else if (m[5] || m[6]) { const i = el("em"); i.append(...inline(m[5] || m[6])); out.push(i); }
    else if (m[7]) out.push(link(m[7], m[8]));
    else if (m[9]) out.push(link(m[9], m[9]));
    last = m.index + m[0].length;
  }
  if (last < text.length) out.push(document.createTextNode(text.slice(last)));
  return out;
}

function codeBlock(lines, lang) {
  const pre = el("pre", "code-block");
  const code = el("code", lang ? `language-${lang.replace(/[^\w+-]/g, "")}` : null, lines.join("\n"));
  const copy = el("button", "copy", "Copy");
  copy.type = "button";
  copy.addEventListener("click", () => {
    navigator.clipboard?.writeText(code.textContent).then(() => { copy.textContent = "Copied"; });
  });
  if (lang) pre.append(el("span", "lang", lang));
  pre.append(copy, code);
  return pre;
}

function paragraph(lines) {
  const p = el("p");
  lines.forEach((line, i) => {
    if (i) p.append(el("br"));
    p.append(...inline(line));
  });
  return p;
}

const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;

function list(lines, start) {
  const first = LIST_ITEM.exec(lines[start]);
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  let i = start;
  let item = null;
  while (i < lines.length) {
    const m = LIST_ITEM.exec(lines[i]);
    if (m && /\d/.test(m[2]) === ordered) {
      item = el("li");
      item.append(...inline(m[3]));
      node.append(item);
    } else if (item && /^\s{2,}\S/.test(lines[i])) {
      item.append(el("br"), ...inline(lines[i].trim()));
    } else break;
    i++;
  }
  return [node, i];
}

// Render markdown text into container (replacing what it held). Works on partial text while streaming:
// an unclosed code fence shows as code so far.
export function renderMarkdown(text, container) {
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  const blocks = [];
  let para = [];
  const flush = () => { if (para.length) { blocks.push(paragraph(para)); para = []; } };
  for (let i = 0; i < lines.length;) {
    const line = lines[i];
    const fence = /^\s*(`{3,}|~{3,})\s*([\w+.#-]*)\s*$/.exec(line);
    if (fence) {
      flush();
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i++; // the closing fence
      blocks.push(codeBlock(body, fence[2]));
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) {
      flush();
      const h = el(`h${Math.min(6, heading[1].length + 2)}`);
      h.append(...inline(heading[2]));
      blocks.push(h);
      i++;
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flush(); blocks.push(el("hr")); i++; continue; }
    if (LIST_ITEM.test(line) && !(para.length && /^\d/.test(line.trim()) && !/^1[.)]/.test(line.trim()))) {
      flush();
      const [node, next] = list(lines, i);
      blocks.push(node);
      i = next;
      continue;
    }
    if (/^\s*>/.test(line)) {
      flush();
      const quoted = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*> ?/, ""));
      const q = el("blockquote");
      renderMarkdown(quoted.join("\n"), q);
      blocks.push(q);
      continue;
    }
    if (!line.trim()) { flush(); i++; continue; }
    para.push(line);
    i++;
  }
  flush();
  container.replaceChildren(...blocks);
}
