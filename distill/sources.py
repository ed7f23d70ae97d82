"""Training prompts built from packaged material, for a corpus larger than the benchmark files' spare rows.

    stdlib    Python's standard library (PSF-2.0, shipped with every Python): each public function, and each
              public method of a public class, of a fixed list of pure-library modules that documents itself
    numpy     numpy's public functions (BSD-3-Clause, a dependency of specrt)
    careers   chat: Faker's English job titles (MIT; `pip install faker`, only to rebuild the set)
    world     chat: pycountry's countries, languages and currencies (LGPL-2.1, Debian's iso-codes data;
              `pip install pycountry`, only to rebuild the set)
    followups multi-turn: a training prompt, the default model's own greedy answer to it (the committed corpus),
              then a second request: mt-bench's own second turn where the row has one, else a follow-up of the
              prompt's kind (code, math, chat), chosen by a hash of its file and row

Each documented callable gives one prompt, in one of a few phrasings chosen by a hash of its name (write it without
the library, explain it with an example, write tests for it, use it in a small program), with the first paragraphs
of its documentation. A prompt set is built once and committed (`datasets/corpus/`, gzip'd `{"turns": [...]}` lines
with each row's source, licence and callable), since docstrings change between Python and numpy versions
(`datasets/corpus/README.md` records the versions that built each file).
"""
from __future__ import annotations

import gzip
import hashlib
import importlib
import importlib.metadata
import inspect
import io
import json
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specrt.datasets import DATASETS_DIR
from specrt.distill.prompts import PromptSplit, dataset_files, training_prompts
from specrt.errors import SpecrtError

CORPUS_DIR = DATASETS_DIR / "corpus"

# pure-library modules whose documented functions make self-contained code tasks (no OS services, no GUI)
STDLIB_MODULES = (
    "abc", "argparse", "array", "ast", "base64", "bisect", "builtins", "calendar", "cmath", "collections",
    "colorsys", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fnmatch",
    "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http.cookies",
    "io", "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "math", "mimetypes", "numbers",
    "operator", "os.path", "pathlib", "pprint", "queue", "quopri", "random", "re", "reprlib", "secrets", "shlex",
    "statistics", "string", "struct", "textwrap", "time", "timeit", "tokenize", "typing", "unicodedata",
    "urllib.parse", "uuid", "weakref", "zipfile", "zlib",
    # library modules over OS services and formats: their tasks are programs that use them
    "asyncio", "binascii", "codecs", "concurrent.futures", "configparser", "email.utils", "graphlib", "logging",
    "os", "shutil", "sqlite3", "tempfile", "threading", "traceback", "warnings", "xml.etree.ElementTree",
    "zoneinfo",
)
NUMPY_MODULES = ("numpy", "numpy.linalg", "numpy.fft", "numpy.random")


@dataclass(frozen=True, slots=True)
class Source:
    modules: tuple[str, ...]
    licence: str
    what: str  # how prompts name the library


SOURCES = {
    "stdlib": Source(STDLIB_MODULES, "PSF-2.0", "Python's standard library"),
    "numpy": Source(NUMPY_MODULES, "BSD-3-Clause", "numpy"),
}

TEMPLATES = (
    "Write a Python function `{name}{signature}` that does what `{qualname}` from {what} does, without using "
    "`{qualname}` itself. Its documentation says:\n\n{doc}",
    "Explain what `{qualname}` in {what} does, when to use it, and show a short example with its output.\n\n"
    "Documentation:\n{doc}",
    "Write pytest unit tests for `{qualname}` from {what}, covering ordinary inputs and edge cases.\n\n"
    "Documentation:\n{doc}",
    "Write a small, complete Python program that uses `{qualname}` from {what} to solve a realistic task, and "
    "explain each step.\n\nFor reference, its documentation:\n{doc}",
)
MAX_DOC = 900  # characters of documentation a prompt quotes (its first paragraphs)


@dataclass(frozen=True, slots=True)
class Documented:
    qualname: str  # e.g. "textwrap.dedent", "str.removeprefix"
    name: str
    signature: str  # "(text)", or "(...)" when inspect cannot tell
    doc: str


