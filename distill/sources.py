"""Training prompts built from packaged material, for a corpus larger than the benchmark files' spare rows.

    stdlib    Python's standard library (PSF-2.0, shipped with every Python): each public function, and each
              public method of a public class, of a fixed list of pure-library modules that documents itself
    numpy     numpy's public functions (BSD-3-Clause, a dependency of specrt)

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
import inspect
import io
import json
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import SpecrtError

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


def built_with() -> dict:
    """What a prompt set was built with (its docstrings are these versions')."""
    import numpy

    return {"python": platform.python_version(), "numpy": numpy.__version__}


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
