"""Model text to HTML: escaping, Markdown, and the per-token provenance colours.

Everything the model (or the user) wrote passes through `html.escape` (or markdown-it
with raw HTML disabled, which escapes it too) before any markup of ours is added, so a
`<script>` in an answer is shown as text, never run.

Three views of an answer:
  "colours"  - the answer rendered as Markdown, and inside it every token's text wrapped
               in a <span> coloured by where the token came from (the default).
  "tokens"   - the raw token stream: one span per token, whitespace kept, fenced code as
               <pre>; shows token boundaries exactly, Markdown syntax left as typed.
  "markdown" - plain Markdown, no colours.

How "colours" keeps Markdown intact: a marker made of private-use characters is put into
the text where each token starts, the text is rendered by markdown-it, and then each text
node of the HTML is split at the markers into coloured spans (spans never cross a tag).
Markers are left out next to Markdown punctuation and at line starts, where they could
change how the Markdown parses; such a token shares its neighbour's span.

A "step" is what one target forward pass produced (see gumiho_core.events.StepEvent),
stored as {"tokens": [[text, origin, depth], ...], "rejected": [text, ...]}.
"""
from __future__ import annotations

import html
import json
import re
from collections import OrderedDict
from html.parser import HTMLParser

from markdown_it import MarkdownIt

# commonmark with raw HTML off: `<b>` in model text stays text. Tables are handy in answers.
_markdown = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")

# One line each: the legend's tooltips, and what hovering over a token says.
ORIGIN_LABELS = {
    "serial": "Guessed by the serial draft head, accepted by the model.",
    "mlp": "Guessed by an MLP draft head (darker = deeper), accepted by the model.",
    "fta": "Added to a short draft path by Full Tree Attention, accepted by the model.",
    "lookup": "Copied from earlier in the conversation (context lookup), accepted by the model.",
    "target": "The model's own token: every forward pass adds one.",
    "rejected": "A draft the model refused (small and struck through, with \"Show rejected drafts\").",
}
ORIGIN_NAMES = {"serial": "serial head", "mlp": "MLP head", "fta": "FTA", "lookup": "context lookup",
                "target": "target"}
MAX_SHADE = 7  # MLP depths beyond this share the darkest shade

# A fenced block: ``` or ~~~ at a line start, up to the closing fence or the end of the
# text (an answer still streaming has no closing fence yet).
_FENCE = re.compile(r"(?m)^(```|~~~)[^\n]*\n.*?(?:^\1[ \t]*$|\Z)", re.DOTALL)


def esc(text: str) -> str:
    return html.escape(text, quote=True)


def step_from_event(event) -> dict:
    """A StepEvent as the JSON-able dict we store and render."""
    return {
        "tokens": [[t.text, t.origin, t.depth] for t in event.tokens],
        "rejected": [t.text for t in event.rejected],
    }


def markdown_html(text: str) -> str:
    return _markdown.render(text)


def _code_ranges(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _FENCE.finditer(text)]


def _token_title(origin: str, depth: int, refused: list[str]) -> str:
    """What hovering over a token says, on one line: its source, depth, and the drafts refused there."""
    title = ORIGIN_NAMES.get(origin, origin) + (f", depth {depth}" if depth else "")
    if refused:
        title += " · rejected: " + " | ".join(f"“{readable(r)}”" for r in refused)
    return title


# Special tokens as the tokenizer spells them ("<|im_end|>"), and the words shown for them.
_SPECIAL = re.compile(r"<\|([A-Za-z0-9_]{1,40})\|>")
SPECIAL_NAMES = {"im_end": "end of turn", "eot_id": "end of turn", "im_start": "turn start",
                 "endoftext": "end of text", "end_of_text": "end of text"}