def documented(module_names: tuple[str, ...]) -> Iterator[Documented]:
    """Each public function of the modules, and each public method of their public classes, that has documentation
    of at least a sentence, in a fixed order (module list order, then names sorted); defined in the module itself
    (not re-exported), each object once."""
    seen: set[int] = set()
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        prefix = module_name.split(".")[0]
        for name in sorted(vars(module)):
            obj = vars(module)[name]
            if name.startswith("_") or id(obj) in seen or not _own(obj, prefix, module_name):
                continue
            seen.add(id(obj))
            qual = "" if module_name == "builtins" else f"{module_name}."
            if inspect.isclass(obj):
                for attr in sorted(vars(obj)):
                    member = vars(obj)[attr]
                    if attr.startswith("_") or not callable(member) or id(member) in seen:
                        continue
                    seen.add(id(member))
                    item = _item(f"{qual}{name}.{attr}", attr, member)
                    if item is not None:
                        yield item
            elif callable(obj):
                item = _item(f"{qual}{name}", name, obj)
                if item is not None:
                    yield item


def _own(obj, prefix: str, module_name: str) -> bool:
    """Whether obj is a function or class defined in this library (not imported from another one)."""
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return False
    owner = getattr(obj, "__module__", None) or module_name
    return owner == module_name or owner.startswith(prefix) or (module_name == "builtins" and owner == "builtins")


def _item(qualname: str, name: str, obj) -> Documented | None:
    doc = inspect.getdoc(obj) or ""
    paragraphs = [p.strip() for p in doc.split("\n\n") if p.strip()]
    text = ""
    for p in paragraphs:
        if text and len(text) + len(p) > MAX_DOC:
            break
        text = f"{text}\n\n{p}" if text else p
    text = text[:MAX_DOC]
    if len(text) < 40 or " " not in text:
        return None
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        signature = "(...)"
    return Documented(qualname, name, signature, text)


def prompts(source: str) -> list[dict]:
    """The prompt rows of a source: `{"turns": [text], "source", "licence", "callable"}`, in a fixed order, each
    text distinct."""
    if source not in SOURCES:
        raise SpecrtError(f"unknown prompt source {source!r}; choose one of {', '.join(SOURCES)}")
    s = SOURCES[source]
    rows, texts = [], set()
    for d in documented(s.modules):
        k = int(hashlib.sha256(d.qualname.encode()).hexdigest(), 16) % len(TEMPLATES)
        text = TEMPLATES[k].format(name=d.name, signature=d.signature, qualname=d.qualname, what=s.what, doc=d.doc)
        if text not in texts:
            texts.add(text)
            rows.append({"turns": [text], "source": source, "licence": s.licence, "callable": d.qualname})
    return rows


# Chat sources: everyday assistant requests (advice, writing, explanation, planning, stories) about subjects taken
# from packaged lists; each subject gets `per_subject` of its source's templates, chosen by a hash of its name.
CAREER_TEMPLATES = (
    "What does {a} {s} do on a typical working day? Describe the main tasks, the skills the work needs and how "
    "someone trains for it.",
    "Write a short, friendly job advertisement for {a} {s} at a small company.",
    "I have an interview next week for a job as {a} {s}. What questions should I expect, and how should I prepare?",
    "Write a cover letter for a job as {a} {s}, for someone changing careers after ten years in retail.",
    "What are the five hardest parts of working as {a} {s}, and how do experienced people handle each?",
    "Write a short story, about 200 words, whose main character is {a} {s} having a very unusual day at work.",
    "My teenager wants to become {a} {s}. What should we know about the work, the pay and the path into it?",
    "Explain to a ten-year-old what {a} {s} does and why the job matters.",
)
COUNTRY_TEMPLATES = (
    "Plan a one-week trip to {s}: where to go, what to see and eat, and what a visitor should know before going.",
    "Give a short overview of the history of {s}, from its earliest records to today.",
    "Describe the geography and climate of {s}, and how they shape daily life there.",
    "Write a short poem about {s}.",
    "What are some traditional dishes from {s}? Describe two of them and give a simple recipe for one.",
    "What are the main industries and exports of {s}, and what challenges does its economy face?",
    "Write a friendly email to a colleague who is moving to {s} for work, with practical advice for the first "
    "month.",
    "What festivals and holidays are celebrated in {s}, and how do people celebrate them?",
)
LANGUAGE_TEMPLATES = (
    "I want to learn {s}. Where should a beginner start, and what makes it hard or easy for an English speaker?",
    "Tell me about the {s} language: where it is spoken, how it is written and where it comes from.",
    "Teach me ten useful everyday phrases in {s}, with a pronunciation guide for each.",
)
CURRENCY_TEMPLATES = (
    "Tell me about the {s}: which countries use it, its history, and what moves its exchange rate.",
    "I am travelling to a country that uses the {s}. How should I handle money there: cash, cards, tipping?",
)


