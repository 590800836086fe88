"""The export cache: keyed by content, listed and cleared from the CLI."""
import json
import shutil

from conftest import make_checkpoint
from specinfer.cache import cached_exports, export_folder
from specinfer.cli import main
from specinfer.export.onnx_export import EXPORT_FORMAT


def test_a_copy_of_a_checkpoint_shares_its_export_and_a_change_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECINFER_CACHE", str(tmp_path / "cache"))
    ckpt = make_checkpoint(tmp_path / "a", "llama2")
    copy = shutil.copytree(ckpt, tmp_path / "elsewhere" / "b")
    assert export_folder(copy, None, EXPORT_FORMAT) == export_folder(ckpt, None, EXPORT_FORMAT)
    assert export_folder(ckpt, 128, EXPORT_FORMAT) != export_folder(ckpt, None, EXPORT_FORMAT)
    assert export_folder(ckpt, None, "specinfer-onnx/0") != export_folder(ckpt, None, EXPORT_FORMAT)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-5}))
    assert export_folder(copy, None, EXPORT_FORMAT) != export_folder(ckpt, None, EXPORT_FORMAT)


def fake_export(root, name, fmt, nbytes):
    folder = root / "onnx" / name
    folder.mkdir(parents=True)
    if fmt:
        (folder / "manifest.json").write_text(json.dumps({"format": fmt, "source": f"/ckpt/{name}", "max_context": 64}))
    (folder / "model.onnx").write_bytes(b"x" * nbytes)
    return folder


def test_cache_list_and_clear(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECINFER_CACHE", str(tmp_path))
    current = fake_export(tmp_path, "aaa", EXPORT_FORMAT, 1000)
    old = fake_export(tmp_path, "bbb", "specinfer-onnx/1", 2_000_000)
    unfinished = fake_export(tmp_path, "ccc", None, 10)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 cached exports") and "/ckpt/bbb" in out and "specinfer-onnx/1" in out
    assert main(["cache", "clear", "--stale"]) == 0
    assert "removed 2 cached exports (2.0 MB)" in capsys.readouterr().out
    assert current.is_dir() and not old.exists() and not unfinished.exists()
    assert main(["cache", "clear"]) == 0 and cached_exports() == []


def test_the_one_time_export_says_what_it_is_once(tmp_path, monkeypatch, capsys):
    from specinfer.engines.loader import onnx_folder
    monkeypatch.setenv("SPECINFER_CACHE", str(tmp_path / "cache"))
    ckpt = make_checkpoint(tmp_path / "tiny", "llama2")
    capsys.readouterr()
    first = onnx_folder(ckpt, 64)
    err = capsys.readouterr().err
    assert err.startswith("specinfer: exporting tiny to ONNX once, into the cache")   # before any progress bar
    assert onnx_folder(ckpt, 64) == first and "exporting" not in capsys.readouterr().err
