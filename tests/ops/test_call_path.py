"""The steady-state eager call of each op, from the public function to the kernel launch: at most six
ropekit functions in four files (ropekit.core.pipeline's contract). A helper added on that path,
a comprehension or a property read included, fails here with the path printed."""

from __future__ import annotations

import pytest

from ropekit.tools import call_path

MAX_FRAMES, MAX_FILES = 6, 4


@pytest.mark.parametrize("op", list(call_path.calls("cpu")))
def test_the_call_path_is_short(op):
    path = call_path.path_of(call_path.calls("cpu")[op])
    files = {f for f, _ in path}
    shown = "\n".join(f"{f}:{fn}" for f, fn in path)
    assert path[0][0].startswith("api/"), shown  # the public function itself is counted
    assert path[-1] == ("core/launch.py", "launch"), shown
    assert len(path) <= MAX_FRAMES and len(files) <= MAX_FILES, shown


def test_the_counter_sees_an_added_frame(monkeypatch):
    """The counter can fail: one more function on the rotation's path is seen."""
    from ropekit.core import pipeline

    real = pipeline.run_rotate

    def extra(*args, **kwargs):
        return real(*args, **kwargs)

    extra.__code__ = extra.__code__.replace(co_filename=pipeline.__file__)
    monkeypatch.setattr(pipeline, "run_rotate", extra)
    path = call_path.path_of(call_path.calls("cpu")["rotation"])
    assert ("core/pipeline.py", "extra") in path and len(path) == MAX_FRAMES + 1


@pytest.mark.parametrize("op", ["apply_rope", "rotate_angles", "apply_rope_and_store", "rerotate_kv_cache"])
def test_prepare_gets_the_arguments_in_signature_order(op):
    """Each op hands pipeline.prepare its positional and keyword-only arguments as two tuples in
    signature order (validation reads them back by name): a parameter added, dropped or swapped in
    one place and not the other fails here."""
    import ast
    import inspect
    import textwrap

    import ropekit.api.ops
    import ropekit.api.rerotate
    import ropekit.api.store

    fn = next(getattr(m, op) for m in (ropekit.api.ops, ropekit.api.store, ropekit.api.rerotate) if hasattr(m, op))
    params = inspect.signature(fn).parameters.values()
    leading = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "prepare"]
    assert len(calls) == 1
    given = [[e.id for e in arg.elts] for arg in calls[0].args[1:3]]
    assert given == [leading, keywords]
