"""What a script needs that one process cannot give its ranks, read from its syntax tree before it runs.

``aiocoll run`` runs a script's ranks as threads of one process unless the script does
something only a process of its own can do (``_procstate``'s refusals: its own exit, signals to
itself, signal handlers, a gloo group made by hand, an RPC agent, torch's profiler,
DDP's logging data, a library kept once per process). What can be known before it runs
is read here, so such a script starts in processes at once rather than failing part way.
The script's own modules are read too: those it imports (directly or through each other)
that live in its directory. What is only known at run time (a library reached through an
installed package, a call made through ``getattr``) is still caught in the ranks,
and the run starts again in processes (``aiocoll._cli._run``).

>>> import pathlib, tempfile, textwrap
>>> path = pathlib.Path(tempfile.mkdtemp()) / "train.py"
>>> _ = path.write_text(textwrap.dedent('''
...     import os
...     from signal import signal as on
...     print(os.getpid())
...     on(15, print)
... '''))
>>> need = read(str(path))
>>> need.why, need.where == f"{path}:5"
('installs a signal handler (signal.signal)', True)
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Need", "read"]

# calls only a process of its own can make, by the full dotted name they are reached by
_CALLS: dict[str, str] = {
    "os._exit": "ends its process (os._exit)",
    "os.abort": "ends its process (os.abort)",
    "signal.signal": "installs a signal handler (signal.signal)",
    "signal.raise_signal": "raises a signal in its process (signal.raise_signal)",
    "signal.alarm": "sets an alarm (signal.alarm)",
    "signal.setitimer": "sets an interval timer (signal.setitimer)",
    "torch.distributed.ProcessGroupGloo": "makes a ProcessGroupGloo directly",
    "torch._C._distributed_c10d.ProcessGroupGloo": "makes a ProcessGroupGloo directly",
    "torch.distributed.rpc.init_rpc": "starts an RPC agent (torch.distributed.rpc.init_rpc)",
    "torch.profiler.profile": "starts torch's profiler (one per process)",
    "torch.autograd.profiler.profile": "starts torch's profiler (one per process)",
    # (its DDP strategy reads DDP's logging data as fit() ends: known only then, after the
    # whole training, which would then run again in processes)
    **dict.fromkeys(
        ("lightning.Trainer", "lightning.pytorch.Trainer", "pytorch_lightning.Trainer"),
        "trains with Lightning's Trainer (whose DDP reads DDP's logging data as fit() ends)",
    ),
}
# methods, whatever object they are called on
_METHODS: dict[str, str] = {
    "_get_ddp_logging_data": "reads DDP's logging data (which describes its process's backend)",
}
# libraries that keep their state once per process (``_procstate.OnePerProcess``'s: none
# today, accelerate's and Lightning's being each rank's own, ``_libstate``)
_LIBRARIES: dict[str, str] = {}


@dataclass(frozen=True)
class Need:
    """Why a script needs processes of its own: what it does, and where (``file:line``)."""

    why: str
    where: str

    def __str__(self) -> str:
        return f"{self.why} at {self.where}"


def read(script: str) -> Need | None:
    """The first thing ``script`` or one of its own modules does that one process cannot serve; None if nothing.

    A file that cannot be read or parsed is skipped: running it reports that as Python would.
    """
    directory = os.path.dirname(os.path.abspath(script))
    todo = [os.path.abspath(script)]
    seen: set[str] = set()
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.add(path)
        try:
            with open(path, "rb") as f:
                tree = ast.parse(f.read(), path)
        except (OSError, SyntaxError, ValueError):
            continue
        reader = _Reader(path)
        need = reader.need(tree)
        if need is not None:
            return need
        todo += [p for p in _own_modules(reader.imported, directory) if p not in seen]
    return None


def _own_modules(names: set[str], directory: str) -> Iterator[str]:
    """The files in ``directory`` that the dotted module ``names`` are (a package's ``__init__`` too)."""
    for name in sorted(names):
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            base = os.path.join(directory, *parts[:i])
            for candidate in (base + ".py", os.path.join(base, "__init__.py")):
                if os.path.isfile(candidate):
                    yield candidate


class _Reader(ast.NodeVisitor):
    """One module's imports (with their aliases) and the first call or import that needs a process."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}  # a name bound by an import -> the dotted name it stands for
        self.imported: set[str] = set()  # every module name imported (for the script's own modules)
        self.found: Need | None = None

    def need(self, tree: ast.AST) -> Need | None:
        # imports first, wherever they are: a call may use a name bound further down (in a function)
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        for node in sorted(imports, key=lambda n: (n.lineno, n.col_offset)):
            self._bind(node)
            if self.found is not None:
                return self.found
        found = [
            (node.lineno, node.col_offset, why)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and (why := self._call(node)) is not None
        ]
        if not found:
            return None
        line, _, why = min(found)  # the first in the file
        return Need(why, f"{self.path}:{line}")

    def _bind(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                self._library(a.name, node)
                self.imported.add(a.name)
                if a.asname:
                    self.aliases[a.asname] = a.name
                else:
                    top = a.name.partition(".")[0]
                    self.aliases.setdefault(top, top)
            return
        if node.level or node.module is None:  # (relative: the script's package, read through its names)
            module = node.module or ""
            for a in node.names:
                self.imported.add(f"{module}.{a.name}".strip("."))
            if module:
                self.imported.add(module)
            return
        self._library(node.module, node)
        self.imported.add(node.module)
        for a in node.names:
            self.imported.add(f"{node.module}.{a.name}")
            self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def _library(self, module: str, node: ast.stmt) -> None:
        why = _LIBRARIES.get(module.partition(".")[0])
        if why is not None and self.found is None:
            self.found = Need(why, f"{self.path}:{node.lineno}")

    def _call(self, node: ast.Call) -> str | None:
        if isinstance(node.func, ast.Attribute) and node.func.attr in _METHODS:
            return _METHODS[node.func.attr]
        dotted = self._dotted(node.func)
        if dotted == "os.kill":
            return self._kill_of_self(node)
        return None if dotted is None else _CALLS.get(dotted)

    def _kill_of_self(self, node: ast.Call) -> str | None:
        """``os.kill(os.getpid(), ...)`` or ``os.kill(0, ...)``: a signal to its own process (group)."""
        if not node.args:
            return None
        pid = node.args[0]
        if isinstance(pid, ast.Constant) and pid.value == 0:
            return "sends a signal to its own process group (os.kill(0, ...))"
        if isinstance(pid, ast.Call) and self._dotted(pid.func) == "os.getpid":
            return "sends a signal to its own process (os.kill(os.getpid(), ...))"
        return None

    def _dotted(self, f: ast.expr) -> str | None:
        parts: list[str] = []
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if not isinstance(f, ast.Name) or f.id not in self.aliases:
            return None
        return ".".join([self.aliases[f.id], *reversed(parts)])
