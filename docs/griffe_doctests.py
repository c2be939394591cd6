"""A griffe extension for the API reference: docstring examples (``>>>``) shown as code.

The docstrings are plain text with doctest examples, which the test suite runs. Markdown
would read ``>>>`` as nested quotes; this wraps each run of example lines (the prompts,
their continuation lines and the output up to a blank line) in a ``pycon`` code fence, and
turns reST's ``::`` before an indented block into a colon.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_PROMPT = re.compile(r"^(\s*)>>> ")


def fence_examples(text: str) -> str:
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _PROMPT.match(lines[i])
        if m is None:
            out.append(re.sub(r"::$", ":", lines[i]) if lines[i].rstrip().endswith("::") else lines[i])
            i += 1
            continue
        indent = m.group(1)
        block = []
        while i < len(lines) and lines[i].strip():
            block.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```"]
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence the examples of every docstring the reference renders."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_examples(obj.docstring.value)
