"""Output directories written whole or not at all (artifacts, distilled checkpoints).

    check_out(out, sources, force, command)  refuse an `out` that is, or holds, an input or the working
                             directory; with `force`, replace only an empty directory or an earlier output
                             of the same command (its MARKER lists every file it wrote, and nothing else
                             may have been added since)
    check_writable(out)      fail early (before a long run) where `out` could not be created
    staged(out, command) as tmp  write into `.NAME.partial-PID` beside `out`; on success MARKER is written
                             and it replaces `out`, on any failure (Ctrl-C and SIGTERM included) it is
                             removed, with the parent directories it created; partials of killed runs are
                             removed first
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from specrt.errors import SpecrtError

STAGING_KINDS = ("partial", "old")  # .NAME.partial-PID: being written; .NAME.old-PID: the replaced output
MARKER = ".specrt-output.json"  # in every output: the command that wrote it and the files it wrote


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so the same cleanup runs and the CLI prints one line."""


def _holds(outer: Path, inner: Path) -> bool:
    return outer == inner or outer in inner.parents


def check_out(out: str | Path, *, sources: Sequence[str | Path | None] = (), force: bool = False,
              command: str) -> None:
    """Raise SpecrtError unless `out` may be written: not (containing) an input or the current directory,
    and, if it exists, only with `force` and only when it is empty or an earlier output of `specrt
    {command}` holding nothing but the files that run wrote (its MARKER); anything else is the user's."""
    out = Path(out)
    try:
        real = out.resolve()
        exists = out.exists() or out.is_symlink()
        for src in (Path(s).expanduser() for s in sources if s is not None):
            if src.exists() and _holds(real, src.resolve()):
                raise SpecrtError(f"--out {out} is or contains the input {src}; writing there would delete it")
        if _holds(real, Path.cwd().resolve()):
            raise SpecrtError(f"--out {out} is or contains the current directory; writing there would delete it")
    except OSError as e:
        raise SpecrtError(f"cannot access {e.filename or out}: {e.strerror or e}") from None
    if exists and not force:
        raise SpecrtError(f"{out} already exists; pass --force to replace it")
    if exists:
        _check_replaceable(out, command)


def _check_replaceable(out: Path, command: str) -> None:
    """`--force` on an existing `out`: only an empty directory or an untouched earlier output of `command`."""
    keep = "remove it yourself or choose another --out"
    if not out.is_dir():
        raise SpecrtError(f"{out} exists and is not a directory; --force replaces only an earlier output of "
                          f"`specrt {command}`, never a file ({keep})")
    try:
        present = set(output_files(out))
        if not present and not any(out.iterdir()):
            return
        marker = out / MARKER
        written = json.loads(marker.read_text()) if marker.is_file() else None
    except (OSError, ValueError, RecursionError) as e:
        raise SpecrtError(f"cannot check what {out} holds before replacing it: {getattr(e, 'strerror', None) or e}"
                          ) from None
    if not isinstance(written, dict) or written.get("command") != command \
            or not isinstance(written.get("files"), list):
        what = f"by `specrt {written['command']}`" if isinstance(written, dict) and "command" in written \
            and written["command"] != command else "by specrt"
        raise SpecrtError(f"{out} was not written {what} (no {MARKER} from `specrt {command}`); --force replaces "
                          f"only an earlier output of `specrt {command}`, so it is left as it is ({keep})")
    added = sorted(present - set(written["files"]) - {MARKER})
    if added:
        shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
        raise SpecrtError(f"{out} holds files `specrt {command}` did not write ({shown}); --force would delete "
                          f"them, so it is left as it is ({keep})")


def output_files(root: Path) -> Iterator[str]:
    """Every entry under `root` that is not a directory (links to directories included, never followed), as
    a relative POSIX path."""
    for parent, dirs, names in os.walk(root, onerror=_raise):
        rel = Path(parent).relative_to(root)
        for name in names + [d for d in dirs if (Path(parent) / d).is_symlink()]:
            yield (rel / name).as_posix()


def _raise(e: OSError) -> None:
    raise e


def note_written(out: str | Path, *files: str) -> None:
    """Add `files` (relative to `out`) to an earlier output's MARKER: what a later command (`specrt profile`,
    `specrt build`) adds to an artifact stays replaceable. Without a marker, nothing is recorded."""
    marker = Path(out) / MARKER
    try:
        written = json.loads(marker.read_text())
        written["files"] = sorted({*written["files"], *files})
        tmp = marker.with_name(f"{MARKER}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(written, indent=1) + "\n")
        os.replace(tmp, marker)
    except (OSError, ValueError, KeyError, TypeError):
        return


def write_marker(out: Path, command: str) -> None:
    """Record in `out` (a staging directory about to be swapped in) the command and every file it holds."""
    files = sorted(output_files(out))
    (out / MARKER).write_text(json.dumps({"command": command, "files": files}, indent=1) + "\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True


def clean_stale(out: Path) -> None:
    """Remove `.NAME.partial-PID` / `.NAME.old-PID` siblings of `out` whose process is gone (killed runs).

    A stale `.old` is kept while `out` is missing: it is then the only copy of the previous output."""
    prefix = f".{out.name}."
    try:
        entries = [p for p in out.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return
    for p in entries:
        kind, _, pid = p.name[len(prefix):].partition("-")
        if kind not in STAGING_KINDS or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == "old" and not out.exists():
            continue
        _remove(p)


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises `Terminated` (a KeyboardInterrupt); only where no handler is set."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT / SIGTERM until the block is done (a swap must not stop half-way)."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _make_parents(out: Path, shown: Path) -> list[Path]:
    """Create the missing parents of `out` (`shown` in messages); return those created, outermost first."""
    missing = []
    try:
        for parent in out.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise SpecrtError(f"cannot write {shown}: {parent} is a file, not a directory")
                break
            missing.append(parent)
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecrtError(f"cannot write {shown}: cannot create {e.filename or out.parent}: {e.strerror or e}") \
            from None
    return missing[::-1]


def _swap(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` is renamed aside first and deleted after."""
    with _signals_deferred():
        if not (out.exists() or out.is_symlink()):
            tmp.rename(out)
            return
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        _remove(old)
        out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            old.rename(out)
            raise
        _remove(old)


def _staging_path(out: Path) -> Path:
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def _make_staging(out: Path, shown: Path) -> Path:
    tmp = _staging_path(out)
    _remove(tmp)
    try:
        tmp.mkdir()
    except OSError as e:
        raise SpecrtError(f"cannot write {shown}: cannot create a directory in {out.parent}: {e.strerror or e}") \
            from None
    return tmp


def _remove_made(made: list[Path]) -> None:
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            break


def check_writable(out: str | Path) -> None:
    """Raise SpecrtError now, rather than after a long run, if `out` could not be written; leaves nothing."""
    shown, out = Path(out), Path(os.path.abspath(out))
    made = _make_parents(out, shown)
    try:
        _make_staging(out, shown).rmdir()
    finally:
        _remove_made(made)


@contextmanager
def staged(out: str | Path, command: str) -> Iterator[Path]:
    """An empty staging directory beside `out`, moved into place as `out` when the block succeeds (with a
    MARKER naming `command` and the files written, so a later `--force` knows it may replace it)."""
    shown, out = Path(out), Path(os.path.abspath(out))
    with sigterm_as_interrupt():
        made = _make_parents(out, shown)
        try:
            clean_stale(out)
            tmp = _make_staging(out, shown)
            yield tmp
            write_marker(tmp, command)
            _swap(tmp, out)
        except BaseException:
            _remove(_staging_path(out))
            _remove_made(made)
            raise
