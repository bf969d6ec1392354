"""Grammar bitmasks applied to CPU logits, touching only the tokens that change.

xgrammar's CPU kernel tests one bit per logit in a scalar loop (a 32-row step over a 32000-
token vocabulary is a million branches). Here each row's words are scanned instead: a row
where most words allow nothing (a JSON grammar between values: a handful of tokens) is
filled with -inf and its allowed logits put back; a row where most words allow everything
(inside a string) gets -inf at its forbidden tokens only; a row whose bits are scattered
over many words is masked whole from its unpacked bits. Each is a few vectorised numpy
passes; numpy because it runs on the calling thread, where torch's intra-op pool would wait
for a core another process holds.
"""

from __future__ import annotations

import numpy as np

# A row with more of its words to visit than 1 / this of them is masked whole.
_SCATTERED_FRACTION = 8


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray, rows: list[int]) -> None:
    """logits [S, V] float32, in place; bitmask [S, W] int32 (bit t % 32 of word t // 32
    set: token t allowed); only `rows` are masked. Columns past the bitmask's 32 * W are
    forbidden."""
    vocab_size = logits.shape[1]
    row_ids = np.asarray(rows, dtype=np.int64)
    words = bitmask[row_ids]  # [R, W]
    num_words = words.shape[1]
    num_bits = min(vocab_size, 32 * num_words)
    is_dense = np.count_nonzero(words, axis=1) * 2 > num_words  # mostly allowed
    # The bits to visit: allowed tokens of sparse rows, forbidden ones of dense rows.
    visit = np.where(is_dense[:, None], ~words, words)
    is_scattered = np.count_nonzero(visit, axis=1) * _SCATTERED_FRACTION > num_words
    for i in np.flatnonzero(is_scattered):
        allowed = np.unpackbits(words[i].view(np.uint8), count=num_bits, bitorder="little")
        np.copyto(logits[row_ids[i], :num_bits], -np.inf, where=allowed == 0)
        logits[row_ids[i], num_bits:] = -np.inf
    visit[is_scattered] = 0
    flat_words = np.flatnonzero(visit)
    bits = np.unpackbits(
        np.ascontiguousarray(visit.reshape(-1)[flat_words]).view(np.uint8).reshape(-1, 4),
        axis=1,
        bitorder="little",
    )  # [K, 32]
    word_index, bit = np.nonzero(bits)
    flat_word = flat_words[word_index]
    row = flat_word // num_words
    token = (flat_word % num_words) * 32 + bit
    keep = token < vocab_size
    row, token = row[keep], token[keep]
    on_dense = is_dense[row]
    logits[row_ids[row[on_dense]], token[on_dense]] = -np.inf
    if vocab_size > num_bits:
        logits[row_ids[is_dense & ~is_scattered], num_bits:] = -np.inf
    on_sparse = ~on_dense
    sparse_at = (row_ids[row[on_sparse]], token[on_sparse])
    allowed_logits = logits[sparse_at]
    logits[row_ids[~is_dense & ~is_scattered]] = -np.inf
    logits[sparse_at] = allowed_logits