def readable(draft: str) -> str:
    """A rejected draft as a reader can take it in: special tokens as ⟨words⟩, line breaks as ↵.

    Only for drafts the model refused (never for the answer itself, which is the model's text):
    a raw "<|im_end|>" or a line break inside a small struck-out alternative breaks the reading.
    """
    text = _SPECIAL.sub(lambda m: f"⟨{SPECIAL_NAMES.get(m.group(1), m.group(1))}⟩", draft)
    text = text.replace("\r\n", "↵").replace("\n", "↵").replace("\t", "⇥")
    return text if text.strip() else "␣" * len(text)


def _rejected_html(draft: str) -> str:
    return f'<s class="rej" title="rejected draft">{esc(readable(draft))}</s>'


def _token_class(origin: str, depth: int) -> str:
    if origin == "mlp":
        return f"tok o-mlp d{min(max(depth, 1), MAX_SHADE)}"
    return f"tok o-{origin if origin in ORIGIN_LABELS else 'target'}"


def colour_html(steps: list[dict]) -> str:
    """The provenance view: one span per token, code fences as <pre>, rejected drafts as <s>.

    Rejected candidates belong just before the target's token of their step (they were the
    drafts the target refused at that position). They are always in the title (hover) and
    are drawn struck through when the container has the class `show-rejected`.
    """
    pieces: list[tuple[str, str, str]] = []  # (text, css class, title)
    for step in steps:
        rejected = [r for r in step.get("rejected", []) if r]
        for text, origin, depth in step.get("tokens", []):
            refused = rejected if origin == "target" else []
            for r in refused:
                pieces.append((r, "rej", "rejected draft"))
            pieces.append((text, _token_class(origin, depth), _token_title(origin, depth, refused)))

    # Where fenced code lies in the accepted text (rejected pieces are not part of it).
    accepted = "".join(t for t, cls, _ in pieces if cls != "rej")
    ranges = _code_ranges(accepted)
    out: list[str] = []
    offset, in_code, r = 0, False, 0

    def boundaries_within(start: int, end: int) -> list[int]:
        cuts = []
        for a, b in ranges:
            for cut in (a, b):
                if start < cut < end:
                    cuts.append(cut)
        return sorted(cuts)

    def inside(pos: int) -> bool:
        return any(a <= pos < b for a, b in ranges)

    for text, cls, title in pieces:
        if cls == "rej":
            out.append(_rejected_html(text))
            continue
        start, end = offset, offset + len(text)
        cuts = [start, *boundaries_within(start, end), end]
        for a, b in zip(cuts, cuts[1:]):
            want_code = inside(a)
            if want_code != in_code:
                out.append('<pre class="code"><code>' if want_code else "</code></pre>")
                in_code = want_code
            out.append(f'<span class="{cls}" title="{esc(title)}">{esc(text[a - start:b - start])}</span>')
        if start == end:  # an empty piece (mid-character) still marks its token
            out.append(f'<span class="{cls}" title="{esc(title)}"></span>')
        offset = end
    if in_code:
        out.append("</code></pre>")
    return f'<div class="prov">{"".join(out)}</div>'


# -- colours on top of Markdown ------------------------------------------------------------
_M_OPEN, _M_CLOSE, _M_DIGIT0 = "\ue000", "\ue001", 0xE010  # private use: never Markdown syntax
_MARKER = re.compile(f"{_M_OPEN}([\ue010-\ue019]+){_M_CLOSE}")
_SYNTAX = set("*_~`#>-+=|[]()!\\<&:.")


def _marker(index: int) -> str:
    return _M_OPEN + "".join(chr(_M_DIGIT0 + int(d)) for d in str(index)) + _M_CLOSE


def _marker_index(match: re.Match) -> int:
    return int("".join(str(ord(c) - _M_DIGIT0) for c in match.group(1)))


_BLOCK_PREFIX = re.compile(r"[ \t#>*+=\-`~|0-9.)]*")  # what can open a heading, list, fence, rule...
_ENTITY_START = re.compile(r"&[#A-Za-z0-9]*$")