@dataclass(frozen=True, slots=True)
class ChatSource:
    licence: str
    package: str  # the package whose data the subjects come from (needed only to rebuild the set)


CHAT_SOURCES = {
    "careers": ChatSource("MIT", "faker"),
    "world": ChatSource("LGPL-2.1-only", "pycountry"),
}


def chat_prompts(source: str) -> list[dict]:
    """The prompt rows of a chat source: `{"turns": [text], "source", "licence", "subject"}`, in a fixed order,
    each text distinct."""
    if source not in CHAT_SOURCES:
        raise SpecrtError(f"unknown chat source {source!r}; choose one of {', '.join(CHAT_SOURCES)}")
    s = CHAT_SOURCES[source]
    try:
        groups = _careers() if source == "careers" else _world()
    except ImportError:
        raise SpecrtError(f"building the {source!r} prompt set needs {s.package}: pip install {s.package}") from None
    rows, texts = [], set()
    for templates, per_subject, subjects in groups:
        for subject in subjects:
            start = int(hashlib.sha256(subject.encode()).hexdigest(), 16) % len(templates)
            for j in range(per_subject):
                text = templates[(start + j) % len(templates)].format(s=subject, a=_article(subject))
                if text not in texts:
                    texts.add(text)
                    rows.append({"turns": [text], "source": source, "licence": s.licence, "subject": subject})
    return rows


def _careers() -> list[tuple[tuple[str, ...], int, list[str]]]:
    from faker.providers.job.en_US import Provider

    return [(CAREER_TEMPLATES, 2, sorted({_job(j) for j in Provider.jobs}))]


def _job(title: str) -> str:
    """'Engineer, civil (contracting)' -> 'civil engineer (contracting)': the list's inverted titles in reading
    order, lower case except acronyms."""
    note = ""
    if "(" in title:
        title, note = title.split("(", 1)
        note = " (" + note.strip()
    parts = [p.strip() for p in title.split(",") if p.strip()]
    words = " ".join(reversed(parts)).split()
    return " ".join(w if w.isupper() and len(w) > 1 else w.lower() for w in words) + note


def _world() -> list[tuple[tuple[str, ...], int, list[str]]]:
    import pycountry

    countries = sorted({_reading_order(getattr(c, "common_name", c.name)) for c in pycountry.countries})
    languages = sorted({lang.name for lang in pycountry.languages if hasattr(lang, "alpha_2")})
    currencies = sorted({c.name for c in pycountry.currencies if not any(w in c.name for w in NOT_CURRENCIES)})
    return [(COUNTRY_TEMPLATES, 3, countries), (LANGUAGE_TEMPLATES, 1, languages), (CURRENCY_TEMPLATES, 1, currencies)]


# ISO 4217's entries that are no country's money: metals, units of account, funds, codes
NOT_CURRENCIES = ("(", "Bond", "SDR", "WIR", "Unidad", "Unit", "Code", "codes", "Gold", "Silver", "Palladium",
                  "Platinum", "Sucre", "Mvdol", "Accounting")


