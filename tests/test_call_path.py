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
