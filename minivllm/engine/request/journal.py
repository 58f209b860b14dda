"""`Journal`: a step's transaction kept in the data — containers and objects that note how to undo each
write while a step is open, so the code that changes them reads as if there were no transaction.

A step is a transaction (see `LLMEngine.step`): `schedule()` reserves blocks, admits and preempts, and
if the forward then fails, every change must be undone. Copying the books before each step would cost
as much as the pool is large (262,144 blocks on a big GPU made a step ~10x slower than 2,048). So the
books note, write by write, what each write replaced, and only while a step is open:

    journal.begin()                      the scheduler's begin_step
    bm.ref_counts[7] += 1                JournaledList: notes "index 7 was 0"
    seq.block_table.append(7)            JournaledList: notes "pop the last item"
    seq.status = RUNNING                 Journaled object: notes "status was WAITING"
    journal.rollback()                   the notes, newest first: everything is as it was at begin
    journal.commit()                     (or) forget the notes: what a step costs is what it touched

Undoing the notes newest first restores every write exactly, whatever the order of the writes, since
each note was taken of the state just before its own write.

The rules, for whoever adds state to the scheduler's side:
  * an object whose attributes a step may change subclasses `Journaled`; assigning an attribute is noted;
  * a list, deque or dict that a step changes in place is a `JournaledList`, `JournaledDeque` or
    `JournaledDict` (assigned to a `Journaled` object, it follows that object's journal);
  * `journal.watch(obj)` puts obj, and every `Journaled` object and journaled container it holds, under
    the journal (the scheduler watches itself, so its books; and each sequence it is given).
Nothing else is needed: no mutator records anything. A container of another kind changed in place inside
a step would not be undone — the engine's state machine test (failed steps, rolled back, must leave no
trace) is what catches such a miss.

This module imports nothing from the engine: the books and the sequences import it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

# One note: (function, its arguments); undoing a note calls function(*arguments).
Note = tuple[Any, ...]
_MISSING = object()  # an attribute or key that did not exist before the write


class Journal:
    def __init__(self) -> None:
        self.notes: list[Note] | None = None  # the open step's notes; None: no step is open

    @property
    def is_open(self) -> bool:
        return self.notes is not None

    @property
    def size(self) -> int:
        """How many writes the open step made (what its commit or rollback costs), 0 when none is open."""
        return len(self.notes) if self.notes is not None else 0

    def begin(self) -> None:
        assert self.notes is None, "a step is already open"
        self.notes = []

    def commit(self) -> None:
        assert self.notes is not None, "no step is open"
        self.notes = None

    def rollback(self) -> None:
        """Undo every write since `begin`, newest first. A note whose undo raises (a plug-in's allocator that
        breaks its contract) does not stop the others: all are undone, then the first error is raised."""
        notes, self.notes = self.notes, None  # closed first: the undoing writes are not noted
        assert notes is not None, "no step is open"
        error: BaseException | None = None
        for undo, *args in reversed(notes):
            try:
                undo(*args)
            except Exception as e:  # noqa: BLE001 -- raised below, once everything else is undone
                error = error or e
        if error is not None:
            raise error

    def watch(self, obj: Journaled, _seen: set[int] | None = None) -> None:
        """Put `obj` under this journal, with the journaled objects and containers it holds (recursively)."""
        seen = set() if _seen is None else _seen
        if id(obj) in seen:
            return
        seen.add(id(obj))
        object.__setattr__(obj, "journal", self)
        for value in vars(obj).values():
            if isinstance(value, Journaled):
                self.watch(value, seen)
            elif isinstance(value, JournaledContainer):
                value.journal = self


def _restore_attr(obj: object, name: str, old: Any) -> None:
    if old is _MISSING:
        object.__delattr__(obj, name)
    else:
        object.__setattr__(obj, name, old)


# Every journaled container type (filled as they are defined): what a `Journaled` object binds to its journal
# when one is assigned to it, found by exact type (a set lookup is cheaper than isinstance on every write).
_CONTAINERS: set[type] = set()


class JournaledContainer:
    """What the journaled containers share: the journal they note into (None: not watched yet)."""

    journal: Journal | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _CONTAINERS.add(cls)

    def _notes(self) -> list[Note] | None:
        journal = self.journal
        return journal.notes if journal is not None else None


class Journaled:
    """An object whose attribute assignments are noted while its journal has a step open. A journaled
    container assigned to it follows its journal."""

    journal: Journal | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        journal = self.journal
        if journal is not None:
            notes = journal.notes
            if notes is not None:
                notes.append((_restore_attr, self, name, self.__dict__.get(name, _MISSING)))
            if type(value) in _CONTAINERS:  # (not isinstance: this runs on every write of a watched object)
                value.journal = journal
        object.__setattr__(self, name, value)


def _note_copy(container: JournaledContainer, restore: Callable[..., Any]) -> None:
    """The general note for a change of shape: the whole contents (lists of requests or of one request's
    blocks: never the pool's size, whose lists only ever change item by item)."""
    notes = container._notes()
    if notes is not None:
        notes.append((restore, container, dict(container) if isinstance(container, dict) else list(container)))


def _noting_copy(base: type, name: str, restore: Callable[..., Any]) -> Callable[..., Any]:
    """`base.name`, noting the whole contents first (the methods that change a container's shape)."""
    method = getattr(base, name)

    def change(self: JournaledContainer, *args: Any, **kwargs: Any) -> Any:
        _note_copy(self, restore)
        return method(self, *args, **kwargs)

    change.__name__ = name
    return change


def _put_back_list(lst: list, items: list) -> None:
    list.__setitem__(lst, slice(None), items)


class JournaledList(JournaledContainer, list):
    """A list that notes its writes. Item writes and appends note one item (the pool's per-block lists are
    written this way); any other change notes the whole list. Pickled, it is a plain list."""

    def __setitem__(self, index: Any, value: Any) -> None:
        journal = self.journal  # (inline, not _notes(): the pool's per-block lists are written every step)
        notes = journal.notes if journal is not None else None
        if notes is not None:
            if isinstance(index, int):
                notes.append((list.__setitem__, self, index, list.__getitem__(self, index)))
            else:
                notes.append((_put_back_list, self, list(self)))
        list.__setitem__(self, index, value)

    def append(self, value: Any) -> None:
        journal = self.journal
        notes = journal.notes if journal is not None else None
        if notes is not None:
            notes.append((list.pop, self))
        list.append(self, value)

    def pop(self, index: int = -1) -> Any:
        notes = self._notes()
        if notes is not None and index == -1:
            value = list.pop(self)
            notes.append((list.append, self, value))
            return value
        _note_copy(self, _put_back_list)
        return list.pop(self, index)

    def __delitem__(self, index: Any) -> None:
        _note_copy(self, _put_back_list)
        list.__delitem__(self, index)

    def __iadd__(self, values: Any) -> JournaledList:
        _note_copy(self, _put_back_list)
        return list.__iadd__(self, values)

    def __imul__(self, count: Any) -> JournaledList:
        _note_copy(self, _put_back_list)
        return list.__imul__(self, count)

    extend, insert, remove, clear, sort, reverse = (_noting_copy(list, name, _put_back_list) for name in (
        "extend", "insert", "remove", "clear", "sort", "reverse"))

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (list(self),)


def _put_back_deque(dq: deque, items: list) -> None:
    deque.clear(dq)
    deque.extend(dq, items)


class JournaledDeque(JournaledContainer, deque):
    """A deque (the waiting queue) that notes its whole contents before its first change of each call."""

    append, appendleft, extend, extendleft, pop, popleft, remove, clear, rotate, __setitem__, __delitem__ = (
        _noting_copy(deque, name, _put_back_deque) for name in (
            "append", "appendleft", "extend", "extendleft", "pop", "popleft", "remove", "clear", "rotate",
            "__setitem__", "__delitem__"))

    def __reduce__(self) -> tuple[Any, ...]:
        return deque, (list(self),)


def _put_back_dict(dct: dict, items: dict) -> None:
    dict.clear(dct)
    dict.update(dct, items)


def _restore_key(dct: dict, key: Any, old: Any) -> None:
    if old is _MISSING:
        dict.pop(dct, key, None)
    else:
        dict.__setitem__(dct, key, old)


class JournaledDict(JournaledContainer, dict):
    """A dict that notes the old value (or absence) of each key it writes or deletes."""

    def _note(self, key: Any) -> None:
        notes = self._notes()
        if notes is not None:
            notes.append((_restore_key, self, key, dict.get(self, key, _MISSING)))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._note(key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: Any) -> None:
        self._note(key)
        dict.__delitem__(self, key)

    def pop(self, key: Any, *default: Any) -> Any:
        self._note(key)
        return dict.pop(self, key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._note(key)
        return dict.setdefault(self, key, default)

    update, popitem, clear = (_noting_copy(dict, name, _put_back_dict) for name in ("update", "popitem", "clear"))

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self),)
