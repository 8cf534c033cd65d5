"""Content hashes of full KV-cache blocks, chained from the start of a sequence.

A block's KV depends on every token up to its last one, so a block is named by
``sha256(parent hash || its tokens)``: two blocks get the same hash only if
their whole prefixes are equal (SHA-256 collisions aside, which no one can
craft). The encoding is fixed-width (32-byte parent digest, then 8 bytes per
token id), so no two different (parent, tokens) pairs encode alike.

Nothing but the token ids changes a block's KV in raypp (one model per engine;
no adapters, no multimodal inputs); an input that did would join the hash here.
Hashes never leave the driver process, so the native byte order is fine.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as SequenceABC

from raypp.engine.sequence import Sequence

ROOT_HASH = hashlib.sha256(b"raypp prefix cache: the empty prefix").digest()


def hash_block(parent: bytes, tokens: SequenceABC[int]) -> bytes:
    """The hash of a block holding ``tokens`` after the block hashed ``parent``
    (:data:`ROOT_HASH` for a sequence's first block)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def block_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[bytes]:
    """``seq.block_hashes``, extended to cover at least its first ``num_blocks`` blocks
    (each must be full): each equals :func:`hash_block` of its tokens after the one
    before. Tokens are only appended to a sequence, so a hash once computed stays valid
    for its lifetime."""
    hashes = seq.block_hashes
    if len(hashes) >= num_blocks:
        return hashes
    start, end = len(hashes) * block_size, num_blocks * block_size
    assert end <= seq.num_tokens, "only full blocks have a hash"
    encoded = array("q", _tokens(seq, start, end)).tobytes()  # one conversion for all blocks
    width = array("q").itemsize * block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for offset in range(0, len(encoded), width):
        parent = hashlib.sha256(parent + encoded[offset:offset + width]).digest()
        hashes.append(parent)
    return hashes


def _tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """``seq.all_token_ids[start:end]`` without copying the whole sequence."""
    prompt, output = seq.prompt_token_ids, seq.output_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return output[start - n:end - n]
    return prompt[start:] + output[:end - n]