def _article(subject: str) -> str:
    return "an" if subject[:1].lower() in "aeiou" else "a"


def _reading_order(name: str) -> str:
    """'Korea, Republic of' -> 'Republic of Korea'."""
    if "," not in name:
        return name
    head, tail = name.split(",", 1)
    return f"{tail.strip()} {head.strip()}"


FOLLOWUPS = {
    "code": (
        "Now write pytest tests for it, including the edge cases.",
        "Can you make it simpler or faster? Show the new version and explain what changed.",
        "Add type hints and a docstring, and say which inputs it does not handle.",
        "Explain how it works, step by step, for someone new to Python.",
    ),
    "math": (
        "Check the answer by solving the problem in a different way.",
        "Make up a similar problem with different numbers, and solve it step by step.",
        "Which step is the easiest to get wrong, and why?",
    ),
    "chat": (
        "Make that shorter: three sentences at most.",
        "Rewrite it for a ten-year-old.",
        "Turn it into a bulleted list of the key points.",
    ),
}
# the licence of each training file's first turns (datasets/README.md, datasets/corpus/README.md)
FILE_KINDS = {"gsm8k": ("math", "MIT"), "math500": ("math", "MIT"), "mbpp": ("code", "CC-BY-4.0"),
              "humaneval": ("code", "MIT"), "mt-bench": ("chat", "Apache-2.0"),
              "corpus/stdlib": ("code", "PSF-2.0"), "corpus/numpy": ("code", "BSD-3-Clause"),
              "corpus/careers": ("chat", "MIT"), "corpus/world": ("chat", "LGPL-2.1-only")}
REPLIES_LICENCE = "Apache-2.0 (SmolLM2-135M-Instruct's output)"


def followup_prompts(conversations: list[tuple[str, tuple[str, ...], str]], *, replies_by: str = REPLIES_LICENCE
                     ) -> list[dict]:
    """Multi-turn rows `{"turns": [first, second], "replies": [answer], "source", "licence", "from"}` from
    (file, turns, answer) triples: a training prompt's turns (its own second turn where it has one), and the
    target's answer to the first."""
    rows = []
    for origin, turns, answer in conversations:
        file, _, row = origin.rpartition(":")
        kind, licence = FILE_KINDS[file.removesuffix(".jsonl.gz")]
        if len(turns) > 1:
            second = turns[1]
        else:
            options = FOLLOWUPS[kind]
            second = options[int(hashlib.sha256(origin.encode()).hexdigest(), 16) % len(options)]
        rows.append({"turns": [turns[0], second], "replies": [answer], "source": "followups",
                     "licence": f"{licence}; replies {replies_by}", "from": origin})
    return rows


# The corpus's parts: which prompt sets of datasets/corpus/ each answers (scripts/corpus_generate.py --part)
PARTS = {"base": ("numpy", "stdlib"), "chat": ("careers", "world"), "followups": ("followups",)}


def part_prompts(part: str, *, limit: int | None = None) -> PromptSplit:
    """The training prompts of a corpus part, in the order its responses are written: base is the eval files'
    spare rows, then its code sets; the others are their sets' rows."""
    if part not in PARTS:
        raise SpecrtError(f"unknown corpus part {part!r}; choose one of {', '.join(PARTS)}")
    files = [CORPUS_DIR / f"{name}.jsonl.gz" for name in PARTS[part]]
    if part == "base":
        return training_prompts(files=[p.stem for p in dataset_files()], prompt_files=files, limit=limit)
    return training_prompts(prompt_files=files, limit=limit)


def built_with() -> dict:
    """What a prompt set was built with (its docstrings are these versions')."""
    import numpy

    versions = {"python": platform.python_version(), "numpy": numpy.__version__}
    for package in ("faker", "pycountry"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def write(rows: list[dict], path: str | Path) -> Path:
    """Rows as gzip'd JSON lines, the same bytes for the same rows (no timestamp in the header), written whole to a
    temporary file, then moved into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as z, \
            io.TextIOWrapper(z, encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path
