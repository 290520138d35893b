"""The one bounded memo of validated call signatures, launch plans and per-value verdicts.

    lookup(key) -> value or None      remember(key, value) -> value      clear()
    remembered(list) -> list          another cache of specs, emptied by clear()
    tensor_key(x), value_key(v)       the parts of a signature key

A signature key holds a call's tensors as (type, shape, strides, dtype, device, requires_grad) and
its other arguments with their types (16 and 16.0 hash alike but validate differently). Every
module that memoizes uses this one dict, so `clear()` (a tuning knob changed; tests) forgets all
of it, and its size is bounded: at MEMO_CAPACITY entries it is emptied and refilled.
"""

from __future__ import annotations

MEMO: dict = {}
MEMO_CAPACITY = 4096
_LISTS: list = []  # other caches of memoized specs (ropekit.core.variant.Signature.recent), cleared with it


def lookup(key):
    """The value memoized under key (None if absent, or if key is None)."""
    return None if key is None else MEMO.get(key)


def remember(key, value):
    """value, memoized under key (not when key is None: an unhashable or unsettled signature)."""
    if key is not None:
        if len(MEMO) >= MEMO_CAPACITY:
            MEMO.clear()
        MEMO[key] = value
    return value


def clear() -> None:
    """Forget every spec, plan and verdict (tuning knobs changed; tests)."""
    MEMO.clear()
    for cache in _LISTS:
        cache.clear()


def remembered(cache: list) -> list:
    """cache, a list of memoized specs, emptied by `clear()` with the memo."""
    _LISTS.append(cache)
    return cache


def tensor_key(x):
    """The part of a signature one tensor argument contributes (None stays None)."""
    if x is None:
        return None
    return (type(x), x.shape, x.stride(), x.dtype, x.device, x.requires_grad)


def value_key(v):
    """A non-tensor argument with its type (16 and 16.0 differ); sequences element by element."""
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(value_key(e) for e in v))
    return (type(v), v)
