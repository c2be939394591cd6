"""``_libstate``'s stand-ins as objects: copied and pickled as the function they stand in for."""

from __future__ import annotations

import copy
import pickle
import sys
import types

import pytest

from aiocoll._process import _libstate


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = types.ModuleType("aiocoll_test_libstate_fn")
    exec("def rank_zero_only(fn):\n    return fn\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_a_stand_in_copies_and_pickles_as_the_function_does(module: types.ModuleType) -> None:
    real = module.rank_zero_only
    stand_in = _libstate.RankAttrs(module, "rank_zero_only", ("rank",))
    stand_in.install()
    try:
        assert copy.copy(stand_in) is stand_in
        assert copy.deepcopy({"f": stand_in})["f"] is stand_in
        assert pickle.loads(pickle.dumps(stand_in)) is stand_in  # (by its module's name)
        stand_in.rank = 3  # (no rank here: the function's own)
        assert real.rank == 3  # type: ignore[attr-defined]
        assert stand_in(len) is len
    finally:
        stand_in.uninstall()
    assert module.rank_zero_only is real
    assert pickle.loads(pickle.dumps(stand_in)) is real  # (given back: the name finds the function)
