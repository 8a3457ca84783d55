"""Bad input gives one clear line and a non-zero exit, never a traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gumiho_core import HeadCheckpoint, new_heads
from tiny import tiny_target

ROOT = Path(__file__).resolve().parent.parent


def launch(*args, timeout=300, env=None):
    import os

    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(result, expected: str):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr


def test_missing_model_path(tmp_path):
    assert_one_line_error(launch("generate", "hi", "--model", str(tmp_path / "nope")), "model path not found")


def test_file_that_is_not_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("definitely not a model")
    assert_one_line_error(launch("generate", "hi", "--model", str(fake)), "is not a GGUF file")


def test_folder_that_is_not_a_model(tmp_path):
    assert_one_line_error(launch("generate", "hi", "--model", str(tmp_path)), "no config.json")


@pytest.mark.parametrize("flag,value,message", [
    # The same words as the UI and the API say them (gumiho_core/settings.py checks all three).
    ("--temperature", "-1", "temperature must be 0 or more"),
    ("--temperature", "nan", "temperature must be a finite number"),
    ("--top-p", "0", "top_p must be more than 0 and at most 1"),
    ("--top-p", "1.5", "top_p must be more than 0 and at most 1"),
    ("--max-new-tokens", "0", "max new tokens must be a whole number, at least 1"),
    ("--total-tokens", "1", "total_tokens must be at least 2"),
])
def test_invalid_settings(flag, value, message):
    assert_one_line_error(launch("generate", "hi", flag, value), message)


def test_hub_id_without_a_hub(tmp_path):
    result = launch("generate", "hi", "--model", "some-org/some-model",
                    env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert_one_line_error(result, "hub is not reachable")


def test_missing_heads_folder(tmp_path):
    assert_one_line_error(launch("generate", "hi", "--heads", str(tmp_path / "none")), "heads not found")


@pytest.mark.slow
def test_heads_for_another_target(tmp_path):
    target = tiny_target()
    HeadCheckpoint.save(new_heads(target), tmp_path / "tiny-heads")
    result = launch("generate", "hi", "--heads", str(tmp_path / "tiny-heads"))
    assert_one_line_error(result, "do not match the target SmolLM2-135M-Instruct")


@pytest.mark.slow
def test_generate_json_output_fields():
    result = launch("generate", "Say hello.", "--max-new-tokens", "8", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("text", "token_ids", "new_tokens", "forward_passes", "tau", "tokens_per_s", "speculative"):
        assert key in out
    assert out["speculative"] is True and out["new_tokens"] == len(out["token_ids"]) <= 8
    assert out["tau"] == pytest.approx(out["new_tokens"] / out["forward_passes"], abs=1e-3)
    plain = json.loads(launch("generate", "Say hello.", "--max-new-tokens", "8", "--json", "--no-speculative").stdout)
    assert plain["token_ids"] == out["token_ids"] and plain["tau"] == 1.0
