"""Drafters read from disk, cached per target and read again when their files change.

EAGLE heads and draft models named by a folder or Hub id, and MTP layers read from the target's
own checkpoint, are loaded once per target so that repeated generate() calls do not pay for it
again (the SmolLM2 EAGLE-3 head: ~0.2 s on CPU; a draft model: seconds). A cache keyed on the
path alone keeps drafting with a stale module when the folder is rewritten (train, evaluate,
train more, evaluate again in one notebook): so every cached module remembers the state of the
checkpoint files it was read from (name, size, st_mtime_ns, st_ctime_ns, inode of each), and a
lookup reloads when that state differs. The check is a few `stat` calls.

A Hub id is looked up in the local Hugging Face cache (its snapshot folder for the `main` ref,
no network); one not cached yet is loaded (which fetches it) and keyed on what that put there.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

# the files a checkpoint is read from: configs, safetensors (and their index), torch .bin weights
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.bin")

# module loaded by `load_cached` -> the state of the files it was read from
_READ_FROM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

T = TypeVar("T")


def local_folder(source: str | os.PathLike) -> Path | None:
    """The folder `source` names on this machine: itself (resolved) when it is a directory, else
    the snapshot folder of a Hub id in the local Hugging Face cache; None when neither."""
    path = Path(source)
    if path.is_dir():
        return path.resolve()
    if path.exists():
        return None  # a file: the loader says what is wrong with it
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(os.fspath(source), "config.json")
    except Exception:  # noqa: BLE001 - not a valid Hub id, or no huggingface_hub: nothing on disk to key on
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def disk_state(source: str | os.PathLike | None) -> tuple | None:
    """What is on disk for a folder / Hub id: (its folder, ((name, size, mtime_ns, ctime_ns, inode),
    ...) of its checkpoint files); None when `source` is nowhere on this machine."""
    if source is None:
        return None
    folder = local_folder(source)
    if folder is None:
        return None
    files = []
    for file in sorted({file for pattern in CHECKPOINT_PATTERNS for file in folder.glob(pattern)}):
        try:
            stat = file.stat()  # follows the Hub cache's symlinks to the blobs
        except OSError:  # removed meanwhile, or a dangling link: not part of the checkpoint
            continue
        files.append((file.name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino))
    return str(folder), tuple(files)


def load_cached(
    loaded: MutableMapping[Any, T], key: Any, source: str | os.PathLike | None, load: Callable[[], T]
) -> T:
    """`loaded[key]` when it was read from the files now at `source`; else `load()`, stored there.

    The state is taken before loading, so a checkpoint rewritten while it loads is read again
    next time. A stale module is dropped before its replacement loads (not both in memory).
    """
    state = disk_state(source)
    module = loaded.get(key)
    if module is not None and state is not None and _READ_FROM.get(module) == state:
        return module
    loaded.pop(key, None)
    module = load()
    # a Hub id not cached before: key on what loading put in the cache (None: reload every time)
    _READ_FROM[module] = state if state is not None else disk_state(source)
    loaded[key] = module
    return module
