"""Every file geir writes is replaced whole or left as it was (``geir.ir._files.replacing``): a failure while
exporting or writing never leaves an empty or half-written file, nor a temporary file beside it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import geir
from geir.ir import _onnx_export
from geir.ir._files import replacing, write_file
from rotary.helpers import ROPE, rotary_graph


def _graph() -> geir.Graph:
    return rotary_graph(ROPE, (1, 4, 2, 16), (1, 4, 1, 8), "float32", rotary_mode=1, partial_slice=[0, 8])


def _leftovers(folder: Path, *keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_a_failure_inside_the_block_keeps_the_old_bytes_and_removes_the_temporary_file(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old content")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with replacing(target) as f:
            f.write(b"half of the new")
            raise RuntimeError("disk on fire")
    assert target.read_bytes() == b"old content" and _leftovers(tmp_path, "out.bin") == []
    with pytest.raises(KeyboardInterrupt):          # not only Exception: an interrupt cleans up too
        with replacing(tmp_path / "new.bin") as f:
            f.write(b"x")
            raise KeyboardInterrupt
    assert _leftovers(tmp_path, "out.bin") == []    # a file that did not exist still does not


def test_success_replaces_keeps_an_existing_mode_and_gives_a_new_file_the_umask_mode(tmp_path):
    old = tmp_path / "old.txt"
    old.write_text("old")
    old.chmod(0o640)
    write_file(old, "new text")
    assert old.read_text() == "new text" and stat.S_IMODE(old.stat().st_mode) == 0o640
    umask = os.umask(0o027)
    try:
        write_file(tmp_path / "fresh.bin", b"\x00\x01")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "fresh.bin").stat().st_mode) == 0o640      # 0o666 & ~0o027, as open() gives
    assert _leftovers(tmp_path, "old.txt", "fresh.bin") == []


def test_a_link_is_written_through_and_a_device_is_written_not_replaced(tmp_path):
    real = tmp_path / "real.txt"
    real.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    write_file(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    write_file(os.devnull, b"to nowhere")                # renaming over /dev/null would replace the device
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_a_name_of_the_longest_length_allowed_can_be_written(tmp_path):
    for longest in (tmp_path / ("n" * 255), tmp_path / ("é" * 127)):   # NAME_MAX is 255 bytes, é takes two
        write_file(longest, b"x")
        assert longest.read_bytes() == b"x"
    assert _leftovers(tmp_path, "n" * 255, "é" * 127) == []


def test_a_missing_directory_names_the_file_asked_for(tmp_path):
    wanted = tmp_path / "no" / "such" / "out.onnx"
    with pytest.raises(FileNotFoundError) as info:
        write_file(wanted, b"x")
    assert info.value.filename == str(wanted)


def test_save_onnx_that_fails_to_export_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """Issue 23 item 13: save_onnx opened (truncated) the file before exporting."""
    path = tmp_path / "model.onnx"
    geir.save_onnx(_graph(), path)
    before = path.read_bytes()

    def refuse(graph):
        raise geir.GraphError("Op 'n': cannot export: made to fail by the test")

    monkeypatch.setattr(_onnx_export, "to_onnx", refuse)
    with pytest.raises(geir.GraphError, match="cannot export"):
        geir.save_onnx(_graph(), path)
    assert path.read_bytes() == before and _leftovers(tmp_path, "model.onnx") == []
    monkeypatch.undo()
    assert geir.load_onnx(str(path)).nodes[0].op_type == ROPE


def test_a_graph_dump_that_fails_to_write_leaves_both_files_as_they_were(tmp_path, monkeypatch):
    """aclgrphDumpGraph writes ``.onnx`` and ``.txt`` in full before either replaces the previous dump: a disk
    that fills up while the text is flushed returns FAILED and keeps the old pair, not a truncated text."""
    from geir import ge

    stem = str(tmp_path / "dump")
    assert ge.aclgrphDumpGraph(_graph(), stem) == ge.SUCCESS
    before = {suffix: Path(stem + suffix).read_bytes() for suffix in (".onnx", ".txt")}
    fsync = os.fsync

    def text_disk_full(fd: int) -> None:          # only the text file's flush fails
        if ".txt" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(28, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", text_disk_full)
    other = rotary_graph(ROPE, (2, 4, 2, 16), (1, 4, 1, 8), "float32", rotary_mode=1, partial_slice=[0, 8])
    assert ge.aclgrphDumpGraph(other, stem) == ge.FAILED
    assert "No space left on device" in ge.GEGetErrorMsgV2()
    assert {suffix: Path(stem + suffix).read_bytes() for suffix in before} == before
    assert _leftovers(tmp_path, "dump.onnx", "dump.txt") == []
