"""HTML rendering: escaping (XSS), token colours, code blocks and Markdown kept intact."""
import re

from app import render

XSS = ['<script>window.pwned=1</script>', '<img src=x onerror="window.pwned=1">']


def steps_for(pieces):
    """Each (text, origin, depth) as its own step's token list, for brevity."""
    return [{"tokens": [[t, o, d]], "rejected": []} for t, o, d in pieces]


def test_model_text_is_escaped_in_both_views():
    steps = steps_for([(XSS[0], "serial", 1), (" and ", "target", 0), (XSS[1], "mlp", 3)])
    text = "".join(p[0] for s in steps for p in s["tokens"])
    message = {"role": "assistant", "text": text, "steps": steps}
    for view in ("colours", "tokens", "markdown"):
        out = render.message_html(message, view)
        assert "<script" not in out and "<img" not in out, view
        assert "&lt;script&gt;" in out and "&lt;img" in out
    user = render.message_html({"role": "user", "text": XSS[1]})
    assert "<img" not in user


def test_rejected_drafts_are_escaped_and_hidden_by_default():
    steps = [{"tokens": [["ok", "target", 0]], "rejected": ['"><img src=x onerror=alert(1)>']}]
    out = render.colour_html(steps)
    assert "<img" not in out and 'class="rej"' in out
    assert "rejected:" in out  # in the title, for hover
    assert "show-rejected" in render.chat_html([{"role": "assistant", "text": "ok", "steps": steps}],
                                               show_rejected=True)


def test_colours_by_origin_and_depth():
    steps = [{"tokens": [["A", "serial", 1], ["B", "mlp", 3], ["C", "mlp", 9], ["D", "fta", 4], ["E", "target", 0],
                         ["F", "lookup", 5]],
              "rejected": ["x"]}]
    out = render.colour_html(steps)
    for cls in ("o-serial", "o-mlp d3", "o-mlp d7", "o-fta", "o-target", "o-lookup"):
        assert f'class="tok {cls}"' in out
    assert out.index("<s class=\"rej\"") < out.index(">E<")  # the refused draft sits where E went


def test_code_block_becomes_pre_even_when_split_across_tokens():
    pieces = [("Here:\n`", "target", 0), ("``py", "serial", 1), ("thon\nx = 1", "mlp", 3), ("\n```", "target", 0),
              ("\nDone", "target", 0)]
    out = render.colour_html(steps_for(pieces))  # the raw-tokens view
    assert out.count('<pre class="code"><code>') == 1 and out.count("</code></pre>") == 1
    pre = out[out.index("<pre"):out.index("</pre>")]
    assert "x = 1" in pre and "Done" not in pre and "Here" not in pre


def test_unclosed_code_block_while_streaming_is_closed_in_html():
    out = render.colour_html(steps_for([("```\nprint(1)", "target", 0)]))
    assert out.endswith("</code></pre></div>")


def test_markdown_view_renders_markdown_and_code():
    text = "# Title\n\n**bold** and `x`\n\n```python\nif a < b:\n    pass\n```\n"
    out = render.message_html({"role": "assistant", "text": text, "steps": steps_for([(text, "target", 0)])},
                              "markdown")
    assert "<h1>Title</h1>" in out and "<strong>bold</strong>" in out
    assert '<code class="language-python">if a &lt; b:\n    pass\n</code>' in out


def test_stats_and_legend():
    html = render.stats_html({"speculative": True, "tokens_per_s": 10, "ttft_s": 0.05, "tau": 2.5, "new_tokens": 10,
                              "forward_passes": 4, "acceptance_per_depth": [0.9, 0.4]}, "eos")
    assert "τ 2.50" in html and "TTFT 50 ms" in html and html.count('class="bar"') == 2
    legend = render.legend_html()
    assert "serial head" in legend and "MLP" in legend and "rejected" in legend