def _fence_bodies(text: str) -> list[tuple[int, int]]:
    """The literal content of each fenced block: after its opening line, before its closing fence."""
    bodies = []
    for m in _FENCE.finditer(text):
        start = text.index("\n", m.start()) + 1
        block = text[start:m.end()]
        closing = re.search(r"(?m)^(```|~~~)[ \t]*\Z", block)
        bodies.append((start, start + closing.start() if closing else m.end()))
    return bodies


def _safe_for_marker(text: str, at: int, bodies: list[tuple[int, int]]) -> bool:
    """May a marker go at `at` without changing how the Markdown parses?"""
    if any(a <= at < b for a, b in bodies):  # code is literal: anything goes
        return True
    before = text[at - 1] if at > 0 else "\n"
    after = text[at] if at < len(text) else "\n"
    if before in _SYNTAX and after in _SYNTAX:  # inside "**", "``", "\\*", "](" ...
        return False
    if _ENTITY_START.search(text[max(0, at - 12):at]):  # inside "&lt;"
        return False
    line = text[text.rfind("\n", 0, at) + 1:at]
    if line.lstrip().startswith(("```", "~~~")):  # a fence's info string ("python")
        return False
    # On a line that so far holds only block syntax ("#", "1.", "```", "---"), a marker
    # is safe only right before a word ("# |Title", "```|python").
    return not (_BLOCK_PREFIX.fullmatch(line) and not after.isalpha())


class _Colourer(HTMLParser):
    """Rebuilds markdown-it's HTML, wrapping text between markers in token spans."""

    def __init__(self, tokens: list[tuple[str, str, list[str]]]):
        super().__init__(convert_charrefs=True)
        self.tokens, self.out, self.current, self.in_pre = tokens, [], None, 0

    def _tag(self, tag, attrs, close=""):
        # Our own markdown-it output, rebuilt with every value escaped and markers removed.
        parts = "".join(f' {k}="{esc(_MARKER.sub("", v or ""))}"' for k, v in attrs)
        self.out.append(f"<{tag}{parts}{close}>")

    def handle_starttag(self, tag, attrs):
        self.in_pre += tag == "pre"
        self._tag(tag, attrs)

    def handle_startendtag(self, tag, attrs):
        self._tag(tag, attrs, " /")

    def handle_endtag(self, tag):
        self.in_pre -= tag == "pre"
        self.out.append(f"</{tag}>")

    def handle_data(self, data):
        pos = 0
        for m in _MARKER.finditer(data):
            self._text(data[pos:m.start()])
            self.current = _marker_index(m)
            for r in self.tokens[self.current][2]:
                self.out.append(_rejected_html(r))
            pos = m.end()
        self._text(data[pos:])

    def _text(self, text):
        if not text:
            return
        # Newlines between block tags are layout, not text: a span there (say inside <ul>)
        # would be invalid HTML.
        if self.current is None or (not self.in_pre and not text.strip()):
            self.out.append(esc(text))
            return
        cls, title = self.tokens[self.current][1], self.tokens[self.current][3]
        self.out.append(f'<span class="{cls}" title="{esc(title)}">{esc(text)}</span>')


def coloured_markdown_html(steps: list[dict]) -> str:
    """The answer as Markdown with each token's text coloured by its origin."""
    tokens = []  # (text, css class, rejected before it, title)
    for step in steps:
        rejected = [r for r in step.get("rejected", []) if r]
        for text, origin, depth in step.get("tokens", []):
            refused = rejected if origin == "target" else []
            tokens.append((text, _token_class(origin, depth), refused, _token_title(origin, depth, refused)))
    marked, length = [], 0
    full = "".join(t[0] for t in tokens)
    bodies = _fence_bodies(full)
    shown = [list(t) for t in tokens]
    carried: list[str] = []  # rejected drafts of tokens that got no marker go with the next one
    for i, (text, _cls, refused, _title) in enumerate(tokens):
        if text and _safe_for_marker(full, length, bodies):
            marked.append(_marker(i))
            shown[i][2], carried = carried + refused, []
        else:
            carried += refused
        marked.append(text)
        length += len(text)
    colourer = _Colourer([tuple(t) for t in shown])
    colourer.feed(_markdown.render("".join(marked)))
    colourer.close()
    return f'<div class="md coloured">{"".join(colourer.out)}</div>'


