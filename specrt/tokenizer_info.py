"""What an artifact records of its tokenizer (the manifest's `tokenizer` entry), read from a saved HF tokenizer."""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Iterator

from specrt.errors import SpecrtError, clipped

MAX_RENDER_CHARS = 1 << 22  # a chat template's output (and any string or list it builds) is bounded by this
# A template's work is bounded too: compiling and rendering it run at most this many Python steps (lines and calls,
# counted by a trace function on the rendering thread alone) and this long; a real chat template takes a few
# thousand. A stop event (`render_stop`) ends a render sooner: the server's, when its client has left.
MAX_RENDER_STEPS = 4_000_000
MAX_RENDER_SECONDS = 5.0
_render = threading.local()


class RenderStopped(Exception):
    """A render was stopped from outside (its client left)."""


@contextmanager
def render_stop(event: threading.Event) -> Iterator[None]:
    """Renders on this thread inside the block stop, with RenderStopped, once `event` is set."""
    previous = getattr(_render, "stop", None)
    _render.stop = event
    try:
        yield
    finally:
        _render.stop = previous


@contextmanager
def bounded_work(what: str) -> Iterator[None]:
    """Run the block under the step and time budget (a SecurityError once past it), restoring any tracer."""
    import jinja2

    steps, deadline, stop = 0, time.monotonic() + MAX_RENDER_SECONDS, getattr(_render, "stop", None)

    def trace(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal steps
        steps += 1
        if not steps & 1023:
            if stop is not None and stop.is_set():
                raise RenderStopped(f"{what} stopped: the request was abandoned")
            if steps > MAX_RENDER_STEPS:
                raise jinja2.exceptions.SecurityError(f"{what} ran more than {MAX_RENDER_STEPS} steps")
            if time.monotonic() > deadline:
                raise jinja2.exceptions.SecurityError(f"{what} took more than {MAX_RENDER_SECONDS:g} s")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


# printf-style conversions ('%10s', '%-*.*f', '%(name)5d') and format() fields ('{:>10}', '{0:{w}}'): their widths
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FIELD = re.compile(r"\{[^{}]*:([^{}]*)\}")


def _check_size(n: int, what: str) -> None:
    import jinja2

    if n > MAX_RENDER_CHARS:
        raise jinja2.exceptions.SecurityError(f"the template {what} past {MAX_RENDER_CHARS} characters")


def _check_replace(s: str, new: str) -> None:
    """str.replace's result within the bound: at most one `new` per character of `s`, and one more."""
    _check_size((len(s) + 1) * max(len(new), 1), "grows a string (replace)")


def _check_join(items: list, sep: str) -> None:
    """str.join's result within the bound (an item that is not a string counted as 16 characters)."""
    _check_size(sum(len(x) if isinstance(x, str) else 16 for x in items) + len(sep) * len(items), "joins a string")


def _check_widths(fmt: str, args: Any) -> None:
    """printf-style and format() widths and precisions within the output bound (`*` takes them from args)."""
    numbers = [int(n) for m in _PERCENT.finditer(fmt) for n in m.groups() if n and n != "*"]
    if "*" in fmt or re.search(r":[^{}]*\{", fmt):
        values = args if isinstance(args, (tuple, list)) else (args,)
        numbers += [v for v in values if isinstance(v, int)]
    numbers += [int(n) for m in _FIELD.finditer(fmt) for n in re.findall(r"\d+", m.group(1))]
    _check_size(max(numbers, default=0), "pads a string")


def compile_template(template: str):
    """Compile a HF chat template the way transformers does (sandboxed, trim/lstrip blocks)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask marker): renders its body."""
        tags = {"generation"}

        def parse(self, parser):  # type: ignore[no-untyped-def]
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):  # type: ignore[no-untyped-def]
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, plus bounds on what `*` and `**` may build: a template comes with the artifact, which
        may come from someone else (`{{ 'x' * 4000000000 }}` would otherwise take all memory)."""

        intercepted_binops = frozenset(["*", "**", "%"])  # intercepted: never folded while compiling, either

        def call(__self, __context, __obj, *args, **kwargs):  # type: ignore[no-untyped-def]
            owner = getattr(__obj, "__self__", None)
            name = getattr(__obj, "__name__", "")
            if isinstance(owner, str):
                if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
                    _check_size(max([a for a in args if isinstance(a, int)], default=0) * (1 + owner.count("\t")),
                                f"pads a string ({name})")
                elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
                    _check_replace(owner, args[1])
                elif name == "join" and args:
                    items = list(args[0])  # an iterator is read once: checked, then joined
                    _check_join(items, owner)
                    args = (items, *args[1:])
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):  # type: ignore[no-untyped-def]
            owner, wrapped = getattr(value, "__self__", None), super().wrap_str_format(value)
            if not isinstance(owner, str) or wrapped is None:
                return wrapped

            def bounded(*args, **kwargs):  # type: ignore[no-untyped-def]
                # widths in the format string, or given as arguments to nested fields ('{0:{1}}')
                _check_widths(owner, (*args, *kwargs.values()))
                return wrapped(*args, **kwargs)

            return bounded

        def call_binop(self, context, operator, left, right):  # type: ignore[no-untyped-def]
            if operator == "%" and isinstance(left, str):
                _check_widths(left, right)
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) \
                            and len(seq) * n > MAX_RENDER_CHARS:
                        raise jinja2.exceptions.SecurityError(
                            f"the template repeats a sequence to more than {MAX_RENDER_CHARS} items")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right * max(abs(left).bit_length(), 1) > 4096:
                raise jinja2.exceptions.SecurityError("the template raises a number to too large a power")
            return super().call_binop(context, operator, left, right)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    bounded_filters(env)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:  # compiling folds constants, so it runs the template's expressions too: inside the same bounds
        with bounded_work("compiling the chat template"):
            return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise SpecrtError(f"invalid chat template: {e}") from None
    except Exception as e:  # noqa: BLE001 - a template from an artifact may raise anything
        raise SpecrtError(f"invalid chat template: {type(e).__name__}: {clipped(str(e))}") from None


def bounded_filters(env: Any) -> None:
    """Jinja's filters that can build more than they are given (padding, joining, replacing, formatting), checked
    against the output bound before they build it."""
    f = dict(env.filters)

    def center(value: Any, width: int = 80) -> str:
        _check_size(width if isinstance(width, int) else 0, "pads a string (center)")
        return f["center"](value, width)

    def indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> str:
        lines = str(s).count("\n") + 1
        _check_size(len(str(s)) + lines * (width if isinstance(width, int) else len(str(width))), "indents a string")
        return f["indent"](s, width, first, blank)

    def format_(value: Any, *args: Any, **kwargs: Any) -> str:
        _check_widths(str(value), args)
        return f["format"](value, *args, **kwargs)

    def replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> str:
        _check_replace(str(s), str(new))
        return f["replace"](eval_ctx, s, old, new, count)

    def join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        items = list(value)
        _check_join(items, str(d))
        return f["join"](eval_ctx, items, d, attribute)

    import jinja2

    env.filters.update(center=center, indent=indent, format=format_,
                       replace=jinja2.pass_eval_context(replace), join=jinja2.pass_eval_context(join))


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                      "cls_token", "mask_token")


def _token_text(tok: Any) -> str | None:
    """A special token as saved by HF: a plain string or an AddedToken dict {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SpecrtError(f"{path}: cannot read JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def read_tokenizer_info(tok_dir: Path, extra_eos_token_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Manifest info (files, chat_template, bos/eos ids, special tokens) of a saved HF tokenizer."""
    import tokenizers

    tok_dir = Path(tok_dir)
    cfg = _load_json(tok_dir / "tokenizer_config.json")
    special: dict[str, str] = {}
    for source in (_load_json(tok_dir / "special_tokens_map.json"), cfg):
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(source.get(key))
            if text is not None:
                special[key] = text
    template = None
    if (tok_dir / "chat_template.jinja").is_file():
        template = (tok_dir / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(cfg.get("chat_template"), str):
        template = cfg["chat_template"]
    elif isinstance(cfg.get("chat_template"), list):  # named templates: prefer "default"
        named = {t.get("name"): t.get("template") for t in cfg["chat_template"]}
        template = named.get("default") or next(iter(named.values()), None)
    tok = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    bos = tok.token_to_id(special["bos_token"]) if "bos_token" in special else None
    eos = [tok.token_to_id(special["eos_token"])] if "eos_token" in special else []
    eos_ids = list(dict.fromkeys(int(i) for i in [*eos, *extra_eos_token_ids] if i is not None))
    files = sorted(p.name for p in tok_dir.iterdir() if p.is_file())
    return {"files": files, "chat_template": template, "bos_token_id": bos,
            "eos_token_ids": eos_ids, "special_tokens": special, "chat": chat_affixes(template, special)}


def chat_affixes(template: str | None, special: dict[str, str]) -> dict | None:
    """The chat template's text around messages, rendered here once for runtimes without Jinja (the C++ runtime).

    {"prefix", "suffix", "trim"}: render([user: x], generation prompt) == prefix + x + suffix for every x (x.strip()
    where "trim": the template trims contents, as Llama 3's does); and "roles":
    conversations of system, user and assistant messages as start[first role] + content, then between["a>b"] +
    content for each next message, then end[last role] (+ "generation" for the generation prompt), checked against
    the template on conversations not used to derive them ({"unsupported": why} where the template is not that
    regular). Contents that a template transforming or testing them would render differently are used throughout.
    {"unsupported": why} for the whole entry when not even one user message renders that way; None without a
    template."""
    if not template:
        return None
    if "strftime_now" in template:
        return {"unsupported": "the chat template renders the current date"}
    try:
        compiled = compile_template(template)
    except SpecrtError as e:
        return {"unsupported": str(e)}

    def render(messages: list[tuple[str, str]], generation: bool) -> str:
        return compiled.render(messages=[{"role": r, "content": x} for r, x in messages],
                               add_generation_prompt=generation, tools=None, documents=None, **special)

    a, b = " \n specrt A 1 \n", "Specrt\tb?"
    try:
        ra, rb = render([("user", a)], True), render([("user", b)], True)
    except Exception as e:  # noqa: BLE001 - a template can raise anything; it is then only unsupported here
        return {"unsupported": f"the chat template does not render one user message ({type(e).__name__})"}
    # the content verbatim, or stripped of surrounding whitespace (Jinja's `trim`, as Llama 3's template does)
    for trim in (False, True):
        show = str.strip if trim else (lambda x: x)
        if ra.count(show(a)) == 1:
            prefix, suffix = ra.split(show(a))
            if rb == prefix + show(b) + suffix:
                break
    else:
        return {"unsupported": "the chat template renders a message's content other than verbatim or trimmed"}
    try:
        roles = _chat_roles(render, show)
    except Exception as e:  # noqa: BLE001
        roles = {"unsupported": f"the chat template raises on a conversation ({type(e).__name__})"}
    return {"prefix": prefix, "suffix": suffix, "trim": trim, "roles": roles}


def _chat_roles(render, show) -> dict:
    """start / between / end / generation text of conversations (see chat_affixes), derived from renders with
    distinct contents and checked on others; `show`: how a content appears in the text (verbatim or trimmed)."""
    c = [f" \n specrt {i} content \n" for i in range(8)]

    def split(text: str, contents: list[str]) -> list[str] | None:
        """The text around each content, in order (None if a content is missing or repeated)."""
        pieces, rest = [], text
        for x in map(show, contents):
            if rest.count(x) != 1:
                return None
            head, rest = rest.split(x)
            pieces.append(head)
        return [*pieces, rest]

    start, between, end = {}, {}, {}
    u = split(render([("user", c[0])], False), [c[0]])
    ua = split(render([("user", c[0]), ("assistant", c[1])], False), c[:2])
    uau = split(render([("user", c[0]), ("assistant", c[1]), ("user", c[2])], False), c[:3])
    with_generation = render([("user", c[0])], True)
    if not (u and ua and uau) or not with_generation.startswith(render([("user", c[0])], False)):
        return {"unsupported": "the chat template does not render user / assistant turns as text around each"}
    start["user"], end["user"] = u
    between["user>assistant"], end["assistant"] = ua[1], ua[2]
    between["assistant>user"] = uau[2]
    generation = with_generation[len(render([("user", c[0])], False)):]
    try:
        su = split(render([("system", c[3]), ("user", c[0])], False), [c[3], c[0]])
    except Exception:  # noqa: BLE001 - a template without a system role
        su = None
    if su:
        start["system"], between["system>user"] = su[0], su[1]

    def compose(messages: list[tuple[str, str]], gen: bool) -> str | None:
        roles = [r for r, _ in messages]
        if roles[0] not in start or any(f"{p}>{q}" not in between for p, q in zip(roles, roles[1:])):
            return None
        text = start[roles[0]] + show(messages[0][1])
        for (p, _), (q, x) in zip(messages, messages[1:]):
            text += between[f"{p}>{q}"] + show(x)
        return text + end[roles[-1]] + (generation if gen else "")

    checks = [([("user", c[4]), ("assistant", c[5]), ("user", c[6]), ("assistant", c[7])], False),
              ([("user", c[5]), ("assistant", c[6]), ("user", c[7])], True)]
    if su:
        checks.append(([("system", c[7]), ("user", c[4]), ("assistant", c[6]), ("user", c[5])], True))
    for messages, gen in checks:
        if compose(messages, gen) != render(messages, gen):
            return {"unsupported": "the chat template's text around a turn depends on more than the roles beside it"}
    return {"start": start, "between": between, "end": end, "generation": generation}
