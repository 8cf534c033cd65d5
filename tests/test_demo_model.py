"""The bundled demo checkpoint loads with transformers and writes readable text."""

from __future__ import annotations

import string
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import raypp.testing  # noqa: E402

DEMO_DIR = Path(raypp.testing.__file__).parent / "demo_model"
PROMPTS = ["The list type", "A function is", "def "]
NEW_TOKENS = 48


def _words(text: str) -> list[str]:
    """Whitespace-separated words, punctuation stripped, lowercased, alphabetic only."""
    out = []
    for w in text.split():
        w = w.strip(string.punctuation).lower()
        if w.isalpha():
            out.append(w)
    return out


@pytest.fixture(scope="module")
def corpus_vocab() -> set[str]:
    from pydoc_data.topics import topics

    vocab: set[str] = set()
    for text in topics.values():
        vocab.update(_words(text))
    return vocab


@pytest.fixture(scope="module")
def demo():
    assert DEMO_DIR.is_dir(), f"missing {DEMO_DIR}; run scripts/train_demo_model.py"
    # One thread: a 4M-parameter model gains nothing from more, and on a busy
    # machine multi-threaded OpenMP makes decoding 10-30x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO_DIR))
        model.eval()
        yield tok, model
    finally:
        torch.set_num_threads(threads)


def test_demo_model_files_and_size(demo):
    _, model = demo
    st = DEMO_DIR / "model.safetensors"
    assert st.is_file()
    assert st.stat().st_size < 20 * 1024 * 1024
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    ):
        assert (DEMO_DIR / name).is_file(), name
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 10_000_000, n_params
    assert model.config.model_type == "llama"


def test_demo_tokenizer(demo):
    tok, model = demo
    assert tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_id == model.config.eos_token_id
    assert len(tok) == model.config.vocab_size
    text = "def f(x):\n    return [x, 'é']  # The list type\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<|system|>\nS\n<|user|>\nHi\n<|assistant|>\n"


def test_demo_model_generates_readable_text(demo, corpus_vocab):
    tok, model = demo
    generated: list[str] = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            enc = tok(prompt, return_tensors="pt")
            out = model.generate(
                **enc,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
            new = out[0, enc["input_ids"].shape[1] :]
            generated.append(tok.decode(new, skip_special_tokens=True))

    words = [w for text in generated for w in _words(text)]
    assert len(words) >= 20, generated
    known = sum(w in corpus_vocab for w in words)
    frac = known / len(words)
    assert frac >= 0.7, (frac, generated)