def compare_html(plain, gumiho) -> str:
    """The Compare box: one greedy prompt answered plain (left) and with Gumiho (right), side by
    side with their speeds. Called while it runs too: the running side says how far it got."""
    if plain.error or gumiho.error:
        return f'<div class="compare error">{esc(plain.error or gumiho.error)}</div>'
    columns = _compare_column("Plain decoding", plain, "") + _compare_column(
        "Gumiho (speculative)", gumiho, "" if plain.done else "starts when plain decoding is done")
    verdict = ""
    if plain.done and gumiho.done and plain.stats and gumiho.stats:
        p, g = plain.stats, gumiho.stats
        speedup = g["tokens_per_s"] / p["tokens_per_s"] if p["tokens_per_s"] else 0.0
        same = plain.text == gumiho.text
        words = "texts identical ✓" if same else "texts differ ✗ (should not happen with greedy decoding)"
        verdict = (f'<div class="compare-verdict">Gumiho ×{speedup:.2f} the speed of plain decoding · '
                   f'<span class="verdict {"same" if same else "differ"}">{words}</span></div>')
    return f'<div class="compare"><b>Compare (greedy)</b><div class="compare-cols">{columns}</div>{verdict}</div>'


def _compare_column(name: str, answer, waiting_note: str) -> str:
    if answer.done and answer.stats:
        st = answer.stats
        head = f"{st['tokens_per_s']:.1f} tok/s · {st['forward_passes']} passes · τ {st['tau']:.2f}"
    elif answer.steps:
        head = f"running… {sum(len(s['tokens']) for s in answer.steps)} tokens"
    else:
        head = waiting_note or "running…"
    done = " done" if answer.done else ""
    body = coloured_markdown_html(answer.steps) if answer.steps else ""
    return (f'<div class="compare-col{done}"><div class="compare-head"><b>{esc(name)}</b> '
            f'<span class="compare-speed">{esc(head)}</span></div>{body}</div>')


