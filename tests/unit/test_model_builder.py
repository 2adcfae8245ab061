"""The offline test model rebuilds byte-identical, and a complete directory is not rebuilt."""

from __future__ import annotations

from kvshuttle.workers import model_builder


def test_rebuild_is_byte_identical(model_dir, tmp_path):
    fresh = model_builder.build_model(tmp_path / "again", "tiny", force=True)
    assert model_builder.file_hashes(fresh) == model_builder.file_hashes(model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        model_builder.file_hashes(fresh))


def test_complete_dir_is_kept(model_dir, tmp_path):
    out = model_builder.build_model(tmp_path / "m", "tiny")
    stamp = (out / model_builder.STAMP).stat().st_mtime_ns
    model_builder.build_model(out, "tiny")
    assert (out / model_builder.STAMP).stat().st_mtime_ns == stamp
    (out / "config.json").write_text("{}")  # damaged: rebuilt
    model_builder.build_model(out, "tiny")
    assert (out / model_builder.STAMP).stat().st_mtime_ns != stamp
    assert model_builder.file_hashes(out) == model_builder.file_hashes(model_dir)
