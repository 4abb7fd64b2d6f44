"""
A model's own chat template: the Jinja text a Hugging Face base ships (tokenizer_config.json's
"chat_template", or chat_template.jinja beside it), and a conversation as (ids, loss mask) in it.

The template is code from outside, so it runs in jinja2's ImmutableSandboxedEnvironment with what
transformers' chat_template_utils gives it (trim_blocks, lstrip_blocks, loop controls, the
{% generation %} tag, tojson, raise_exception, strftime_now, a limited dict and namespace): it
renders what transformers renders and reaches nothing else. Ids are what apply_chat_template(...,
tokenize=True) gives: the rendered text encoded whole, its added tokens matched. A control token
(a special token, or an added one the template writes) quoted in a message stays text, as
transformers' sanitize_control_tokens=True keeps it, so a message cannot close its own turn.

The loss mask covers each assistant reply and the end-of-turn token that closes it (<|im_end|>,
<|eot_id|>, </s>), not the header the template writes before it: from the end of the conversation
rendered up to that reply with add_generation_prompt=True to the end of the conversation rendered
with it, trailing whitespace after the end-of-turn token left out. A template with {% generation %}
tags marks the replies itself (transformers' return_assistant_tokens_mask), and those are used.
"""

import json
import re
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes

from guards import guard_chat
from guards.guard_errors import UserError

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
         "mask_token")
# transformers' markers around a control token quoted in a message (private-use characters)
START, END = "\ue000", "\ue001"
# our markers around each reply's content in one rendering (_reply_spans); removed from the data
REPLY, REPLY_END = "\ue002", "\ue003"
MAX_SLOW_REPLIES = 64  # replies a template writes unlike its first: each found by a rendering