def test_coloured_markdown_keeps_markdown_and_code():
    pieces = [("Here", "target", 0), (" is", "serial", 1), (" **", "serial", 2), ("bold", "mlp", 3), ("**", "mlp", 4),
              ("\n\n-", "target", 0), (" item", "serial", 1), ("\n\n``", "target", 0), ("`py", "serial", 1),
              ("thon\n", "target", 0), ("if a < b:\n", "mlp", 5), ("    pass\n", "mlp", 6), ("```", "target", 0),
              ("\n", "target", 0), ("# Done", "serial", 1)]
    out = render.coloured_markdown_html(steps_for(pieces))
    assert '<strong><span class="tok o-mlp d3" title="MLP head, depth 3">bold</span></strong>' in out
    assert "<ul>" in out and "<li>" in out and "<h1>" in out
    code = out[out.index('<pre><code class="language-python">'):out.index("</code></pre>")]
    assert 'o-mlp d5' in code and 'o-mlp d6' in code
    assert re.sub("<[^>]+>", "", code).endswith("if a &lt; b:\n    pass\n")  # layout kept, text escaped
    assert "\ue000" not in out and "\ue001" not in out  # no marker survives
    # No span sits directly inside a list or between blocks.
    assert "<ul>\n<span" not in out and "</p>\n<span" not in out


def test_markers_never_break_block_syntax():
    """Token boundaries inside Markdown syntax still give the same document as plain Markdown."""
    text = "# Title\n\n1. one\n2. two\n\n---\n\n> quote &amp; *em* `code`\n\n```js\nlet x = 1;\n```\n"
    plain = render.markdown_html(text)
    for size in (1, 2, 3):  # every way of cutting the text into tokens of this length
        pieces = [(text[i:i + size], "serial", 1) for i in range(0, len(text), size)]
        coloured = render.coloured_markdown_html(steps_for(pieces))
        assert re.sub("<[^>]+>", "", coloured).strip() == re.sub("<[^>]+>", "", plain).strip()
        tags = lambda h: [t for t in re.findall(r"</?(\w+)", h) if t not in ("span", "div", "s")]
        assert tags(coloured) == tags(plain), size


def test_legend_shows_what_the_tree_can_produce_and_marks_the_rest_off():
    from gumiho_core import TreeSettings

    def chips(html):  # label -> "on" / "off", and every chip's tooltip
        found = re.findall(r'<span class="legend-item( off)?" title="([^"]+)"><(?:span|s) class="[^"]+">([^<]+)<', html)
        return {label: "off" if off else "on" for off, _, label in found}, [tip for _, tip, _ in found]

    default, tips = chips(render.legend_html(TreeSettings()))
    assert default == {"serial head": "on", "context lookup": "on", "target": "on", "rejected draft": "on",
                       "MLP heads": "off", "FTA": "off"}
    assert all(tip and "\n" not in tip for tip in tips) and len(tips) == len(default)
    deep, _ = chips(render.legend_html(TreeSettings.gpu()))
    assert deep["MLP d3"] == deep["MLP d5"] == deep["MLP d7"] == deep["FTA"] == "on"
    no_lookup, _ = chips(render.legend_html(TreeSettings(lookup_tokens=0)))
    assert no_lookup["context lookup"] == "off"
    plain, _ = chips(render.legend_html(None, has_heads=False))
    assert [k for k, v in plain.items() if v == "on"] == ["target"]


def test_rejected_drafts_read_as_words_not_raw_special_tokens():
    steps = [{"tokens": [["Hi", "serial", 1], [".", "target", 0]], "rejected": ["<|im_end|>", "\n\n", " there"]}]
    for out in (render.colour_html(steps), render.coloured_markdown_html(steps)):
        rejected = re.findall(r'<s class="rej"[^>]*>([^<]*)</s>', out)
        assert rejected == ["⟨end of turn⟩", "↵↵", " there"], rejected
        assert "&lt;|im_end|&gt;" not in out and "<|im_end|>" not in out
        assert "rejected: “⟨end of turn⟩” | “↵↵” | “ there”" in out  # the hover title, one line
    # The answer itself is the model's text: a special token it wrote stays as written.
    written = render.colour_html([{"tokens": [["<|im_end|>", "target", 0]], "rejected": []}])
    assert "&lt;|im_end|&gt;" in written


def test_chat_log_carries_its_session_for_the_address():
    assert "data-session" not in render.chat_html([])  # the page as first built: the address is left alone
    assert 'data-session=""' in render.chat_html([], session="")
    assert 'data-session="12"' in render.chat_html([], session="12")
