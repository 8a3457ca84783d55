"""The model + heads picker finds checkpoint folders under its roots."""
from app import models
from gumiho_core.heads import CONFIG_FILE, WEIGHTS_FILE


def test_heads_and_models_are_discovered(tmp_path, monkeypatch):
    good = tmp_path / "runs" / "exp1" / "heads"
    good.mkdir(parents=True)
    (good / CONFIG_FILE).write_text("{}")
    (good / WEIGHTS_FILE).write_bytes(b"")
    half = tmp_path / "runs" / "exp2"
    half.mkdir()
    (half / CONFIG_FILE).write_text("{}")  # no weights: not offered
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (tmp_path / "models" / "q.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(models, "HEADS_ROOTS", [tmp_path / "runs", tmp_path / "missing"])
    monkeypatch.setattr(models, "MODEL_ROOTS", [tmp_path / "models"])
    assert models.heads_choices() == [str(good)]
    assert models.model_choices() == [str(tmp_path / "models" / "q.gguf"), str(model)]
