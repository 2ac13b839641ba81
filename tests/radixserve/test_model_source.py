"""Reading a model folder: a folder whose config names code of its own (Kimi-K2's and Moonlight's
`auto_map` for a model_type transformers lacks) is refused in one line at once, never run and
never behind transformers' interactive "run the custom code?" prompt."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.model_source import ModelUnreadable, load_config, resolve_model

CUSTOM = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
          "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}


def custom_code_folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(CUSTOM))
    (tmp_path / "configuration_deepseek.py").write_text("raise SystemExit('custom code ran')\n")
    return tmp_path


def test_a_config_that_is_custom_code_is_refused_in_one_line(tmp_path) -> None:
    with pytest.raises(ModelUnreadable, match=r"names code of its own .* never run here") as refused:
        load_config(resolve_model(custom_code_folder(tmp_path)))
    assert "\n" not in str(refused.value)


@pytest.mark.timeout(60)
def test_the_refusal_asks_nothing_on_a_terminal(tmp_path) -> None:
    """With a terminal for stdin (as under `make run`), transformers would ask whether to run the
    code and wait for the answer; the folder is refused without asking."""
    folder = custom_code_folder(tmp_path)
    script = ("from radixserve.model_source import load_config, resolve_model\n"
              f"try:\n    load_config(resolve_model({str(folder)!r}))\nexcept ValueError as e:\n"
              "    print(type(e).__name__)\n")
    controller, terminal = pty.openpty()
    try:
        done = subprocess.run([sys.executable, "-c", script], stdin=terminal, capture_output=True, text=True,
                              timeout=50)
    finally:
        os.close(controller)
        os.close(terminal)
    assert done.stdout.strip() == "ModelUnreadable", done.stdout + done.stderr
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