class _Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: where the text it wraps lands in the output."""
    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.tracking = None  # (pieces so far, spans) while rendering

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_wrap"), [], [], body).set_lineno(lineno)

    def _wrap(self, caller):
        text = caller()
        if self.tracking is not None:  # as transformers: it is the next piece the template yields
            pieces, spans = self.tracking
            start = len("".join(pieces))
            spans.append((start, start + len(text)))
        return text


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    out = json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
                     sort_keys=sort_keys)
    # ensure_ascii's escapes, all but the markers around a quoted control token: escaped, they
    # would let the token inside pass as the template's own
    return re.sub(f"[^\x00-\x7f{START}{END}]", _escape, out) if ensure_ascii else out


def _escape(m):
    return json.dumps(m[0])[1:-1]


class _Dict:
    """dict(...) and dict.fromkeys(...), and no other attribute of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace() that stores no underscore name (nothing of CPython's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")


def compile_template(template, where):
    """The template compiled in the sandbox (UserError if it is not a string or does not parse)."""
    if not isinstance(template, str):
        raise UserError(f"{where}: chat_template is {type(template).__name__}, not a string of "
                        f"Jinja: fix it or "
                        f"remove it (conversations then use the project's own template)")
    try:
        return _compile(template)
    except (jinja2.exceptions.TemplateError, RecursionError, MemoryError) as e:
        raise UserError(f"{where}: the chat template does not parse ({type(e).__name__}: "
                        f"{_line(e)}): fix it, or remove it") from None


def _line(e):
    """An error's message in one line (raise_exception's may hold newlines, even a fake
    traceback)."""
    return " ".join(str(e).split())[:120]


@lru_cache(maxsize=8)
def _compile(template):
    env = guard_chat.Sandbox(trim_blocks=True, lstrip_blocks=True,
                             extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(template)


def render(template, messages, names, where, add_generation_prompt=False):
    """(text, generation spans) of `messages` in `template`; names: bos_token and the like."""
    compiled = compile_template(template, where)
    tracker = next(e for e in compiled.environment.extensions.values()
                   if isinstance(e, _Generation))
    pieces, spans = [], []
    tracker.tracking = pieces, spans
    size = 0
    try:
        with guard_chat.bounded(compiled.environment, where):
            for piece in compiled.generate(messages=messages, tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **names):
                pieces.append(piece)
                size += len(piece)
                guard_chat.check_output(size, where)
    except jinja2.exceptions.SecurityError as e:
        raise UserError(f"{where}: the chat template tried to leave jinja2's sandbox "
                        f"({_line(e)}): it is not run; remove it or use the model's original "
                        f"one") from None
    except UserError:
        raise
    # raise_exception(), an undefined name, a type error: the template's own failure
    except Exception as e:
        raise UserError(f"{where}: the chat template fails on this conversation "
                        f"({type(e).__name__}: "
                        f"{_line(e)}): fix the conversation or the template") from None
    finally:
        tracker.tracking = None
    return "".join(pieces), spans


def control_tokens(enc, template):
    """The tokens a message may quote only as text: the special ones, and the added tokens the
    template writes (transformers' default for sanitize_control_tokens)."""
    literal = _literal_text(template)
    return tuple(t for t in enc.special_tokens_set
                 if t not in enc.extra_tokens or (t in literal and not t.isspace()))


@lru_cache(maxsize=8)
def _literal_text(template):
    ast = compile_template(template, "chat_template").environment.parse(template)
    strings = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
    strings |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return "\0".join(strings)


def separator(enc, template):
    """The token that ends each conversation in packed data (data.doc_ids cuts documents at
    it): the EOS, unless the template writes it inside conversations (ChatML's <|im_end|>, Llama
    3's <|eot_id|>); then the first of the other named and special tokens that it never writes."""
    ast = compile_template(template, "chat_template").environment.parse(template)
    used, literal = jinja2.meta.find_undeclared_variables(ast), _literal_text(template)
    names = [(n, _name(enc.config.get(n))) for n in ("eos_token", "unk_token", "pad_token")]
    others = sorted(enc.special_tokens_set - set(enc.extra_tokens), key=enc.encode_single_token)
    for variable, token in [*names, *((None, t) for t in others)]:
        if token and variable not in used and token not in literal:
            return enc.encode_single_token(token)
    raise UserError(f"{enc.name}: its chat template writes every special token, so none can end a "
                    "conversation in packed data: add an unused special token (e.g. pad_token) "
                    "to tokenizer_config.json")


def _name(value):
    return value.get("content") if isinstance(value, dict) else value


def encode(enc, messages, where):
    """(ids, mask) of one conversation in the model's chat template (`enc.chat_template`)."""
    template, where = enc.chat_template, f"{where} ({enc.name})"  # (an error names the model)
    controls = control_tokens(enc, template)
    quoted = re.compile("|".join(map(re.escape, sorted(controls, key=len, reverse=True)))
                        or "(?!)")
    marked = _mark(messages, quoted)
    names = {n: _name(enc.config[n]) for n in NAMED if isinstance(_name(enc.config.get(n)), str)}
    text, spans = render(template, marked, names, where)
    if not spans:
        spans = _reply_spans(template, marked, names, where, text, controls)
    ids, mask, spans, k = [], [], sorted(spans), 0
    for start, piece, as_text in _pieces(text):
        piece_ids, offsets = enc.encode_with_offsets(piece, as_text, first=start == 0)
        ids += piece_ids
        for a, b in offsets:  # learned where it overlaps a span (both in order: one pass)
            while k < len(spans) and spans[k][1] <= start + a:
                k += 1
            mask.append(int(k < len(spans) and spans[k][0] < start + b))
    return ids, mask


def _mark(obj, quoted):
    """Every string of the data (any field, dict keys too) with its control tokens quoted, as
    transformers' mark_control_tokens marks messages: a tool call's name or arguments, or a
    reasoning_content, cannot write a token that opens or closes a turn."""
    if isinstance(obj, str):
        obj = re.sub(f"[{START}{END}{REPLY}{REPLY_END}]", "", obj)  # (none from the data)
        return quoted.sub(lambda t: START + t[0] + END, obj)
    if isinstance(obj, dict):
        return {_mark(k, quoted): _mark(v, quoted) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_mark(v, quoted) for v in obj]
    return obj


def _reply_spans(template, messages, names, where, text, controls):
    """Each reply's span in `text`: the first and the last from the conversation rendered up
    to them (the docstring's rule); those between from where their content lands in one
    rendering with each reply's content between markers, with the same text around it as
    around the first's. Two renderings more per conversation, not two per reply (10,000
    messages: a second, not minutes); a reply written otherwise is rendered up to, as before."""
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        return []
    exact = {k: _exact_span(template, messages, names, where, text, controls, k)
             for k in {replies[0], replies[-1]}}
    content = _contents(template, messages, names, where, text) if len(replies) > 2 else None
    around = None
    if content:
        (s0, e0), (c0, d0) = exact[replies[0]], content[0]
        around = (text[s0:c0], text[d0:e0]) if s0 <= c0 and d0 <= e0 else None
    spans, slow = [], 0
    for k, cd in zip(replies, content or [None] * len(replies)):
        span = exact.get(k) or _around(text, cd, around)
        if span is None:
            slow += 1
            if slow > MAX_SLOW_REPLIES:
                raise UserError(f"{where}: the chat template writes its replies so that each "
                                f"needs a rendering of its own, and this conversation has "
                                f"{len(replies)}: wrap each reply in {{% generation %}}..."
                                f"{{% endgeneration %}} in the template, or split it")
            span = _exact_span(template, messages, names, where, text, controls, k)
        spans.append(span)
    return spans


def _contents(template, messages, names, where, text):
    """[(start, end)] of each reply's content in `text`, from one rendering with markers
    around them; None where the markers change the rest (a template that trims the content)."""
    tagged = [{**m, "content": REPLY + m["content"] + REPLY_END} if m["role"] == "assistant" else m
              for m in messages]
    marked = render(template, tagged, names, where)[0]
    found = list(re.finditer(f"[{REPLY}{REPLY_END}]", marked))
    n = sum(m["role"] == "assistant" for m in messages)
    order = "".join(m[0] for m in found)
    clean = marked.replace(REPLY, "").replace(REPLY_END, "")
    if order != (REPLY + REPLY_END) * n or clean != text:
        return None
    at = [m.start() - i for i, m in enumerate(found)]  # (in `text`: the markers before taken out)
    return list(zip(at[::2], at[1::2]))


def _around(text, content, around):
    """The span of a reply whose content is at `content` when `text` has the first reply's text
    `around` it (before, after), else None."""
    if content is None or around is None:
        return None
    (c, d), (before, after) = content, around
    if c >= len(before) and text[c - len(before):c] == before and text[d:d + len(after)] == after:
        return c - len(before), d + len(after)
    return None


def _exact_span(template, messages, names, where, text, controls, k):
    """The span of reply k: from the end of the conversation rendered up to it with
    add_generation_prompt=True to the end of the conversation rendered with it."""
    head = render(template, messages[:k], names, where, add_generation_prompt=True)[0]
    upto = render(template, messages[:k + 1], names, where)[0]
    if not (text.startswith(upto) and upto.startswith(head)):
        raise UserError(f"{where}: the chat template renders the conversation up to message "
                        f"{k + 1} otherwise than inside the whole one (it rewrites earlier "
                        f"turns), so the replies cannot be found for the loss mask: wrap each "
                        f"reply in {{% generation %}}...{{% endgeneration %}} in the template")
    reply = upto[len(head):]
    if any(reply.rstrip().endswith(t) for t in controls):  # its end-of-turn token; not the newline
        reply = reply.rstrip()
    return len(head), len(head) + len(reply)


def _pieces(text):
    """(start, piece, as_text) of a rendered chat: the text between quoted control tokens, and
    each quoted token (to encode as text), as transformers' encode_marked_chat cuts it."""
    pos, out = 0, []
    for m in re.finditer(f"{START}(.*?){END}|[{START}{END}]", text, flags=re.S):
        out.append((pos, text[pos:m.start()], False))
        if m.group(1):
            out.append((m.start(1), m.group(1), True))
        pos = m.end()
    out.append((pos, text[pos:], False))
    return [p for p in out if p[1]]
