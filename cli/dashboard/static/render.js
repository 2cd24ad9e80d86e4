// corral dashboard: what the page shows of text from the appliance, drawn as the CLI draws
// it (cli/render.py, text()): one line of printable ASCII. A browser does not act on
// escape sequences, but it does reorder text around bidi controls and right-to-left
// letters, hides zero-width characters and shows look-alike letters as Latin ones; so
// everything beyond printable ASCII is shown as an escape (\n, \r, \t, \xNN for the rest
// of C0 and C1 and for a byte that was not UTF-8, \uNNNN, \UNNNNNNNN), and a run of RUN
// spaces or more as its count. tests/unit/cli/test_dashboard_render.py holds it to
// cli/render.py, character for character.
"use strict";

const corralRender = (() => {
  const RUN = 3;
  const SIMPLE = { "\n": "\\n", "\r": "\\r", "\t": "\\t" };

  function hex(code, size) {
    return code.toString(16).padStart(size, "0");
  }

  function escape(ch) {
    if (Object.hasOwn(SIMPLE, ch)) return SIMPLE[ch];
    const code = ch.codePointAt(0);
    if (code >= 0xdc80 && code <= 0xdcff) return `\\x${hex(code - 0xdc00, 2)}`;
    if (code < 0x100) return `\\x${hex(code, 2)}`;
    return code < 0x10000 ? `\\u${hex(code, 4)}` : `\\U${hex(code, 8)}`;
  }

  function pieces(value) {
    const chars = Array.from(value);  // code points; a lone surrogate stays one
    const out = [];
    let at = 0;
    while (at < chars.length) {
      if (chars[at] === " ") {
        let end = at;
        while (end < chars.length && chars[end] === " ") end += 1;
        if (end - at >= RUN) out.push(`[${end - at} spaces]`);
        else for (let i = at; i < end; i += 1) out.push(" ");
        at = end;
        continue;
      }
      const ch = chars[at];
      out.push(ch.length === 1 && ch >= "!" && ch <= "~" ? ch : escape(ch));
      at += 1;
    }
    return out;
  }

  function cut(parts, width) {
    const whole = parts.join("");
    if (width === undefined || width === null || whole.length <= width) return whole;
    let size = 0;
    const kept = [];
    for (const part of parts) {
      if (size + part.length > width - 3) break;
      kept.push(part);
      size += part.length;
    }
    return `${kept.join("")}...`;
  }

  // Any value (null and undefined as "-") as one line of printable ASCII, at most `width`
  // characters when given.
  function text(value, width) {
    if (value === null || value === undefined) return "-";
    return cut(pieces(typeof value === "string" ? value : String(value)), width);
  }

  return { text };
})();

// What every text node of the page is given (dashboard.js).
function shown(value, width) {
  return corralRender.text(value, width);
}
