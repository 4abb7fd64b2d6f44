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
from jinja2.sandbox import ImmutableSandboxedEnvironment

from guard_errors import UserError

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' markers around a control token quoted in a message (private-use characters)
START, END = "\ue000", "\ue001"


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
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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
        raise UserError(f"{where}: chat_template is {type(template).__name__}, not a string of Jinja: fix it or "
                        f"remove it (conversations then use the project's own template)")
    try:
        return _compile(template)
    except jinja2.exceptions.TemplateError as e:
        raise UserError(f"{where}: the chat template does not parse ({type(e).__name__}: {str(e)[:120]}): fix "
                        f"it, or remove it") from None


@lru_cache(maxsize=8)
def _compile(template):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda f: datetime.now().strftime(f), dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(template)


def render(template, messages, names, where, add_generation_prompt=False):
    """(text, generation spans) of `messages` in `template`; names: bos_token and the like."""
    compiled = compile_template(template, where)
    tracker = next(e for e in compiled.environment.extensions.values() if isinstance(e, _Generation))
    pieces, spans = [], []
    tracker.tracking = pieces, spans
    try:
        for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                       documents=None, **names):
            pieces.append(piece)
    except jinja2.exceptions.SecurityError as e:
        raise UserError(f"{where}: the chat template tried to leave jinja2's sandbox ({str(e)[:120]}): it is not "
                        f"run; remove it or replace it with the model's original one") from None
    except Exception as e:  # raise_exception(), an undefined name, a type error: the template's own failure
        raise UserError(f"{where}: the chat template fails on this conversation ({type(e).__name__}: "
                        f"{str(e)[:120]}): fix the conversation or the template") from None
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
    """The token that ends each conversation in packed data (tokenizer.doc_ids cuts documents at
    it): the EOS, unless the template writes it inside conversations (ChatML's <|im_end|>, Llama
    3's <|eot_id|>); then the first of the other named and special tokens that it never writes."""
    ast = compile_template(template, "chat_template").environment.parse(template)
    used, literal = jinja2.meta.find_undeclared_variables(ast), _literal_text(template)
    names = [(n, _name(enc.config.get(n))) for n in ("eos_token", "unk_token", "pad_token")]
    others = sorted(enc.special_tokens_set - set(enc.extra_tokens), key=enc.encode_single_token)
    for variable, token in [*names, *((None, t) for t in others)]:
        if token and variable not in used and token not in literal:
            return enc.encode_single_token(token)
    raise UserError(f"{enc.name}: its chat template writes every special token, so none can end a conversation "
                    f"in packed data: add an unused special token (e.g. pad_token) to tokenizer_config.json")


def _name(value):
    return value.get("content") if isinstance(value, dict) else value


def encode(enc, messages, where):
    """(ids, mask) of one conversation in the model's chat template (`enc.chat_template`)."""
    template = enc.chat_template
    controls = control_tokens(enc, template)
    quoted = re.compile("|".join(map(re.escape, sorted(controls, key=len, reverse=True))) or "(?!)")
    marked = [{**m, "content": quoted.sub(lambda t: START + t[0] + END, m["content"].replace(START, "").replace(
        END, ""))} for m in messages]
    names = {n: _name(enc.config[n]) for n in NAMED if isinstance(_name(enc.config.get(n)), str)}
    text, spans = render(template, marked, names, where)
    if not spans:
        spans = _reply_spans(template, marked, names, where, text, controls)
    ids, mask = [], []
    for start, piece, as_text in _pieces(text):
        piece_ids, offsets = enc.encode_with_offsets(piece, as_text, first=start == 0)
        ids += piece_ids
        mask += [int(any(start + a < e and start + b > s for s, e in spans)) for a, b in offsets]
    return ids, mask


def _reply_spans(template, messages, names, where, text, controls):
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(template, messages[:k], names, where, add_generation_prompt=True)[0]
        upto = render(template, messages[:k + 1], names, where)[0]
        if not (text.startswith(upto) and upto.startswith(head)):
            raise UserError(f"{where}: the chat template renders the conversation up to message {k + 1} otherwise "
                            f"than inside the whole one (it rewrites earlier turns), so the replies cannot be found "
                            f"for the loss mask: wrap each reply in {{% generation %}}...{{% endgeneration %}} in the "
                            f"template")
        reply = upto[len(head):]
        if any(reply.rstrip().endswith(t) for t in controls):  # the end-of-turn token closes it; not the newline
            reply = reply.rstrip()
        spans.append((len(head), len(head) + len(reply)))
    return spans


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
