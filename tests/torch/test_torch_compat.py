"""aiocoll/_torch/: the one package that touches torch's private names, and what it adapts.

A test that changes its state or replaces a name changes it in the module that reads it
(``_torch._core``, ``_torch._c10dstate``, ...), not on the package's face, where it would
change nothing.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiocoll
import aiocoll.testing
from aiocoll import _patches, _torch
from aiocoll._torch import _c10dstate, _core, _dtensor, _groups

PACKAGE = Path(aiocoll.__file__).parent

# torch's private names in code: a dotted path from torch (or dist, c10d) through a
# name with one leading underscore, and the private methods aiocoll calls on groups
PRIVATE = re.compile(
    r"\b(torch|dist|c10d)(\.\w+)*\._(?!_)\w*"
    r"|distributed_c10d|\._get_backend\b|\._register_backend\b|\._allgather_base\b|\._reduce_scatter_base\b"
    r"|\._thread_id\b|\._set_thread_isolation_mode\b|\._version\b"
)


def _code_only(source: str) -> list[tuple[int, str]]:
    """``(line number, code)`` with strings, docstrings and comments blanked out."""
    lines = source.splitlines()
    blank: dict[int, list[tuple[int, int]]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                blank.setdefault(r, []).append((c0 if r == r0 else 0, c1 if r == r1 else len(lines[r - 1])))
    out = []
    for n, line in enumerate(lines, 1):
        chars = list(line)
        for a, b in blank.get(n, []):
            chars[a:b] = " " * (b - a)
        out.append((n, "".join(chars)))
    return out


def test_only_the_compat_package_uses_torchs_private_names() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}: {code.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "_torch"
        for n, code in _code_only(path.read_text())
        if PRIVATE.search(code)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_guard_sees_private_names() -> None:
    # the test above could pass by seeing nothing: show it sees what it must
    source = (
        "x = torch._C._foo  # c\nfrom torch.distributed import distributed_c10d\npg._get_backend(d)\n"
        'dist.Backend._plugins\ns = "torch._C in a string"\ny = torch.__version__\n'
    )
    hits = [n for n, code in _code_only(source) if PRIVATE.search(code)]
    assert hits == [1, 2, 3, 4]


def test_the_packages_state_lives_in_one_module_each() -> None:
    # a name a module rebinds (``global``) is that module's alone, and not on the face, where
    # a test that reset it would reset nothing
    owners: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "_torch").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                for name in node.names:
                    owners.setdefault(name, set()).add(path.stem)
    assert owners["_prepared"] == {"_core"}
    assert owners["_checked"] == {"_c10dstate"}
    assert all(len(modules) == 1 for modules in owners.values()), owners
    assert not owners.keys() & vars(_torch).keys()


def test_spawn_under_no_grad_and_inference_mode() -> None:
    # the one-time set-up before rank threads runs a backward, whatever the caller's mode
    _core._prepared = False

    def fn(comm: aiocoll.Comm) -> float:
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    with torch.no_grad():
        assert aiocoll.spawn(fn, world=2) == [2.0, 2.0]
    assert _core._prepared  # (spawn ran the set-up again, under no_grad)
    _core._prepared = False
    with torch.inference_mode():
        assert aiocoll.spawn(fn, world=2) == [2.0, 2.0]
    assert _core._prepared


def test_the_check_passes_on_this_torch() -> None:
    _c10dstate._checked = None
    _torch.check_c10d()
    assert _c10dstate._checked == torch.__version__


def test_a_torch_that_shares_state_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    shared: dict[Any, Any] = {}

    class FutureWorld(_c10dstate._World):  # type: ignore[misc,name-defined]
        @property
        def pg_new_thing(self) -> dict[Any, Any]:
            return shared  # a module global, as torch keeps pg_map

    class State(_c10dstate.C10dState, FutureWorld):  # type: ignore[misc]
        pass

    monkeypatch.setattr(_c10dstate, "_World", FutureWorld)
    monkeypatch.setattr(_c10dstate, "C10dState", State)
    monkeypatch.setattr(_c10dstate, "_checked", None)
    with pytest.raises(aiocoll.TorchCompatError, match=r"'pg_new_thing' is shared.*tested on torch 2\.10 to 2\.15"):
        _torch.check_c10d()


def test_premul_factor_on_every_release() -> None:
    op = dist._make_nccl_premul_sum(2.5)
    assert _torch.premul_factor(op) == 2.5

    class Old:  # torch 2.10-2.12: no .factor, the factor is in the pickling state
        def __getstate__(self) -> tuple[Any, Any]:
            return (dist.ReduceOp.PREMUL_SUM, torch.tensor([3.0]))

    assert torch.equal(_torch.premul_factor(Old()), torch.tensor([3.0]))  # type: ignore[arg-type]

    class Broken:
        def __getstate__(self) -> int:
            return 0

    with pytest.raises(aiocoll.TorchCompatError, match="PREMUL_SUM"):
        _torch.premul_factor(Broken())


def test_the_process_group_answers_to_both_generations_of_method_names() -> None:
    from aiocoll._c10d._backend import AiocollProcessGroup

    for new, old in _groups._LEGACY_PG_METHODS.items():
        assert getattr(AiocollProcessGroup, old) is getattr(AiocollProcessGroup, new), old


def test_no_crash_when_a_backward_follows_a_dtensor_world() -> None:
    # torch 2.10 crashed (segmentation fault) here before prepare_for_rank_threads():
    # autograd's device threads first started from a rank thread, after a DTensor world
    code = textwrap.dedent(
        """
        import warnings
        import torch, torch.distributed as dist, aiocoll
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor, Shard, Replicate
        warnings.simplefilter("ignore")

        def mesh_fn(comm):
            mesh = init_device_mesh("cpu", (2, 2))
            d = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0), Replicate()])
            return (d @ d).full_tensor().sum().item()

        def grad_fn(comm):
            a = torch.full((2,), float(dist.get_rank() + 1), requires_grad=True)
            y = funcol.wait_tensor(funcol.all_gather_tensor_autograd(a * 2, 0, dist.group.WORLD))
            (y * torch.arange(4.0)).sum().backward()
            return a.grad.tolist()

        print(aiocoll.spawn(mesh_fn, world=4)[0])
        print(aiocoll.spawn(grad_fn, world=2))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["3920.0", "[[0.0, 4.0], [8.0, 12.0]]"]


