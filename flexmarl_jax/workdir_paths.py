"""Every path under a run's workdir goes through here: local directories, `file://` URLs and object stores.

A workdir is given as a plain path (`runs/tiny`), a `file://` URL (`file:///abs/run`) or an object-store URL
(`gs://bucket/run`). `normalize` turns a `file://` URL into the local path it names (`etils.epath` does not
accept `file://`), so that everything below sees either a local path or a remote URL:

- `path(location, *parts)`: an `etils.epath.Path` (local files, or gs:// through epath's backends);
- `kvstore_url(location, *parts)`: the same place as a TensorStore kvstore URL (`file:///abs/...` or
  `gs://...`), for the experience store;
- `orbax_directory(location, *parts)`: what Orbax takes (an absolute local path, or the URL);
- `write_atomically` and `append_line`: the two ways the run writes its own files. Object stores have no
  rename and no append: a remote object is written whole (each write replaces it atomically), and an
  appended line rewrites the object.

Pure Python (etils only): the config and the CLI use it before JAX starts.
"""

from __future__ import annotations

import os
import urllib.parse

from etils import epath

FILE_SCHEME = "file://"


class BadLocation(ValueError):
    """A workdir location this layer cannot serve; the message names it and what is allowed."""


def normalize(location: str | os.PathLike[str]) -> str:
    """A plain path for a local location (a `file://` URL becomes its absolute path), else the URL as given.

    `file:///abs/run` -> `/abs/run`; `runs/tiny` stays relative; `gs://bucket/run` stays. A `file://` URL
    naming a host (`file://host/path`) or a relative path is a BadLocation."""
    text = os.fspath(location)
    if not text.startswith(FILE_SCHEME):
        return text
    parsed = urllib.parse.urlparse(text)
    if parsed.netloc not in ("", "localhost"):
        raise BadLocation(f"{text!r} names host {parsed.netloc!r}; a file:// URL must be file:///ABSOLUTE/PATH")
    local = urllib.parse.unquote(parsed.path)
    if not local.startswith("/"):
        raise BadLocation(f"{text!r} is not absolute; a file:// URL must be file:///ABSOLUTE/PATH")
    return local


def is_local(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is on this host's file system (a plain path or a `file://` URL)."""
    return "://" not in normalize(location)


def path(location: str | os.PathLike[str], *parts: str) -> epath.Path:
    """``location`` joined with ``parts`` as an `etils.epath.Path` (local or remote)."""
    return epath.Path(normalize(location)).joinpath(*parts)


def orbax_directory(location: str | os.PathLike[str], *parts: str) -> epath.Path:
    """A directory for Orbax: absolute when local (Orbax wants absolute paths), the URL when remote."""
    text = normalize(location)
    if "://" not in text:
        text = os.path.abspath(text)
    return epath.Path(text).joinpath(*parts)


def kvstore_url(location: str | os.PathLike[str], *parts: str) -> str:
    """The TensorStore kvstore URL of ``location`` joined with ``parts``, ending in "/" (a directory)."""
    text = normalize(location)
    joined = "/".join([text.rstrip("/"), *(part.strip("/") for part in parts)])
    if "://" in joined:
        return joined.rstrip("/") + "/"
    return FILE_SCHEME + os.path.abspath(joined) + "/"


def write_atomically(target: epath.Path, text: str) -> None:
    """Replaces ``target``'s contents with ``text``; a reader sees the old or the new file, never a part.
    Local: a temporary file renamed over it. Remote: one object write, which replaces the object whole."""
    if is_local(os.fspath(target)):
        temporary = target.with_name(target.name + ".tmp")
        temporary.write_text(text)
        os.replace(temporary, target)
    else:
        target.write_text(text)


def append_line(target: epath.Path, line: str, *, durable: bool = True) -> None:
    """Appends ``line`` (ending in a newline) to ``target``: flushed and fsynced when local and ``durable``
    (the process may exit hard right after); rewritten whole when remote (objects cannot be appended to)."""
    if is_local(os.fspath(target)):
        with open(os.fspath(target), "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
    else:
        before = target.read_text() if target.exists() else ""
        target.write_text(before + line)