def legend_chips(tree=None, serial_depth: int = 2, has_heads: bool = True) -> list[tuple[str, str, str, bool]]:
    """(css class, label, tooltip, on) for each colour; `on` = the current tree can produce it.

    `tree` is the TreeSettings every answer uses (None = the defaults). The serial head drafts
    depths 1..serial_depth; MLP heads only the depths past it, up to tree.depth; FTA only with
    tree.fta; context lookup only with lookup_tokens > 0. Without heads only the target speaks.
    """
    from gumiho_core import TreeSettings

    tree = tree or TreeSettings()
    mlp_depths = list(range(serial_depth + 1, tree.depth + 1))
    why_off = " Off: the current draft tree does not make these."
    chips = [("tok o-serial", "serial head", ORIGIN_LABELS["serial"], has_heads)]
    if has_heads and mlp_depths:  # the first, middle and last depth show the range of shades
        for d in sorted({mlp_depths[0], mlp_depths[len(mlp_depths) // 2], mlp_depths[-1]}):
            chips.append((f"tok o-mlp d{min(d, MAX_SHADE)}", f"MLP d{d}", ORIGIN_LABELS["mlp"], True))
    else:
        chips.append(("tok o-mlp d3", "MLP heads",
                      ORIGIN_LABELS["mlp"] + f" Off: the tree stops at depth {tree.depth}.", False))
    fta_on = has_heads and tree.fta and tree.fta_tokens > 0
    chips.append(("tok o-fta", "FTA", ORIGIN_LABELS["fta"] + ("" if fta_on else why_off), fta_on))
    lookup_on = has_heads and tree.lookup_tokens > 0
    chips.append(("tok o-lookup", "context lookup", ORIGIN_LABELS["lookup"] + ("" if lookup_on else why_off),
                  lookup_on))
    chips.append(("tok o-target", "target", ORIGIN_LABELS["target"], True))
    chips.append(("rej", "rejected draft", ORIGIN_LABELS["rejected"], has_heads))
    return chips


def legend_html(tree=None, serial_depth: int = 2, has_heads: bool = True) -> str:
    """The colour legend: what this tree can produce first, then the rest greyed out as "off"."""
    chips = legend_chips(tree, serial_depth, has_heads)

    def chip(cls, label, tip, on):
        inner = f'<s class="{cls}">{esc(label)}</s>' if cls == "rej" else f'<span class="{cls}">{esc(label)}</span>'
        return f'<span class="legend-item{"" if on else " off"}" title="{esc(tip)}">{inner}</span>'

    on = "".join(chip(*c) for c in chips if c[3])
    off = "".join(chip(*c) for c in chips if not c[3])
    off = f'<span class="legend-off">off with this tree: {off}</span>' if off else ""
    return f'<div class="legend" id="legend"><b>Token origin:</b> {on}{off}</div>'


def token_sources(steps: list[dict]) -> dict[str, int]:
    """How many of an answer's tokens came from context lookup, from the draft heads, from the target."""
    counts = {"lookup": 0, "heads": 0, "target": 0}
    for step in steps or []:
        for _text, origin, _depth in step.get("tokens", []):
            counts[origin if origin in ("lookup", "target") else "heads"] += 1
    return counts


def sources_line(steps: list[dict]) -> str:
    """"41% looked up · 33% heads · 26% target": why an answer was as fast as it was."""
    counts = token_sources(steps)
    total = sum(counts.values())
    if not total:
        return ""
    return " · ".join(f"{counts[k] / total:.0%} {word}" for k, word in
                      (("lookup", "looked up"), ("heads", "heads"), ("target", "target")))


def stats_html(stats: dict | None, finish_reason: str | None = None, steps: list[dict] | None = None) -> str:
    """One line of numbers, where the tokens came from, and a labelled chart of acceptance per draft depth."""
    if not stats:
        return ""
    mode = "Gumiho" if stats.get("speculative") else "plain"
    parts = [
        f"{mode}",
        f"{stats.get('tokens_per_s', 0):.1f} tok/s",
        f"TTFT {stats.get('ttft_s', 0) * 1e3:.0f} ms",
        f"τ {stats.get('tau', 0):.2f}",
        f"{stats.get('new_tokens', 0)} tokens",
        f"{stats.get('forward_passes', 0)} passes",
    ]
    if finish_reason:
        parts.append(esc(finish_reason))
    sources = sources_line(steps) if stats.get("speculative") else ""
    if sources:
        parts.append(f'<span class="sources" title="where the answer\'s tokens came from">{sources}</span>')
    bars = _acceptance_bars(stats, steps or []) if stats.get("speculative") else ""
    return f'<div class="stats">{" · ".join(parts)} {bars}</div>'


def _acceptance_bars(stats: dict, steps: list[dict]) -> str:
    """Bars of P(draft accepted) by depth: the heads' depths one by one, the deeper ones (which
    only looked-up chains reach, up to 32) as one bar, each titled with its rate and count."""
    rates = stats.get("acceptance_per_depth") or []
    if not rates:
        return ""
    accepted = [0] * len(rates)  # accepted draft tokens at each depth, from the answer's steps
    for step in steps:
        for _text, origin, depth in step.get("tokens", []):
            if origin != "target" and 1 <= depth <= len(accepted):
                accepted[depth - 1] += 1
    heads_depth = min(len(rates), int((stats.get("tree") or {}).get("depth") or len(rates)))
    groups = [(f"{d}", f"depth {d}", [d]) for d in range(1, heads_depth + 1)]
    if len(rates) > heads_depth:
        deeper = list(range(heads_depth + 1, len(rates) + 1))
        groups.append((f"{deeper[0]}+", f"depths {deeper[0]}–{deeper[-1]} (looked-up chains only)", deeper))
    cols = []
    for label, name, depths in groups:
        got = sum(accepted[d - 1] for d in depths)
        # Drafts tried at a depth = accepted / rate (the rate is accepted / tried); a group's rate is then exact.
        tried = sum(accepted[d - 1] / rates[d - 1] for d in depths if rates[d - 1] > 0)
        rate = got / tried if tried else (rates[depths[0] - 1] if len(depths) == 1 else 0.0)
        cols.append(f'<span class="bar" title="{esc(name)}: {rate:.0%} of drafts accepted ({got} tokens)">'
                    f'<span style="height:{max(0.0, min(1.0, rate)) * 100:.0f}%"></span><i>{label}</i></span>')
    return (f'<span class="bars-chart"><span class="bars-title">accepted by depth</span>'
            f'<span class="bars" title="share of drafts the model accepted at each draft depth">{"".join(cols)}'
            f'</span></span>')


def message_html(message: dict, view: str = "colours") -> str:
    role = message["role"]
    if role == "user":
        body = f'<div class="plain">{esc(message["text"])}</div>'
    elif view == "markdown" or not message.get("steps"):
        body = f'<div class="md">{markdown_html(message["text"])}</div>'
    elif view == "tokens":
        body = colour_html(message["steps"])
    else:
        body = coloured_markdown_html(message["steps"])
    note = ""
    if message.get("finish_reason") in ("cancelled", "error"):
        note = f'<div class="note">({"stopped" if message["finish_reason"] == "cancelled" else "failed"}: partial answer)</div>'
    if message.get("error"):
        note += f'<div class="error">{esc(message["error"])}</div>'
    if message.get("unsaved"):  # the database refused it: shown, never as if it were kept
        note += '<div class="error unsaved">not saved: the database refused this answer</div>'
    stats = (stats_html(message.get("stats"), message.get("finish_reason"), message.get("steps"))
             if role == "assistant" else "")
    return f'<div class="msg {esc(role)}"><div class="who">{esc(role)}</div>{body}{note}{stats}</div>'


# Stored messages never change (edits delete and re-add), so their HTML is kept: while an
# answer streams, only the growing answer is rendered again at each step.
_rendered: OrderedDict = OrderedDict()


def _cached_message_html(message: dict, view: str) -> str:
    if message.get("id") is None:
        return message_html(message, view)
    # The whole message is the key (C-fast to serialise), so two databases in one process
    # with the same row ids can never share an entry.
    key = (view, json.dumps(message, sort_keys=True, default=str))
    if key not in _rendered:
        _rendered[key] = message_html(message, view)
        if len(_rendered) > 2000:
            _rendered.popitem(last=False)
    return _rendered[key]


def chat_html(messages: list[dict], view: str = "colours", show_rejected: bool = False,
              session: str | None = None) -> str:
    """The whole conversation. `session` ("12", or "" for a chat not stored yet) goes on the log
    as data-session: assets/app.js puts it in the page's address (/?session=12), so a reload or a
    bookmark reopens it. None (the page as first built) leaves the address alone."""
    classes = "chat" + (" show-rejected" if show_rejected else "")
    if not messages:
        inner = '<div class="empty">Say something to start a conversation.</div>'
    else:
        inner = "".join(_cached_message_html(m, view) for m in messages)
    address = "" if session is None else f' data-session="{esc(session)}"'
    return f'<div class="{classes}" id="chat-log"{address}>{inner}</div>'
