"""tests/child_logs.py: a failed test's report carries the end of each child process's log."""

from __future__ import annotations

import os

from tests import child_logs


def test_the_newest_logs_come_first_each_cut_to_its_end_and_all_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(child_logs, "TAIL_CHARS", 10)
    monkeypatch.setattr(child_logs, "ALL_TAILS_CHARS", 25)
    for age, name in enumerate(["agent.log", "nested/worker.log", "web.log", "beat.log"]):
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"{name} begins " + "x" * 20 + f" {name[:3]}-end")
        os.utime(path, (1_000_000 - age, 1_000_000 - age))
    (tmp_path / "notes.txt").write_text("not a log")

    tails = child_logs.log_tails(tmp_path)

    assert [name for name, _ in tails] == ["agent.log", "nested/worker.log", "web.log"]
    assert [len(tail) for _, tail in tails] == [10, 10, 5]
    assert tails[0][1].endswith("age-end") and tails[1][1].endswith("nes-end")


def test_a_directory_without_logs_adds_nothing(tmp_path):
    assert child_logs.log_tails(tmp_path) == []
    assert child_logs.log_tails(tmp_path / "gone") == []
