#!/usr/bin/env python
"""Train the tiny bundled demo model in ``src/raypp/testing/demo_model``.

The corpus is ``pydoc_data.topics.topics`` -- the "Python help topics" text that
ships with every CPython install (PSF License), so no download is needed.  The
script

1. cleans the corpus lightly (joins wrapped prose lines, drops reST heading
   underlines and ASCII tables, keeps code blocks as they are),
2. trains a byte-level BPE tokenizer (vocab 4096) with ``tokenizers``,
3. trains a 4-layer Llama (``transformers.LlamaForCausalLM``) from scratch on
   one CPU thread for a fixed wall-clock budget (``--minutes``, default 25),
4. saves a Hugging Face checkpoint (config, safetensors weights, generation
   config, tokenizer files) plus a README with the measured numbers.

Seeds are fixed.  With the default time budget the learning-rate schedule is a
cosine over *wall time*, so the exact number of steps depends on the machine;
pass ``--steps N`` for a step-based schedule that is bit-for-bit reproducible.

Run it niced and single-threaded::

    nice -n 19 python scripts/train_demo_model.py --minutes 25
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

# Single thread: set before torch is imported so the OpenMP pool is never bigger.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "src" / "raypp" / "testing" / "demo_model"

EOS = "<|endoftext|>"
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [EOS, *CHAT_TOKENS]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_UNDERLINE = re.compile(r"^\s*([*=\-~^#\"'`])\1{2,}\s*$")


# --------------------------------------------------------------------------- corpus
def clean_topic(text: str) -> str:
    """Light clean-up of one pydoc topic.

    * heading underlines (``*****``, ``=====``, ...) are dropped,
    * ASCII tables (blocks whose lines all start with ``+`` or ``|``) are dropped,
    * prose paragraphs (no indented line) are joined into one line with single
      spaces; indented blocks (code, grammar, lists) keep their layout.
    """
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    lines = [ln for ln in lines if not _UNDERLINE.match(ln)]
    paragraphs: list[list[str]] = []
    cur: list[str] = []
    for ln in lines:
        if ln.strip():
            cur.append(ln)
        elif cur:
            paragraphs.append(cur)
            cur = []
    if cur:
        paragraphs.append(cur)

    out = []
    for para in paragraphs:
        stripped = [ln.lstrip() for ln in para]
        if all(s.startswith(("+", "|")) for s in stripped):
            continue  # ASCII table
        if all(not ln[0].isspace() for ln in para):
            out.append(re.sub(r"\s+", " ", " ".join(para)).strip())
        else:
            out.append("\n".join(para))
    return "\n\n".join(out).strip()


def load_documents() -> list[str]:
    from pydoc_data.topics import topics

    docs = [clean_topic(topics[k]) for k in sorted(topics)]
    return [d for d in docs if d]


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(docs: list[str], vocab_size: int, max_len: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))

    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "additional_special_tokens": CHAT_TOKENS,
        "added_tokens_decoder": added,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = {
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": CHAT_TOKENS,
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return tok


def check_tokenizer(out: Path, docs: list[str]):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out))
    samples = [docs[0][:500], "def f(x):\n    return x  # comment\n", "Ünïcode — ok ✓"]
    for s in samples:
        ids = hf(s, add_special_tokens=True)["input_ids"]
        assert hf.decode(ids) == s, (s, hf.decode(ids))
    assert hf.eos_token == EOS and hf.pad_token == EOS, (hf.eos_token, hf.pad_token)
    for t in SPECIAL_TOKENS:
        assert len(hf(t, add_special_tokens=False)["input_ids"]) == 1, t
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
    ]
    rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n", repr(rendered)
    return hf


# --------------------------------------------------------------------------- model
def build_model(vocab_size: int, eos_id: int, max_pos: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
    )
    return LlamaForCausalLM(cfg)


def lr_at(progress: float, step: int, warmup: int, lr_max: float, lr_min: float) -> float:
    if step < warmup:
        return lr_max * (step + 1) / warmup
    progress = min(max(progress, 0.0), 1.0)
    return lr_min + 0.5 * (lr_max - lr_min) * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def corpus_loss(model, data: torch.Tensor, ctx: int, batch: int) -> float:
    """Mean next-token loss over non-overlapping windows covering the whole corpus."""
    model.eval()
    n = (len(data) - 1) // ctx
    windows = data[: n * ctx + 1]
    x_all = windows[:-1].view(n, ctx)
    y_all = windows[1:].view(n, ctx)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        x, y = x_all[i : i + batch], y_all[i : i + batch]
        logits = model(input_ids=x).logits.float()
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"
        ).item()
        count += y.numel()
    model.train()
    return total / count


def sample_text(model, tok, prompt: str, n: int, do_sample: bool) -> str:
    ids = tok(prompt, return_tensors="pt")
    kw = dict(do_sample=do_sample, max_new_tokens=n, pad_token_id=tok.eos_token_id)
    if do_sample:
        kw.update(temperature=0.8, top_k=40)
    out = model.generate(**ids, **kw)
    return tok.decode(out[0], skip_special_tokens=False)


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--minutes", type=float, default=25.0, help="training wall-clock budget")
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (overrides --minutes)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set if torch was used before
        torch.set_num_interop_threads(1)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    max_pos = 512

    out: Path = args.out
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    t0 = time.time()
    docs = load_documents()
    n_chars = sum(len(d) for d in docs)
    print(f"corpus: {len(docs)} topics, {n_chars} chars", flush=True)

    raw_tok = train_tokenizer(docs, args.vocab, max_pos, tmp)
    tok = check_tokenizer(tmp, docs)
    eos_id = tok.eos_token_id
    ids: list[int] = []
    for enc in raw_tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    data = torch.tensor(ids, dtype=torch.long)
    print(
        f"tokenizer: vocab {len(tok)}, corpus {len(data)} tokens ({n_chars / len(data):.2f} chars/token)",
        flush=True,
    )

    model = build_model(len(tok), eos_id, max_pos)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    gen = torch.Generator().manual_seed(args.seed)
    span = args.ctx + 1
    budget_s = args.minutes * 60.0
    model.train()
    t_train = time.time()
    step, ema, tokens_seen = 0, None, 0
    while True:
        elapsed = time.time() - t_train
        if args.steps:
            if step >= args.steps:
                break
            progress = step / args.steps
        else:
            if elapsed >= budget_s:
                break
            progress = elapsed / budget_s
        lr = lr_at(progress, step, args.warmup, args.lr, args.min_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(data) - span, (args.batch,), generator=gen)
        batch = torch.stack([data[s : s + span] for s in starts.tolist()])
        x = batch[:, :-1]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0:
            el = time.time() - t_train
            print(
                f"step {step:5d}  loss {loss.item():.3f}  ema {ema:.3f}  lr {lr:.2e}  "
                f"{el / 60:.1f} min  {tokens_seen / el:.0f} tok/s",
                flush=True,
            )
    train_s = time.time() - t_train
    print(f"training done: {step} steps, {tokens_seen} tokens, {train_s / 60:.1f} min", flush=True)

    final_loss = corpus_loss(model, data, args.ctx, 32)
    print(
        f"final loss (whole corpus, ctx {args.ctx}): {final_loss:.3f}  "
        f"(ppl {math.exp(final_loss):.1f}); train EMA {ema:.3f}",
        flush=True,
    )

    # ---- save -------------------------------------------------------------
    from transformers import GenerationConfig

    model.eval()
    size_fp32 = n_params * 4
    dtype = torch.float32 if size_fp32 < 18 * 1024 * 1024 else torch.bfloat16
    model = model.to(dtype)
    model.config.use_cache = True
    model.save_pretrained(str(tmp), safe_serialization=True)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id)
    model.generation_config.save_pretrained(str(tmp))
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    dname = "float32" if dtype == torch.float32 else "bfloat16"
    cfg["torch_dtype"] = dname  # older transformers key
    cfg["dtype"] = dname  # transformers >= 5 key
    cfg["rope_theta"] = 10000.0  # older transformers read it top-level (>= 5: rope_parameters)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    samples = []
    for p in ["The list type", "A function is", "def "]:
        samples.append((p, "greedy", sample_text(model, tok, p, 40, False)))
    torch.manual_seed(args.seed)
    for p in ["The list type", "A function is", "def "]:
        samples.append((p, "sampled", sample_text(model, tok, p, 40, True)))
    for p, mode, text in samples:
        print(f"--- [{mode}] {p!r}\n{text}\n", flush=True)

    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    st_size = (tmp / "model.safetensors").stat().st_size
    total_min = (time.time() - t0) / 60
    cmd = "nice -n 19 python scripts/train_demo_model.py"
    if args.steps:
        cmd += f" --steps {args.steps}"
    else:
        cmd += f" --minutes {args.minutes:g}"
    readme = f"""# raypp demo model