def test_no_crash_when_the_first_world_ran_from_a_thread_that_ended() -> None:
    # torch 2.10's CUDA build without a GPU crashed (segmentation fault) here: the no-op
    # CUDA guard was installed from the helper thread, and freed when it ended
    code = textwrap.dedent(
        """
        import asyncio, threading, warnings
        import torch, aiocoll
        from aiocoll._spawn import spawn_async
        from torch._subclasses.fake_tensor import FakeTensorMode
        warnings.simplefilter("ignore")

        def rank(comm):
            with FakeTensorMode():
                torch.empty(3)
            return comm.rank

        first = []
        helper = threading.Thread(target=lambda: first.append(asyncio.run(spawn_async(rank, 2))))
        helper.start()
        helper.join()
        print(first[0], aiocoll.spawn(rank, world=2), aiocoll.spawn(rank, world=2))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[0, 1] [0, 1] [0, 1]"


def test_the_threaded_harness_gets_the_state_torch_forgot(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.11 added _World.comms but not to the harness's ThreadLocalWorld
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    class NewerWorld(_c10dstate._World):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self._pg_new_thing: list[Any] = []

        @property
        def pg_new_thing(self) -> list[Any]:
            return self._pg_new_thing

    monkeypatch.setattr(_c10dstate, "_World", NewerWorld)
    changes = _torch.threaded_harness.mend_thread_local_world()
    added = [c.name for c in changes]
    mended = _patches.PatchSet("a test's mended world", "a test's", lambda key: changes, ["*.ThreadLocalWorld.*"])
    with _patches.lease(mended):
        assert "pg_new_thing" in added
        assert isinstance(vars(ThreadLocalWorld)["pg_new_thing"], property)
        assert "pg_config_info" not in added  # derived from pg_map, not state to keep
    assert not hasattr(ThreadLocalWorld, "pg_new_thing")


def test_the_process_group_answers_what_c10d_asks_a_backend() -> None:
    # c10d asks group._get_backend(device) about capabilities; aiocoll's group has none,
    # and says so, so torch takes its fallback or raises its own clear error
    def fn(comm: aiocoll.Comm) -> list[Any]:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        out: list[Any] = [backend is dist.group.WORLD, backend.supports_splitting, backend.supports_coalescing]
        out.append(backend.supports_tensor_alloc(torch.device("cpu")))
        if hasattr(dist, "split_group"):
            try:
                dist.split_group(split_ranks=[[0], [1]])
            except RuntimeError as e:
                out.append(str(e))
        return out

    res = aiocoll.spawn(fn, world=2)
    for out in res:
        assert out[:4] == [True, False, False, False]
        if hasattr(dist, "split_group"):  # torch's own refusal (2.15: "does not support splitting")
            assert "split" in out[4], out[4]


def test_a_process_harness_without_its_hooks_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    assert _torch.process_harness.test_case() is MultiProcessTestCase
    monkeypatch.delattr(MultiProcessTestCase, "_check_return_codes")
    with pytest.raises(aiocoll.TorchCompatError, match=r"MultiProcessTestCase\._check_return_codes"):
        aiocoll.testing.replace_process_harness()


def test_process_harness_steering_is_undone_exactly() -> None:
    c10d = dist.distributed_c10d
    before = (c10d._new_process_group_helper, c10d.rendezvous)
    steered = _patches.PatchSet(
        "a test's steered init",
        "a test's",
        lambda key: _torch.process_harness.init_changes(lambda *a: None, lambda *a: None),
        _torch.process_harness.INIT_TARGETS,
    )
    with _patches.lease(steered):
        assert c10d._new_process_group_helper is not before[0]
        assert c10d.rendezvous is not before[1]
    assert (c10d._new_process_group_helper, c10d.rendezvous) == before


def test_rank_threads_free_dtensors_per_thread_cache_in_their_turn() -> None:
    # freed as the threads exit, two ranks' caches can deadlock torch (a C++ mutex against the GIL)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def fn(comm: aiocoll.Comm) -> tuple[bool, bool]:
        mesh = init_device_mesh("cpu", (2,))
        (distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]) * 2).sum().full_tensor()
        state = _dtensor._thread_state_dict()
        assert state is not None
        had = _dtensor._DTENSOR_THREAD_CACHE in state
        _torch.drop_thread_caches()
        return had, _dtensor._DTENSOR_THREAD_CACHE in state

    assert aiocoll.spawn(fn, world=2) == [(True, False)] * 2
