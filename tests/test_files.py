"""vitlab.files.replaced: a file written whole or not at all."""
from __future__ import annotations

import pytest

from vitlab.files import replaced


def test_replaced_puts_the_written_file_in_place_and_keeps_the_old_one_when_the_writing_fails(tmp_path):
    target = tmp_path / "a b.csv"  # a name with a space
    target.write_text("old\n")
    with pytest.raises(RuntimeError, match="disk full"):
        with replaced(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["a b.csv"]
    with replaced(target) as tmp:
        tmp.write_text("new\n")
        assert target.read_text() == "old\n" and tmp.parent == tmp_path  # the old one until the new one is whole
    assert target.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["a b.csv"]
    with replaced(tmp_path / "made.txt") as tmp:
        tmp.write_text("1")
    assert (tmp_path / "made.txt").read_text() == "1"
