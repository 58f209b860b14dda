"""The journal (engine/request/journal.py): any writes, undone newest first, leave everything as it was at begin;
a commit keeps them; a closed journal notes nothing; the books never record anything themselves."""

from __future__ import annotations

import pickle
import re
from collections import deque
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine.request.journal import Journal, Journaled, JournaledDeque, JournaledDict, JournaledList

ROOT = Path(__file__).resolve().parents[2]


class Books(Journaled):
    def __init__(self) -> None:
        self.count = 0
        self.items: list[int] = JournaledList([1, 2, 3])
        self.queue: deque[int] = JournaledDeque([4, 5])
        self.index: dict[int, int] = JournaledDict({0: 0})
        self.inner: Inner = Inner()


class Inner(Journaled):
    def __init__(self) -> None:
        self.flag = False
        self.table: list[int] = JournaledList()


def state(b: Books) -> tuple:
    return (b.count, list(b.items), list(b.queue), dict(b.index), b.inner.flag, list(b.inner.table),
            sorted(vars(b)))


def apply(b: Books, op: int, k: int) -> None:
    """One write of 16 kinds, with argument k."""
    lst, table = b.items, b.inner.table
    if op == 0:
        b.count += k
    elif op == 1 and lst:
        lst[k % len(lst)] = k
    elif op == 2:
        lst.append(k)
    elif op == 3 and lst:
        lst.pop()
    elif op == 4:
        del lst[k % (len(lst) + 1):]
    elif op == 5:
        lst.extend([k, k])
    elif op == 6 and lst:
        lst.pop(0)
    elif op == 7:
        lst += [k]
    elif op == 8:
        b.queue.appendleft(k)
    elif op == 9 and b.queue:
        b.queue.popleft()
    elif op == 10:
        b.index[k % 4] = k
    elif op == 11 and b.index:
        del b.index[next(iter(b.index))]
    elif op == 12:
        b.items = JournaledList([k])  # a new container assigned follows the journal...
        b.items.append(k)  # ...so this write is noted too
    elif op == 13:
        b.inner.flag = not b.inner.flag
        table.append(k)
    elif op == 14 and table:
        table[k % len(table)] = -1
    elif op == 15:
        b.queue = JournaledDeque([k])
        b.queue.remove(k)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 9)), max_size=12), st.booleans()),
                max_size=6))
def test_a_rollback_undoes_any_writes_and_a_commit_keeps_them(steps):
    journal, books = Journal(), Books()
    journal.watch(books)
    for ops, fails in steps:
        before = state(books)
        journal.begin()
        for op, k in ops:
            apply(books, op, k)
        after = state(books)
        if fails:
            journal.rollback()
            assert state(books) == before
        else:
            journal.commit()
            assert state(books) == after
        assert not journal.is_open


def test_a_closed_journal_notes_nothing_and_pickles_plain_containers():
    journal, books = Journal(), Books()
    journal.watch(books)
    books.items.append(9)
    books.count = 3
    assert journal.size == 0 and journal.notes is None
    journal.begin()
    books.items.append(10)
    books.inner.flag = True
    assert journal.size == 2  # what a step costs is what it touched
    journal.commit()
    for container, plain in ((books.items, list), (books.queue, deque), (books.index, dict)):
        copy = pickle.loads(pickle.dumps(container))
        assert type(copy) is plain and copy == plain(container)  # a plan never carries a journal along


def test_an_object_not_watched_notes_nothing():
    journal, books = Journal(), Books()
    journal.begin()
    books.items.append(1)
    books.count = 1
    assert journal.size == 0
    journal.rollback()
    assert books.count == 1


# The books and the scheduler change their state as if there were no transaction: no mutator records.
BOOKS = ("scheduler.py", "block_manager.py", "sliding_window.py", "kv_cache_groups.py", "state_pool.py",
         "state_cache.py", "sequence.py", "scheduler_commit.py")


def test_no_mutator_records_anything():
    engine = ROOT / "minivllm" / "engine"
    for name in BOOKS:
        path = next(engine.rglob(name))
        calls = re.findall(r"\b(?:_?record\w*|undo\w*|notes)\s*\(|\.notes\b|\.undo\b", path.read_text())
        assert not calls, f"{name} records its own writes: {calls}"
    scheduler = next(engine.rglob("scheduler.py")).read_text()
    assert re.findall(r"self\.journal\.(\w+)\(", scheduler) == ["watch", "watch", "begin", "commit", "rollback"]


def test_an_undo_that_raises_stops_nothing_else():
    """A plug-in (a student's allocator) that breaks its contract during a rollback: the rest is undone all the
    same, then its error is raised."""
    journal, books = Journal(), Books()
    journal.watch(books)
    before = state(books)
    journal.begin()
    books.items.append(7)
    journal.notes.append((int, "not a number"))  # an undo that raises ValueError
    books.count = 5
    try:
        journal.rollback()
    except ValueError:
        pass
    else:
        raise AssertionError("the failing undo's error was swallowed")
    assert state(books) == before and not journal.is_open
