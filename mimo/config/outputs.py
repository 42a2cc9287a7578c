"""Whether a path a run will write (a file or a directory) can be made there: found before the
run starts, not at its first write, steps (or a whole run, for an export) later."""

from __future__ import annotations

import os


def first_existing(path: str) -> str:
    """`path` made absolute, or its nearest ancestor that exists."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def output_problem(path: str, kind: str) -> str:
    """Why `path` cannot become a `kind` ("file" or "directory") by the layout of the filesystem ('' when
    it can): an existing path of the other kind, or a file where a parent directory must be. Whether
    the filesystem lets this user write there is found when the run writes."""
    full, existing = os.path.abspath(path), first_existing(path)
    if existing == full:
        if kind == "directory" and not os.path.isdir(full):
            return f"{path} exists and is not a directory"
        if kind == "file" and os.path.isdir(full):
            return f"{path} is a directory; name the file to write"
        return ""
    if not os.path.isdir(existing):
        return f"{path} cannot be made: {existing} is a file"
    return ""
