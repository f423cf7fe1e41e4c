"""Differential tests: an exercise's function against the book's own, on drawn inputs.

A chapter's ``test_*_differential.py`` asks for the ``differential`` fixture (exercise_plugin.py
provides it) and, for each exercise, draws inputs across the exercise's whole domain, calls the
function in place (yours, with ``--impl=student``) and the book's version on copies of the same
inputs, and compares what they return, what they raise and what they leave behind::

    def test_slot_mapping(differential):
        book_slot_mapping = differential.book(BlockManager.slot_mapping)

        def check(rng):  # one drawn input
            ...
            differential.agree(
                f"slot_mapping(seq, {start}, {end}) with block_table={table}, block_size={bs}",
                differential.call(BlockManager.slot_mapping, bm, seq, start, end),
                differential.call(book_slot_mapping, bm2, seq2, start, end),
                meaning="slot = block_table[p // block_size] * block_size + p % block_size",
            )

        differential.run(check, examples=200)

``check(rng)`` draws everything from ``rng``, a ``random.Random``. Three ways to make it, chosen by
``--draw`` (or ``$VLLM_FS_DRAW``), all reproducible from one run to the next:

* ``hypothesis``: Hypothesis's ``st.randoms()``, whose draws come from Hypothesis: simple inputs
  first, then biased towards the ends of every range (empty batches, the largest block, a zero).
  Fixed seed, no example database, and no shrinking: a failing input is reported as drawn, so a
  wrong answer costs one failing example, not minutes of shrinking a workload.
* ``random``: ``random.Random(seed)`` for seeds 0, 1, 2, ... (uniform draws, no shrinking).
* ``both`` (the default): the first half of the examples from Hypothesis, the rest from
  ``random.Random(seed)``. Each finds wrong answers the other misses: Hypothesis the ends of a
  range, uniform draws the combinations in the middle (a decode with three drafts when two tokens
  of budget are left).

``exercises/mistakes.py --compare-draws`` measures how much of the catalogue of wrong answers each
finds; the README gives the figures.

With ``--impl=reference`` the two sides are the same function, so the comparison always holds;
the run then checks that every drawn input is one the book accepts, on a tenth of the examples.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

DRAWS = ("both", "hypothesis", "random")
DEFAULT_DRAW = "both"


@dataclass
class Outcome:
    """What one call did: the value it returned, or the exception it raised."""

    value: object = None
    error: BaseException | None = None

    def describe(self) -> str:
        if self.error is not None:
            return f"raised {type(self.error).__name__}: {str(self.error)[:160]}"
        return f"returned {describe(self.value)}"


def describe(value: object, limit: int = 240) -> str:
    """A short, readable rendering of a value for a failure message."""
    if isinstance(value, torch.Tensor):
        if value.numel() <= 64:
            text = f"tensor({value.tolist()}, dtype={str(value.dtype).removeprefix('torch.')})"
        else:
            flat = value.flatten()[:8].tolist()
            text = (
                f"tensor of shape {list(value.shape)}, dtype {str(value.dtype).removeprefix('torch.')}, starting {flat}"
            )
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_difference(yours: object, book: object, atol: float = 0.0, rtol: float = 0.0, path: str = "") -> str | None:
    """Where ``yours`` first differs from ``book`` (a path such as ``[2][0]``), with both values;
    None when they agree. Floats and floating tensors agree within ``atol + rtol * |book|``;
    everything else must be equal (tensors: same shape and dtype too)."""
    where = path or "the result"
    if isinstance(book, torch.Tensor):
        if not isinstance(yours, torch.Tensor):
            return f"{where}: yours is {type(yours).__name__}, the book's a tensor"
        if yours.shape != book.shape:
            return f"{where}: yours has shape {list(yours.shape)}, the book's {list(book.shape)}"
        if yours.dtype != book.dtype:
            return f"{where}: yours is {yours.dtype}, the book's {book.dtype}"
        if book.is_floating_point():
            y, b = yours.double(), book.double()
            same_inf = (y == b) | (y.isnan() & b.isnan())
            close = same_inf | ((y - b).abs() <= atol + rtol * b.abs())
        else:
            close = yours == book
        if bool(close.all()):
            return None
        index = tuple(int(i) for i in (~close).nonzero()[0])
        return (
            f"{where} at {list(index)}: yours {describe(yours[index].item())}, the book's "
            f"{describe(book[index].item())} ({int((~close).sum())} of {close.numel()} entries differ)"
        )
    if isinstance(book, Mapping):
        if not isinstance(yours, Mapping):
            return f"{where}: yours is {type(yours).__name__}, the book's a mapping"
        if set(yours) != set(book):
            return f"{where}: yours has keys {sorted(map(str, yours))}, the book's {sorted(map(str, book))}"
        for key in book:
            diff = first_difference(yours[key], book[key], atol, rtol, f"{path}[{key!r}]")
            if diff:
                return diff
        return None
    if isinstance(book, (list, tuple)):
        if not isinstance(yours, (list, tuple)):
            return f"{where}: yours is {describe(yours)}, the book's {describe(book)}"
        if len(yours) != len(book):
            return (
                f"{where}: yours has {len(yours)} items, the book's {len(book)}: "
                f"yours {describe(yours)}, the book's {describe(book)}"
            )
        for i, (y, b) in enumerate(zip(yours, book)):
            diff = first_difference(y, b, atol, rtol, f"{path}[{i}]")
            if diff:
                return diff
        return None
    if isinstance(book, float) and isinstance(yours, (int, float)) and not isinstance(yours, bool):
        if (math.isnan(book) and math.isnan(yours)) or yours == book or abs(yours - book) <= atol + rtol * abs(book):
            return None
        return f"{where}: yours {yours!r}, the book's {book!r}"
    if yours != book:
        return f"{where}: yours {describe(yours)}, the book's {describe(book)}"
    return None


class Differential:
    """The ``differential`` fixture: the book's versions of swapped functions, calls that capture
    what happened, and the comparison that fails with the first differing input."""

    def __init__(
        self, originals: Callable[[object, str], object | None], installed: Mapping[int, object], impl: str, draw: str
    ):
        self._original = originals  # (owner, name) -> the book's raw attribute, if something replaced it
        self._installed = installed  # id(function put in place) -> the book's function it replaced
        self.impl = impl
        self.draw = draw

    # ------------------------------------------------------------------ the book's versions
    def book(self, fn):
        """The book's version of ``fn`` (a module function, or a method read off its class),
        callable the same way; ``fn`` itself when nothing replaced it."""
        if isinstance(fn, property):
            return property(self.book(fn.fget))
        bound_to = getattr(fn, "__self__", None)
        func = getattr(fn, "__func__", fn)
        original = self._installed.get(id(func))
        if original is None:
            return fn
        return original.__get__(bound_to, type(bound_to)) if bound_to is not None else original

    def twin(self, cls: type, *names: str) -> type:
        """A subclass of ``cls`` whose methods ``names`` are the book's: two objects, one of
        ``cls`` and one of its twin, differ only in those methods."""
        attrs = {}
        for name in names:
            for klass in cls.__mro__:
                raw = self._original(klass, name)
                if raw is not None:
                    attrs[name] = raw
                    break
                if name in vars(klass):
                    break
        return type(f"Book{cls.__name__}", (cls,), attrs) if attrs else cls

    # ------------------------------------------------------------------ calls and comparisons
    @staticmethod
    def call(fn, *args, **kwargs) -> Outcome:
        """Call ``fn``; its value, or the exception it raised. An unfinished exercise's
        NotImplementedError propagates, so the grade can say "not attempted"."""
        try:
            return Outcome(value=fn(*args, **kwargs))
        except NotImplementedError:
            raise
        except Exception as exc:
            return Outcome(error=exc)

    def agree(
        self,
        call: str,
        yours: Outcome,
        book: Outcome,
        meaning: str = "",
        atol: float = 0.0,
        rtol: float = 0.0,
        state: tuple[object, object] | None = None,
    ) -> None:
        """Fail unless ``yours`` and ``book`` did the same on the input ``call`` describes: equal
        values (within ``atol``/``rtol`` for floats), or the same kind of exception. ``state``
        is ``(yours, book)``: what each call left behind (a block table, a cache), compared too.
        ``meaning`` says what the compared result stands for, to help read a difference."""
        if book.error is not None or yours.error is not None:
            if book.error is None:
                diff = f"yours {yours.describe()}, while the book's {book.describe()}"
            elif yours.error is None:
                diff = f"the book's {book.describe()} (an input it refuses), while yours {yours.describe()}"
            elif not isinstance(yours.error, type(book.error)):
                diff = f"yours {yours.describe()}, the book's {book.describe()}"
            else:
                diff = None
        else:
            diff = first_difference(yours.value, book.value, atol, rtol)
        if diff is None and state is not None and yours.error is None:
            diff = first_difference(state[0], state[1], atol, rtol, "what the call left behind")
        if diff is not None:
            lines = [f"{call}:", f"  {diff}"]
            if meaning:
                lines.append(f"  ({meaning})")
            raise AssertionError("\n".join(lines))

    # ------------------------------------------------------------------ drawing inputs
    def run(self, check: Callable[[random.Random], None], examples: int) -> None:
        """Run ``check`` on ``examples`` drawn inputs (a tenth of them with the reference)."""
        n = examples if self.impl == "student" else max(2, examples // 10)
        if self.draw == "both":
            self._hypothesis(check, (n + 1) // 2)
            self._random(check, n // 2)
        elif self.draw == "random":
            self._random(check, n)
        else:
            self._hypothesis(check, n)

    @staticmethod
    def _random(check: Callable[[random.Random], None], n: int) -> None:
        for seed in range(n):
            try:
                check(random.Random(seed))
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n(inputs drawn by random.Random({seed}))") from None

    @staticmethod
    def _hypothesis(check: Callable[[random.Random], None], n: int) -> None:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import strategies as st

        @settings(
            max_examples=n,
            derandomize=True,
            database=None,
            deadline=None,
            print_blob=False,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(st.randoms(use_true_random=False))
        def drawn(rng):
            check(rng)

        drawn()


def draw_from(option: str | None) -> str:
    """The input drawer chosen by ``--draw`` or ``$VLLM_FS_DRAW``."""
    draw = option or os.environ.get("VLLM_FS_DRAW") or DEFAULT_DRAW
    if draw not in DRAWS:
        raise ValueError(f"--draw must be one of {DRAWS}, got {draw!r}")
    return draw