A tiny Llama-architecture causal LM bundled with raypp so that
`raypp generate --demo` and the tests can produce readable English text with no
download. It is a toy: it has memorised a small corpus and writes
Python-documentation-flavoured text; it does not follow instructions.

## Corpus

`pydoc_data.topics.topics` from the CPython standard library (the text behind
`help("topics")`), Python Software Foundation License. Cleaned lightly:
wrapped prose lines are joined, reST heading underlines and ASCII tables are
dropped, code blocks are kept. {len(docs)} topics, {n_chars:,} characters,
{len(data):,} tokens.

## Tokenizer

Byte-level BPE trained with `tokenizers` (ByteLevel pre-tokenizer and decoder),
vocabulary {len(tok)}. Special tokens: `<|endoftext|>` (EOS and pad, also
separates documents during training; there is no BOS), `<|system|>`,
`<|user|>`, `<|assistant|>`. The chat template renders
`<|system|>\\n...\\n<|user|>\\n...\\n<|assistant|>\\n` (the model never saw chat
data, so chat prompts just get continued as documentation text).

## Model

`LlamaForCausalLM`: hidden 256, 4 layers, 4 attention heads, 2 KV heads,
intermediate 704, max positions {max_pos}, RoPE theta 10000, RMSNorm eps 1e-5,
tied embeddings; {n_params:,} parameters, stored as {dname} safetensors
({st_size / 1e6:.1f} MB).

## Training

From scratch, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), LR
{args.lr:g} with {args.warmup}-step warmup and cosine decay to {args.min_lr:g},
context {args.ctx}, batch {args.batch}, gradient clip 1.0, seed {args.seed},
one CPU thread.

- training wall time: {train_s / 60:.1f} min ({step} steps, {tokens_seen:,} tokens,
  ~{tokens_seen / len(data):.1f} passes over the corpus); whole script {total_min:.1f} min
- final loss (mean next-token cross-entropy over the whole corpus, context
  {args.ctx}): **{final_loss:.3f}** (perplexity {math.exp(final_loss):.1f});
  last training-batch EMA {ema:.3f}

Reproduce (from the repository root):

```bash
{cmd}
```

With `--minutes` the cosine schedule runs over wall time, so the step count
depends on the machine; `--steps N` gives a step-based, exactly repeatable run.

## Samples (greedy, 40 new tokens)

"""
    for _p, mode, text in samples:
        if mode == "greedy":
            readme += f"```text\n{text}\n```\n\n"
    (tmp / "README.md").write_text(readme)

    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(
        f"saved to {out} (model.safetensors {st_size / 1e6:.2f} MB, {dname}); total {total_min:.1f} min",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
